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
* **submit to running**: ``--latency-jobs`` single jobs (the same inference job), one at a time
  on the idle cluster, each way. Through gpush: a real ``gpush server`` (its own process, on a
  scratch database of its own, ``--server-workers`` workers, its default 1 s cycle interval), so
  the leader's loop runs as it ships: woken by the API when a job is submitted and by the
  Kubernetes adapter's Pod watch when a Pod of its jobs changes. Each job is submitted over HTTP
  with the SDK (1 to 3 s after the last one ended, so that it lands anywhere in the leader's
  cycle) and read every 20 ms until gpush says ``running``; then cancelled, its Pod gone
  before the next. Directly: the batch/v1 Job gpush renders for that job (its stored spec and
  placement), created with the client; the time until a watch sees its Pod Running; deleted, its
  Pod gone before the next. p50 and p99 of each; the target: gpush's p50 within 0.3 s of the
  direct p50. Where gpush's time goes is printed from time stamps on one clock: the submit's
  answer, the job's events (``routed``: the cycle decided; ``submitted``: the Job created;
  ``running``: the status written), the bench's own Pod watch (Pod Running) and the poll; and
  the server's /metrics (cycles, the seconds of each step and adapter call).
* **inventory**: ``--inventory-nodes`` nodes in all (the rest created directly as the GPU
  Operator's device plugin would publish them), gpush's Pods still bound; the time of one
  ``KubernetesAdapter.inventory()`` with its node cache off, median of ``--repeats`` after one
  untimed call (target under 2 s).

With ``--rounds N`` the paths run N times in turn and the medians are the figures
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
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scratch import scratch_database  # noqa: E402
from submit import gpush_cli, gpush_server  # noqa: E402

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
CLUSTER = "k8s-bench"
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

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED") and (obj.get("spec") or {}).get("nodeName"):
            self.bound.add(obj["metadata"]["name"])
            self._check()

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
                    self._event(event["type"], obj)
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


def adapter_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The Kubernetes adapter's settings the command line chooses (the rest: its defaults)."""
    settings = {"submit_threads": args.threads, "informers": not args.no_informers}
    if args.watch_seconds is not None:
        settings["watch_seconds"] = args.watch_seconds
    return settings


def register_cluster(url: str, kubeconfig: Path, namespace: str, settings: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Open (and upgrade) the database at ``url``, register the test cluster as ``kind: k8s``
    with gpush's Pods in ``namespace`` and the adapter's ``settings``, and apply the policy;
    (engine, session factory, adapter pool)."""
    from broker.client.embedded import open_database
    from broker.core.clusters import AdapterPool, add_cluster
    from broker.core.db import session_factory
    from broker.routing import versions as policystore
    from broker.routing.versions import cluster_views

    engine = open_database(url, auto_upgrade=True)
    sessions = session_factory(engine)
    pool = AdapterPool(now)
    config = {
        "kubeconfig": str(kubeconfig),
        "context": CONTEXT,
        "namespace": namespace,
        "create_namespace": True,
        "tag": TAG,
        "image": IMAGE,
        **settings,
    }
    with sessions() as session, session.begin():
        add_cluster(session, name=CLUSTER, kind="k8s", config=config, actor="root", now=now())
    with sessions() as session, session.begin():
        views = cluster_views(session, pool)
        policystore.apply(session, POLICY, comment="bench", author="root", now=now(), views=views, base_version=None)
    return engine, sessions, pool


class Broker:
    """An embedded broker: database, the k8s cluster registered, a policy, the scheduler."""

    def __init__(self, url: str, kubeconfig: Path, namespace: str, settings: dict[str, Any]):
        from broker.scheduling.cycle import Scheduler

        self.namespace = namespace
        self.engine, self.sessions, self.pool = register_cluster(url, kubeconfig, namespace, settings)
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
        CLUSTER,
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


# --- (d) submit-to-running latency, one job at a time -------------------------------------------------------

SERVER_INTERVAL = 1.0  # gpush server's default --cycle-interval
LATENCY_TARGET_S = 0.3  # gpush's p50 within this of the same Job created directly (the target)
# What the throughput phase submits; the direct Jobs are rendered from what gpush stored for it.
LATENCY_SPEC = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 2, "command": ["sleep", "infinity"]}
DIRECT_TAG = "gdirect"  # the direct Jobs' broker label: not gpush's, so gpush's Pod watch ignores them
POLL_S = 0.02  # how often the bench reads the job from gpush, as `gpush status --watch` would
STOPPED = ("held", "failed", "cancelled", "succeeded")
# The gpush job's way, in order: each step the time from the previous mark (see latency_gpush).
GPUSH_STEPS = (
    ("submit_s", "submit answered"),
    ("placed_s", "to placed (wake-up, cycle up to the decision)"),
    ("job_created_s", "to Job created (commit, create, record)"),
    ("pod_running_s", "to Pod Running (Kubernetes)"),
    ("state_written_s", "to running written (Pod event, cycle, status read, write)"),
    ("seen_s", "to running seen (the poll)"),
)
DIRECT_STEPS = (
    ("create_s", "create answered"),
    ("pod_created_s", "to Pod created"),
    ("pod_bound_s", "to Pod bound"),
    ("pod_running_s", "to Pod Running"),
)


class PodTimeline(BindWatch):
    """When each job's Pod was seen created, bound, Running and deleted, by watch; by job id (the
    ``gpush.io/job-id`` label), in ``time.time()`` seconds, the clock of the broker's event times."""

    def __init__(self, api: Any, namespace: str, tag: str):
        from adapters.k8s.render import LABEL_BROKER

        self.marks: dict[int, dict[str, float]] = {}
        self.changed = threading.Condition()
        super().__init__(api, namespace, f"{LABEL_BROKER}={tag}")

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        from adapters.k8s.render import LABEL_JOB_ID

        at = time.time()
        try:
            job_id = int(((obj.get("metadata") or {}).get("labels") or {})[LABEL_JOB_ID])
        except (KeyError, ValueError):
            return
        with self.changed:
            marks = self.marks.setdefault(job_id, {})
            marks.setdefault("created", at)
            if kind == "DELETED":
                marks.setdefault("deleted", at)
            elif kind in ("ADDED", "MODIFIED"):
                if (obj.get("spec") or {}).get("nodeName"):
                    marks.setdefault("bound", at)
                if (obj.get("status") or {}).get("phase") == "Running":
                    marks.setdefault("running", at)
            self.changed.notify_all()

    def wait_for(self, job_id: int, mark: str, timeout: float) -> float:
        with self.changed:
            if not self.changed.wait_for(lambda: mark in self.marks.get(job_id, {}), timeout):
                raise TimeoutError(
                    f"the Pod of job {job_id} was not seen {mark} after {timeout:.0f} s "
                    f"(seen: {sorted(self.marks.get(job_id, {}))})"
                )
            return self.marks[job_id][mark]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98] if len(ordered) > 1 else ordered[0]
    return {"p50_s": statistics.median(ordered), "p99_s": p99, "min_s": ordered[0], "max_s": ordered[-1]}


def step_medians(jobs: list[dict[str, Any]], steps: tuple[tuple[str, str], ...]) -> dict[str, float]:
    return {key: statistics.median(job[key] for job in jobs) for key, _ in steps}


def gpush_env(workdir: Path) -> dict[str, str]:
    """The environment of the ``gpush`` processes: the user's own settings and data kept out."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GPUSH_URL", "GPUSH_TOKEN", "GPUSH_DATABASE_URL", "GPUSH_METRICS_TOKEN")
    }
    env.update(GPUSH_DATA_DIR=str(workdir / "data"), GPUSH_CONFIG_DIR=str(workdir / "config"))
    # On SQLite a command would otherwise start a local server in the background, which would
    # take the scheduler's lock from the server under test (and outlive the bench).
    env["GPUSH_LOCAL_SERVER"] = "0"
    return env


def cycle_counters(url: str) -> dict[str, float]:
    """The scheduling loop's counters from the server's /metrics: cycles, their seconds, each step's
    seconds, the adapter's calls and their seconds (with one worker, the leader's own)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name in ("gpush_scheduler_cycle_seconds_count", "gpush_scheduler_cycle_seconds_sum"):
                out[name.removeprefix("gpush_scheduler_")] = sample.value
            elif name == "gpush_scheduler_cycle_step_seconds_sum":
                out[f"step {labels['step']}"] = sample.value
            elif name.startswith("gpush_adapter_call_seconds_") and labels.get("cluster") == CLUSTER:
                out[f"{labels['method']} {name.rsplit('_', 1)[1]}"] = sample.value
    return out


def per_cycle(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the loop did between two readings of :func:`cycle_counters`: its cycles, their mean
    seconds, each step's and each adapter call's seconds a cycle, and the calls."""
    cycles = after.get("cycle_seconds_count", 0.0) - before.get("cycle_seconds_count", 0.0)
    out: dict[str, Any] = {"cycles": int(cycles)}
    if not cycles:
        return out

    def mean(key: str) -> float:
        return round((after[key] - before.get(key, 0.0)) / cycles, 4)

    out["cycle_s"] = mean("cycle_seconds_sum")
    out["steps_s"] = {k.removeprefix("step "): mean(k) for k in sorted(after) if k.startswith("step ")}
    out["adapter_s"] = {k.removesuffix(" sum"): mean(k) for k in sorted(after) if k.endswith(" sum")}
    out["adapter_calls"] = {
        k.removesuffix(" count"): int(after[k] - before.get(k, 0.0)) for k in sorted(after) if k.endswith(" count")
    }
    return out


def latency_gpush(
    api: Any, client: Any, server_url: str, namespace: str, jobs: int, timeout: float, rng: Any
) -> tuple[dict[str, Any], Any]:
    """``jobs`` jobs one at a time through a gpush server, after one untimed (connections, the
    adapter built, its caches filled): each submitted over HTTP, read every POLL_S until running,
    cancelled, and its Pod gone before the next. Each submission waits first: one interval, for
    the loop to be back in its idle rhythm (the previous job's events set its cycles), then a
    random part of two more, so that it lands anywhere in the leader's cycle, as a user's would
    (measured without the wait: always between cycles). Returns the figures and the untimed job
    as gpush stored it (its spec and placement)."""
    timeline = PodTimeline(api, namespace, TAG)

    def one() -> tuple[dict[str, Any], Any]:
        time.sleep(SERVER_INTERVAL + rng.uniform(0, 2 * SERVER_INTERVAL))
        begin = time.time()
        job = client.submit(LATENCY_SPEC)
        answered = time.time()
        deadline = begin + timeout
        while True:
            seen = client.get(job.id)
            if seen.state == "running":
                break
            if seen.state in STOPPED or time.time() > deadline:
                raise RuntimeError(f"gpush job {job.id} is {seen.state}, not running: {seen.state_reason}")
            time.sleep(POLL_S)
        running = time.time()
        client.cancel(job.id)
        pod_running = timeline.wait_for(job.id, "running", timeout)
        events: dict[str, float] = {}
        for event in client.events(job.id):
            events.setdefault(event.to_state.value, event.at.timestamp())
        timeline.wait_for(job.id, "deleted", timeout)
        while client.get(job.id).state != "cancelled":
            if time.time() > deadline + timeout:
                raise RuntimeError(f"gpush job {job.id} was not cancelled {timeout:.0f} s after its Pod went")
            time.sleep(0.05)
        marks = [begin, answered, events["routed"], events["submitted"], pod_running, events["running"], running]
        sample = {"job": job.id, "total_s": running - begin}
        sample.update({key: b - a for (key, _), (a, b) in zip(GPUSH_STEPS, pairwise(marks), strict=True)})
        return sample, seen

    try:
        _, warm = one()
        before = cycle_counters(server_url)
        samples = [one()[0] for _ in range(jobs)]
        loop = per_cycle(before, cycle_counters(server_url))
    finally:
        timeline.stop()
    totals = [s["total_s"] for s in samples]
    return {
        "jobs": len(samples),
        **percentiles(totals),
        "steps_p50_s": step_medians(samples, GPUSH_STEPS),
        "loop": loop,
        "per_job": samples,
    }, warm


def direct_latency_job(job_id: int, warm: Any, namespace: str) -> dict[str, Any]:
    """The Job gpush renders for the untimed job ``warm``, for another id and with the direct
    broker label; no preferred node (a Job written by hand names none)."""
    from dataclasses import replace

    from adapters.k8s.render import RenderOptions, render
    from broker.core.adapter import Placement
    from broker.core.gpus import gpu_model
    from broker.core.schemas import JobSpec

    placement = replace(Placement.from_dict(warm.placement), node=None)
    memory = gpu_model(placement.gpu_model).memory_gb if placement.gpu_model else None
    options = RenderOptions(tag=DIRECT_TAG, namespace=namespace, image=IMAGE)
    return render(job_id, JobSpec.model_validate(warm.spec), placement, options, gpu_memory_gb=memory).body


def latency_direct(api: Any, namespace: str, warm: Any, jobs: int, timeout: float) -> dict[str, Any]:
    """``jobs`` batch/v1 Jobs one at a time, after one untimed, each as gpush renders it: the time
    from the create until its Pod is seen Running; each deleted, its Pod gone before the next."""
    from kubernetes import client

    client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
    batch = client.BatchV1Api(api)
    timeline = PodTimeline(api, namespace, DIRECT_TAG)
    samples: list[dict[str, Any]] = []
    try:
        for job_id in range(jobs + 1):
            body = direct_latency_job(job_id, warm, namespace)
            begin = time.time()
            batch.create_namespaced_job(namespace, body, _preload_content=False)
            answered = time.time()
            running = timeline.wait_for(job_id, "running", timeout)
            batch.delete_namespaced_job(
                body["metadata"]["name"], namespace, propagation_policy="Background", _preload_content=False
            )
            timeline.wait_for(job_id, "deleted", timeout)
            if job_id == 0:
                continue
            marks = timeline.marks[job_id]
            points = [begin, answered, marks["created"], marks["bound"], running]
            one = {"job": job_id, "total_s": running - begin}
            one.update({key: b - a for (key, _), (a, b) in zip(DIRECT_STEPS, pairwise(points), strict=True)})
            samples.append(one)
    finally:
        timeline.stop()
    totals = [s["total_s"] for s in samples]
    return {
        "jobs": len(samples),
        **percentiles(totals),
        "steps_p50_s": step_medians(samples, DIRECT_STEPS),
        "per_job": samples,
    }


def bench_latency(
    api: Any, kubeconfig: Path, url: str, workdir: Path, args: argparse.Namespace, round_: int
) -> dict[str, Any]:
    """Submit-to-running of single jobs on the idle cluster: through a real ``gpush server`` (its
    own process on a scratch database, the scheduling loop as it ships: one leader, cycles every
    second, woken by submissions and by the cluster's Pod changes), then the same Job created
    directly."""
    import random

    from broker.client.sdk import GpushClient

    rng = random.Random(round_)
    namespace = f"bench-latency-gpush-{round_}"
    engine, _, pool = register_cluster(url, kubeconfig, namespace, adapter_settings(args))
    pool.close()
    engine.dispose()
    env = gpush_env(workdir)
    created = gpush_cli(env, url, "admin", "token", "create", "--user", "bench", "--tenant", "bench", "--json")
    log = workdir / f"server-{round_}.log"
    with gpush_server(env, url, args.server_workers, log) as (port, _):
        server_url = f"http://127.0.0.1:{port}"
        with GpushClient(server_url, json.loads(created)["token"]) as client:
            gpush, warm = latency_gpush(api, client, server_url, namespace, args.latency_jobs, args.timeout, rng)
    gpush["server_workers"] = args.server_workers
    clear_namespace(api, namespace)
    direct_namespace = f"bench-latency-direct-{round_}"
    direct = latency_direct(api, direct_namespace, warm, args.latency_jobs, args.timeout)
    clear_namespace(api, direct_namespace)
    return {"direct": direct, "gpush": gpush, "gap_p50_s": gpush["p50_s"] - direct["p50_s"]}


def print_latency(prefix: str, latency: dict[str, Any]) -> None:
    direct, gpush, gap = latency["direct"], latency["gpush"], latency["gap_p50_s"]
    print(
        f"{prefix}submit to running, one job at a time on the idle cluster ({gpush['jobs']} jobs each): "
        f"direct Job p50 {direct['p50_s']:.2f} s, p99 {direct['p99_s']:.2f} s; gpush p50 {gpush['p50_s']:.2f} s, "
        f"p99 {gpush['p99_s']:.2f} s; gpush - direct at p50 {gap:+.2f} s "
        f"(target <= {LATENCY_TARGET_S:g} s: {verdict(gap <= LATENCY_TARGET_S)})"
    )
    for name, result, steps in (("gpush", gpush, GPUSH_STEPS), ("direct", direct, DIRECT_STEPS)):
        parts = ", ".join(f"{label} {result['steps_p50_s'][key]:.3f}" for key, label in steps)
        print(f"  {name}, where the time goes (medians, s): {parts}")
    loop = gpush["loop"]
    if loop.get("cycles"):
        steps = ", ".join(f"{k} {v:.3f}" for k, v in loop["steps_s"].items())
        calls = ", ".join(f"{k} {v:.3f}" for k, v in loop["adapter_s"].items())
        print(
            f"  gpush server's loop over those jobs: {loop['cycles']} cycles, {loop['cycle_s']:.3f} s a cycle "
            f"(steps, s a cycle: {steps}; adapter calls, s a cycle: {calls})"
        )


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
    parser.add_argument(
        "--watch-seconds",
        type=float,
        help="the adapter's watch_seconds: how long one status read waits for events (default: the adapter's)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat every path, report medians (default 1)")
    parser.add_argument(
        "--latency-jobs",
        type=int,
        default=20,
        help="single jobs timed from submission to running, each way, each round (default 20; 0: none)",
    )
    parser.add_argument(
        "--server-workers",
        type=int,
        default=1,
        help="worker processes of the gpush server of the latency phase (default 1: its /metrics is the leader's)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures here as JSON")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds (8 nodes, 16 Pods, 2 latency jobs, 40 inventory nodes): that the bench "
        "runs (make test runs it); its figures mean nothing",
    )
    parser.add_argument("--serve-cluster", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke and not args.serve_cluster:
        args.nodes, args.pods, args.threads, args.rounds = 8, 16, 4, 1
        args.inventory_nodes, args.repeats, args.latency_jobs, args.timeout = 40, 1, 2, 120.0
    if args.serve_cluster:
        return serve_cluster(args.nodes, args.kubeconfig)

    from kubernetes import config

    results: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "replicas": REPLICAS,
        "db": args.db,
        "cpus": os.cpu_count(),
        "watch_seconds": args.watch_seconds,  # None: the adapter's default
        "smoke": args.smoke,
    }
    workdir = Path(tempfile.mkdtemp(prefix="gpush-k8s-bench-"))
    with ExitStack() as stack:
        kubeconfig = stack.enter_context(cluster_process(args.nodes, workdir))
        api = config.new_client_from_config(config_file=str(kubeconfig))
        api.configuration.connection_pool_maxsize = max(args.threads, 4) + 4
        stack.callback(api.close)

        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            # The paths one after another in each round (the three of throughput, then the two of
            # latency), each on an idle cluster, so a slow spell of the machine weighs on all alike;
            # the medians are the figures.
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
            broker = Broker(url, kubeconfig, f"bench-gpush-{r}", adapter_settings(args))
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
            if args.latency_jobs > 0:
                if args.db == "postgres":
                    url, _ = stack.enter_context(scratch_database(args.pg_url, f"{BENCH_DATABASE}_latency_{r}"))
                else:
                    url = f"sqlite:///{workdir / f'gpush-latency-{r}.db'}"
                one["latency"] = bench_latency(api, kubeconfig, url, workdir, args, r)
                print_latency(f"round {r + 1}: ", one["latency"])
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

        if args.latency_jobs > 0:
            latency = results["latency"] = {
                "direct": {k: median(f"latency.direct.{k}") for k in ("p50_s", "p99_s")},
                "gpush": {k: median(f"latency.gpush.{k}") for k in ("p50_s", "p99_s")},
                "gap_p50_s": median("latency.gap_p50_s"),
                "target_s": LATENCY_TARGET_S,
                "jobs": args.latency_jobs,
                "server_workers": args.server_workers,
            }
            latency["met"] = latency["gap_p50_s"] <= LATENCY_TARGET_S
            direct, gpush = latency["direct"], latency["gpush"]
            print(
                f"medians of {len(rounds)} rounds: submit to running, direct Job p50 {direct['p50_s']:.2f} s "
                f"(p99 {direct['p99_s']:.2f}), gpush p50 {gpush['p50_s']:.2f} s (p99 {gpush['p99_s']:.2f}); "
                f"gpush - direct at p50 {latency['gap_p50_s']:+.2f} s "
                f"(target <= {LATENCY_TARGET_S:g} s: {verdict(latency['met'])})"
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
