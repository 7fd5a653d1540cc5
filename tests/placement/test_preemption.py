"""Choosing victims (broker.placement.preemption): only preemptible jobs of lower standing,
in the order that loses the least, never more than the waiting job needs, and fair-share
reclaiming rate-limited."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from broker.core.adapter import CapacityUnit, Placement, Sharing
from broker.core.schemas import JobSpec
from broker.placement.capacity import CapacityView
from broker.placement.decision import CycleDecisions
from broker.placement.fairshare import FairShare
from broker.placement.preemption import Blocked, Planner, Running, Terms, Waiting, choose_victims, standing
from broker.placement.reservation import Reservation, Reservations
from broker.routing.policy import load_policy

NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


def job(job_id, tenant="ml", priority=0, preemptible=True, started=60, checkpoint=None) -> Running:
    return Running(
        job_id,
        tenant,
        priority,
        preemptible,
        NOW - timedelta(minutes=started),
        None if checkpoint is None else NOW - timedelta(minutes=checkpoint),
    )


def needs(gpus: int, size: dict[int, int]):
    """A fit that needs ``gpus`` GPUs freed; each victim frees size[job_id] (default 1)."""
    return lambda victims: sum(size.get(v.job_id, 1) for v in victims) >= gpus


URGENT = Waiting(100, "ops", priority=10)


def test_a_job_that_is_not_preemptible_is_never_touched():
    running = [job(1, preemptible=False), job(2, preemptible=False)]
    assert choose_victims(URGENT, running, needs(1, {}), terms=Terms(), share_gap={}, now=NOW) is None


def test_lowest_priority_then_least_work_since_the_last_checkpoint():
    running = [
        job(1, priority=5, started=10),
        job(2, priority=0, started=300, checkpoint=2),  # long run, checkpointed 2 min ago
        job(3, priority=0, started=30),  # 30 min of work at risk
        job(4, priority=10),  # same priority as the waiting job: not below it
    ]
    choice = choose_victims(URGENT, running, needs(1, {}), terms=Terms(), share_gap={}, now=NOW)
    assert [v.job_id for v in choice.victims] == [2]
    assert choice.reason(URGENT) == "preempted by job 100 (priority 10, tenant ops)"
    two = choose_victims(URGENT, running, needs(2, {}), terms=Terms(), share_gap={}, now=NOW)
    assert [v.job_id for v in two.victims] == [2, 3]


def test_never_more_than_the_waiting_job_needs():
    # Job 2 alone frees the 4 GPUs needed: job 1, taken first, is given back.
    running = [job(1, priority=0, started=1), job(2, priority=0, started=50)]
    choice = choose_victims(URGENT, running, needs(4, {1: 1, 2: 4}), terms=Terms(), share_gap={}, now=NOW)
    assert [v.job_id for v in choice.victims] == [2]
    # And when no set fits, nothing is preempted.
    assert choose_victims(URGENT, running, needs(9, {1: 1, 2: 4}), terms=Terms(), share_gap={}, now=NOW) is None


def test_priority_gap_and_fair_share_reclaiming_with_its_rate_limit():
    same = Waiting(200, "cv", priority=0)
    running = [job(1, tenant="ml", priority=0), job(2, tenant="ml", priority=0)]
    gap = {"cv": -4.0, "ml": 6.0}  # cv is below its share, ml above
    assert standing(same, running[0], Terms(), gap) is None  # reclaiming is off by default
    terms = Terms(reclaim=True, reclaims_per_hour=1)
    choice = choose_victims(same, running, needs(1, {}), terms=terms, share_gap=gap, now=NOW)
    assert choice.why == "reclaim" and "reclaims its fair share" in choice.reason(same)
    # The hour's one reclaim is spent: no more until it has passed.
    spent = [NOW - timedelta(minutes=20)]
    assert (
        choose_victims(same, running, needs(1, {}), terms=terms, share_gap=gap, now=NOW, recent_reclaims=spent) is None
    )
    assert choose_victims(same, running, needs(2, {}), terms=terms, share_gap=gap, now=NOW) is None  # 1 an hour
    # A tenant at or below its share is not reclaimed from.
    assert choose_victims(same, running, needs(1, {}), terms=terms, share_gap={"cv": -4.0, "ml": 0.0}, now=NOW) is None
    # A higher gap is needed when the policy says so.
    assert standing(Waiting(1, "ops", 3), job(9, priority=1), Terms(min_priority_gap=5), {}) is None


# -- gangs: the planner on the cycle's own decisions --------------------------------------

EXCLUSIVE = load_policy("rules:\n  - {name: all, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}\n")
A100 = "A100-SXM4-80GB"


class Ask:
    """A waiting job as the decision and the planner read it."""

    def __init__(self, job_id: int, priority: int = 10, **fields) -> None:
        self.job_id, self.tenant, self.priority = job_id, "ops", priority
        self.waiting_since = NOW
        self.spec = JobSpec.model_validate({"kind": "training", "command": ["run"], **fields})

    @property
    def asked(self) -> JobSpec:
        return self.spec


def on(job_id: int, nodes: str, units: int, started=60, checkpoint=None, priority=0) -> Running:
    """A running job on ``nodes`` ("n1" or "n1,n2": a gang), ``units`` GPUs on each."""
    names = tuple(nodes.split(","))
    placement = Placement(
        "slurm-a",
        Sharing.SLURM_EXCLUSIVE,
        units,
        float(units * len(names)),
        node=names[0],
        gpu_model=A100,
        nodes=names if len(names) > 1 else (),
    )
    return replace(job(job_id, priority=priority, started=started, checkpoint=checkpoint), placement=placement)


def fleet(nodes: int, running: list[Running], others: dict[str, int] | None = None, *, gpus: int = 4):
    """``nodes`` nodes of ``gpus`` A100s with ``running`` on them, and ``others`` (node ->
    GPUs) held by jobs that may not be preempted."""
    used = dict(others or {})
    for r in running:
        for node in r.placement.nodes or (r.placement.node,):
            used[node] = used.get(node, 0) + r.placement.units
    names = [f"n{i}" for i in range(1, nodes + 1)]
    units = [
        CapacityUnit(
            "slurm-a", n, Sharing.SLURM_EXCLUSIVE, A100, 80.0, gpus, used.get(n, 0), 1.0, gpus=tuple(range(gpus))
        )
        for n in names
    ]
    return CapacityView.build({"slurm-a": units})


def plan(asks: list[Ask], running: list[Running], view: CapacityView, book: Reservations | None = None):
    """The planner's choices for ``asks`` on the cycle's decisions over ``view``:
    {waiting job id: victim ids}, and the placements it fitted them with."""
    decisions = CycleDecisions(EXCLUSIVE, view, FairShare({}, {}), book)
    blocked = [
        Blocked(Waiting(a.job_id, a.tenant, a.priority), a, decisions.routing(a.asked, a.tenant).routes) for a in asks
    ]
    chosen = Planner(running, terms=Terms(), share_gap={}, now=NOW).plan(blocked, decisions)
    return {item.waiting.job_id: sorted(v.job_id for v in choice.victims) for item, choice in chosen}


def gang(job_id: int = 100, nodes: int = 2, gpus: int = 4, **fields) -> Ask:
    return Ask(job_id, nodes=nodes, gpus=gpus, **fields)


def test_a_gang_preempts_on_as_many_nodes_as_it_needs_and_the_set_that_loses_least():
    # n1: four 1-GPU jobs, 20 min of work each (80 GPU-min); n2: one 4-GPU job, 21 min
    # (84 GPU-min); n3: a 3-GPU job 1 min and a 1-GPU job 22 min (25 GPU-min). The two
    # nodes that lose least are n3 and n1, though n2's one job comes before n3's second.
    running = [on(i, "n1", 1, started=20) for i in (1, 2, 3, 4)]
    running += [on(5, "n2", 4, started=21), on(6, "n3", 3, started=1), on(7, "n3", 1, started=22)]
    view = fleet(3, running)
    assert plan([gang()], running, view) == {100: [1, 2, 3, 4, 6, 7]}
    # the victims' GPUs went to the gang's fit: nothing is free for a later job of the cycle
    assert free_on(view) == {"n1": 0, "n2": 0, "n3": 0}


def free_on(view: CapacityView) -> dict[str, int]:
    return {s.unit.node: s.free for s in view.slots["slurm-a"][Sharing.SLURM_EXCLUSIVE]}


def test_a_gang_is_refused_when_only_one_of_its_nodes_can_be_freed():
    running = [on(1, "n1", 4), on(2, "n2", 4, priority=10)]  # n2's job is not below the gang
    view = fleet(3, running, others={"n3": 2})  # n3: half taken by a job that may not be preempted
    assert plan([gang()], running, view) == {}
    assert free_on(view) == {"n1": 0, "n2": 0, "n3": 2}  # nothing taken, nothing freed


def test_a_gang_finds_its_victims_among_more_candidates_than_a_one_node_job_looks_at():
    # 12 nodes where 3 cheap preemptible jobs sit beside one that may not be preempted:
    # 36 candidates that free no whole node, ahead of the 8 that free n13 and n14.
    running = [on(10 * i + k, f"n{i}", 1, started=5) for i in range(1, 13) for k in range(3)]
    running += [on(1000 + 4 * (i - 13) + k, f"n{i}", 1, started=50) for i in (13, 14) for k in range(4)]
    view = fleet(14, running, others={f"n{i}": 1 for i in range(1, 13)})
    assert plan([gang()], running, view) == {100: [1000 + k for k in range(8)]}


def test_a_running_gang_chosen_as_victim_frees_every_node_it_holds():
    # the low-priority gang on n1 and n2 loses 80 GPU-min, n3's and n4's jobs 60 each: one
    # victim that frees both nodes loses less than the two others together
    running = [on(1, "n1,n2", 4, started=10), on(2, "n3", 4, started=15), on(3, "n4", 4, started=15)]
    view = fleet(4, running)
    assert plan([gang()], running, view) == {100: [1]}
    # a one-node job that needs 4 GPUs preempts the gang too (it is stopped whole), and the
    # other node it frees stays free for the next job of the cycle
    view = fleet(4, running)
    assert plan([Ask(100, gpus=4)], running, view) == {100: [1]}
    assert sorted(free_on(view).values()) == [0, 0, 0, 4]


def test_preemption_keeps_off_nodes_reserved_for_a_gang_that_starts_before_the_job_ends():
    # n1 is reserved for gang 50 from 12:30; n1's job loses less than n2's
    running = [on(1, "n1", 4, started=5), on(2, "n2", 4, started=50)]
    held = {50: Reservation(50, "slurm-a", ("n1", "n3"), NOW + timedelta(minutes=30), NOW)}

    def book() -> Reservations:
        return Reservations(timedelta(minutes=10), NOW, held, {})

    # a job that would end after 12:30 preempts n2's job, not n1's
    assert plan([Ask(100, gpus=4, time_limit="2h")], running, fleet(3, running, others={"n3": 4}), book()) == {100: [2]}
    # one that ends by then may be backfilled on n1
    assert plan([Ask(100, gpus=4, time_limit="20m")], running, fleet(3, running, others={"n3": 4}), book()) == {
        100: [1]
    }
    # and when n2's job may not be preempted, the long job preempts nothing: it waits
    only_n1 = running[:1]
    assert plan([Ask(100, gpus=4)], only_n1, fleet(3, only_n1, others={"n2": 4, "n3": 4}), book()) == {}


def test_a_gang_preempts_no_more_than_its_ranks_need():
    # a rank needs 2 GPUs: n2 has them free. On n1 job 1 (1 GPU, 30 min) comes before job 2
    # (2 GPUs, 31 min), but job 2 alone makes room: n1 loses 62 GPU-min, less than n3's
    # one job (4 GPUs, 20 min: 80), and job 1 is not preempted
    running = [on(1, "n1", 1, started=30), on(2, "n1", 2, started=31), on(3, "n3", 4, started=20)]
    view = fleet(3, running, others={"n1": 1, "n2": 2})
    assert plan([gang(gpus=2)], running, view) == {100: [2]}
