"""Jobs through gpush into a real Slurm, beside the same jobs through plain sbatch.

What it measures, on the single-machine Slurm test cluster of integration/slurm/
(started here in a scratch directory on ports of its own, stopped at the end) and a
scratch PostgreSQL database:

* **sbatch**: ``--jobs`` small jobs (``true`` on an MPS share of 1%, so up to 16 run
  at once on mps01, one per CPU) submitted one after another with ``sbatch``, as a
  user's script would; the time from the first submission until Slurm reports the
  last one COMPLETED.
* **gpush**: the same jobs as one gpush batch submission, placed by the scheduling
  cycle and handed to Slurm by the
  Slurm adapter (``submit_many``, on ``submit_threads`` threads), a cycle every
  ``--interval`` seconds as the leader runs them; the time from the
  submission until gpush reports the last one succeeded. The ratio is sbatch's time
  over gpush's: at least 1.0 means the broker is not the bottleneck.
* **latency**: on the idle cluster, ``--latency-jobs`` single jobs, each submitted
  alone while the scheduler runs its loop (``--interval``, 1 s by default as in
  ``gpush server``): the time from the submission until gpush reports the job
  running, p50 and p99, beside ``sbatch`` until squeue says RUNNING.

Both backends of the adapter can be measured (``--backend cli|rest``). A benchmark,
not a test: it prints figures and exits 0 when it ran.

    .venv/bin/python integration/bench/slurm.py --jobs 1000
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
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scratch import scratch_database  # noqa: E402

from broker.core.auth import Principal  # noqa: E402
from broker.core.clusters import AdapterPool, add_cluster  # noqa: E402
from broker.core.db import make_engine, session_factory  # noqa: E402
from broker.core.models import Job  # noqa: E402
from broker.core.schemas import JobSpec, Role  # noqa: E402
from broker.intake import queue  # noqa: E402
from broker.routing import versions as policystore  # noqa: E402
from broker.routing.versions import cluster_views  # noqa: E402
from broker.scheduling.cycle import Scheduler  # noqa: E402
from integration.slurm.cluster import SlurmTestCluster, start  # noqa: E402

ADMIN = Principal(user="root", tenant="bench", role=Role.ADMIN)
POLICY = """
rules:
  - name: light-on-mps
    why: the benchmark's small jobs share the MPS GPU
    match: {isolation: [process, none]}
    route: {cluster: slurm-a, sharing: slurm/mps}
"""
DEFAULT_PG_URL = os.environ.get("GPUSH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
BENCH_DATABASE = "gpush_bench_slurm"


def now() -> datetime:
    return datetime.now(UTC)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def squeue_states(cluster: SlurmTestCluster, names: set[str]) -> dict[str, str]:
    jobs = json.loads(cluster.run("squeue", "--json").stdout).get("jobs", [])
    out = {}
    for job in jobs:
        if job.get("name") in names:
            state = job.get("job_state")
            out[job["name"]] = state[0] if isinstance(state, list) else state
    return out


def sbatch_small(cluster: SlurmTestCluster, name: str, workdir: Path, command: str) -> None:
    """One small job as a user submits it: an MPS share of 1%, straight to sbatch."""
    cluster.run(
        "sbatch", "--parsable", f"--job-name={name}", "--gres=mps:1", f"--chdir={workdir}",
        "--output=/dev/null", "--wrap", command,
    )  # fmt: skip


def bench_sbatch(cluster: SlurmTestCluster, jobs: int, workdir: Path) -> dict:
    names = {f"sb{i}" for i in range(jobs)}
    begin = time.perf_counter()
    for name in sorted(names):
        sbatch_small(cluster, name, workdir, "true")
    submitted = time.perf_counter() - begin
    while True:
        states = squeue_states(cluster, names)
        if len(states) == jobs and all(s == "COMPLETED" for s in states.values()):
            break
        time.sleep(0.2)
    total = time.perf_counter() - begin
    return {"jobs": jobs, "submit_s": submitted, "total_s": total, "jobs_per_s": jobs / total}


class Broker:
    def __init__(self, url: str, cluster: SlurmTestCluster, backend: str, workdir: Path, backlog: int = 0):
        self.engine = make_engine(url)
        self.sessions = session_factory(self.engine)
        self.pool = AdapterPool(now)
        config = {"jobcomp_file": str(cluster.jobcomp), "workdir": str(workdir), "backlog_jobs": backlog}
        if backend == "rest":
            os.environ["GPUSH_BENCH_SLURM_JWT"] = cluster.token()
            config |= {"rest_url": cluster.rest_url, "token_env": "GPUSH_BENCH_SLURM_JWT", "user": "root"}
        else:
            config |= {"slurm_conf": str(cluster.conf)}
        with self.sessions() as session, session.begin():
            add_cluster(session, name="slurm-a", kind="slurm", config=config, actor="root", now=now())
        with self.sessions() as session, session.begin():
            views = cluster_views(session, self.pool)
            policystore.apply(
                session, POLICY, comment="bench", author="root", now=now(), views=views, base_version=None
            )
        self.scheduler = Scheduler(self.engine, self.pool, clock=now)

    def submit(self, n: int) -> list[int]:
        specs = [
            JobSpec.model_validate(
                {"kind": "inference", "isolation": "process", "gpu_memory_gb": 0.4, "command": ["true"]}
            )
            for _ in range(n)
        ]
        with self.sessions() as session, session.begin():
            return [r.job["id"] for r in queue.submit_jobs(session, specs, ADMIN, now=now())]

    def count(self, state: str, ids: list[int] | None = None) -> int:
        with self.sessions() as session:
            query = select(func.count()).select_from(Job).where(Job.state == state)
            if ids is not None:
                query = query.where(Job.id.in_(ids))
            return session.execute(query).scalar_one()


def bench_gpush(broker: Broker, jobs: int, interval: float) -> dict:
    begin = time.perf_counter()
    broker.submit(jobs)
    cycles = 0
    while broker.count("succeeded") < jobs:
        started = time.perf_counter()
        broker.scheduler.run_cycle()
        cycles += 1
        # The leader's loop: a cycle, then the rest of the interval (gpush server's default is 1 s).
        time.sleep(max(0.0, interval - (time.perf_counter() - started)))
        failed = broker.count("failed")
        if failed:
            raise RuntimeError(f"{failed} jobs failed in Slurm")
    total = time.perf_counter() - begin
    return {"jobs": jobs, "total_s": total, "jobs_per_s": jobs / total, "cycles": cycles}


def bench_latency(broker: Broker, cluster: SlurmTestCluster, n: int, interval: float, workdir: Path) -> dict:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            broker.scheduler.run_cycle()
            stop.wait(interval)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    gpush_s: list[float] = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            (job_id,) = broker.submit(1)
            while broker.count("running", [job_id]) + broker.count("succeeded", [job_id]) == 0:
                time.sleep(0.01)
            gpush_s.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
    sbatch_s: list[float] = []
    for i in range(n):
        name = f"lat{i}"
        t0 = time.perf_counter()
        sbatch_small(cluster, name, workdir, "sleep 0.5")
        while squeue_states(cluster, {name}).get(name) not in ("RUNNING", "COMPLETED", "COMPLETING"):
            time.sleep(0.01)
        sbatch_s.append(time.perf_counter() - t0)
    return {
        "gpush_p50_s": statistics.median(gpush_s),
        "gpush_p99_s": percentile(gpush_s, 99),
        "sbatch_p50_s": statistics.median(sbatch_s),
        "sbatch_p99_s": percentile(sbatch_s, 99),
        "interval_s": interval,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--latency-jobs", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.0, help="scheduler loop interval (gpush server: 1 s)")
    parser.add_argument("--backend", choices=["cli", "rest"], default="rest")
    parser.add_argument(
        "--backlog", type=int, default=0, help="the cluster's backlog_jobs: jobs left pending in Slurm's queue (0)"
    )
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    state = Path(tempfile.mkdtemp(prefix="gpush-slurm-bench-"))
    os.chmod(state, 0o755)
    env = {"GPUSH_SLURMCTLD_PORT": "9817", "GPUSH_SLURMD_PORT": "9821", "GPUSH_SLURMRESTD_PORT": "9820"}
    cluster = start(state, fresh=True, env={**os.environ, **env})
    workdir = Path(tempfile.mkdtemp(prefix="gpush-slurm-bench-out-"))
    os.chmod(workdir, 0o777)
    results: dict = {"backend": args.backend, "slurm": cluster.version, "backlog_jobs": args.backlog}
    try:
        results["sbatch"] = bench_sbatch(cluster, args.jobs, workdir)
        print(
            f"sbatch: {args.jobs} jobs in {results['sbatch']['total_s']:.1f} s "
            f"({results['sbatch']['jobs_per_s']:.0f} jobs/s; submissions took {results['sbatch']['submit_s']:.1f} s)"
        )
        with scratch_database(args.pg_url, BENCH_DATABASE, migrate=True) as (url, _):
            broker = Broker(url, cluster, args.backend, workdir, args.backlog)
            results["gpush"] = bench_gpush(broker, args.jobs, args.interval)
            ratio = results["sbatch"]["total_s"] / results["gpush"]["total_s"]
            results["ratio"] = ratio
            print(
                f"gpush ({args.backend}): {args.jobs} jobs in {results['gpush']['total_s']:.1f} s "
                f"({results['gpush']['jobs_per_s']:.0f} jobs/s, {results['gpush']['cycles']} cycles); "
                f"ratio to sbatch {ratio:.2f} (target >= 1.0: {'met' if ratio >= 1 else 'MISSED'})"
            )
            results["latency"] = bench_latency(broker, cluster, args.latency_jobs, args.interval, workdir)
            lat = results["latency"]
            print(
                f"submit -> running, idle cluster ({args.latency_jobs} jobs, cycle interval {args.interval:g} s): "
                f"gpush p50 {lat['gpush_p50_s'] * 1000:.0f} ms, p99 {lat['gpush_p99_s'] * 1000:.0f} ms; "
                f"sbatch p50 {lat['sbatch_p50_s'] * 1000:.0f} ms, p99 {lat['sbatch_p99_s'] * 1000:.0f} ms"
            )
            broker.engine.dispose()
    finally:
        cluster.stop(purge=True)
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
