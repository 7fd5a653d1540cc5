"""Jobs through gpush into a real Slurm, beside the same jobs through plain sbatch.

What it measures, on the single-machine Slurm test cluster of integration/slurm/
(started here in a scratch directory on ports of its own, fresh for every phase so
that no phase inherits another's finished jobs, which squeue lists for MinJobAge,
300 s; stopped at the end) and a scratch PostgreSQL database per gpush phase. gpush's
side runs its leader as ``gpush server`` does: :func:`run_scheduler_loop` on a thread,
a cycle every ``--interval`` seconds (1 s, the server's default) and woken by a
:class:`Wakeup` that the bench sets right after each submission commits, with a
``NOTIFY``, as the API's submit route does.

* **throughput**, ``--rounds`` rounds, sbatch first in odd rounds and gpush first in
  even ones:

  - **sbatch**: ``--jobs`` small jobs (``true`` on an MPS share of ``--mps-share``
    percent, 1 by default: 100 fit on mps01 and 16 run at once, one per CPU) submitted
    one after another with ``sbatch``, as a user's script would; the time from the
    first submission until the last one is COMPLETED in the job completion log, read as
    it grows (``squeue --json`` of 1,000 jobs costs about 0.16 s of CPU a call, taken
    from the jobs it watches).
  - **gpush**: the same jobs as one gpush batch submission, placed by the scheduling
    cycle and handed to Slurm by the Slurm adapter (``submit_many``, on
    ``submit_threads`` threads); the time from the submission until gpush's database
    says the last one succeeded.

  The ratio is sbatch's time over gpush's: at least 1.0 means the broker is not the
  bottleneck. Each round's ratio is printed, and their median: on the test cluster
  Slurm starts jobs in passes (16 at a pass here) whose timing differs from run to
  run, so one phase's time varies by up to a fifth.
* **latency**: on the idle cluster, ``--latency-jobs`` pairs of single jobs (``sleep
  0.5``), one through gpush and one through ``sbatch`` submitted together, each pair
  1 to 2 s (at random) after the last: both meet the same pass of Slurm's scheduler
  (the test cluster's starts pending jobs once a second), so the difference is what
  each path adds; the pairs take turns at which reaches slurmctld first, since the
  first may be started at its submission (:func:`bench_latency`). The time from the
  submission until gpush's database says the job runs, p50 and p99, beside ``sbatch``
  until squeue says RUNNING; the gap between their p50s against the target (0.3 s).
  Where the time goes is printed as medians after the submission: the first cycle's
  start, the REST submission's return, Slurm's start of the job (slurmctld's log, to
  the millisecond), the start of the status read that saw it run, the state written.

Both backends of the adapter can be measured (``--backend cli|rest``). A benchmark,
not a test: it prints figures and exits 0 when it ran.

    .venv/bin/python integration/bench/slurm.py --jobs 1000 --rounds 3
    .venv/bin/python integration/bench/slurm.py --jobs 300 --mps-share 8 --backlog 100   # 12 fit, 16 could run
    .venv/bin/python integration/bench/slurm.py --jobs 100 --latency-jobs 5   # a quick look
    .venv/bin/python integration/bench/slurm.py --smoke --json out.json   # seconds: does it run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scratch import scratch_database  # noqa: E402

from broker.core.auth import Principal  # noqa: E402
from broker.core.clusters import AdapterPool, add_cluster  # noqa: E402
from broker.core.db import make_engine, session_factory  # noqa: E402
from broker.core.models import Job, JobEvent  # noqa: E402
from broker.core.schemas import JobSpec, Role  # noqa: E402
from broker.intake import queue  # noqa: E402
from broker.routing import versions as policystore  # noqa: E402
from broker.routing.versions import cluster_views  # noqa: E402
from broker.scheduling.cycle import Scheduler  # noqa: E402
from broker.scheduling.leader import Wakeup, notify, run_scheduler_loop  # noqa: E402
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
PORTS = {"GPUSH_SLURMCTLD_PORT": "9817", "GPUSH_SLURMD_PORT": "9821", "GPUSH_SLURMRESTD_PORT": "9820"}
LATENCY_TARGET_S = 0.3  # gpush's p50 submit -> running within this of plain sbatch's (the target)
LATENCY_COMMAND = "sleep 0.5"
# slurmctld's log lines for a job it starts: its main scheduler's and its backfill pass's.
_STARTED = re.compile(r"^\[(?P<at>[0-9T:.-]+)\] .*(?:sched: Allocate|_start_job: Started) JobId=(?P<id>\d+)\b")


def now() -> datetime:
    return datetime.now(UTC)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


@contextmanager
def fresh_cluster(state: Path) -> Iterator[SlurmTestCluster]:
    """The test cluster started from nothing in ``state`` (job ids from 1, an empty
    squeue); stopped, its state kept for the next start to wipe, when the block ends."""
    cluster = start(state, fresh=True, env={**os.environ, **PORTS})
    try:
        yield cluster
    finally:
        cluster.stop()


def slurm_starts(cluster: SlurmTestCluster) -> dict[str, float]:
    """Slurm job id -> when slurmctld started it (epoch seconds, from its log, to the ms)."""
    starts: dict[str, float] = {}
    log = cluster.log_dir / "slurmctld.log"
    if not log.exists():
        return starts
    for line in log.read_text(errors="replace").splitlines():
        match = _STARTED.match(line)
        if match:
            try:
                # The log's time is local time without an offset: fromisoformat takes it as such.
                starts.setdefault(match["id"], datetime.fromisoformat(match["at"]).timestamp())
            except ValueError:
                continue
    return starts


def sbatch_small(cluster: SlurmTestCluster, name: str, workdir: Path, command: str, share: int = 1) -> str:
    """One small job as a user submits it: an MPS share (percent), straight to sbatch; its id."""
    out = cluster.run(
        "sbatch", "--parsable", f"--job-name={name}", f"--gres=mps:{share}", f"--chdir={workdir}",
        "--output=/dev/null", "--wrap", command,
    ).stdout  # fmt: skip
    return out.strip().split(";")[0]


class CompletionLog:
    """The job completion log (jobcomp/filetxt), read as it grows: names of jobs COMPLETED,
    and every record's fields (``JobId``, ``Name``, ``JobState``, ``SubmitTime``,
    ``StartTime``, ``EndTime``, ``NodeList``, ``NodeCnt``...) in the order written."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.rest = b""
        self.completed: set[str] = set()
        self.failed: list[str] = []
        self.records: list[dict[str, str]] = []

    def read(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            fields = dict(w.split("=", 1) for w in line.decode(errors="replace").split() if "=" in w)
            if fields:
                self.records.append(fields)
            if fields.get("JobState") == "COMPLETED":
                self.completed.add(fields.get("Name", ""))
            elif fields.get("JobState"):
                self.failed.append(f"{fields.get('Name')}: {fields.get('JobState')}")


def bench_sbatch(cluster: SlurmTestCluster, jobs: int, workdir: Path, share: int) -> dict:
    names = [f"sb{i}" for i in range(jobs)]
    done = CompletionLog(cluster.jobcomp)
    begin = time.perf_counter()
    for name in names:
        sbatch_small(cluster, name, workdir, "true", share)
    submitted = time.perf_counter() - begin
    while True:
        done.read()
        if done.failed:
            raise RuntimeError(f"sbatch jobs did not complete: {done.failed[:5]}")
        if done.completed.issuperset(names):
            break
        time.sleep(0.1)
    total = time.perf_counter() - begin
    return {"jobs": jobs, "submit_s": submitted, "total_s": total, "jobs_per_s": jobs / total}


@dataclass
class CycleTrace:
    """One cycle of the leader's loop, in epoch seconds."""

    start: float
    end: float
    read: tuple[float, float] | None  # the status read (step 2)
    placed: int
    submitted: int
    synced: int


class TracedScheduler(Scheduler):
    """gpush server's scheduler, keeping when each cycle and its status read ran (an
    append a cycle), for the latency breakdown and the cycle counts. The status read is
    timed by the scheduler's public timing hook (``on_phase``, told as each step ends):
    its ``sync`` step, which reads the clusters' changes (the writing of them runs beside
    later steps and is not told)."""

    def __init__(self, *args, trace: list[CycleTrace], **kwargs):
        super().__init__(*args, on_phase=self._phase_ended, **kwargs)
        self.trace = trace
        self._read: tuple[float, float] | None = None

    def _phase_ended(self, step: str, seconds: float) -> None:
        if step == "sync":
            end = time.time()
            self._read = (end - seconds, end)

    def run_cycle(self):
        begin, self._read = time.time(), None
        report = super().run_cycle()
        self.trace.append(CycleTrace(begin, time.time(), self._read, report.placed, report.submitted, report.synced))
        return report


class Broker:
    """gpush as ``gpush server`` runs it, in this process: a database, the test cluster
    registered with the bench's policy, the leader's loop on a thread (:meth:`leader`),
    and submissions that wake it as the API's do (:meth:`submit`)."""

    def __init__(
        self, url: str, cluster: SlurmTestCluster, backend: str, workdir: Path, settings: dict, policy: str = POLICY
    ):
        self.engine = make_engine(url)
        self.sessions = session_factory(self.engine)
        self.wakeup = Wakeup()
        # As broker.api.app builds it: an adapter that pushes changes wakes the leader.
        self.pool = AdapterPool(now, on_change=self.wakeup.set)
        self.trace: list[CycleTrace] = []
        config = {"jobcomp_file": str(cluster.jobcomp), "workdir": str(workdir), **settings}
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
                session, policy, comment="bench", author="root", now=now(), views=views, base_version=None
            )

    @contextmanager
    def leader(self, interval: float) -> Iterator[None]:
        """The scheduling loop of broker.api.server.attach_scheduler, for the block; it
        begins once the loop has run its first cycle, as in a server that was running."""
        stop = threading.Event()
        thread = threading.Thread(
            target=run_scheduler_loop,
            args=(self.engine, lambda: TracedScheduler(self.engine, self.pool, clock=now, trace=self.trace), stop),
            kwargs={"interval": interval, "wakeup": self.wakeup},
            name="gpush-scheduler",
            daemon=True,
        )
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not self.trace:
                if not thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the scheduling loop did not run a cycle in 30 s")
                time.sleep(0.01)
            yield
        finally:
            stop.set()
            thread.join(timeout=30)

    def close(self) -> None:
        self.pool.close()
        self.engine.dispose()

    def submit(self, n: int, command: list[str], share: int = 1) -> list[int]:
        """Queue ``n`` jobs in one transaction and wake the leader, as POST /v1/jobs:batch does.
        Each asks for ``share`` percent of the 40 GB A100 in GPU memory, so gpush sizes its MPS
        share as sbatch's (a hair under, since gpush rounds the share up)."""
        memory_gb = share * 0.4 - 1e-6
        spec = {"kind": "inference", "isolation": "process", "gpu_memory_gb": memory_gb, "command": command}
        return self.submit_specs([JobSpec.model_validate(spec) for _ in range(n)])

    def submit_specs(self, specs: list[JobSpec]) -> list[int]:
        """Queue the jobs in one transaction and wake the leader; their gpush ids."""
        with self.sessions() as session, session.begin():
            ids = [r.job["id"] for r in queue.submit_jobs(session, specs, ADMIN, now=now())]
            notify(session.connection())
        self.wakeup.set()
        return ids

    def count(self, state: str) -> int:
        with self.sessions() as session:
            return session.execute(select(func.count()).select_from(Job).where(Job.state == state)).scalar_one()

    def state(self, job_id: int) -> str:
        with self.sessions() as session:
            return session.execute(select(Job.state).where(Job.id == job_id)).scalar_one()

    def history(self, ids: list[int]) -> tuple[dict[int, dict[str, float]], dict[int, str | None]]:
        """Per job, when it entered each state (epoch seconds); and its Slurm job id."""
        with self.sessions() as session:
            events = session.execute(
                select(JobEvent.job_id, JobEvent.to_state, JobEvent.at)
                .where(JobEvent.job_id.in_(ids), JobEvent.type == "transition")
                .order_by(JobEvent.id)
            ).all()
            backend = dict(session.execute(select(Job.id, Job.backend_id).where(Job.id.in_(ids))).all())
        entered: dict[int, dict[str, float]] = {i: {} for i in ids}
        for job_id, state, at in events:
            entered[job_id].setdefault(state, at.timestamp())
        return entered, backend


def bench_gpush(broker: Broker, jobs: int, interval: float, share: int) -> dict:
    with broker.leader(interval):
        begin, since = time.perf_counter(), time.time()
        broker.submit(jobs, ["true"], share)
        while broker.count("succeeded") < jobs:
            failed = broker.count("failed")
            if failed:
                raise RuntimeError(f"{failed} jobs failed in Slurm")
            time.sleep(0.05)
        total = time.perf_counter() - begin
    cycles = [c for c in broker.trace if c.start >= since]
    return {
        "jobs": jobs,
        "total_s": total,
        "jobs_per_s": jobs / total,
        "cycles": len(cycles),
        "submitting_cycles": sum(1 for c in cycles if c.submitted),
        "cycle_s": sum(c.end - c.start for c in cycles),
        "status_read_s": sum(c.read[1] - c.read[0] for c in cycles if c.read),
    }


@dataclass
class LatencySide:
    """One side's submit -> running times (s) and, per job, the times of its stages."""

    total: list[float] = field(default_factory=list)
    stages: list[dict[str, float | None]] = field(default_factory=list)

    def summary(self) -> dict:
        names = list(self.stages[0]) if self.stages else []
        return {
            "p50_s": statistics.median(self.total),
            "p99_s": percentile(self.total, 99),
            "runs_s": self.total,
            "stage_medians_s": {name: median_of([s[name] for s in self.stages]) for name in names},
        }


RUNNING_OR_LATER = ("running", "succeeded", "failed")
SQUEUE_RUNNING_OR_LATER = ("RUNNING", "COMPLETING", "COMPLETED", "FAILED")


def bench_latency(
    broker: Broker, cluster: SlurmTestCluster, pauses: list[float], interval: float, workdir: Path
) -> tuple[LatencySide, LatencySide]:
    """Pairs of one job through gpush and one through sbatch, submitted together after each
    pause, so both meet the same pass of Slurm's scheduler and the difference between them
    is what each path adds; one loop watches both (gpush's database, ``squeue -j``).

    The job that reaches slurmctld first on an idle cluster may be started at once, at its
    submission, and the second then waits for the next pass (seen on 22.05: sbatch's job
    running 31-76 ms after sbatch while gpush's, 40 ms behind it, waited a second). So the
    pairs take turns: in even ones sbatch goes first, in odd ones gpush's submission
    (until its REST submission returned), then sbatch."""
    gpush, sbatch = LatencySide(), LatencySide()
    pairs: list[tuple[int, str, float, float, float, float, float]] = []
    with broker.leader(interval):
        for i, pause in enumerate(pauses):
            time.sleep(pause)
            gpush_first = i % 2 == 1
            if not gpush_first:
                t_sbatch = time.time()
                slurm_id = sbatch_small(cluster, f"lat{i}", workdir, LATENCY_COMMAND)
                returned = time.time()
            t_gpush = time.time()
            (job_id,) = broker.submit(1, ["sh", "-c", LATENCY_COMMAND])
            if gpush_first:
                while broker.state(job_id) in ("queued", "routed", "submitting"):
                    time.sleep(0.002)
                t_sbatch = time.time()
                slurm_id = sbatch_small(cluster, f"lat{i}", workdir, LATENCY_COMMAND)
                returned = time.time()
            seen_gpush = seen_sbatch = None
            while seen_gpush is None or seen_sbatch is None:
                if seen_gpush is None and broker.state(job_id) in RUNNING_OR_LATER:
                    seen_gpush = time.time()
                if seen_sbatch is None:
                    state = cluster.run("squeue", "-h", "-j", slurm_id, "-o", "%T").stdout.strip()
                    if state in SQUEUE_RUNNING_OR_LATER:
                        seen_sbatch = time.time()
                time.sleep(0.01)
            pairs.append((job_id, slurm_id, t_gpush, seen_gpush, t_sbatch, returned, seen_sbatch))
            gpush.total.append(seen_gpush - t_gpush)
            sbatch.total.append(seen_sbatch - t_sbatch)
        time.sleep(1.0)  # the last jobs' lines in slurmctld's log
    entered, backend = broker.history([pair[0] for pair in pairs])
    started = slurm_starts(cluster)
    cycles = sorted(broker.trace, key=lambda c: c.start)
    for job_id, slurm_id, t0, seen, t_sbatch, returned, seen_sbatch in pairs:
        written = entered[job_id].get("running") or entered[job_id].get("succeeded")
        first = next((c.start for c in cycles if c.start >= t0), None)
        read = max((c.read[0] for c in cycles if c.read and written and c.read[1] <= written), default=None)
        slurm = started.get(backend.get(job_id) or "")
        gpush.stages.append(
            {
                "cycle_started": first - t0 if first else None,
                "submit_returned": entered[job_id]["submitted"] - t0 if "submitted" in entered[job_id] else None,
                "slurm_started": slurm - t0 if slurm else None,
                "status_read": read - t0 if read else None,
                "state_written": written - t0 if written else None,
                "seen": seen - t0,
            }
        )
        slurm = started.get(slurm_id)
        sbatch.stages.append(
            {
                "submit_returned": returned - t_sbatch,
                "slurm_started": slurm - t_sbatch if slurm else None,
                "seen": seen_sbatch - t_sbatch,
            }
        )
    return gpush, sbatch


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def print_round(n: int, rounds: int, jobs: int, result: dict) -> None:
    sb, gp = result["sbatch"], result["gpush"]
    print(
        f"round {n}/{rounds}: sbatch {jobs} jobs in {sb['total_s']:.1f} s ({sb['jobs_per_s']:.0f} jobs/s, "
        f"submissions {sb['submit_s']:.1f} s); gpush in {gp['total_s']:.1f} s ({gp['jobs_per_s']:.0f} jobs/s, "
        f"{gp['cycles']} cycles, {gp['submitting_cycles']} of them submitting, "
        f"{gp['cycle_s']:.1f} s in cycles, {gp['status_read_s']:.1f} s of them reading statuses); "
        f"ratio {result['ratio']:.2f}",
        flush=True,
    )


def print_latency(lat: dict, n: int, interval: float) -> None:
    gp, sb = lat["gpush"], lat["sbatch"]
    gap = lat["gap_p50_s"]
    print(
        f"submit -> running, idle cluster ({n} jobs, gpush server's loop at {interval:g} s): "
        f"gpush p50 {ms(gp['p50_s'])}, p99 {ms(gp['p99_s'])}; sbatch p50 {ms(sb['p50_s'])}, p99 {ms(sb['p99_s'])}; "
        f"gap p50 {ms(gap)}, p99 {ms(lat['gap_p99_s'])}, within a pair p50 {ms(lat['pair_gap_p50_s'])} "
        f"(target p50 gap <= {ms(LATENCY_TARGET_S)}: {'met' if gap <= LATENCY_TARGET_S else 'MISSED'})"
    )
    stages = gp["stage_medians_s"]
    print(
        "  gpush, medians after the submission: first cycle began "
        f"{ms(stages['cycle_started'])}, REST submission returned {ms(stages['submit_returned'])}, "
        f"Slurm started the job {ms(stages['slurm_started'])}, the status read that saw it began "
        f"{ms(stages['status_read'])}, running written {ms(stages['state_written'])}, seen {ms(stages['seen'])}"
    )
    stages = sb["stage_medians_s"]
    print(
        f"  sbatch, medians: sbatch returned {ms(stages['submit_returned'])}, Slurm started the job "
        f"{ms(stages['slurm_started'])}, squeue said RUNNING {ms(stages['seen'])}"
    )
    print(
        "  Slurm's own pass (submission returned -> started), median: "
        f"gpush's jobs {ms(lat['slurm_pass_gpush_s'])}, sbatch's {ms(lat['slurm_pass_sbatch_s'])}; "
        f"gap within a pair, p50, when sbatch reached Slurm first {ms(lat['pair_gap_p50_sbatch_first_s'])}, "
        f"when gpush did {ms(lat['pair_gap_p50_gpush_first_s'])}"
    )


def slurm_pass(side: LatencySide) -> float | None:
    return median_of(
        [
            s["slurm_started"] - s["submit_returned"]
            if s["slurm_started"] is not None and s["submit_returned"] is not None
            else None
            for s in side.stages
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs of each throughput phase (1000)")
    parser.add_argument("--rounds", type=int, default=1, help="throughput rounds; their median ratio is the figure (1)")
    parser.add_argument("--latency-jobs", type=int, default=20, help="single jobs for submit -> running (20)")
    parser.add_argument("--interval", type=float, default=1.0, help="scheduler loop interval (gpush server: 1 s)")
    parser.add_argument("--backend", choices=["cli", "rest"], default="rest")
    parser.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="the cluster's backlog_jobs: jobs left pending in Slurm's queue (default: the adapter's, 0)",
    )
    parser.add_argument(
        "--mps-share",
        type=int,
        default=1,
        help="percent of the MPS GPU each throughput job takes (1: 100 fit, 16 run at once, one per CPU)",
    )
    parser.add_argument("--seed", type=int, default=1, help="of the latency jobs' submission times (1)")
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds (20 jobs, one round, 2 latency pairs): that the bench runs (make test "
        "runs it); its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.rounds, args.latency_jobs = 20, 1, 2
    # A stopped run (timeout, kill) still stops its Slurm daemons: the finally blocks run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    settings = {} if args.backlog is None else {"backlog_jobs": args.backlog}
    state = Path(tempfile.mkdtemp(prefix="gpush-slurm-bench-"))
    os.chmod(state, 0o755)
    workdir = Path(tempfile.mkdtemp(prefix="gpush-slurm-bench-out-"))
    os.chmod(workdir, 0o777)
    results: dict = {
        "backend": args.backend,
        "settings": settings,
        "mps_share": args.mps_share,
        "interval_s": args.interval,
        "smoke": args.smoke,
        "rounds": [],
    }
    described = ", ".join(f"{k}={v}" for k, v in settings.items()) or "the adapter's defaults"
    described += f", {args.mps_share}% MPS shares"

    def gpush_phase(run) -> dict:
        with fresh_cluster(state) as cluster, scratch_database(args.pg_url, BENCH_DATABASE, migrate=True) as (url, _):
            results["slurm"] = cluster.version
            broker = Broker(url, cluster, args.backend, workdir, settings)
            try:
                return run(broker, cluster)
            finally:
                broker.close()

    def sbatch_phase() -> dict:
        with fresh_cluster(state) as cluster:
            return bench_sbatch(cluster, args.jobs, workdir, args.mps_share)

    phases = {
        "sbatch": sbatch_phase,
        "gpush": lambda: gpush_phase(lambda broker, _: bench_gpush(broker, args.jobs, args.interval, args.mps_share)),
    }
    try:
        for n in range(1, args.rounds + 1):
            order = ("sbatch", "gpush") if n % 2 else ("gpush", "sbatch")
            result = {name: phases[name]() for name in order}
            result["ratio"] = result["sbatch"]["total_s"] / result["gpush"]["total_s"]
            results["rounds"].append(result)
            print_round(n, args.rounds, args.jobs, result)
        ratios = [r["ratio"] for r in results["rounds"]]
        results["ratio"] = statistics.median(ratios)
        print(
            f"throughput ({args.jobs} jobs, {args.backend}, {described}): ratio to sbatch, median of "
            f"{len(ratios)} round(s) {results['ratio']:.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}; "
            f"target >= 1.0: {'met' if results['ratio'] >= 1 else 'MISSED'})",
            flush=True,
        )

        if args.latency_jobs:
            rng = random.Random(args.seed)
            # A second and a random part of one between pairs: the last pair's jobs (0.5 s)
            # have ended, and the next submissions fall anywhere in Slurm's second.
            pauses = [1.0 + rng.random() for _ in range(args.latency_jobs)]

            def both(broker: Broker, cluster: SlurmTestCluster) -> dict:
                gpush, sbatch = bench_latency(broker, cluster, pauses, args.interval, workdir)
                return {
                    "gpush": gpush.summary(),
                    "sbatch": sbatch.summary(),
                    "slurm_pass_gpush_s": slurm_pass(gpush),
                    "slurm_pass_sbatch_s": slurm_pass(sbatch),
                    "pair_gap_p50_s": statistics.median(g - b for g, b in zip(gpush.total, sbatch.total)),
                    # Even pairs: sbatch reached slurmctld first; odd ones: gpush.
                    "pair_gap_p50_sbatch_first_s": statistics.median(
                        g - b for g, b in zip(gpush.total[::2], sbatch.total[::2])
                    ),
                    "pair_gap_p50_gpush_first_s": median_of(
                        [g - b for g, b in zip(gpush.total[1::2], sbatch.total[1::2])]
                    ),
                }

            lat = gpush_phase(both)
            lat["gap_p50_s"] = lat["gpush"]["p50_s"] - lat["sbatch"]["p50_s"]
            lat["gap_p99_s"] = lat["gpush"]["p99_s"] - lat["sbatch"]["p99_s"]
            lat["target_gap_s"] = LATENCY_TARGET_S
            results["latency"] = lat
            print_latency(lat, args.latency_jobs, args.interval)
    finally:
        subprocess.run(["rm", "-rf", str(state), str(workdir)], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
