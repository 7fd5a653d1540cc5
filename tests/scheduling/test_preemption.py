"""Preemption in the live cycle, on the simulated fleet: who is preempted, how they are
told, what their end means, and the limits (never the non-preemptible, never more than
needed, fair-share reclaims rate-limited)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from broker.core.adapter import Unreachable
from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.core.models import GangReservation, JobEvent, Preemption
from broker.intake import queue
from broker.simulation.cluster import SimulatedCluster
from tests.scheduling.test_cycle import ADMIN, DEFAULT_POLICY, apply_policy, job, scheduler, submit

# slurm-a's whole GPUs: 8 A100-80GB on gpu-01 and gpu-02, where training of 1-4 GPUs goes.
PREEMPTING = (
    DEFAULT_POLICY
    + """
preemption:
  min_priority_gap: 5
  reclaim: true
  reclaims_per_hour: 2
  grace: 30s
  defaults:
    - match: {tenant: research}
      preemptible: true
"""
)


@pytest.fixture
def preempting(fleet, sessions, clock):
    apply_policy(sessions, fleet, clock, PREEMPTING)
    return fleet


def fill(sessions, clock, n=2, tenant="research", **fields) -> list[int]:
    """``n`` jobs of 4 whole GPUs each (n=2 fills gpu-01 and gpu-02)."""
    fields = {"kind": "training", "gpus": 4, "labels": {"sim-duration": "36000"}} | fields
    return [submit(sessions, clock, tenant=tenant, **fields) for _ in range(n)]


def started(engine, pool, clock):
    """A scheduler that has run the jobs submitted so far: placed, then seen running."""
    cycle = scheduler(engine, pool, clock)
    cycle.run_cycle()
    cycle.run_cycle()
    return cycle


def events(sessions, job_id) -> list[tuple[str, str, str]]:
    with sessions() as session:
        rows = session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars()
        return [(e.type, e.to_state, e.reason or "") for e in rows]


def test_a_job_of_higher_priority_preempts_and_starts_the_next_cycle(engine, sessions, clock, preempting):
    victims = fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    assert [job(sessions, v).state for v in victims] == ["running", "running"]
    clock.advance(600)
    with sessions() as session, session.begin():  # the second victim saved its state 5 minutes ago
        queue.record_checkpoint(session, victims[1], ADMIN, now=clock() - timedelta(minutes=5))
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)

    report = cycle.run_cycle()
    assert report.preempted == 1
    waiting = job(sessions, urgent)
    # The victim that loses the least: the one with a checkpoint 5 minutes old, not 10.
    assert waiting.state == "queued"
    assert waiting.state_reason.startswith(f"waiting for job {victims[1]} to stop: preempted for it (priority)")
    assert job(sessions, victims[0]).state == "running"

    report = cycle.run_cycle()  # the victim saved and exited: requeued, and the urgent job placed
    requeued = job(sessions, victims[1])
    assert requeued.state == "queued" and requeued.placement is None
    assert job(sessions, urgent).state == "submitted"
    story = events(sessions, victims[1])
    assert (
        "preemption",
        "running",
        f"preempted by job {urgent} (priority 10, tenant prod): to be told with SIGTERM",
    ) in story
    assert ("preemption", "running", "told with SIGTERM; 30 s to save its state") in story
    transition = [r for t, s, r in story if t == "transition" and s == "requeued"]
    assert transition == [
        f"preempted by job {urgent} (priority 10, tenant prod); ended after saving its state (exit 0)"
    ]
    assert any(t == "preemption" and r.startswith(f"preempts job {victims[1]}") for t, _, r in events(sessions, urgent))
    cycle.run_cycle()
    with sessions() as session:
        (row,) = session.execute(select(Preemption)).scalars()
    assert row.ended_at is not None and row.why == "priority"
    assert row.lost_gpu_seconds == pytest.approx(5 * 60 * 4)  # 5 minutes since its checkpoint, 4 GPUs


def test_a_job_not_preemptible_is_never_touched(engine, sessions, clock, preempting):
    fill(sessions, clock, tenant="research", preemptible=False)  # its spec says no
    fill(sessions, clock, n=0)
    other = fill(sessions, clock, n=1, tenant="vision")  # no default matches: not preemptible
    cycle = started(engine, preempting, clock)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=100)
    for _ in range(3):
        report = cycle.run_cycle()
        assert report.preempted == 0
    assert job(sessions, urgent).state_reason.startswith("waiting for 4 whole GPUs")
    assert job(sessions, other[0]).state in ("running", "submitted", "queued")
    with sessions() as session:
        assert session.execute(select(Preemption)).first() is None


def test_no_more_victims_than_the_job_needs_and_none_without_a_fit(engine, sessions, clock, preempting):
    small = [
        submit(sessions, clock, tenant="research", kind="training", gpus=1, labels={"sim-duration": "36000"})
        for _ in range(8)
    ]
    cycle = started(engine, preempting, clock)
    submit(sessions, clock, tenant="prod", kind="training", gpus=2, priority=10)
    cycle.run_cycle()
    with sessions() as session:
        chosen = session.execute(select(Preemption.victim_id)).scalars().all()
    assert len(chosen) == 2 and set(chosen) <= set(small)
    # The two are on one node: a 2-GPU job needs both GPUs on the same node.
    nodes = {job(sessions, v).placement["node"] for v in chosen}
    assert len(nodes) == 1
    # A job no set of victims could hold (more GPUs than a node has) preempts nothing.
    huge = submit(sessions, clock, tenant="prod", kind="training", gpus=5, priority=10)
    cycle.run_cycle()
    with sessions() as session:
        assert len(session.execute(select(Preemption)).all()) == 2
    assert job(sessions, huge).state == "held"


def test_a_victim_that_ignores_its_signal_is_stopped_after_the_grace(engine, sessions, clock, preempting, monkeypatch):
    monkeypatch.setattr(SimulatedCluster, "preempt", lambda self, job_id, signal, grace: None)
    victims = fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)
    cycle.run_cycle()
    clock.advance(20)  # inside the 30 s grace: still running
    cycle.run_cycle()
    told = [v for v in victims if any(t == "preemption" for t, _, _ in events(sessions, v))]
    assert len(told) == 1 and job(sessions, told[0]).state == "running"
    clock.advance(11)
    cycle.run_cycle()  # grace over: cancelled on its cluster
    assert ("preemption", "running", "its 30 s of grace are over: stopped") in events(sessions, told[0])
    cycle.run_cycle()  # the cluster says cancelled: requeued all the same, not cancelled
    victim = job(sessions, told[0])
    assert victim.state == "queued"
    assert any(s == "requeued" and r.endswith("ended stopped by its cluster") for t, s, r in events(sessions, told[0]))
    # Placed in the cycle that stopped the victim: step 3 stops, step 4 reads the GPUs free.
    assert job(sessions, urgent).state == "running"


def test_a_user_cancel_of_a_victim_still_cancels_it(engine, sessions, clock, preempting, monkeypatch):
    monkeypatch.setattr(SimulatedCluster, "preempt", lambda self, job_id, signal, grace: None)
    victims = fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)
    cycle.run_cycle()
    with sessions() as session:
        (victim,) = session.execute(select(Preemption.victim_id)).scalars()
    with sessions() as session, session.begin():
        queue.cancel_job(session, victim, ADMIN, now=clock())
    cycle.run_cycle()
    cycle.run_cycle()
    assert job(sessions, victim).state == "cancelled"
    assert set(victims) - {victim}


def test_fair_share_reclaim_is_rate_limited(engine, sessions, clock, preempting):
    # research holds all 8 GPUs, one job each; vision (same priority, holding nothing)
    # is below its share and reclaims, at most 2 an hour however many of its jobs wait.
    held = [
        submit(sessions, clock, tenant="research", kind="training", gpus=1, labels={"sim-duration": "360000"})
        for _ in range(8)
    ]
    cycle = started(engine, preempting, clock)
    assert all(job(sessions, h).state == "running" for h in held)
    storm = [submit(sessions, clock, tenant="vision", kind="training", gpus=1) for _ in range(6)]
    for _ in range(5):
        cycle.run_cycle()
        clock.advance(60)
    with sessions() as session:
        rows = session.execute(select(Preemption)).scalars().all()
    assert len(rows) == 2 and {r.why for r in rows} == {"reclaim"}
    assert "reclaims its fair share" in rows[0].reason
    # The two reclaimed GPUs run two of the storm (a sim job starts at once); the rest wait.
    assert sorted(job(sessions, s).state for s in storm) == ["queued"] * 4 + ["running"] * 2
    clock.advance(3600)
    cycle.run_cycle()
    with sessions() as session:
        assert len(session.execute(select(Preemption)).all()) == 4


def test_without_a_preemption_section_nothing_is_preempted(engine, sessions, clock, fleet):
    fill(sessions, clock, preemptible=True)
    cycle = started(engine, fleet, clock)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=100)
    assert cycle.run_cycle().preempted == 0
    assert job(sessions, urgent).state == "queued"


def test_a_preemption_survives_a_failed_signal_and_a_broker_restart(engine, sessions, clock, preempting, monkeypatch):
    """The choice is written before the cluster is asked: a signal that fails is sent by the
    next cycle, and a new scheduler (a restart) stops the victim when the grace runs out."""
    calls = []

    def flaky(self, job_id, signal, grace):
        calls.append(job_id)
        if len(calls) == 1:
            raise Unreachable("slurmctld did not answer")

    monkeypatch.setattr(SimulatedCluster, "preempt", flaky)
    fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)
    report = cycle.run_cycle()
    assert report.preempted == 0 and any("slurmctld did not answer" in e for e in report.errors)
    with sessions() as session:
        (row,) = session.execute(select(Preemption)).scalars()
    assert row.signalled_at is None
    restarted = scheduler(engine, preempting, clock)  # a new broker process
    assert restarted.run_cycle().preempted == 1 and calls == [row.victim_id, row.victim_id]
    assert job(sessions, urgent).state == "queued"  # the victim ignored it (this fake does nothing)
    clock.advance(31)
    scheduler(engine, preempting, clock).run_cycle()  # another restart, after the grace: stopped
    again = scheduler(engine, preempting, clock)
    again.run_cycle()
    assert job(sessions, row.victim_id).state == "queued"
    assert job(sessions, urgent).state == "running"


def test_a_preempted_run_is_charged_where_it_ran_while_the_job_waits_to_run_again(engine, sessions, clock, preempting):
    from broker.accounting.usage import job_usage, summarize

    victims = fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    clock.advance(600)
    submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)
    cycle.run_cycle()
    cycle.run_cycle()
    with sessions() as session:
        (victim,) = session.execute(select(Preemption.victim_id)).scalars()
    assert job(sessions, victim).state == "queued" and job(sessions, victim).placement is None
    clock.advance(60)
    with sessions() as session:
        usage = {u.job_id: u for u in job_usage(session, ADMIN, since=None, until=clock())}
    ran = usage[victim]
    assert (ran.cluster, ran.sharing) == ("slurm-a", "slurm/exclusive")
    assert ran.gpu_seconds == pytest.approx(600 * 4, abs=8)  # 10 minutes on 4 whole GPUs, then queued
    assert [r["jobs"] for r in summarize(usage.values(), ["tenant"]) if r["tenant"] == "research"] == [2]
    assert set(victims) >= {victim}


def test_a_preempted_job_runs_again_as_a_new_run(engine, sessions, clock, preempting):
    fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10, labels={"sim-duration": "60"})
    cycle.run_cycle()
    cycle.run_cycle()
    with sessions() as session:
        (victim,) = session.execute(select(Preemption.victim_id)).scalars()
    clock.advance(61)  # the urgent job ends; the victim is placed again and starts
    for _ in range(3):
        cycle.run_cycle()
    assert job(sessions, urgent).state == "succeeded"
    assert job(sessions, victim).state == "running"
    runs = [r for t, s, r in events(sessions, victim) if t == "transition" and s == "running"]
    assert len(runs) == 2


# -- gangs: three nodes of 4 A100s, every job on whole GPUs ---------------------------------

GANG_FLEET = """
clusters:
  slurm-g:
    flavor: slurm
    nodes:
      - {name: gpu, count: 3, cpus: 64, memory: 512G, gpus: [{model: A100-SXM4-80GB, count: 4}]}
"""
GANG_POLICY = """
rules:
  - {name: all, match: {}, route: {cluster: slurm-g, sharing: slurm/exclusive}}
preemption:
  min_priority_gap: 5
  grace: 30s
  defaults:
    - match: {tenant: research}
      preemptible: true
"""
LONG = {"sim-duration": "36000"}


@pytest.fixture
def three_nodes(sessions, clock):
    pool = AdapterPool(clock)
    with sessions() as session, session.begin():
        add_cluster(session, name="slurm-g", kind="sim", config={"fleet_yaml": GANG_FLEET}, actor="root", now=clock())
    apply_policy(sessions, pool, clock, GANG_POLICY)
    return pool


def node_of(sessions, job_id) -> str:
    return job(sessions, job_id).placement["node"]


def test_a_gang_preempts_the_nodes_whose_jobs_lose_least_and_starts_on_both_in_one_cycle(
    engine, sessions, clock, three_nodes
):
    cycle = scheduler(engine, three_nodes, clock)
    whole = submit(sessions, clock, tenant="research", kind="training", gpus=4, labels=LONG)
    three = submit(sessions, clock, tenant="research", kind="training", gpus=3, labels=LONG)
    cycle.run_cycle()
    one = submit(sessions, clock, tenant="research", kind="training", gpus=1, labels=LONG)  # beside `three`
    cycle.run_cycle()
    small = [submit(sessions, clock, tenant="research", kind="training", gpus=1, labels=LONG) for _ in range(4)]
    cycle.run_cycle()
    cycle.run_cycle()
    x, y = node_of(sessions, whole), node_of(sessions, three)
    (z,) = {"gpu-01", "gpu-02", "gpu-03"} - {x, y}
    assert node_of(sessions, one) == y and {node_of(sessions, s) for s in small} == {z}
    # x: one 4-GPU job, 21 min of work (84 GPU-min); y: 3 GPUs 1 min and 1 GPU 22 min
    # (25 GPU-min); z: four 1-GPU jobs, 20 min each (80 GPU-min)
    work = {whole: 21, three: 1, one: 22} | dict.fromkeys(small, 20)
    clock.advance(3600)
    with sessions() as session, session.begin():
        for job_id, minutes in work.items():
            queue.record_checkpoint(session, job_id, ADMIN, now=clock() - timedelta(minutes=minutes))
    gang = submit(sessions, clock, tenant="prod", kind="training", nodes=2, gpus=4, priority=10)

    cycle.run_cycle()
    with sessions() as session:
        chosen = set(session.execute(select(Preemption.victim_id)).scalars())
    assert chosen == {three, one, *small}  # y and z: 105 GPU-min, not x and z (164)
    assert job(sessions, gang).state_reason.startswith("waiting for job ")
    assert job(sessions, whole).state == "running"

    cycle.run_cycle()  # the victims saved and exited: the gang is placed on both their nodes at once
    placed = job(sessions, gang)
    assert placed.state == "submitted" and set(placed.placement["nodes"]) == {y, z}
    assert all(job(sessions, v).state == "queued" for v in chosen)
    cycle.run_cycle()
    assert job(sessions, gang).state == "running"


def test_a_running_gang_is_preempted_whole_and_queued_again(engine, sessions, clock, three_nodes):
    cycle = scheduler(engine, three_nodes, clock)
    low = submit(sessions, clock, tenant="research", kind="training", nodes=2, gpus=4, labels=LONG)
    kept = submit(sessions, clock, tenant="ml", kind="training", gpus=4, labels=LONG)  # not preemptible
    cycle.run_cycle()
    cycle.run_cycle()
    assert job(sessions, low).state == "running" and job(sessions, kept).state == "running"
    gang_nodes = set(job(sessions, low).placement["nodes"])
    clock.advance(600)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)

    cycle.run_cycle()
    with sessions() as session:
        (row,) = session.execute(select(Preemption)).scalars()
    assert row.victim_id == low and row.gpu_equivalents == 8  # both nodes' GPUs
    assert row.placement["nodes"] == sorted(gang_nodes)

    cycle.run_cycle()  # stopped on both nodes: queued again whole, and the urgent job placed
    again = job(sessions, low)
    assert again.state == "queued" and again.placement is None
    assert any(s == "requeued" and r.startswith(f"preempted by job {urgent}") for _, s, r in events(sessions, low))
    assert node_of(sessions, urgent) in gang_nodes
    with sessions() as session:
        (info,) = list_clusters(session)
    allocated = {u.node: u.allocated for u in three_nodes.get(info).inventory()}
    (other,) = gang_nodes - {node_of(sessions, urgent)}
    assert allocated[other] == 0  # no rank of the gang left running there
    cycle.run_cycle()
    assert job(sessions, low).state_reason.startswith("waiting for 2 nodes with 4 free A100-SXM4-80GBs on slurm-g")


def test_a_job_does_not_preempt_onto_nodes_reserved_for_a_gang_that_starts_before_it_ends(
    engine, sessions, clock, three_nodes
):
    cycle = scheduler(engine, three_nodes, clock)
    ending = [
        submit(sessions, clock, tenant="research", kind="training", gpus=4, time_limit="1h", labels=LONG)
        for _ in range(2)
    ]
    later = submit(sessions, clock, tenant="research", kind="training", gpus=4, time_limit="5h", labels=LONG)
    cycle.run_cycle()
    cycle.run_cycle()
    gang = submit(sessions, clock, tenant="ml", kind="training", nodes=2, gpus=4, time_limit="1h")
    cycle.run_cycle()
    clock.advance(11 * 60)  # past the policy's default wait: the nodes that free at 11:00 are reserved
    cycle.run_cycle()
    with sessions() as session:
        (reserved,) = session.execute(select(GangReservation)).scalars()
    assert reserved.job_id == gang and set(reserved.nodes) == {node_of(sessions, j) for j in ending}
    # the jobs on the reserved nodes lose 1 min of work, the other 10 min: yet a job that
    # would run past 11:00 preempts the other, and lands there
    with sessions() as session, session.begin():
        for job_id, minutes in {ending[0]: 1, ending[1]: 1, later: 10}.items():
            queue.record_checkpoint(session, job_id, ADMIN, now=clock() - timedelta(minutes=minutes))
    freed = node_of(sessions, later)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10, time_limit="10h")
    cycle.run_cycle()
    with sessions() as session:
        assert list(session.execute(select(Preemption.victim_id)).scalars()) == [later]
    cycle.run_cycle()
    assert job(sessions, urgent).placement["node"] == freed


def test_the_output_of_a_requeued_job_says_where_it_ran_and_that_it_waits_to_run_again(
    engine, sessions, clock, preempting, http, sdk
):
    """Not "never reached a cluster": it ran, was requeued, and waits to run again; where its
    earlier run's output is, while the cluster still says."""
    import io

    from broker.cli.console import Output
    from broker.cli.jobs import status

    fill(sessions, clock)
    cycle = started(engine, preempting, clock)
    urgent = submit(sessions, clock, tenant="prod", kind="training", gpus=4, priority=10)
    cycle.run_cycle()
    cycle.run_cycle()
    with sessions() as session:
        (row,) = session.execute(select(Preemption)).scalars()
    victim, node = row.victim_id, row.placement["node"]
    assert job(sessions, victim).state == "queued"

    answer = http(user="root", tenant="ops", role="admin").get(f"/v1/jobs/{victim}/logs")
    assert answer.status_code == 409
    assert answer.json()["error"]["message"] == (
        f"job {victim} is queued: it was running on slurm-a node {node} and was requeued (preempted by job "
        f"{urgent} (priority 10, tenant prod); ended after saving its state (exit 0)); its earlier output: "
        f"simulated cluster slurm-a, node {node} (in memory: the simulator writes no files); it waits to run "
        "again: `gpush status` says what it waits for"
    )
    # gpush status's Output line says the same, not "it has not reached a cluster"
    stdout = io.StringIO()
    assert status(sdk(user="root", tenant="ops", role="admin"), Output(stdout=stdout, width=400), victim) == 0
    (line,) = [line for line in stdout.getvalue().splitlines() if line.startswith("Output")]
    assert f"none yet: job {victim} is queued: it was running on slurm-a node {node} and was requeued" in line
