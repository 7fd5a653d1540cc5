"""MIG layout changes step by step (broker.fleet.mig_changes, broker.fleet.mig_steps): fence,
empty, change through the node agent (a stateful fake NVML), publish, confirm, admit;
deadlines, rollback, resuming."""

from __future__ import annotations

from typing import ClassVar

import pytest
from sqlalchemy import select, update

from broker.core.adapter import MigPublisher, NodeFencer, Rejected
from broker.core.errors import InvalidRequest
from broker.core.gpus import gpu_model
from broker.core.models import Job, MigChange
from broker.fleet.mig_changes import (
    StepLimits,
    change_findings,
    clear_change,
    events_of,
    request_changes,
    wanted_by_agent,
)
from broker.fleet.mig_steps import Reconfigurations
from broker.inventory.events import fleet_events
from broker.inventory.report_store import save_report
from broker.mig.layouts import MigSlot
from broker.mig.plan import GpuPlan, MigPlan, Outcome
from broker.nodeagent.agent import change_mig_layouts, collect
from tests.doubles.fake_nvml import FakeNvml

A100 = "A100-SXM4-40GB"
TODAY = ["3g.20gb@0", "3g.20gb@4"]
PLANNED = ["1g.5gb@0", "1g.5gb@1", "1g.5gb@2", "1g.5gb@3", "1g.5gb@4", "1g.5gb@5", "1g.5gb@6"]


class Tier:
    """A cluster that fences nodes and takes MIG layouts (what Slurm and Kubernetes will do)."""

    capabilities: ClassVar[frozenset[type]] = frozenset({NodeFencer, MigPublisher})
    changes_gpus: ClassVar[bool] = False

    def __init__(self) -> None:
        self.fences: dict[str, str] = {}
        self.layouts: dict[tuple[str, int], tuple[str, ...]] = {("mig-01", 0): tuple(TODAY)}
        self.refuse = False

    def fence(self, node: str, reason: str) -> None:
        self.fences[node] = reason

    def unfence(self, node: str) -> None:
        self.fences.pop(node, None)

    def fenced(self) -> dict[str, str]:
        return dict(self.fences)

    def publish_mig(self, node: str, gpu: int, instances, reported=None) -> None:
        if self.refuse == "bug":
            raise KeyError("an adapter's bug")
        if self.refuse:
            raise Rejected("the tier refuses")
        self.layouts[(node, gpu)] = tuple(instances)

    def mig_published(self, node: str, gpu: int):
        return self.layouts.get((node, gpu))


def plan(today=TODAY, planned=PLANNED, node="mig-01", index=0, action="repartition") -> MigPlan:
    model = gpu_model(A100)
    gpu = GpuPlan(
        node,
        index,
        model,
        tuple(MigSlot.parse(s) for s in today),
        tuple(MigSlot.parse(s) for s in planned),
        True,
        True,
        action,
        "7 waiting 1g.5gb jobs",
    )
    return MigPlan((gpu,), 7, Outcome(()), Outcome(()), ())


@pytest.fixture
def gpus():
    return FakeNvml.with_layouts(A100, [TODAY, ["7g.40gb@0"]])


@pytest.fixture
def tier():
    return Tier()


@pytest.fixture
def machine(sessions, clock, tier):
    return Reconfigurations(sessions, clock, lambda name: tier, limits=StepLimits())


def report(sessions, clock, gpus, node="mig-01"):
    with sessions() as session, session.begin():
        save_report(session, collect(gpus, node, now=clock), by="agent", now=clock())


def ask(sessions, clock, tier, gpus, the_plan=None, **kwargs):
    report(sessions, clock, gpus)
    from broker.inventory.report_store import load_reports

    with sessions() as session, session.begin():
        reports = load_reports(session)
        done = request_changes(
            session,
            the_plan or plan(),
            {"mig-01": "slurm-a"},
            lambda name: tier,
            reports,
            by="root",
            now=clock(),
            **kwargs,
        )
    return done


def agent_round(sessions, clock, gpus):
    """What `gpush agent --allow-mig-changes` does each round: report, make what the answer asks, report again."""
    report(sessions, clock, gpus)
    with sessions() as session:
        wanted = wanted_by_agent(session, "mig-01")
    if wanted:
        with sessions() as session:
            from broker.inventory.report_store import load_reports

            current = load_reports(session)["mig-01"]
        change_mig_layouts(gpus, current, wanted)
        report(sessions, clock, gpus)
    return wanted


def change(sessions, change_id=1) -> MigChange:
    with sessions() as session:
        row = session.get(MigChange, change_id)
        session.expunge(row)
        return row


def steps(sessions, change_id=1) -> list[str]:
    with sessions() as session:
        return [e.step for e in events_of(session, [change_id])[change_id]]


def test_a_change_goes_through_every_step_and_the_gpu_has_the_new_layout(sessions, clock, tier, gpus, machine):
    (asked,) = ask(sessions, clock, tier, gpus)
    assert asked.change == 1 and asked.refused is None
    machine.advance()
    assert change(sessions).step == "changing"  # fenced and empty: the agent's turn
    assert tier.fences == {"mig-01": "gpush MIG change 1"}
    assert machine.fenced() == {("slurm-a", "mig-01"): "MIG change 1 of GPU 0 (changing)"}
    clock.advance(5)
    assert agent_round(sessions, clock, gpus) == [{"change": 1, "gpu": 0, "layout": sorted(PLANNED)}]
    machine.advance()
    done = change(sessions)
    assert done.step == "done" and done.ended_at is not None
    assert steps(sessions) == ["planned", "draining", "emptying", "changing", "publishing", "confirming", "done"]
    with sessions() as session:  # gpush events (no job) shows the same steps, of MIG change 1 of GPU 0
        shown = [(e.kind, e.id, e.where, e.step) for e in fleet_events(session)]
    assert shown == [("mig-change", 1, "slurm-a GPU 0", s) for s in steps(sessions)]
    assert sorted(tier.layouts[("mig-01", 0)]) == sorted(PLANNED)
    assert tier.fences == {} and machine.fenced() == {}
    gpu0 = collect(gpus, "mig-01").gpus[0]
    assert sorted(f"{m.profile}@{m.placement_start}" for m in gpu0.mig_instances) == sorted(PLANNED)
    assert collect(gpus, "mig-01").gpus[1].mig_instances[0].profile == "7g.40gb"  # the other GPU untouched


def test_a_dry_run_writes_nothing_and_refusals_say_why(sessions, clock, tier, gpus):
    (dry,) = ask(sessions, clock, tier, gpus, dry_run=True)
    assert dry.change is None and dry.refused is None and dry.planned == sorted(PLANNED)
    with sessions() as session:
        assert session.scalar(select(MigChange)) is None
    (off,) = ask(sessions, clock, tier, gpus, the_plan=plan(action="enable-mig"))
    assert "nvidia-smi -i 0 -mig 1" in off.refused
    ask(sessions, clock, tier, gpus)
    (again,) = ask(sessions, clock, tier, gpus)
    assert "under way" in again.refused


def test_a_cluster_that_cannot_publish_is_refused_before_anything_is_written(sessions, clock, gpus):
    class Plain:
        capabilities: ClassVar[frozenset[type]] = frozenset()

    (refused,) = ask(sessions, clock, Plain(), gpus)
    assert "cannot take a new MIG layout" in refused.refused and refused.change is None


def test_busy_instances_keep_the_change_waiting_then_it_is_cancelled_untouched(sessions, clock, tier, gpus):
    machine = Reconfigurations(sessions, clock, lambda name: tier, limits=StepLimits(emptying=_minutes(30)))
    ask(sessions, clock, tier, gpus)
    with sessions() as session, session.begin():
        session.add(_running_job(clock, profile="3g.20gb"))
    machine.advance()
    assert change(sessions).step == "emptying" and tier.fences
    clock.advance(31 * 60)
    machine.advance()
    ended = change(sessions)
    assert ended.step == "cancelled" and "job 1" in _last_note(sessions)
    assert tier.fences == {} and tier.layouts[("mig-01", 0)] == tuple(TODAY)


def test_a_job_on_an_instance_the_change_keeps_does_not_hold_it_up(sessions, clock, tier, gpus, machine):
    keep_one = ["3g.20gb@4", "1g.5gb@0", "1g.5gb@1", "1g.5gb@2"]
    ask(sessions, clock, tier, gpus, the_plan=plan(planned=keep_one))
    with sessions() as session, session.begin():
        session.add(_running_job(clock, profile="1g.5gb"))
    machine.advance()
    assert change(sessions).step == "changing"


def test_a_cluster_that_needs_the_node_empty_waits_for_every_job_on_it(sessions, clock, tier, gpus, machine):
    """Slurm aborts the jobs on a node whose GRES change: there a job on an instance the
    change keeps, or on another GPU, holds the change up too, and is preempted if it may be."""
    tier.needs_empty_node = True
    keep_one = ["3g.20gb@4", "1g.5gb@0", "1g.5gb@1", "1g.5gb@2"]
    ask(sessions, clock, tier, gpus, the_plan=plan(planned=keep_one))
    with sessions() as session, session.begin():
        session.add(_running_job(clock, profile="7g.40gb"))  # GPU 1's, untouched by the change
    machine.advance()
    assert change(sessions).step == "emptying"
    with sessions() as session, session.begin():
        session.execute(update(Job).values(state="succeeded"))
    machine.advance()
    assert change(sessions).step == "changing"
    assert "empty: no work on mig-01;" in _notes(sessions)[-1]


def test_an_agent_that_refuses_the_layout_says_why_and_the_change_rolls_back_at_once(
    sessions, clock, tier, gpus, machine
):
    """A process started on an instance after the node was emptied: the agent will not destroy
    it, says so in its next report, and the change rolls back then, not when its step runs out."""
    ask(sessions, clock, tier, gpus)
    machine.advance()
    assert change(sessions).step == "changing"
    gpus.gpus[0].processes.append((4242, 1, 1024))  # on 3g.20gb@0 (GPU instance 1), which the change destroys
    with sessions() as session:
        wanted = wanted_by_agent(session, "mig-01")
    made = change_mig_layouts(gpus, collect(gpus, "mig-01"), wanted)
    assert not made and [(r.change, r.gpu) for r in made.refused] == [(1, 0)]
    clock.advance(5)
    with sessions() as session, session.begin():
        told = collect(gpus, "mig-01", now=clock).model_copy(update={"mig_refused": made.refused})
        save_report(session, told, by="agent", now=clock())
    machine.advance()
    row = change(sessions)
    assert row.rolling_back and row.step in ("changing", "publishing", "confirming", "rolled-back")
    assert "the agent of mig-01 did not make it: refused:" in " ".join(_notes(sessions))


def test_an_adapter_that_fails_unexpectedly_holds_up_its_change_alone_then_it_rolls_back(
    sessions, clock, tier, gpus, machine
):
    ask(sessions, clock, tier, gpus)
    machine.advance()
    clock.advance(5)
    agent_round(sessions, clock, gpus)
    tier.refuse = "bug"
    machine.advance()  # publishing fails: no exception leaves advance(), the change waits
    assert change(sessions).step == "publishing"
    clock.advance(11 * 60)
    machine.advance()
    assert change(sessions).rolling_back
    assert "slurm-a failed: KeyError:" in " ".join(_notes(sessions))


def test_an_agent_that_never_changes_the_gpu_rolls_the_change_back(sessions, clock, tier, gpus, machine):
    ask(sessions, clock, tier, gpus)
    machine.advance()
    clock.advance(11 * 60)  # past the changing step's 10 minutes; the agent reports but changes nothing
    report(sessions, clock, gpus)
    machine.advance()
    back = change(sessions)
    assert back.step == "changing" and back.rolling_back and back.target == sorted(TODAY)
    clock.advance(30)
    report(sessions, clock, gpus)  # its next report: the GPU has the old layout, the tier too
    machine.advance()
    back = change(sessions)
    assert back.step == "rolled-back" and back.ended_at is not None
    assert "rolling back to 3g.20gb@0, 3g.20gb@4" in " ".join(_notes(sessions))
    assert tier.fences == {}
    with sessions() as session:
        (finding,) = change_findings(session, clock())
    assert finding.kind == "mig_change_rolled_back" and finding.severity == "warning" and finding.gpu == 0


def test_a_rollback_that_runs_out_too_fails_and_keeps_the_node_fenced(sessions, clock, tier, gpus, machine):
    ask(sessions, clock, tier, gpus)
    machine.advance()
    clock.advance(5)
    agent_round(sessions, clock, gpus)  # the GPU changes...
    tier.refuse = True  # ... but the tier will not take it, nor the old layout back
    machine.advance()
    clock.advance(11 * 60)
    machine.advance()
    assert change(sessions).rolling_back
    clock.advance(11 * 60)  # the agent is gone: nobody puts the old layout back
    machine.advance()
    failed = change(sessions)
    assert failed.step == "failed"
    assert "stays fenced" in _last_note(sessions)
    assert tier.fences and machine.fenced() == {("slurm-a", "mig-01"): "MIG change 1 of GPU 0 (failed)"}
    clock.advance(3 * 86400)  # days later it still holds its node, and says so
    with sessions() as session:
        (finding,) = change_findings(session, clock())
    assert finding.severity == "critical" and "gpush mig changes 1 --clear" in finding.fix
    (again,) = ask(sessions, clock, tier, gpus)
    assert "change 1 of this GPU failed and holds its node" in again.refused
    with sessions() as session, session.begin():
        clear_change(session, session.get(MigChange, 1), lambda name: tier, by="root", now=clock())
    assert tier.fences == {} and machine.fenced() == {}
    assert change(sessions).step == "cleared" and _last_note(sessions) == "cleared by root: mig-01 takes work again"
    with sessions() as session:
        assert change_findings(session, clock()) == []
        with pytest.raises(InvalidRequest, match="only a failed change is cleared"):
            clear_change(session, session.get(MigChange, 1), lambda name: tier, by="root", now=clock())


def test_a_broker_that_restarts_mid_change_resumes_from_the_step_it_reached(sessions, clock, tier, gpus):
    Reconfigurations(sessions, clock, lambda name: tier).advance()  # nothing yet
    ask(sessions, clock, tier, gpus)
    Reconfigurations(sessions, clock, lambda name: tier).advance()
    assert change(sessions).step == "changing"
    clock.advance(5)
    agent_round(sessions, clock, gpus)
    restarted = Reconfigurations(sessions, clock, lambda name: tier)
    restarted.advance()
    assert change(sessions).step == "done"
    assert steps(sessions).count("changing") == 1  # nothing done twice


def test_at_most_max_at_once_gpus_change_together(sessions, clock, tier):
    gpus = FakeNvml.with_layouts(A100, [TODAY, TODAY, TODAY])
    three = MigPlan(tuple(plan(index=i).gpus[0] for i in range(3)), 7, Outcome(()), Outcome(()), ())
    ask(sessions, clock, tier, gpus, the_plan=three)
    Reconfigurations(sessions, clock, lambda name: tier, max_at_once=2).advance()
    with sessions() as session:
        assert [c.step for c in session.scalars(select(MigChange).order_by(MigChange.id))] == [
            "changing",
            "changing",
            "planned",
        ]


def test_the_confirming_step_waits_for_a_clean_drift_check(sessions, clock, tier, gpus):
    from broker.inventory.view import Finding

    findings = [Finding("mig_layout_mismatch", "critical", "slurm-a", "mig-01", "the tier disagrees", "", "", gpu=0)]
    machine = Reconfigurations(sessions, clock, lambda name: tier, findings_of=lambda s, c, n: list(findings))
    ask(sessions, clock, tier, gpus)
    machine.advance()
    clock.advance(5)
    agent_round(sessions, clock, gpus)
    machine.advance()
    assert change(sessions).step == "confirming"
    findings.clear()
    machine.advance()
    assert change(sessions).step == "done"


def _minutes(n):
    from datetime import timedelta

    return timedelta(minutes=n)


def _running_job(clock, profile, spec=None):
    now = clock()
    return Job(
        tenant="ml",
        user="alice",
        kind="training",
        isolation="hardware",
        priority=0,
        state="running",
        spec=spec or {"command": ["train"], "kind": "training", "gpus": 1},
        spec_hash="x" * 64,
        cluster="slurm-a",
        placement={"cluster": "slurm-a", "sharing": "slurm/mig", "units": 1, "node": "mig-01", "mig_profile": profile},
        gpu_equivalents=0.43,
        created_at=now,
        updated_at=now,
    )


def _notes(sessions, change_id=1):
    with sessions() as session:
        return [e.note for e in events_of(session, [change_id])[change_id]]


def _last_note(sessions, change_id=1):
    return _notes(sessions, change_id)[-1]


class ManagedTier(Tier):
    """A cluster whose MIG manager re-cuts the GPU itself when told (Kubernetes): pending for
    a while, then the instances, placed its own way."""

    changes_gpus: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.pending = False

    def publish_mig(self, node: str, gpu: int, instances, reported=None) -> None:
        super().publish_mig(node, gpu, instances)
        self.pending = True

    def mig_published(self, node: str, gpu: int):
        return None if self.pending else super().mig_published(node, gpu)


def test_a_cluster_that_recuts_the_gpu_itself_is_told_and_no_agent_is_asked(sessions, clock, gpus):
    from broker.inventory.report_store import load_reports
    from broker.nodeagent.mig_apply import apply_layout_change, layout_change

    tier = ManagedTier()
    machine = Reconfigurations(sessions, clock, lambda name: tier)
    asked_for = ["2g.10gb@0", "1g.5gb@2"]
    (asked,) = ask(sessions, clock, tier, gpus, the_plan=plan(planned=asked_for))
    assert asked.refused is None
    machine.advance()
    assert change(sessions).step == "confirming" and change(sessions).changed_by == "cluster"
    with sessions() as session:
        assert wanted_by_agent(session, "mig-01") == []  # the agent leaves this GPU alone
    assert sorted(tier.layouts[("mig-01", 0)]) == sorted(asked_for)
    machine.advance()
    assert change(sessions).step == "confirming"  # its MIG manager is still at it
    tier.pending = False
    # The GPU as the MIG manager cut it: the same profiles, placed its own way.
    with sessions() as session:
        gpu0 = load_reports(session)["mig-01"].gpus[0]
    apply_layout_change(gpus, layout_change(gpu0, [MigSlot("2g.10gb", 2), MigSlot("1g.5gb", 0)]))
    clock.advance(5)
    report(sessions, clock, gpus)
    machine.advance()
    assert change(sessions).step == "done"
    assert steps(sessions) == ["planned", "draining", "emptying", "publishing", "confirming", "done"]


def test_preemptible_work_on_an_instance_the_change_destroys_is_preempted_for_it(sessions, clock, tier, gpus):
    from broker.core.models import JobEvent, Preemption
    from broker.routing.rules import load_policy
    from tests.scheduling.test_cycle import DEFAULT_POLICY

    policy = load_policy(DEFAULT_POLICY + "\npreemption:\n  grace: 30s\n", "policy")
    machine = Reconfigurations(sessions, clock, lambda name: tier)
    machine.configure(None, policy)
    ask(sessions, clock, tier, gpus)
    spec = {"command": ["train"], "kind": "training", "gpus": 1, "preemptible": True}
    with sessions() as session, session.begin():
        session.add(_running_job(clock, profile="3g.20gb", spec=spec))  # job 1: may be preempted
        session.add(_running_job(clock, profile="3g.20gb"))  # job 2: may not
    machine.advance()
    machine.advance()  # asked once, not twice
    with sessions() as session:
        (row,) = session.scalars(select(Preemption)).all()
        assert (row.victim_id, row.preemptor_id, row.mig_change_id, row.why) == (1, None, 1, "mig-change")
        assert (row.signal, row.grace_seconds) == ("SIGTERM", 30)
        note = session.scalars(select(JobEvent.reason).where(JobEvent.job_id == 1)).all()
    assert note == ["preempted for MIG change 1 of mig-01 GPU 0: to be told with SIGTERM"]
    assert change(sessions).step == "emptying"
    assert "preempting job 1 (preemptible): to be told with SIGTERM, 30 s of grace" in _notes(sessions)
    with sessions() as session, session.begin():  # both end (the victim requeued, the other finished)
        for job in session.scalars(select(Job)):
            job.state = "queued" if job.id == 1 else "succeeded"
    machine.advance()
    assert change(sessions).step == "changing"


def test_a_change_that_ends_leaves_the_node_fenced_while_a_failed_one_holds_it(sessions, clock, tier):
    gpus = FakeNvml.with_layouts(A100, [TODAY, TODAY])
    two = MigPlan(tuple(plan(index=i).gpus[0] for i in range(2)), 7, Outcome(()), Outcome(()), ())
    machine = Reconfigurations(sessions, clock, lambda name: tier)
    ask(sessions, clock, tier, gpus, the_plan=two)
    machine.advance()
    with sessions() as session, session.begin():  # change 1 failed earlier: its node is held
        failed = session.get(MigChange, 1)
        failed.step, failed.ended_at = "failed", clock()
    clock.advance(5)
    agent_round(sessions, clock, gpus)
    machine.advance()
    assert change(sessions, 2).step == "done"
    assert "mig-01" in tier.fences  # still fenced: the failed change 1 holds it
    assert machine.fenced() == {("slurm-a", "mig-01"): "MIG change 1 of GPU 0 (failed)"}


# -- multi-node jobs (issue 34 item 6) ------------------------------------------------------


def _gang_rank(clock, profile="3g.20gb", state="running"):
    """A two-node job on slurm-a whose rank 1 holds a ``profile`` slice of mig-01."""
    job = _running_job(clock, profile)
    job.state = state
    job.spec = {"command": ["train"], "kind": "training", "gpus": 1, "nodes": 2}
    job.placement = {**job.placement, "node": "mig-02", "nodes": ["mig-02", "mig-01"]}
    job.gpu_equivalents = 0.86
    return job


def test_a_gangs_rank_on_the_node_holds_the_change_up(sessions, clock, tier, gpus):
    machine = Reconfigurations(sessions, clock, lambda name: tier, limits=StepLimits(emptying=_minutes(30)))
    ask(sessions, clock, tier, gpus)
    with sessions() as session, session.begin():
        session.add(_gang_rank(clock))
    machine.advance()
    assert change(sessions).step == "emptying"
    clock.advance(31 * 60)
    machine.advance()
    assert change(sessions).step == "cancelled" and "job 1" in _last_note(sessions)
    assert tier.layouts[("mig-01", 0)] == tuple(TODAY)


def _waiting_for_ones(clock, n=7):
    """Jobs placed on 1g.5gb slices that the cluster has not started: what a MIG plan re-cuts for."""
    out = []
    for _ in range(n):
        job = _running_job(clock, "1g.5gb")
        job.state = "routed"
        job.placement = {**job.placement, "node": "mig-09", "gpu_equivalents": 1 / 7}
        out.append(job)
    return out


def _plan(sessions):
    from broker.inventory.report_store import load_reports
    from broker.mig.queue import plan_for

    with sessions() as session:
        return plan_for(session, load_reports(session), None).plan


@pytest.mark.parametrize("holder", ["rank", "reservation"])
def test_the_mig_plan_keeps_the_layout_of_a_node_a_gang_keeps(sessions, clock, gpus, holder):
    from broker.core.models import GangReservation

    report(sessions, clock, gpus)
    with sessions() as session, session.begin():
        session.add_all(_waiting_for_ones(clock))
    assert [g.node for g in _plan(sessions).changed]  # mig-01 is re-cut for them, by itself
    with sessions() as session, session.begin():
        if holder == "rank":
            gang = _gang_rank(clock, profile="7g.40gb")
            session.add(gang)
            why = "its node runs a rank of multi-node job 8"
        else:
            gang = _gang_rank(clock, state="queued")
            gang.placement = None
            session.add(gang)
            session.flush()
            session.add(
                GangReservation(
                    job_id=gang.id, cluster="slurm-a", nodes=["mig-01", "mig-02"], start_by=clock(), made_at=clock()
                )
            )
            why = "its node is reserved for multi-node job 8"
    planned = _plan(sessions)
    assert planned.changed == ()
    assert {(g.node, g.action, g.reason) for g in planned.gpus} == {("mig-01", "keep", why)}


def test_a_gangs_rank_holds_its_instances_on_every_node_of_the_gang(sessions, clock):
    from broker.mig.queue import held_instances

    with sessions() as session, session.begin():
        session.add(_gang_rank(clock))
    with sessions() as session:
        assert held_instances(session, ["mig-01", "mig-02"]) == {("mig-01", "3g.20gb"): 1, ("mig-02", "3g.20gb"): 1}
