"""``gpush simulate`` decides as the live scheduler does: the same workload through the
live scheduling cycle (SQLite, simulated clusters behind the adapter protocol) and
through the replay gives the same placements and the same reasons, cycle by cycle.

Both call the one decision (broker.placement.decision); what this test guards is
everything around it that could still drift: the order jobs are tried in, the
capacity each cycle sees, the tenants' usage and quotas, and when jobs end.
"""

from __future__ import annotations

import random
import re
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from broker.core.auth import Principal
from broker.core.clusters import AdapterPool, add_cluster
from broker.core.models import Job
from broker.core.schemas import Role
from broker.intake import queue
from broker.placement import tenants as tenant_store
from broker.routing import versions as policystore
from broker.routing.policy import load_policy
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from broker.simulation.cluster import SimulatedCluster
from broker.simulation.fleet import load_fleet
from broker.simulation.replay import T0, replay
from broker.simulation.results import JobRecord
from broker.simulation.workload import Workload, read_workload

ROOT = Path(__file__).resolve().parents[2]
FLEET = (ROOT / "examples" / "fleet.yaml").read_text()
POLICY = (ROOT / "policies" / "default.yaml").read_text()
ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)
CLUSTERS = ("slurm-a", "k8s-a")


class SettableClock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now


def random_workload(seed: int, jobs: int = 70, *, with_gangs: bool = False, time_limits: bool = False) -> str:
    """A mix over the demo fleet that keeps it contended: every sharing mode, elastic
    replicas, priorities, tenants with weights and a quota, jobs that never fit; with
    ``with_gangs``, every fifth job a multi-node one; with ``time_limits``, every job
    a time limit half again its duration (what reservations count ends by)."""
    rng = random.Random(seed)
    shapes = [
        {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 5},
        {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 10},
        {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 20},
        {"kind": "inference", "isolation": "process", "gpu_memory_gb": 3},
        {"kind": "inference", "isolation": "process", "gpu_memory_gb": 12},
        {
            "kind": "inference",
            "isolation": "none",
            "gpu_memory_gb": 3,
            "elastic": {"min_replicas": 2, "max_replicas": 3},
        },
        {"kind": "batch", "isolation": "none", "gpu_memory_gb": 4},
        {"kind": "training", "isolation": "exclusive", "gpus": 1},
        {"kind": "training", "isolation": "exclusive", "gpus": 2},
        {"kind": "training", "gpus": 4},
        {"kind": "training", "gpus": 32},  # more than any node: held
    ]
    gangs = [
        {"kind": "training", "nodes": 2, "gpus": 2},
        {"kind": "training", "nodes": 2, "gpus": 4},
        {"kind": "training", "nodes": 3, "gpus": 1},  # slurm-a has 2 nodes of whole GPUs: held
    ]
    out = []
    for n in range(jobs):
        job = dict(rng.choice(shapes))
        if with_gangs and n % 5 == 0:
            job = dict(gangs[(n // 5) % len(gangs)])
        job.update(
            name=f"j{n}",
            at=rng.choice([0, 0, 60, 120, 300, 600, 900, 1800]) + rng.randrange(0, 3) * 30,
            duration=rng.choice([300, 600, 1200, 3600, 7200]),
            tenant=rng.choice(["nlp", "vision", "search", "product"]),
            priority=rng.choice([0, 0, 0, 10, 50]),
        )
        if time_limits:
            job["time_limit"] = -(-job["duration"] * 3 // 120)  # minutes
        out.append(job)
    tenants = {"nlp": {"weight": 2}, "vision": {"weight": 1, "gpu_quota": 3}, "search": {"weight": 1}}
    return yaml.safe_dump({"tenants": tenants, "jobs": out}, sort_keys=False)


def _snapshot(rows) -> dict[int, tuple]:
    """What a user sees of each job after a cycle: where it was placed, or why not."""
    return {job_id: view for job_id, view in rows}


def _replay_view(record: JobRecord) -> tuple:
    if record.placement is not None:
        return ("placed", _where(record.placement))
    if record.state == "held":
        return ("held", record.reason)
    return ("waiting", record.reason)


def _live_view(job: Job) -> tuple:
    if job.placement is not None or job.state in ("submitted", "running", "succeeded", "failed"):
        return ("placed", _where(job.placement))
    if job.state == "held":
        return ("held", job.state_reason)
    return ("waiting", job.state_reason if job.state_reason != "queued" else None)


def _where(placement: dict | None) -> tuple:
    p = placement or {}
    return tuple(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in sorted(p.items())
        if k in ("cluster", "sharing", "units", "node", "nodes", "mig_profile", "gpus", "replicas", "gpu_equivalents")
    )


def run_replay(workload: Workload, fleet_yaml: str = FLEET) -> list[tuple[float, dict[int, tuple]]]:
    steps: list[tuple[float, dict[int, tuple]]] = []

    def observe(t: float, records: list[JobRecord]) -> None:
        steps.append((t, _snapshot((r.job_id, _replay_view(r)) for r in records if r.arrival <= t)))

    fleet = load_fleet(fleet_yaml, "fleet")
    replay(fleet, load_policy(POLICY), workload.arrivals, tenants=workload.tenants, observe=observe)
    return steps


def run_live(engine, sessions, workload: Workload, fleet_yaml: str = FLEET) -> list[tuple[float, dict[int, tuple]]]:
    clock = SettableClock(T0)
    fleet = load_fleet(fleet_yaml, "fleet")
    sims = [SimulatedCluster.from_fleet(fleet, name, clock=clock) for name in CLUSTERS]
    pool = AdapterPool(clock, overrides={sim.name: sim for sim in sims})
    with sessions() as session, session.begin():
        for name in CLUSTERS:
            add_cluster(session, name=name, kind="sim", config={"fleet_yaml": fleet_yaml}, actor="root", now=clock())
        for name, terms in workload.tenants.items():
            tenant_store.set_tenant(
                session, name, weight=terms.weight, gpu_quota=terms.gpu_quota, clear_quota=False, now=clock()
            )
    with sessions() as session, session.begin():
        policystore.apply(
            session,
            POLICY,
            comment="test",
            author="root",
            now=clock(),
            views=cluster_views(session, pool),
            base_version=None,
        )
    scheduler = Scheduler(engine, pool, clock=clock)
    arrivals = sorted(enumerate(workload.arrivals), key=lambda pair: (pair[1].at, pair[0]))
    steps: list[tuple[float, dict[int, tuple]]] = []
    i = 0
    while True:
        times = [arrivals[i][1].at] if i < len(arrivals) else []
        times += [(m - T0).total_seconds() for sim in sims if (m := sim.next_event_time()) is not None]
        if not times:
            break
        t = min(times)
        clock.now = T0 + timedelta(seconds=t)
        batch = []
        while i < len(arrivals) and arrivals[i][1].at <= t:
            arrival = arrivals[i][1]
            labels = {**arrival.spec.labels, "sim-duration": f"{arrival.duration:g}"}
            batch.append(arrival.spec.model_copy(update={"labels": labels}))
            i += 1
        if batch:
            with sessions() as session, session.begin():
                queue.submit_jobs(session, batch, ADMIN, now=clock())
        report = scheduler.run_cycle()
        assert report.errors == []
        # The replay reads the clusters' status changes at the end of its cycle; the
        # live scheduler at the start of its next one: both before what is compared.
        with sessions() as session:
            jobs = session.execute(select(Job).order_by(Job.id)).scalars().all()
            steps.append((t, _snapshot((job.id, _live_view(job)) for job in jobs)))
    return steps


def assert_same_steps(live, replayed) -> None:
    for n, ((t_live, live_jobs), (t_replay, replay_jobs)) in enumerate(zip(live, replayed)):
        assert t_live == t_replay, f"cycle {n}: live at {t_live} s, replay at {t_replay} s"
        differ = {
            job_id: {"live": live_jobs.get(job_id), "replay": replay_jobs.get(job_id)}
            for job_id in sorted(set(live_jobs) | set(replay_jobs))
            if live_jobs.get(job_id) != replay_jobs.get(job_id)
        }
        assert not differ, f"cycle {n} at {t_live:g} s: {differ}"
    assert len(live) == len(replayed), f"{len(live)} live cycles, {len(replayed)} replayed"


def test_the_example_workload_decides_alike_live_and_in_simulation(engine, sessions) -> None:
    workload = read_workload((ROOT / "examples" / "workload.yaml").read_text(), "examples/workload.yaml")
    replayed = run_replay(workload)
    live = run_live(engine, sessions, workload)
    assert_same_steps(live, replayed)
    # The workload exercises what could drift: jobs placed, waiting at a quota, held.
    seen = [view for _, jobs in live for view in jobs.values()]
    assert any(kind == "placed" for kind, _ in seen)
    assert any(kind == "held" for kind, _ in seen)
    assert any(kind == "waiting" and "at quota" in (why or "") for kind, why in seen)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_contended_workloads_decide_alike_live_and_in_simulation(engine, sessions, seed) -> None:
    workload = read_workload(random_workload(seed), f"random-{seed}.yaml")
    live = run_live(engine, sessions, workload)
    assert_same_steps(live, run_replay(workload))
    # Contended: jobs wait for capacity with others ahead of them, and at a quota.
    seen = [view for _, jobs in live for view in jobs.values()]
    assert any(kind == "waiting" and "ahead)" in (why or "") for kind, why in seen)
    assert any(kind == "waiting" and "at quota" in (why or "") for kind, why in seen)


@pytest.mark.parametrize("seed", [4, 5])
def test_workloads_with_multi_node_jobs_decide_alike_live_and_in_simulation(engine, sessions, seed) -> None:
    workload = read_workload(random_workload(seed, with_gangs=True), f"gangs-{seed}.yaml")
    live = run_live(engine, sessions, workload)
    assert_same_steps(live, run_replay(workload))
    # Gangs were placed on two nodes at once, waited saying how far they were, and held.
    seen = [view for _, jobs in live for view in jobs.values()]
    assert any(kind == "placed" and len(dict(where).get("nodes") or ()) == 2 for kind, where in seen)
    assert any(kind == "waiting" and "have them now" in (why or "") for kind, why in seen)
    assert any(kind == "held" and "needs 3 nodes with" in (why or "") for kind, why in seen)


@pytest.mark.parametrize("seed", [4, 6])
def test_workloads_with_gang_reservations_decide_alike_live_and_in_simulation(engine, sessions, seed) -> None:
    workload = read_workload(random_workload(seed, 90, with_gangs=True, time_limits=True), f"reserve-{seed}.yaml")
    live = run_live(engine, sessions, workload)
    assert_same_steps(live, run_replay(workload))
    # Gangs that waited past the policy's default (10 minutes) had nodes reserved, saying so.
    seen = [view for _, jobs in live for view in jobs.values()]
    assert any(kind == "waiting" and "; reserved " in (why or "") for kind, why in seen)


# The demo fleet (its Kubernetes H100 node on an NVSwitch) with four whole-GPU Slurm nodes of
# NVLink pairs in two blocks instead of its two in one (issue 35).
TOPOLOGY_FLEET = re.sub(r"        (gpu_topology: nvlink-pairs|block: b1)\b.*\n", "", FLEET).replace(
    "        count: 2\n        cpus: 128",
    "        count: 4\n        gpu_topology: nvlink-pairs\n        blocks: 2\n        cpus: 128",
)


def topology_workload(seed: int) -> str:
    """The random mix with gangs, some of them requiring one block, and 2-GPU jobs some of
    which require one NVLink island."""
    data = yaml.safe_load(random_workload(seed, 80, with_gangs=True))
    for n, job in enumerate(data["jobs"]):
        if job.get("nodes") and n % 10 == 0:
            job["topology"] = {"level": "block", "mode": "required"}
        elif job.get("gpus") == 2 and n % 2 == 0:
            job["topology"] = {"level": "nvlink", "mode": "required"}
    return yaml.safe_dump(data, sort_keys=False)


@pytest.mark.parametrize("seed", [7, 9])
def test_workloads_on_a_fleet_with_topology_decide_alike_live_and_in_simulation(engine, sessions, seed) -> None:
    assert "blocks: 2" in TOPOLOGY_FLEET and "gpu_topology: nvswitch" in TOPOLOGY_FLEET
    workload = read_workload(topology_workload(seed), f"topology-{seed}.yaml")
    live = run_live(engine, sessions, workload, TOPOLOGY_FLEET)
    assert_same_steps(live, run_replay(workload, TOPOLOGY_FLEET))
    # The decision named GPUs (known free on every whole-GPU node) and placed gangs.
    seen = [view for _, jobs in live for view in jobs.values()]
    assert any(kind == "placed" and dict(where).get("gpus") for kind, where in seen)
    assert any(kind == "placed" and len(dict(where).get("nodes") or ()) == 2 for kind, where in seen)
    # Jobs that required one island waited saying so.
    assert any(kind == "waiting" and "GPUs in one NVLink island on slurm-a" in (why or "") for kind, why in seen)


def test_a_difference_is_caught() -> None:
    """The comparison is not vacuous: a placement elsewhere or another reason fails it."""
    placed = ("placed", (("cluster", "slurm-a"), ("node", "mig-01")))
    with pytest.raises(AssertionError, match="cycle 0"):
        assert_same_steps([(0.0, {1: placed})], [(0.0, {1: ("placed", (("cluster", "slurm-a"), ("node", "mig-02")))})])
    with pytest.raises(AssertionError, match="cycle 0"):
        assert_same_steps([(0.0, {1: ("waiting", "a")})], [(0.0, {1: ("waiting", "b")})])
