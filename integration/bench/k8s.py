"""Pods through gpush into Kubernetes, beside the same Pods created directly, on the test API server.

What it measures, on the project's Kubernetes API test server with the node simulator
(integration/k8s/), run in a child process of their own as an API server runs apart from its
clients, over ``--nodes`` simulated GPU nodes (time-sliced T4s: 4 GPUs a node, 4 replicas each):

* **direct**: ``--pods`` Pods, each requesting ``nvidia.com/gpu: 1``, created with
  ``CoreV1Api.create_namespaced_pod`` on ``--threads`` threads (the adapter's own
  ``submit_threads``, so both sides send as many requests at once); the time from the first
  create until every Pod is bound (``spec.nodeName`` set, seen by a watch): Pods per second.
* **direct, as Jobs**: the same, each Pod as a batch/v1 Job (what gpush creates), so the
  simulator's Job controller makes the Pods: the cost of that hop without gpush, to tell it
  apart from gpush's own.
* **gpush**: the same number of jobs (time-sliced inference, ``isolation: none``) submitted at once
  to an embedded broker (PostgreSQL scratch database, or SQLite with ``--db sqlite``) with the
  cluster registered as ``kind: k8s`` and a policy routing them to ``k8s/timeslice``; scheduling
  cycles run as the leader runs them (a cycle, then the rest of ``--interval``); the time from
  the submission until every job's Pod is bound. The ratio is gpush's rate over the direct Pods'
  rate (target at least 0.8); the ratio to the direct Jobs is printed beside it.
* **inventory**: ``--inventory-nodes`` nodes in all (the rest created directly as the GPU
  Operator's device plugin would publish them), gpush's Pods still bound; the time of one
  ``KubernetesAdapter.inventory()`` with its node cache off, median of ``--repeats`` after one
  untimed call (target under 2 s).

With ``--rounds N`` the three paths run N times in turn and the medians are the figures
(``make bench`` runs 3): this VM's speed varies from minute to minute.

Each phase has a namespace of its own, deleted (its Pods gone) before the next begins, so every
phase starts on an idle cluster with the same free capacity.

A benchmark, not a test: it prints figures with their targets and exits 0 when it ran.

    .venv/bin/python integration/bench/k8s.py                     # 1,000 nodes, 2,000 Pods, 5,000 nodes
    .venv/bin/python integration/bench/k8s.py --nodes 100 --pods 200 --inventory-nodes 500
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scratch import scratch_database  # noqa: E402

CONTEXT = "gpush-bench"
TAG = "gbench"
GPUS_PER_NODE = 4
REPLICAS = 4
IMAGE = "registry.k8s.io/pause:3.10"
POLICY = """
rules:
  - name: inference-on-timeslice
    why: the benchmark's inference jobs share time-sliced T4s
    match: {kind: inference, isolation: none}
    route: {cluster: k8s-bench, sharing: k8s/timeslice}
"""
DEFAULT_PG_URL = os.environ.get("GPUSH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
BENCH_DATABASE = "gpush_bench_k8s"
DIRECT_LABEL = ("bench.gpush.io/path", "direct")


def now() -> datetime:
    return datetime.now(UTC)


def t4_pool(name: str, count: int) -> Any:
    from integration.k8s.gpu_nodes import GpuPool

    return GpuPool(
        name, count=count, product="Tesla-T4", gpus_per_node=GPUS_PER_NODE, replicas=REPLICAS, cpu="64", memory="256Gi"
    )


# --- the cluster, in a child process -------------------------------------------------------------------


def serve_cluster(nodes: int, kubeconfig: Path) -> int:
    """Child process: the test API server and the simulator until stdin closes."""
    import logging

    from kubernetes import config

    from integration.k8s.apiserver import start
    from integration.k8s.simulator import Simulator

    logging.basicConfig(level=logging.WARNING, format="cluster: %(levelname)s %(name)s: %(message)s")
    server = start()
    server.write_kubeconfig(kubeconfig, context=CONTEXT)
    api = config.new_client_from_config(config_file=str(kubeconfig))
    sim = Simulator(api, [t4_pool("t4", nodes)], record_events=False).start()
    begin = time.perf_counter()
    sim.create_nodes()
    deadline = time.monotonic() + 600
    while len(sim.c.managed) < nodes and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"ready {nodes} nodes in {time.perf_counter() - begin:.1f} s", flush=True)
    try:
        sys.stdin.read()  # the parent closes it (or dies): stop
    finally:
        print(f"counters {json.dumps(sim.counters)}", flush=True)
        sim.stop()
        server.stop()
    return 0


@contextmanager
def cluster_process(nodes: int, workdir: Path):
    kubeconfig = workdir / "kubeconfig"
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-cluster", "--nodes", str(nodes), "--kubeconfig", str(kubeconfig)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = child.stdout.readline().strip()
        if not line.startswith("ready"):
            raise RuntimeError(f"the test cluster did not start (it said {line!r}); see its errors above")
        print(f"cluster: {line.removeprefix('ready ')} (test API server and simulator in process {child.pid})")
        yield kubeconfig
    finally:
        child.stdin.close()
        try:
            rest = child.stdout.read()
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            rest = ""
        for line in rest.splitlines():
            if line.startswith("counters "):
                print(f"simulator: {line.removeprefix('counters ')}")


# --- watching Pods get bound ------------------------------------------------------------------------------


class BindWatch:
    """Counts the Pods of a label selector that have a node, by watch, from a resourceVersion."""

    def __init__(self, api: Any, namespace: str, label_selector: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.label_selector = label_selector
        self.bound: set[str] = set()
        self.target = 0
        self.done = threading.Event()
        self.done_at = 0.0
        self._stop = threading.Event()
        listing = self.core.list_namespaced_pod(namespace, label_selector=label_selector, limit=1)
        self._rv = listing.metadata.resource_version
        self._thread = threading.Thread(target=self._run, name=f"bind-watch-{namespace}", daemon=True)
        self._thread.start()

    def expect(self, count: int) -> None:
        self.target = count
        self._check()

    def _check(self) -> None:
        if self.target and len(self.bound) >= self.target and not self.done.is_set():
            self.done_at = time.perf_counter()
            self.done.set()

    def _run(self) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        while not self._stop.is_set():
            resp = self.core.list_namespaced_pod(
                self.namespace,
                label_selector=self.label_selector,
                watch=True,
                resource_version=self._rv,
                allow_watch_bookmarks=True,
                timeout_seconds=5,
                _preload_content=False,
                _request_timeout=(10, 30),
            )
            try:
                for line in iter_resp_lines(resp):
                    if not line:
                        continue
                    event = json.loads(line)
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        raise RuntimeError(f"the Pod watch failed: {obj.get('message')}")
                    self._rv = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED") and (obj.get("spec") or {}).get("nodeName"):
                        self.bound.add(obj["metadata"]["name"])
                        self._check()
                    if self._stop.is_set():
                        break
            finally:
                resp.release_conn()

    def wait(self, timeout: float) -> float:
        """Seconds (perf_counter) when the target was reached; raises after ``timeout``."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"only {len(self.bound)} of {self.target} Pods were bound after {timeout:.0f} s")
        return self.done_at

    def stop(self) -> None:
        self._stop.set()


def clear_namespace(api: Any, namespace: str, timeout: float = 120.0) -> float:
    """Delete a phase's namespace and wait until its Pods are gone, so the next phase starts on an
    idle cluster (gpush's inventory lists every Pod; leftovers would weigh on it alone)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(api)
    begin = time.perf_counter()
    core.delete_namespace(namespace, propagation_policy="Background")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(namespace)
        except ApiException as exc:
            if exc.status == 404 and not core.list_namespaced_pod(namespace, limit=1).items:
                break
        time.sleep(0.2)
    time.sleep(1.0)  # the simulator frees what the Pods held, from the watch
    return time.perf_counter() - begin


# --- (a) Pods created directly ----------------------------------------------------------------------------


def direct_pod(name: str) -> dict:
    container = {
        "name": "main",
        "image": IMAGE,
        "resources": {"requests": {"cpu": "100m"}, "limits": {"nvidia.com/gpu": "1"}},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {DIRECT_LABEL[0]: DIRECT_LABEL[1]}},
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }


def timed_creates(api: Any, namespace: str, count: int, threads: int, timeout: float, create: Any) -> dict:
    """``create(i)`` for i < ``count`` on ``threads`` threads in a new namespace; the seconds the
    creates took and until ``count`` labelled Pods there were bound."""
    from kubernetes import client

    client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
    watch = BindWatch(api, namespace, f"{DIRECT_LABEL[0]}={DIRECT_LABEL[1]}")
    watch.expect(count)
    begin = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, range(count)))
    created = time.perf_counter() - begin
    try:
        total = watch.wait(timeout) - begin
    finally:
        watch.stop()
    return {"threads": threads, "create_s": created, "total_s": total, "pods_per_s": count / total}


def bench_direct(api: Any, pods: int, threads: int, timeout: float, namespace: str = "bench-direct") -> dict:
    from kubernetes import client

    core = client.CoreV1Api(api)

    def create(i: int) -> None:
        # As a client that cares for speed would: no response model built.
        core.create_namespaced_pod(namespace, direct_pod(f"direct-{i:05d}"), _preload_content=False)

    return {"pods": pods, **timed_creates(api, namespace, pods, threads, timeout, create)}


def direct_job(name: str) -> dict:
    pod = direct_pod(name)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": pod["metadata"]["labels"]},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]},
        },
    }


def bench_direct_jobs(api: Any, jobs: int, threads: int, timeout: float, namespace: str = "bench-direct-jobs") -> dict:
    """The same, as batch/v1 Jobs (what gpush creates): the Job controller's hop without gpush."""
    from kubernetes import client

    batch = client.BatchV1Api(api)

    def create(i: int) -> None:
        batch.create_namespaced_job(namespace, direct_job(f"direct-{i:05d}"), _preload_content=False)

    return {"jobs": jobs, **timed_creates(api, namespace, jobs, threads, timeout, create)}


# --- (b) the same Pods through gpush ---------------------------------------------------------------------


class Broker:
    """An embedded broker: database, the k8s cluster registered, a policy, the scheduler."""

    def __init__(
        self, url: str, kubeconfig: Path, threads: int, informers: bool = True, namespace: str = "bench-gpush"
    ):
        self.namespace = namespace
        from broker.client.embedded import open_database
        from broker.core.clusters import AdapterPool, add_cluster
        from broker.core.db import session_factory
        from broker.routing import versions as policystore
        from broker.routing.versions import cluster_views
        from broker.scheduling.cycle import Scheduler

        self.engine = open_database(url, auto_upgrade=True)
        self.sessions = session_factory(self.engine)
        self.pool = AdapterPool(now)
        config = {
            "kubeconfig": str(kubeconfig),
            "context": CONTEXT,
            "namespace": namespace,
            "create_namespace": True,
            "tag": TAG,
            "image": IMAGE,
            "submit_threads": threads,
            "informers": informers,
        }
        with self.sessions() as session, session.begin():
            add_cluster(session, name="k8s-bench", kind="k8s", config=config, actor="root", now=now())
        with self.sessions() as session, session.begin():
            views = cluster_views(session, self.pool)
            policystore.apply(
                session, POLICY, comment="bench", author="root", now=now(), views=views, base_version=None
            )
        self.scheduler = Scheduler(self.engine, self.pool, clock=now)

    def close(self) -> None:
        self.pool.close()
        self.engine.dispose()

    def submit(self, n: int) -> list[int]:
        from broker.core.auth import Principal
        from broker.core.schemas import JobSpec, Role
        from broker.intake import queue

        admin = Principal(user="root", tenant="bench", role=Role.ADMIN)
        spec = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 2, "command": ["sleep", "infinity"]}
        specs = [JobSpec.model_validate(spec) for _ in range(n)]
        with self.sessions() as session, session.begin():
            return [r.job["id"] for r in queue.submit_jobs(session, specs, admin, now=now())]

    def count(self, state: str) -> int:
        from sqlalchemy import func, select

        from broker.core.models import Job

        with self.sessions() as session:
            return session.execute(select(func.count()).select_from(Job).where(Job.state == state)).scalar_one()


def bench_gpush(api: Any, broker: Broker, pods: int, interval: float, timeout: float) -> dict:

    watch = BindWatch(api, broker.namespace, f"gpush.io/broker={TAG}")
    watch.expect(pods)
    steps: dict[str, float] = {}
    errors: list[str] = []
    cycles: list[dict[str, Any]] = []
    begin = time.perf_counter()
    broker.submit(pods)
    submitted = time.perf_counter() - begin
    deadline = begin + timeout
    try:
        while not watch.done.is_set():
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"only {len(watch.bound)} of {pods} gpush Pods were bound after {timeout:.0f} s "
                    f"(jobs submitted to Kubernetes: {broker.count('submitted') + broker.count('running')}; "
                    f"errors: {errors[-3:]})"
                )
            started = time.perf_counter()
            report = broker.scheduler.run_cycle()
            cycles.append(
                {
                    "start_s": round(started - begin, 3),
                    "cycle_s": round(time.perf_counter() - started, 3),
                    "submitted": report.submitted,
                    "synced": report.synced,
                    "bound_after": len(watch.bound),
                    "steps_s": {k: round(v, 3) for k, v in sorted(report.seconds.items())},
                }
            )
            errors += report.errors
            for step, seconds in report.seconds.items():
                steps[step] = steps.get(step, 0.0) + seconds
            if report.failed:
                raise RuntimeError(f"{report.failed} jobs failed: {report.errors[-3:]}")
            # The leader's loop: a cycle, then the rest of the interval (gpush server: 1 s).
            rest = interval - (time.perf_counter() - started)
            if rest > 0:
                watch.done.wait(rest)
        total = watch.done_at - begin
    finally:
        watch.stop()
    return {
        "pods": pods,
        "submit_s": submitted,
        "total_s": total,
        "pods_per_s": pods / total,
        "cycles": len(cycles),
        "interval_s": interval,
        "per_cycle": cycles,
        "cycle_step_s": {k: round(v, 3) for k, v in sorted(steps.items())},
        "cycle_errors": len(errors),
    }


# --- (c) inventory at scale --------------------------------------------------------------------------------


def add_nodes(api: Any, count: int, threads: int = 16) -> None:
    """Nodes as the device plugin publishes them, created directly (the simulator does not run them)."""
    from kubernetes import client

    from integration.k8s.gpu_nodes import node_manifest

    core = client.CoreV1Api(api)
    pool = t4_pool("t4-extra", count)

    def create(i: int) -> None:
        body = node_manifest(pool, i)
        core.create_node(body, _preload_content=False)
        # A create ignores status (as the real API server does): the kubelet's status write.
        core.patch_node_status(
            body["metadata"]["name"],
            {"status": body["status"]},
            _content_type="application/merge-patch+json",
            _preload_content=False,
        )

    with ThreadPoolExecutor(threads) as pool_:
        list(pool_.map(create, range(count)))


def bench_inventory(api: Any, kubeconfig: Path, nodes_now: int, nodes_wanted: int, repeats: int) -> dict:
    from adapters.k8s import KubernetesAdapter

    extra = max(0, nodes_wanted - nodes_now)
    if extra:
        begin = time.perf_counter()
        add_nodes(api, extra)
        print(f"inventory: {extra} more nodes created in {time.perf_counter() - begin:.1f} s")
    adapter = KubernetesAdapter(
        "k8s-bench",
        {
            "kubeconfig": str(kubeconfig),
            "context": CONTEXT,
            "namespace": "bench-gpush",
            "tag": TAG,
            "cache_seconds": 0,
            "informers": False,  # a full refresh each call: what a cold start or a relist costs
        },
    )
    units = adapter.inventory()  # untimed: loads the kubeconfig, opens connections
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        units = adapter.inventory()
        times.append(time.perf_counter() - begin)
    nodes = {u.node for u in units}
    return {
        "nodes": len(nodes),
        "units": len(units),
        "physical_gpus": round(sum(u.capacity * u.gpu_equivalent for u in units)),
        "allocated_units": sum(u.allocated for u in units),
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": repeats,
    }


# --- main --------------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="simulated GPU nodes (default 1000)")
    parser.add_argument("--pods", type=int, default=2000, help="Pods for each of direct and gpush (default 2000)")
    parser.add_argument("--threads", type=int, default=8, help="create threads, direct and gpush (default 8)")
    parser.add_argument("--interval", type=float, default=1.0, help="scheduler loop interval (gpush server: 1 s)")
    parser.add_argument("--inventory-nodes", type=int, default=5000, help="nodes for the inventory timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed inventory calls (default 5)")
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument(
        "--pg-url", default=DEFAULT_PG_URL, help="server for the scratch database ($GPUSH_BENCH_PG_URL)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a phase after this many seconds")
    parser.add_argument(
        "--no-informers",
        action="store_true",
        help="gpush lists Nodes and Pods each cycle (the adapter's informers=false)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat the three paths, report medians (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write the figures here as JSON")
    parser.add_argument("--serve-cluster", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_cluster:
        return serve_cluster(args.nodes, args.kubeconfig)

    from kubernetes import config

    results: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "replicas": REPLICAS,
        "db": args.db,
        "cpus": os.cpu_count(),
    }
    workdir = Path(tempfile.mkdtemp(prefix="gpush-k8s-bench-"))
    with ExitStack() as stack:
        kubeconfig = stack.enter_context(cluster_process(args.nodes, workdir))
        api = config.new_client_from_config(config_file=str(kubeconfig))
        api.configuration.connection_pool_maxsize = max(args.threads, 4) + 4
        stack.callback(api.close)

        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            # The three paths one after another in each round, each on an idle cluster, so a
            # slow spell of the machine weighs on all three alike; the medians are the figures.
            one: dict[str, Any] = {}
            direct = one["direct"] = bench_direct(api, args.pods, args.threads, args.timeout, f"bench-direct-{r}")
            print(
                f"round {r + 1}: direct: {direct['pods']} Pods bound in {direct['total_s']:.1f} s "
                f"({direct['pods_per_s']:.0f} Pods/s; creates took {direct['create_s']:.1f} s on "
                f"{direct['threads']} threads)"
            )
            clear_namespace(api, f"bench-direct-{r}")
            jobs = one["direct_jobs"] = bench_direct_jobs(
                api, args.pods, args.threads, args.timeout, f"bench-direct-jobs-{r}"
            )
            print(
                f"round {r + 1}: direct, as Jobs (the simulator's Job controller makes the Pods): {jobs['jobs']} "
                f"Pods bound in {jobs['total_s']:.1f} s ({jobs['pods_per_s']:.0f} Pods/s; "
                f"creates took {jobs['create_s']:.1f} s)"
            )
            clear_namespace(api, f"bench-direct-jobs-{r}")
            if args.db == "postgres":
                url, _ = stack.enter_context(scratch_database(args.pg_url, f"{BENCH_DATABASE}_{r}"))
            else:
                url = f"sqlite:///{workdir / f'gpush-{r}.db'}"
            broker = Broker(
                url, kubeconfig, args.threads, informers=not args.no_informers, namespace=f"bench-gpush-{r}"
            )
            try:
                gpush = one["gpush"] = bench_gpush(api, broker, args.pods, args.interval, args.timeout)
            finally:
                broker.close()
            one["ratio"] = gpush["pods_per_s"] / direct["pods_per_s"]
            one["ratio_to_direct_jobs"] = gpush["pods_per_s"] / jobs["pods_per_s"]
            print(
                f"round {r + 1}: gpush ({args.db}): {gpush['pods']} Pods bound in {gpush['total_s']:.1f} s "
                f"({gpush['pods_per_s']:.0f} Pods/s, {gpush['cycles']} cycles at {args.interval:g} s); "
                f"gpush / direct Pods {one['ratio']:.2f}, gpush / direct Jobs {one['ratio_to_direct_jobs']:.2f}"
            )
            print(f"  gpush cycle steps, seconds summed over the run: {gpush['cycle_step_s']}")
            clear_namespace(api, f"bench-gpush-{r}")
            rounds.append(one)
        results["rounds"] = rounds

        def median(path: str) -> float:
            values = []
            for one in rounds:
                value: Any = one
                for part in path.split("."):
                    value = value[part]
                values.append(value)
            return statistics.median(values)

        ratio = results["ratio"] = median("ratio")
        results["ratio_to_direct_jobs"] = median("ratio_to_direct_jobs")
        print(
            f"medians of {len(rounds)} rounds: direct Pods {median('direct.pods_per_s'):.0f}/s, direct Jobs "
            f"{median('direct_jobs.pods_per_s'):.0f}/s, gpush {median('gpush.pods_per_s'):.0f}/s; "
            f"gpush / direct Pods: {ratio:.2f} (target >= 0.8: {verdict(ratio >= 0.8)}); "
            f"gpush / direct Jobs (the objects gpush creates): {results['ratio_to_direct_jobs']:.2f}"
        )

        inv = results["inventory"] = bench_inventory(api, kubeconfig, args.nodes, args.inventory_nodes, args.repeats)
        print(
            f"inventory of {inv['nodes']} nodes ({inv['physical_gpus']} physical GPUs, {inv['allocated_units']} "
            f"replicas held): median {inv['median_s']:.2f} s of {inv['repeats']} (min {inv['min_s']:.2f}, "
            f"max {inv['max_s']:.2f}) (target < 2 s: {verdict(inv['median_s'] < 2)})"
        )
    subprocess.run(["rm", "-rf", str(workdir)], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
