"""Scheduling-cycle throughput at scale, on PostgreSQL against a simulated fleet.

What it measures, on a database of its own (created for the run, dropped at the end)
with two simulated clusters (broker/simulation/cluster/) registered under the names the
shipped policy routes to, ``slurm-a`` and ``k8s-a``, and ``policies/default.yaml``
active:

* **fill**: ``--jobs`` queued jobs (default 100,000), then scheduling cycles
  (``Scheduler.run_cycle``; ``--claim-limit`` jobs claimed per tenant and cycle, 834 by
  default: about 5,000 a cycle over the six tenants) until the queue drains or a cycle
  places nothing, because what is left at the head of the queue waits for capacity the
  fleet no longer has. The fleet runs in frozen virtual time, so no job ends and the
  run is the fleet filling up from empty. Reported: jobs placed per second (placed
  jobs over the wall time of the cycles) over the cycles *with room* (at least half of
  what they decide is placed) and over every cycle that placed anything (the tail of
  the fill re-decides thousands of waiting jobs to place a few), each cycle's time,
  and the time of a cycle on the full fleet (it decides a window of waiting jobs and
  places none, which is what a leader does every interval when full).
* **one cycle with a million queued** (``--million``): a fresh database with
  1,000,000 queued jobs (``--million-jobs``) and an empty fleet, then a few cycles that
  each claim and place about 1,000 jobs (167 per tenant): the time of the first (claim
  and place) and the median of the later ones (which also sync the previous cycle's
  1,000 jobs, now running).
* **peak RSS** of this process (``resource.getrusage``), which runs the scheduler and
  the simulated fleet; jobs are loaded by child processes, so the loader's memory is
  not counted.
* **baseline**: the simplest per-job write loop PostgreSQL allows for the same rows,
  ``UPDATE jobs SET state, placement WHERE id; … COMMIT`` per 1,000 rows,
  one statement per job, on a scratch copy of the queued rows in the same database.
  gpush's placed jobs per second over its rows per second is the ratio: a figure that
  means the same on a laptop or a CI runner (a placed job is several writes: its
  placement, three transitions with their events, and the cluster's status).

The fleet (``--nodes`` nodes of ``--gpus-per-node`` GPUs; default 1,000 × 8) mixes what
the shipped policy routes to: Slurm nodes with A100s in MIG mode (1g.5gb, 2g.10gb,
3g.20gb layouts), MPS A100s and whole A100-80GBs; Kubernetes pools of time-sliced T4s
(4 replicas) and A100s under the mixed MIG strategy. The jobs mix training
(exclusive, 1 to 8 GPUs, and MIG-sized), inference (MPS, MIG, time-sliced, elastic) and
batch, over six tenants with fair-share weights and one quota, three priorities, and
a few jobs no node can ever hold (held).

Loaded jobs go through ``broker.intake.queue.submit_jobs`` in batches (``COPY``), as a batch
submission does, then ``VACUUM ANALYZE jobs``, which autovacuum does after any bulk load,
and a ``CHECKPOINT``, so that no checkpoint of the load lands in the measured cycles.

It is a benchmark, not a test: the targets (≥ 5,000 jobs/s with 100,000 queued; one
cycle < 200 ms with a million queued; RSS < 1 GB) are printed beside the figures,
never asserted. It exits 0 when it ran, 1 when something broke.

    .venv/bin/python integration/bench/schedule.py --json schedule-results.json
    .venv/bin/python integration/bench/schedule.py --million
    .venv/bin/python integration/bench/schedule.py --jobs 20000 --nodes 200   # a quick look
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table
from scratch import scratch_database
from sqlalchemy import func, select

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
BENCH_DATABASE = "gpush_bench_schedule"
ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "policies" / "default.yaml"
LOAD_BATCH = 10_000
# The virtual time the run happens at; frozen, so the fleet only fills.
START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
MILLION_CYCLES = 5
# Claim limits are per tenant: with the six tenants below, about 5,000 and 1,000 jobs a cycle.
FILL_CLAIM = 834
MILLION_CLAIM = 167
MAX_CYCLES = 1000

TARGET_JOBS_PER_S = 5000
TARGET_CYCLE_MS = 200
TARGET_RSS_MB = 1024

console = Console(width=None if sys.stdout.isatty() else 170)


# -- the fleet and the workload -----------------------------------------------------


def _split(total: int, shares: list[float]) -> list[int]:
    """``total`` split by ``shares``; the rounding remainder goes to the largest share."""
    counts = [int(total * share) for share in shares]
    counts[shares.index(max(shares))] += total - sum(counts)
    return counts


def fleet_yaml(nodes: int, gpus_per_node: int) -> str:
    """A fleet file of ``nodes`` nodes with ``gpus_per_node`` GPUs each, in the mix the
    shipped policy routes to (see the module docstring)."""
    mig, mps, whole, timeslice, k8s_mig = _split(nodes, [0.15, 0.10, 0.40, 0.20, 0.15])
    g = gpus_per_node
    # A Slurm MIG node: half its GPUs in seven 1g.5gb slices, a quarter in two 3g.20gb,
    # the rest mixed; entries with no GPU are left out.
    layouts = [
        (g // 2, ["1g.5gb"] * 7),
        (g // 4, ["3g.20gb", "3g.20gb"]),
        (g - g // 2 - g // 4, ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]),
    ]
    mig_gpus = "\n".join(
        f"          - {{model: A100-SXM4-40GB, count: {count}, mig: [{', '.join(layout)}]}}"
        for count, layout in layouts
        if count
    )
    slurm_nodes = []
    if mig:
        slurm_nodes.append(
            f"      - name: mig\n        count: {mig}\n        cpus: 64\n        memory: 512G\n"
            f"        gpus:\n{mig_gpus}"
        )
    if mps:
        slurm_nodes.append(
            f"      - name: mps\n        count: {mps}\n        cpus: 64\n        memory: 512G\n"
            f"        gpus:\n          - {{model: A100-SXM4-40GB, mps: true, count: {g}}}"
        )
    if whole:
        slurm_nodes.append(
            f"      - name: gpu\n        count: {whole}\n        cpus: 128\n        memory: 1T\n"
            f"        gpus:\n          - {{model: A100-SXM4-80GB, count: {g}}}"
        )
    pools = []
    if timeslice:
        pools.append(f"      - {{name: t4, nodes: {timeslice}, gpus_per_node: {g}, model: T4, timeslice_replicas: 4}}")
    if k8s_mig:
        pools.append(
            f"      - {{name: a100-mig, nodes: {k8s_mig}, gpus_per_node: {g}, model: A100-SXM4-40GB, "
            "mig: [3g.20gb, 2g.10gb, 1g.5gb, 1g.5gb]}"
        )
    return (
        f"# Generated by integration/bench/schedule.py: {nodes} nodes x {g} GPUs.\n"
        "clusters:\n"
        "  slurm-a:\n    flavor: slurm\n    nodes:\n" + "\n".join(slurm_nodes) + "\n"
        "  k8s-a:\n    flavor: k8s\n    pools:\n" + "\n".join(pools) + "\n"
    )


# (name, fair-share weight, GPU quota or None, share of the submitted jobs)
TENANTS = [
    ("research", 3.0, None, 0.35),
    ("vision", 2.0, None, 0.25),
    ("nlp", 1.0, None, 0.20),
    ("speech", 1.0, None, 0.10),
    ("recsys", 1.0, 200.0, 0.07),
    ("interns", 0.5, None, 0.03),
]
# (share, job fields): where the shipped policy sends each is in the comment. The
# shares follow the fleet's shape (whole GPUs are the scarce kind; MIG, MPS and
# time-slicing hold many jobs each), so the fleet fills up over several cycles.
JOB_MIX: list[tuple[float, dict[str, Any]]] = [
    (0.060, {"kind": "training", "gpus": 1}),  # slurm/exclusive
    (0.015, {"kind": "training", "gpus": 2}),
    (0.007, {"kind": "training", "gpus": 4}),
    (0.003, {"kind": "training", "gpus": 8}),
    (0.200, {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 4}),  # slurm/mig 1g.5gb, k8s/mig
    (0.030, {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 8}),  # 2g.10gb
    (0.040, {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 16}),  # 3g.20gb
    (0.300, {"kind": "inference", "isolation": "process", "gpu_memory_gb": 2}),  # slurm/mps 5%
    (0.060, {"kind": "inference", "isolation": "process", "gpu_memory_gb": 4}),  # slurm/mps 10%
    (0.050, {"kind": "inference", "isolation": "hardware", "gpu_memory_gb": 8}),  # k8s/mig 2g.10gb
    (0.150, {"kind": "inference", "isolation": "none", "gpu_memory_gb": 3}),  # k8s/timeslice
    (
        0.050,
        {
            "kind": "inference",
            "isolation": "none",
            "gpu_memory_gb": 2,
            "elastic": {"min_replicas": 2, "max_replicas": 8},
        },
    ),
    (0.020, {"kind": "batch", "gpus": 1}),  # slurm/exclusive
    (0.040, {"kind": "batch", "isolation": "none", "gpu_memory_gb": 2}),  # k8s/timeslice
    (0.002, {"kind": "training", "gpus": 16}),  # no node has 16 GPUs: held
]
PRIORITIES = [(0.85, 0), (0.10, 10), (0.05, -10)]
DURATIONS_S = ["600", "1800", "3600", "14400"]


class Workload:
    """Random jobs of the mix above; each distinct spec is validated once and reused."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self._specs: dict[tuple, Any] = {}
        self._tenants = [t[0] for t in TENANTS]
        self._tenant_w = [t[3] for t in TENANTS]
        self._mix = [m[1] for m in JOB_MIX]
        self._mix_w = [m[0] for m in JOB_MIX]
        self._prio = [p[1] for p in PRIORITIES]
        self._prio_w = [p[0] for p in PRIORITIES]

    def pick(self):
        from broker.core.schemas import JobSpec

        rng = self.rng
        tenant = rng.choices(self._tenants, self._tenant_w)[0]
        mix = rng.choices(range(len(self._mix)), self._mix_w)[0]
        priority = rng.choices(self._prio, self._prio_w)[0]
        duration = rng.choice(DURATIONS_S)
        key = (tenant, mix, priority, duration)
        spec = self._specs.get(key)
        if spec is None:
            fields = self._mix[mix]
            command = ["python", "serve.py"] if fields["kind"] == "inference" else ["python", "train.py"]
            spec = JobSpec.model_validate(
                {
                    **fields,
                    "command": command,
                    "tenant": tenant,
                    "user": f"{tenant}-user",
                    "priority": priority,
                    "time_limit": "8h",
                    "labels": {"sim-duration": duration, "team": tenant},
                }
            )
            self._specs[key] = spec
        return spec


def _load_worker(url: str, worker: int, workers: int, total: int, seed: int) -> None:
    """Child process: submit this worker's share of ``total`` jobs in batches."""
    from broker.core.auth import Principal
    from broker.core.db import make_engine, session_factory
    from broker.core.schemas import Role
    from broker.intake.queue import submit_jobs

    admin = Principal(user="bench", tenant="ops", role=Role.ADMIN)
    engine = make_engine(url, pool_size=1)
    sessions = session_factory(engine)
    workload = Workload(seed + worker)
    batches = (total + LOAD_BATCH - 1) // LOAD_BATCH
    for batch in range(worker, batches, workers):
        size = min(LOAD_BATCH, total - batch * LOAD_BATCH)
        specs = [workload.pick() for _ in range(size)]
        # Each batch a second older than the next: the queue's age order is batch order.
        now = START - timedelta(days=1) + timedelta(seconds=batch)
        with sessions() as session, session.begin():
            submit_jobs(session, specs, admin, now=now)
    engine.dispose()


def load_jobs(url: str, total: int, seed: int) -> float:
    """Submit ``total`` jobs from child processes (one per CPU, at most 4); returns seconds."""
    workers = max(1, min(os.cpu_count() or 1, 4, (total + LOAD_BATCH - 1) // LOAD_BATCH))
    ctx = multiprocessing.get_context("spawn")
    begin = time.perf_counter()
    procs = [ctx.Process(target=_load_worker, args=(url, w, workers, total, seed)) for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"job loader processes exited with {failed}")
    return time.perf_counter() - begin


# -- the database and the broker ----------------------------------------------------


class FrozenClock:
    def __call__(self) -> datetime:
        return START


def setup_broker(url: str, fleet_file: Path):
    """Register the two simulated clusters (no state file: nothing persisted between
    calls), apply the shipped policy, set the tenants; returns (engine, AdapterPool)."""
    from broker.core.clusters import AdapterPool, add_cluster
    from broker.core.db import make_engine, session_factory
    from broker.placement import tenants
    from broker.routing import versions as policystore
    from broker.routing.versions import cluster_views

    clock = FrozenClock()
    engine = make_engine(url)
    sessions = session_factory(engine)
    pool = AdapterPool(clock)
    config = {"fleet": str(fleet_file), "state_file": None}
    with sessions() as session, session.begin():
        for name in ("slurm-a", "k8s-a"):
            add_cluster(session, name=name, kind="sim", config=config, actor="bench", now=clock())
        for name, weight, quota, _share in TENANTS:
            tenants.set_tenant(session, name, weight=weight, gpu_quota=quota, clear_quota=False, now=clock())
    with sessions() as session, session.begin():
        views = cluster_views(session, pool)
        policystore.apply(
            session, POLICY.read_text(), comment="bench", author="bench", now=clock(), views=views, base_version=None
        )
    return engine, pool, clock


def settle(conninfo: str) -> None:
    """After a bulk load: fresh statistics (what autovacuum would do) and a checkpoint, so
    no checkpoint of the load's writes lands in the middle of the measured cycles."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE jobs")
        conn.execute("ANALYZE job_events")
        try:
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            pass  # not a superuser: the measurements are noisier, not wrong


def states(engine) -> dict[str, int]:
    from broker.core.models import Job

    with engine.connect() as conn:
        return dict(conn.execute(select(Job.state, func.count()).group_by(Job.state)).all())


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / (1024 * 1024)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# -- measurements -------------------------------------------------------------------


@dataclass
class Cycle:
    seconds: float
    placed: int
    waiting: int
    held: int
    synced: int
    recovered: int
    errors: int
    steps: dict[str, float] = field(default_factory=dict)


def run_cycle(scheduler) -> tuple[Cycle, list[str]]:
    begin = time.perf_counter()
    report = scheduler.run_cycle()
    seconds = time.perf_counter() - begin
    steps = dict(getattr(report, "seconds", None) or {})
    cycle = Cycle(
        seconds, report.placed, report.waiting, report.held, report.synced, report.recovered, len(report.errors), steps
    )
    return cycle, list(report.errors)


@dataclass
class Result:
    """One line of the table and one object of the JSON ``results``."""

    scenario: str
    queued_at_start: int
    cycles: int
    placed: int
    decided: int
    seconds: float
    jobs_per_s: float | None
    cycle_ms_p50: float | None
    cycle_ms_max: float | None
    baseline_per_s: float | None = None
    ratio: float | None = None
    targets: dict[str, bool] | None = None
    note: str = ""


def fill(url: str, conninfo: str, args: argparse.Namespace, fleet_file: Path) -> tuple[list[Result], dict[str, Any]]:
    from broker.scheduling.cycle import Scheduler

    engine, pool, clock = setup_broker(url, fleet_file)
    console.print(f"  loading {args.jobs:,} queued jobs")
    load_s = load_jobs(url, args.jobs, args.seed)
    settle(conninfo)
    console.print(f"  loaded in {load_s:.1f} s ({args.jobs / load_s:,.0f} jobs/s)")
    scheduler = Scheduler(engine, pool, clock=clock, claim_limit=args.claim_limit)
    cycles: list[Cycle] = []
    errors: list[str] = []
    for _ in range(args.max_cycles):
        cycle, errs = run_cycle(scheduler)
        cycles.append(cycle)
        errors += errs
        console.print(
            f"  cycle {len(cycles):3d}: {cycle.seconds * 1e3:8.1f} ms  placed {cycle.placed:5d}  "
            f"waiting {cycle.waiting:5d}  held {cycle.held:4d}  synced {cycle.synced:5d}"
            + (f"  errors {cycle.errors}" if cycle.errors else "")
        )
        if cycle.placed == 0 and cycle.synced == 0 and cycle.recovered == 0:
            break
    placing = [c for c in cycles if c.placed]
    # The fleet has room while most of what a cycle decides is placed; after that the
    # cycles mostly re-decide waiting jobs and the rate says more about the fleet's size.
    roomy = [c for c in placing if c.placed * 2 >= c.placed + c.waiting + c.held]
    full = [c for c in cycles if not c.placed and not c.synced]
    final = states(engine)
    engine.dispose()
    results = [
        _rate_row("fill: cycles with room", roomy, args.jobs, args, "most of what a cycle decides is placed"),
        _rate_row("fill: every cycle that placed", placing, args.jobs, args, "to the last placement"),
    ]
    if full:
        ms = [c.seconds * 1e3 for c in full]
        results.append(
            Result(
                scenario="fill: cycle on the full fleet",
                queued_at_start=final.get("queued", 0),
                cycles=len(full),
                placed=0,
                decided=sum(c.waiting + c.held for c in full),
                seconds=sum(c.seconds for c in full),
                jobs_per_s=None,
                cycle_ms_p50=statistics.median(ms),
                cycle_ms_max=max(ms),
                note="decides a window of waiting jobs",
            )
        )
    detail = {
        "load_seconds": load_s,
        "cycles": [asdict(c) for c in cycles],
        "states_after": final,
        "errors": errors[:20],
        "error_count": len(errors),
    }
    return results, detail


def _rate_row(scenario: str, cycles: list[Cycle], queued: int, args: argparse.Namespace, note: str) -> Result:
    placed = sum(c.placed for c in cycles)
    seconds = sum(c.seconds for c in cycles)
    rate = placed / seconds if seconds else None
    times = [c.seconds * 1e3 for c in cycles]
    return Result(
        scenario=scenario,
        queued_at_start=queued,
        cycles=len(cycles),
        placed=placed,
        decided=sum(c.placed + c.waiting + c.held for c in cycles),
        seconds=seconds,
        jobs_per_s=rate,
        cycle_ms_p50=statistics.median(times) if times else None,
        cycle_ms_max=max(times) if times else None,
        targets={f">={TARGET_JOBS_PER_S:,}/s": rate is not None and rate >= TARGET_JOBS_PER_S},
        note=f"{note}; claim limit {args.claim_limit} per tenant",
    )


def million(url: str, conninfo: str, args: argparse.Namespace, fleet_file: Path) -> tuple[list[Result], dict[str, Any]]:
    from broker.scheduling.cycle import Scheduler

    engine, pool, clock = setup_broker(url, fleet_file)
    console.print(f"  loading {args.million_jobs:,} queued jobs")
    load_s = load_jobs(url, args.million_jobs, args.seed + 1000)
    settle(conninfo)
    console.print(f"  loaded in {load_s:.1f} s ({args.million_jobs / load_s:,.0f} jobs/s)")
    scheduler = Scheduler(engine, pool, clock=clock, claim_limit=args.million_claim_limit)
    cycles: list[Cycle] = []
    errors: list[str] = []
    for _ in range(args.million_cycles):
        cycle, errs = run_cycle(scheduler)
        cycles.append(cycle)
        errors += errs
        console.print(
            f"  cycle {len(cycles)}: {cycle.seconds * 1e3:8.1f} ms  placed {cycle.placed:5d}  "
            f"waiting {cycle.waiting:5d}  held {cycle.held:4d}  synced {cycle.synced:5d}"
        )
    engine.dispose()
    first, later = cycles[:1], cycles[1:]
    results = [
        _cycle_row("1M queued: first cycle", first, args, "claims and places; nothing to sync yet"),
    ]
    if later:
        results.append(
            _cycle_row("1M queued: later cycles", later, args, "also sync the previous cycle's jobs (now running)")
        )
    detail = {
        "load_seconds": load_s,
        "cycles": [asdict(c) for c in cycles],
        "errors": errors[:20],
        "error_count": len(errors),
    }
    return results, detail


def _cycle_row(scenario: str, cycles: list[Cycle], args: argparse.Namespace, note: str) -> Result:
    ms = [c.seconds * 1e3 for c in cycles]
    p50 = statistics.median(ms)
    return Result(
        scenario=scenario,
        queued_at_start=args.million_jobs,
        cycles=len(cycles),
        placed=sum(c.placed for c in cycles),
        decided=sum(c.placed + c.waiting + c.held for c in cycles),
        seconds=sum(c.seconds for c in cycles),
        jobs_per_s=sum(c.placed for c in cycles) / sum(c.seconds for c in cycles),
        cycle_ms_p50=p50,
        cycle_ms_max=max(ms),
        targets={f"<{TARGET_CYCLE_MS}ms": p50 < TARGET_CYCLE_MS},
        note=f"{note}; claim limit {args.million_claim_limit} per tenant",
    )


def baseline(conninfo: str, rows: int, batch: int) -> Result:
    """``UPDATE … WHERE id`` one job at a time, committed every ``batch``, on a scratch
    copy of up to ``rows`` queued jobs: the plainest way to write a placement."""
    placement = json.dumps(
        {"cluster": "slurm-a", "sharing": "slurm/exclusive", "units": 1, "gpu_equivalents": 1.0, "node": "gpu-001"}
    )
    with psycopg.connect(conninfo) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_baseline")
        conn.execute("CREATE TABLE bench_baseline AS SELECT * FROM jobs ORDER BY id LIMIT %s", (rows,), prepare=False)
        conn.execute("ALTER TABLE bench_baseline ADD PRIMARY KEY (id)")
        conn.execute("CREATE INDEX ON bench_baseline (state, priority, created_at)")
        conn.commit()
        ids = [r[0] for r in conn.execute("SELECT id FROM bench_baseline ORDER BY id")]
        cur = conn.cursor()
        begin = time.perf_counter()
        for start in range(0, len(ids), batch):
            for job_id in ids[start : start + batch]:
                cur.execute(
                    "UPDATE bench_baseline SET state = 'submitted', placement = %s::jsonb, cluster = 'slurm-a'"
                    " WHERE id = %s",
                    (placement, job_id),
                )
            conn.commit()
        seconds = time.perf_counter() - begin
        conn.execute("DROP TABLE bench_baseline")
        conn.commit()
    return Result(
        scenario="baseline: UPDATE loop",
        queued_at_start=len(ids),
        cycles=0,
        placed=len(ids),
        decided=len(ids),
        seconds=seconds,
        jobs_per_s=len(ids) / seconds,
        cycle_ms_p50=None,
        cycle_ms_max=None,
        note=f"one UPDATE per row, COMMIT per {batch}",
    )


# -- report -------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    cpu = None
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpush": version("gpush"),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(results: list[Result], rss_mb: float) -> None:
    table = Table(title="gpush scheduling cycle on PostgreSQL, simulated fleet", title_justify="left")
    for name in ("scenario", "queued", "cycles", "placed", "decided", "s", "jobs/s", "cycle p50 ms", "max ms"):
        table.add_column(name, justify="left" if name == "scenario" else "right")
    for name in ("baseline/s", "ratio", "target", "note"):
        table.add_column(name, justify="left" if name in ("target", "note") else "right")
    for r in results:
        target = ", ".join(f"{goal} {'met' if met else 'MISSED'}" for goal, met in (r.targets or {}).items())
        table.add_row(
            r.scenario,
            f"{r.queued_at_start:,}",
            str(r.cycles),
            f"{r.placed:,}",
            f"{r.decided:,}",
            _fmt(r.seconds, 2),
            _fmt(r.jobs_per_s, 0),
            _fmt(r.cycle_ms_p50, 1),
            _fmt(r.cycle_ms_max, 1),
            _fmt(r.baseline_per_s, 0),
            _fmt(r.ratio, 2),
            target,
            r.note,
        )
    console.print(table)
    met = "met" if rss_mb < TARGET_RSS_MB else "MISSED"
    console.print(f"peak RSS of the scheduler process: {rss_mb:,.0f} MB (<{TARGET_RSS_MB:,} MB {met})")


def print_steps(cycles: list[dict[str, Any]], title: str) -> None:
    """Where the time of the cycles went, per step, if the scheduler reports it."""
    totals: Counter[str] = Counter()
    for cycle in cycles:
        totals.update(cycle.get("steps") or {})
    if not totals:
        return
    whole = sum(c["seconds"] for c in cycles)
    parts = ", ".join(f"{step} {s * 1e3:,.0f} ms ({s / whole:.0%})" for step, s in totals.items())
    console.print(f"{title}: {parts}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=100_000, help="Queued jobs of the fill run (default 100000).")
    parser.add_argument("--nodes", type=int, default=1000, help="Nodes of the simulated fleet (default 1000).")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8).")
    parser.add_argument(
        "--claim-limit",
        type=int,
        default=FILL_CLAIM,
        help=f"Jobs claimed per tenant and cycle in the fill run (default {FILL_CLAIM}).",
    )
    parser.add_argument("--million", action="store_true", help="Also time cycles of 1,000 jobs with a million queued.")
    parser.add_argument(
        "--million-jobs", type=int, default=1_000_000, help="Queued jobs of the --million run (default 1000000)."
    )
    parser.add_argument(
        "--million-claim-limit",
        type=int,
        default=MILLION_CLAIM,
        help=f"Jobs claimed per tenant and cycle in the --million run (default {MILLION_CLAIM}).",
    )
    parser.add_argument(
        "--max-cycles",
        type=int,
        default=MAX_CYCLES,
        help=f"Stop the fill run after this many cycles (default {MAX_CYCLES}).",
    )
    parser.add_argument(
        "--million-cycles",
        type=int,
        default=MILLION_CYCLES,
        help=f"Cycles of the --million run (default {MILLION_CYCLES}).",
    )
    parser.add_argument("--no-fill", action="store_true", help="Skip the fill run (with --million: only that).")
    parser.add_argument("--seed", type=int, default=7, help="Seed of the random workload (default 7).")
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("GPUSH_BENCH_PG_URL", DEFAULT_PG_URL),
        help=f"PostgreSQL server to use; the benchmark creates and drops its own database "
        f"{BENCH_DATABASE!r} there (default {DEFAULT_PG_URL}; env GPUSH_BENCH_PG_URL).",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: a fill of 600 jobs on 10 nodes and the --million run with 1,200 "
        "queued; that the bench runs (make test runs it), its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.nodes, args.claim_limit, args.max_cycles = 600, 10, 50, 10
        args.million, args.million_jobs, args.million_claim_limit, args.million_cycles = True, 1200, 20, 2
    for name in (
        "jobs",
        "nodes",
        "gpus_per_node",
        "claim_limit",
        "million_jobs",
        "million_claim_limit",
        "max_cycles",
        "million_cycles",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be more than 0")
    if args.no_fill and not args.million:
        parser.error("--no-fill leaves nothing to run without --million")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    console.print(
        f"gpush {machine['gpush']} on {machine['cpu_count']} CPUs ({machine['cpu_model']}), "
        f"Python {machine['python']}; fleet {args.nodes:,} nodes x {args.gpus_per_node} GPUs"
    )
    results: list[Result] = []
    details: dict[str, Any] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpush-bench-schedule-") as tmp:
        fleet_file = Path(tmp) / "fleet.yaml"
        fleet_file.write_text(fleet_yaml(args.nodes, args.gpus_per_node))
        try:
            if not args.no_fill:
                console.print(f"[bold]fill[/bold]: {args.jobs:,} queued, claim limit {args.claim_limit:,} per tenant")
                with scratch_database(args.pg_url, BENCH_DATABASE, migrate=True) as (url, conninfo):
                    rows, details["fill"] = fill(url, conninfo, args, fleet_file)
                    base = baseline(conninfo, min(args.jobs, 20_000), 1000)
                for row in rows:
                    if row.jobs_per_s is not None:
                        row.baseline_per_s = base.jobs_per_s
                        row.ratio = row.jobs_per_s / base.jobs_per_s
                results += [*rows, base]
                details["fill"]["peak_rss_mb"] = peak_rss_mb()
                print_steps(details["fill"]["cycles"], "fill: time by step")
            if args.million:
                console.print(
                    f"[bold]million[/bold]: {args.million_jobs:,} queued, "
                    f"claim limit {args.million_claim_limit} per tenant"
                )
                with scratch_database(args.pg_url, BENCH_DATABASE, migrate=True) as (url, conninfo):
                    rows, details["million"] = million(url, conninfo, args, fleet_file)
                results += rows
                details["million"]["peak_rss_mb"] = peak_rss_mb()
                print_steps(details["million"]["cycles"], "million: time by step")
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            console.print_exception()
    for name, detail in details.items():
        if detail.get("error_count"):
            failures.append(f"{name}: {detail['error_count']} cycle errors, first: {detail['errors'][0]}")
    rss = peak_rss_mb()
    if results:
        print_table(results, rss)
        console.print(
            "jobs/s: jobs placed (routed, fitted, submitted to the simulated cluster and recorded) over the wall "
            "time of the cycles. decided: placed + waiting + held.\nbaseline: one UPDATE per job on a scratch "
            "copy of the rows, same database; ratio: gpush jobs/s over the baseline's rows/s."
        )
    for failure in failures:
        console.print(f"[red]error: {failure}[/red]")
    if args.json:
        report = {
            "machine": machine,
            "settings": {
                "jobs": args.jobs,
                "nodes": args.nodes,
                "gpus_per_node": args.gpus_per_node,
                "claim_limit": args.claim_limit,
                "million": args.million,
                "million_jobs": args.million_jobs,
                "million_claim_limit": args.million_claim_limit,
                "seed": args.seed,
                "smoke": args.smoke,
            },
            "results": [asdict(r) for r in results],
            "peak_rss_mb": rss,
            "targets": {
                "jobs_per_s": TARGET_JOBS_PER_S,
                "cycle_ms_with_million_queued": TARGET_CYCLE_MS,
                "rss_mb": TARGET_RSS_MB,
            },
            "details": details,
            "errors": failures,
        }
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"results written to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
