"""The scheduling cycle on the simulated fleet: where jobs go, why they wait, and crash safety."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from broker.core.adapter import BackendJob, BackendState, Sharing, StatusPage
from broker.core.auth import Principal
from broker.core.clusters import AdapterPool, list_clusters
from broker.core.models import Job
from broker.core.schemas import JobSpec, Role
from broker.intake import queue
from broker.placement import tenants
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from broker.scheduling.leader import Leadership

ROOT = Path(__file__).resolve().parents[2]
FLEET = (ROOT / "examples" / "fleet.yaml").read_text()
DEFAULT_POLICY = (ROOT / "policies" / "default.yaml").read_text()
ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)


def apply_policy(sessions, pool, clock, text, base=None):
    with sessions() as session, session.begin():
        views = cluster_views(session, pool)
        return policystore.apply(
            session, text, comment="test", author="root", now=clock(), views=views, base_version=base
        )


def submit(sessions, clock, tenant="ml", **fields) -> int:
    spec = JobSpec.model_validate({"command": ["python", "x.py"], "tenant": tenant, "user": "alice", **fields})
    with sessions() as session, session.begin():
        (result,) = queue.submit_jobs(session, [spec], ADMIN, now=clock())
    return result.job["id"]


def job(sessions, job_id) -> Job:
    with sessions() as session:
        return session.get(Job, job_id)


def scheduler(engine, pool, clock) -> Scheduler:
    return Scheduler(engine, pool, clock=clock)


def test_jobs_go_where_their_isolation_class_belongs(engine, sessions, clock, fleet):
    ids = {
        "mig": submit(sessions, clock, kind="training", isolation="hardware", gpu_memory_gb=4),
        "big-mig": submit(sessions, clock, kind="training", isolation="hardware", gpu_memory_gb=16),
        "whole": submit(sessions, clock, kind="training", gpus=4),
        "mps": submit(sessions, clock, kind="inference", isolation="process", gpu_memory_gb=2),
        "timeslice": submit(
            sessions,
            clock,
            kind="inference",
            isolation="none",
            gpu_memory_gb=3,
            elastic={"min_replicas": 2, "max_replicas": 8},
        ),
    }
    report = scheduler(engine, fleet, clock).run_cycle()
    assert report.errors == []
    placed = {name: job(sessions, i) for name, i in ids.items()}
    assert {n: j.state for n, j in placed.items()} == dict.fromkeys(ids, "submitted")
    assert (
        placed["mig"].placement["sharing"] == Sharing.SLURM_MIG and placed["mig"].placement["mig_profile"] == "1g.5gb"
    )
    assert placed["big-mig"].placement["mig_profile"] == "3g.20gb"
    assert placed["whole"].placement["sharing"] == Sharing.SLURM_EXCLUSIVE
    assert placed["mps"].placement["sharing"] == Sharing.SLURM_MPS
    ts = placed["timeslice"].placement
    assert (ts["cluster"], ts["sharing"], ts["replicas"], ts["gpu_memory_gb"]) == ("k8s-a", "k8s/timeslice", 2, 3)
    # GPU-equivalents: 1g of 7 slices is 1/7; two replicas of a T4 split 4 ways are 2/4.
    assert placed["mig"].gpu_equivalents == pytest.approx(1 / 7)
    assert placed["timeslice"].gpu_equivalents == pytest.approx(0.5)
    # The next cycle sees them running (the simulated cluster started them).
    scheduler(engine, fleet, clock).run_cycle()
    assert job(sessions, ids["mig"]).state == "running"


def test_jobs_run_to_their_end_in_virtual_time(engine, sessions, clock, fleet):
    job_id = submit(sessions, clock, kind="training", gpus=1, labels={"sim-duration": "600"})
    cycle = scheduler(engine, fleet, clock)
    cycle.run_cycle()
    cycle.run_cycle()
    assert job(sessions, job_id).state == "running"
    clock.advance(601)
    cycle.run_cycle()
    assert job(sessions, job_id).state == "succeeded"


def test_no_rule_and_never_fits_are_held_at_once_with_the_reason(engine, sessions, clock, fleet):
    no_catch_all = "\n".join(DEFAULT_POLICY.split("  - name: everything-else-on-whole-gpus")[0].splitlines())
    apply_policy(sessions, fleet, clock, no_catch_all + "\n")
    unmatched = submit(sessions, clock, kind="batch", isolation="exclusive", gpus=1)
    too_big = submit(sessions, clock, kind="training", gpus=16)
    scheduler(engine, fleet, clock).run_cycle()
    held = job(sessions, unmatched)
    assert held.state == "held" and held.state_reason.startswith("held: no rule matches")
    big = job(sessions, too_big)
    assert big.state == "held" and "can never fit" in big.state_reason and "16 whole GPUs" in big.state_reason


def test_waiting_jobs_say_what_they_wait_for(engine, sessions, clock, fleet):
    # 16 GB needs a 3g.20gb slice: slurm-a has 2, its fallback k8s-a has 8.
    ids = [submit(sessions, clock, kind="training", isolation="hardware", gpu_memory_gb=16) for _ in range(12)]
    scheduler(engine, fleet, clock).run_cycle()
    states = [job(sessions, i) for i in ids]
    assert [j.cluster for j in states[:10]] == ["slurm-a"] * 2 + ["k8s-a"] * 8
    assert all(j.placement["mig_profile"] == "3g.20gb" for j in states[:10])
    first, second = states[10], states[11]
    assert first.state == "queued" and first.state_reason == "waiting for a 3g.20gb slice on slurm-a (0 of 2 free)"
    assert second.state_reason == "waiting for a 3g.20gb slice on slurm-a (0 of 2 free, 1 job ahead)"


def test_a_tenant_over_its_quota_waits_and_others_go_ahead(engine, sessions, clock, fleet):
    with sessions() as session, session.begin():
        tenants.set_tenant(session, "vision", weight=None, gpu_quota=4, clear_quota=False, now=clock())
    first = submit(sessions, clock, tenant="vision", kind="training", gpus=4)
    second = submit(sessions, clock, tenant="vision", kind="training", gpus=1)
    other = submit(sessions, clock, tenant="nlp", kind="training", gpus=1)
    scheduler(engine, fleet, clock).run_cycle()
    assert job(sessions, first).state == "submitted"
    assert job(sessions, other).state == "submitted"
    waiting = job(sessions, second)
    assert waiting.state == "queued" and waiting.state_reason == "tenant vision at quota (4/4 GPU)"


def test_fair_share_under_contention_follows_weights(engine, sessions, clock, fleet):
    with sessions() as session, session.begin():
        tenants.set_tenant(session, "a", weight=3, gpu_quota=None, clear_quota=False, now=clock())
        tenants.set_tenant(session, "b", weight=1, gpu_quota=None, clear_quota=False, now=clock())
    # 8 whole A100-80GB on slurm-a; each tenant asks for far more, one GPU at a time.
    for _ in range(12):
        submit(sessions, clock, tenant="a", kind="training", gpus=1)
        submit(sessions, clock, tenant="b", kind="training", gpus=1)
    scheduler(engine, fleet, clock).run_cycle()
    with sessions() as session:
        running = session.execute(select(Job.tenant).where(Job.state == "submitted")).scalars().all()
    assert running.count("a") + running.count("b") == 8
    assert running.count("a") == 6 and running.count("b") == 2


class CrashAfterSubmit:
    """Wraps an adapter: the cluster accepts the job, then the broker dies before writing."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, item):
        return getattr(self.inner, item)

    def submit(self, job_id, spec, placement, owner=None):
        self.inner.submit(job_id, spec, placement, owner)
        raise SystemExit("broker killed between the adapter call and the database write")


def test_a_crash_between_submit_and_write_loses_and_doubles_nothing(engine, sessions, clock, fleet):
    ids = [submit(sessions, clock, kind="training", gpus=1) for _ in range(3)]
    with sessions() as session:
        infos = {c.name: c for c in list_clusters(session)}
    slurm = fleet.get(infos["slurm-a"])
    crashing = AdapterPool(clock, overrides={"slurm-a": CrashAfterSubmit(slurm), "k8s-a": fleet.get(infos["k8s-a"])})
    with pytest.raises(SystemExit):
        Scheduler(engine, crashing, clock=clock).run_cycle()
    assert {job(sessions, i).state for i in ids} == {"submitting"}
    # A new broker starts: every job is found on the cluster and recorded once.
    report = scheduler(engine, fleet, clock).run_cycle()
    assert report.recovered == 3
    # The broker died in the first adapter call: job 1 reached the cluster and is found
    # (then seen running by the same cycle's status sync); jobs 2 and 3 never did, so
    # they went back to the queue and were submitted again by the same cycle.
    assert [job(sessions, i).state for i in ids] == ["running", "submitted", "submitted"]
    with sessions() as session:
        reasons = [e.reason for e in queue.job_events(session, ids[0], ADMIN)]
    assert any("found on slurm-a" in (r or "") for r in reasons)
    backend = [slurm.find(i) for i in ids]
    assert all(b is not None for b in backend)
    assert len({b.backend_id for b in backend}) == 3


def test_a_job_the_cluster_never_got_goes_back_to_the_queue(engine, sessions, clock, fleet):
    job_id = submit(sessions, clock, kind="training", gpus=1)

    class CrashBeforeSubmit(CrashAfterSubmit):
        def submit(self, job_id, spec, placement, owner=None):
            raise SystemExit("broker killed before the adapter call")

    with sessions() as session:
        infos = {c.name: c for c in list_clusters(session)}
    crashing = AdapterPool(
        clock, overrides={"slurm-a": CrashBeforeSubmit(fleet.get(infos["slurm-a"])), "k8s-a": fleet.get(infos["k8s-a"])}
    )
    with pytest.raises(SystemExit):
        Scheduler(engine, crashing, clock=clock).run_cycle()
    report = scheduler(engine, fleet, clock).run_cycle()
    assert report.recovered == 1
    # Requeued by recovery, then placed again by the same cycle.
    assert job(sessions, job_id).state == "submitted"
    with sessions() as session:
        events = queue.job_events(session, job_id, ADMIN)
    assert [e.to_state for e in events].count("submitting") == 2


def test_cancel_of_a_running_job_reaches_the_cluster(engine, sessions, clock, fleet):
    job_id = submit(sessions, clock, kind="training", gpus=1)
    cycle = scheduler(engine, fleet, clock)
    cycle.run_cycle()
    cycle.run_cycle()
    with sessions() as session, session.begin():
        _job, outcome = queue.cancel_job(session, job_id, ADMIN, now=clock())
    assert outcome == "cancel_requested"
    cycle.run_cycle()  # asks the cluster to cancel
    cycle.run_cycle()  # sees it cancelled
    done = job(sessions, job_id)
    assert (done.state, done.state_reason) == ("cancelled", "cancelled as requested")


def test_applying_on_a_stale_base_is_refused(sessions, clock, fleet):
    from broker.core.errors import Conflict

    with sessions() as session:
        base = policystore.active_version(session)
    alice = DEFAULT_POLICY + "\n# alice's edit\n"
    bob = DEFAULT_POLICY + "\n# bob's edit\n"
    first, _ = apply_policy(sessions, fleet, clock, alice, base=base)
    assert first.version == base + 1
    with pytest.raises(Conflict, match="another admin applied"):
        apply_policy(sessions, fleet, clock, bob, base=base)
    with sessions() as session:
        assert policystore.active_version(session) == base + 1


def test_reapplying_the_active_text_makes_no_new_version(sessions, clock, fleet):
    with sessions() as session:
        before = policystore.active_version(session)
    info, _ = apply_policy(sessions, fleet, clock, DEFAULT_POLICY)
    assert info.version == before


def test_only_one_scheduler_leads_on_sqlite(engine):
    first, second = Leadership(engine), Leadership(engine)
    assert first.try_acquire() is True
    assert second.try_acquire() is False
    first.release()
    assert second.try_acquire() is True
    second.release()


def test_a_cluster_backlog_lets_that_many_unstarted_jobs_wait_in_its_own_queue():
    from datetime import UTC, datetime

    from broker.core.adapter import Placement
    from broker.core.clusters import ClusterInfo
    from broker.scheduling.holdings import beyond_backlog

    def info(name, **config):
        return ClusterInfo(name, "slurm", config, True, "root", datetime(2026, 1, 1, tzinfo=UTC))

    def placed(cluster):
        return Placement(cluster=cluster, sharing=Sharing.SLURM_MPS, units=1, gpu_equivalents=0.01)

    pending = [placed("slurm-a")] * 5 + [placed("slurm-b")] * 3
    clusters = {"slurm-a": info("slurm-a", backlog_jobs=2), "slurm-b": info("slurm-b")}
    counted = beyond_backlog(pending, clusters)
    # slurm-a: the first 2 may wait in Slurm's queue, 3 still count; slurm-b keeps no backlog.
    assert [p.cluster for p in counted] == ["slurm-a"] * 3 + ["slurm-b"] * 3
    assert beyond_backlog(pending, {"slurm-a": info("slurm-a"), "slurm-b": info("slurm-b")}) == pending


class ClusterSays(CrashAfterSubmit):
    """Wraps an adapter: its status pages are the ones the test queues, then its own."""

    def __init__(self, inner):
        super().__init__(inner)
        self.pages: list[list[BackendJob]] = []

    def submit(self, job_id, spec, placement, owner=None):
        return self.inner.submit(job_id, spec, placement, owner)

    def statuses(self, cursor=None):
        if self.pages:
            return StatusPage(self.pages.pop(0), cursor)
        return self.inner.statuses(cursor)


def test_a_job_its_cluster_requeues_or_loses_while_running_is_followed(engine, sessions, clock, fleet):
    with sessions() as session:
        infos = {c.name: c for c in list_clusters(session)}
    slurm = ClusterSays(fleet.get(infos["slurm-a"]))
    pool = AdapterPool(clock, overrides={"slurm-a": slurm, "k8s-a": fleet.get(infos["k8s-a"])})
    cycle = Scheduler(engine, pool, clock=clock)
    job_id = submit(sessions, clock, kind="training", gpus=1)
    cycle.run_cycle()
    cycle.run_cycle()
    assert job(sessions, job_id).state == "running"
    backend_id = job(sessions, job_id).backend_id

    # Slurm requeued it itself (its node failed): it waits in Slurm again, in Slurm's words.
    waiting = "requeued by slurm-a (it started there once before); waiting for its begin time"
    slurm.pages.append([BackendJob(job_id, backend_id, BackendState.PENDING, reason=waiting)])
    cycle.run_cycle()
    assert (job(sessions, job_id).state, job(sessions, job_id).state_reason) == ("submitted", waiting)
    slurm.pages.append([BackendJob(job_id, backend_id, BackendState.RUNNING)])
    cycle.run_cycle()
    assert job(sessions, job_id).state == "running"

    # slurmctld crashed and forgot it while it ran: back to gpush's queue, placed again.
    lost = "slurm-a lost the job while it ran (slurmctld restarted without it and ended its processes)"
    slurm.pages.append([BackendJob(job_id, backend_id, BackendState.LOST, reason=lost)])
    cycle.run_cycle()
    assert job(sessions, job_id).state == "queued"
    cycle.run_cycle()
    with sessions() as session:
        events = [(e.from_state, e.to_state, e.reason) for e in queue.job_events(session, job_id, ADMIN)]
    assert ("running", "submitted", waiting) in events
    assert ("running", "requeued", lost) in events
    assert [to for _, to, _ in events].count("submitting") == 2
    assert job(sessions, job_id).state == "submitted"


def test_an_observer_is_told_each_step_of_the_cycle_as_it_ends(engine, sessions, clock, fleet):
    """The public timing hook (on_phase): benchmarks and tracing time a cycle's steps
    without wrapping the scheduler's collaborators."""
    submit(sessions, clock, kind="inference", isolation="process", gpu_memory_gb=2)
    told: list[tuple[str, float]] = []
    report = Scheduler(
        engine, fleet, clock=clock, on_phase=lambda step, seconds: told.append((step, seconds))
    ).run_cycle()
    assert report.placed == 1
    steps = [step for step, _ in told]
    # In the cycle's order: recover, MIG changes, the status read, then the others.
    assert steps[:3] == ["recover", "mig", "sync"]
    assert {"inventory", "cancel", "claim", "decide", "write"} <= set(steps)
    assert steps.index("sync") < steps.index("inventory") < steps.index("decide") < steps.index("write")
    assert all(seconds >= 0 for _, seconds in told)
    # What the observer heard of a step run on the cycle's thread is what the report keeps.
    for step in ("recover", "mig", "inventory", "cancel", "decide"):
        assert sum(s for name, s in told if name == step) == pytest.approx(report.seconds[step])
