"""Gang reservations in the one decision: a multi-node job that waited long gets the nodes
that free soonest reserved; nothing that would end after it can start lands there; work
that ends in time is backfilled; a reservation keeps its nodes from cycle to cycle."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import UTC, datetime, timedelta

import pytest

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.placement.capacity import CapacityView
from broker.placement.decision import CycleDecisions, Placed, Waiting
from broker.placement.fairshare import FairShare
from broker.placement.reservation import Reservations
from broker.routing.policy import load_policy
from broker.scheduling import holdings

POLICY = load_policy(
    """
rules:
  - name: training
    match: {kind: training}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""
)
NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
AFTER = timedelta(minutes=10)
_ids = itertools.count(1)


class Job:
    def __init__(self, waited: timedelta = timedelta(0), **fields) -> None:
        self.tenant = "ml"
        self.job_id = next(_ids)
        self.waiting_since = NOW - waited
        self.spec = JobSpec.model_validate({"kind": "training", "command": ["run"], **fields})

    @property
    def asked(self) -> JobSpec:
        return self.spec


def whole(node: str, allocated: int) -> CapacityUnit:
    return CapacityUnit("slurm-a", node, Sharing.SLURM_EXCLUSIVE, "A100-SXM4-80GB", 80.0, 8, allocated, 1.0,
                        gpus=tuple(range(8)))  # fmt: skip


def hours(h: float) -> datetime:
    return NOW + timedelta(hours=h)


# a1: half taken until 13:00; a2: full until 13:00; a3: full until 12:30 by one job and by
# another with no time limit; a4: full until 15:00.
RUNNING = {
    ("slurm-a", "a1"): [(4, hours(1))],
    ("slurm-a", "a2"): [(8, hours(1))],
    ("slurm-a", "a3"): [(4, hours(0.5)), (4, None)],
    ("slurm-a", "a4"): [(8, hours(3))],
}


def cycle(held=None, *, now: datetime = NOW):
    view = CapacityView.build({"slurm-a": [whole("a1", 4), whole("a2", 8), whole("a3", 8), whole("a4", 8)]})
    book = Reservations(AFTER, now, held or {}, RUNNING)
    return view, book, CycleDecisions(POLICY, view, FairShare({}, {}), book)


def test_a_gang_that_waited_long_gets_the_nodes_that_free_soonest_and_says_so():
    view, book, decisions = cycle()
    gang = Job(waited=timedelta(minutes=20), nodes=2, gpus=8)
    outcome = decisions.decide(gang)
    assert isinstance(outcome, Waiting)
    # a1 and a2 have room at 13:00; a3 never (a job without a limit), a4 at 15:00
    assert outcome.reason == (
        "waiting for 2 nodes with 8 free A100-SXM4-80GBs on slurm-a: 0 have them now; "
        "reserved a1, a2 on slurm-a; starts by ~13:00 UTC when their jobs end"
    )
    reservation = book.held[gang.job_id]
    assert (reservation.nodes, reservation.start_by, reservation.made_at) == (("a1", "a2"), hours(1), NOW)


def test_a_gang_that_has_not_waited_long_enough_reserves_nothing_and_small_work_lands_anywhere():
    view, book, decisions = cycle()
    gang = Job(waited=timedelta(minutes=9), nodes=2, gpus=8)
    outcome = decisions.decide(gang)
    assert "reserved" not in outcome.reason and book.held == {}
    long_job = decisions.decide(Job(gpus=2, time_limit="4h"))
    assert isinstance(long_job, Placed) and long_job.placement.node == "a1"


def test_nothing_that_ends_after_the_gang_could_start_lands_on_its_nodes_but_shorter_work_is_backfilled():
    view, book, decisions = cycle()
    gang = Job(waited=timedelta(hours=2), nodes=2, gpus=8)
    decisions.decide(gang)
    # a1 has the only free GPUs; it is reserved until 13:00
    too_long = decisions.decide(Job(gpus=2, time_limit="2h"))
    assert isinstance(too_long, Waiting) and too_long.reason == (
        "waiting for 2 whole GPUs on slurm-a (0 of 32 free); a1, a2 held for a multi-node job until ~13:00 UTC, "
        "which this job's time limit runs past (1 job ahead)"  # the gang waits for whole GPUs there too
    )
    no_limit = decisions.decide(Job(gpus=1))
    assert isinstance(no_limit, Waiting) and no_limit.reason.endswith("lack of a time limit runs past (2 jobs ahead)")
    short = Job(gpus=2, time_limit="45m")
    backfilled = decisions.decide(short)
    assert isinstance(backfilled, Placed) and backfilled.placement.node == "a1"
    assert book.backfilled == {short.job_id: 2}
    # exactly until the gang can start is in time
    assert isinstance(decisions.decide(Job(gpus=2, time_limit="1h")), Placed)
    # what was hidden from the long jobs is still free for what comes next
    assert {s.unit.node: s.free for s in view.slots["slurm-a"][Sharing.SLURM_EXCLUSIVE]}["a1"] == 0


def test_a_reservation_keeps_its_nodes_from_cycle_to_cycle_and_its_start_follows_the_jobs_on_them():
    _, book, decisions = cycle()
    gang = Job(waited=timedelta(hours=1), nodes=2, gpus=8)
    decisions.decide(gang)
    first = book.held[gang.job_id]
    # next cycle: a2's job ended early (a2 is free now), a1 still as before
    later = NOW + timedelta(minutes=5)
    view = CapacityView.build({"slurm-a": [whole("a1", 4), whole("a2", 0), whole("a3", 8), whole("a4", 8)]})
    running = {key: ends for key, ends in RUNNING.items() if key[1] != "a2"}
    book = Reservations(AFTER, later, {gang.job_id: first}, running)
    outcome = CycleDecisions(POLICY, view, FairShare({}, {}), book).decide(gang)
    assert isinstance(outcome, Waiting)
    again = book.held[gang.job_id]
    assert (again.nodes, again.start_by, again.made_at) == (("a1", "a2"), hours(1), NOW)
    # another gang cannot take the nodes held for the first
    other = Job(waited=timedelta(hours=1), nodes=1, gpus=8, time_limit="3h")
    assert isinstance(CycleDecisions(POLICY, view, FairShare({}, {}), book).decide(other), Waiting)


def test_the_gang_may_use_its_own_reserved_nodes_and_its_reservation_ends_when_placed():
    _, book, decisions = cycle()
    gang = Job(waited=timedelta(hours=1), nodes=2, gpus=8, time_limit="10h")
    decisions.decide(gang)
    held = dict(book.held)
    view = CapacityView.build({"slurm-a": [whole("a1", 0), whole("a2", 0), whole("a3", 8), whole("a4", 8)]})
    book = Reservations(AFTER, hours(1), held, {})
    outcome = CycleDecisions(POLICY, view, FairShare({}, {}), book).decide(gang)
    assert isinstance(outcome, Placed) and outcome.placement.nodes == ("a1", "a2")
    assert book.held == {} and book.backfilled == {}


def test_a_reservation_bounds_the_wait_of_a_gang_behind_a_stream_of_small_jobs():
    """Without a reservation, 1-GPU jobs of an hour arriving every few minutes keep some
    GPUs of every node busy and the gang never starts; with one, it starts once the jobs
    that ran on its nodes when it was made have ended."""

    def run(after: timedelta | None) -> datetime | None:
        nodes = {"a1": [], "a2": []}  # node -> [(end, units)]
        held: dict = {}
        gang = Job(nodes=2, gpus=8, time_limit="1h")
        gang.waiting_since = NOW
        now = NOW
        for _ in range(48):  # a cycle every 5 minutes for 4 hours
            for ends in nodes.values():
                ends[:] = [(end, units) for end, units in ends if end > now]
            view = CapacityView.build(
                {"slurm-a": [whole(node, sum(u for _, u in ends)) for node, ends in nodes.items()]}
            )
            running = {("slurm-a", n): [(u, end) for end, u in ends] for n, ends in nodes.items()}
            book = Reservations(after, now, held, running)
            decisions = CycleDecisions(POLICY, view, FairShare({}, {}), book)
            # a small job arrives before the gang is decided each cycle (higher in the order)
            small = decisions.decide(Job(gpus=1, time_limit="1h"))
            if isinstance(small, Placed):
                nodes[small.placement.node].append((now + timedelta(hours=1), 1))
            if isinstance(decisions.decide(gang), Placed):
                return now
            held = book.held
            now += timedelta(minutes=5)
        return None

    assert run(None) is None  # starved: some 1-GPU job always holds each node
    started = run(AFTER)
    assert started is not None and started - NOW <= AFTER + timedelta(hours=1)


@pytest.mark.parametrize(
    ("section", "after"),
    [("", 600), ("scheduling: {gang_reservation_after: 30m}", 1800), ("scheduling: {gang_reservations: false}", None)],
)
def test_the_policy_says_after_how_long_a_gang_gets_a_reservation(section, after):
    rule = "{name: r, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}"
    policy = load_policy(f"rules:\n  - {rule}\n{section}\n")
    assert policy.gang_reservation_after == after


def test_a_wait_before_a_reservation_that_is_not_a_duration_is_refused_saying_what_to_write():
    with pytest.raises(InvalidRequest, match="gang_reservation_after"):
        load_policy(
            "rules:\n  - {name: r, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}\n"
            "scheduling: {gang_reservation_after: soon}\n"
        )


# -- nodes a fleet change holds (issue 34 item 6) ------------------------------------------


def closed(unit: CapacityUnit, why: str) -> CapacityUnit:
    """``unit`` as its cluster reports it while its node is drained or cordoned: all taken, with why."""
    return dataclasses.replace(unit, allocated=unit.capacity, labels={**unit.labels, "unavailable": why})


LENT = "drain: lent to k8s-a (gpush lending pool)"  # a node being lent, as Slurm's adapter says


@pytest.mark.parametrize("fenced_by", ["lending", "mig change"])
def test_a_node_being_lent_or_re_cut_is_never_reserved_for_a_gang(fenced_by):
    inventory = {"slurm-a": [whole("a1", 4), whole("a2", 8), whole("a3", 8), whole("a4", 8)]}
    if fenced_by == "lending":
        inventory["slurm-a"][0] = closed(inventory["slurm-a"][0], LENT)
    else:  # the scheduler's own fence for a MIG change under way
        inventory = holdings.fence(inventory, {("slurm-a", "a1"): "MIG change 3 of GPU 0 (emptying)"})
    view = CapacityView.build(inventory)
    gang = Job(waited=timedelta(minutes=20), nodes=2, gpus=8)
    # a1 would have room first (its job ends at 13:00), but it is on its way out
    assert "a1" not in view.gang_candidates(gang.spec, POLICY.rules[0].route)
    book = Reservations(AFTER, NOW, {}, RUNNING)
    outcome = CycleDecisions(POLICY, view, FairShare({}, {}), book).decide(gang)
    assert isinstance(outcome, Waiting)
    assert outcome.reason.endswith("reserved a2, a4 on slurm-a; starts by ~15:00 UTC when their jobs end")
    assert book.held[gang.job_id].nodes == ("a2", "a4")


def test_a_reservation_whose_node_starts_being_lent_picks_another():
    gang = Job(waited=timedelta(minutes=20), nodes=2, gpus=8)
    _, book, decisions = cycle()
    decisions.decide(gang)
    assert book.held[gang.job_id].nodes == ("a1", "a2")
    units = [whole("a1", 4), closed(whole("a2", 8), LENT), whole("a3", 8), whole("a4", 8)]
    view = CapacityView.build({"slurm-a": units})
    later = Reservations(AFTER, NOW, book.held, RUNNING)
    CycleDecisions(POLICY, view, FairShare({}, {}), later).decide(gang)
    assert later.held[gang.job_id].nodes == ("a1", "a4")


def test_a_gang_is_never_placed_on_a_node_being_lent_or_re_cut():
    units = [whole("a1", 0), whole("a2", 0), whole("a3", 0), whole("a4", 0)]
    inventory = holdings.fence({"slurm-a": units}, {("slurm-a", "a1"): "MIG change 3 of GPU 0 (draining)"})
    inventory["slurm-a"][3] = closed(inventory["slurm-a"][3], LENT)
    view = CapacityView.build(inventory)
    decisions = CycleDecisions(POLICY, view, FairShare({}, {}))
    three = decisions.decide(Job(nodes=3, gpus=8))
    assert isinstance(three, Waiting)
    assert three.reason.startswith("waiting for 3 nodes with 8 free A100-SXM4-80GBs on slurm-a: 2 have them now")
    two = decisions.decide(Job(nodes=2, gpus=8))
    assert isinstance(two, Placed) and two.placement.nodes == ("a2", "a3")


def test_a_gang_on_mig_slices_gets_no_reservation_however_long_it_waits():
    # What the README says of reservations: whole GPUs only. A MIG gang waits for its
    # slices to free as a one-node job does, and longer MIG work may still take them.
    policy = load_policy(
        "rules:\n  - name: mig\n    match: {kind: training}\n    route: {cluster: slurm-a, sharing: slurm/mig}\n"
    )
    units = [
        CapacityUnit(
            "slurm-a",
            node,
            Sharing.SLURM_MIG,
            "A100-SXM4-40GB",
            5.0,
            7,
            6,
            1 / 7,
            mig_profile="1g.5gb",
            in_mig_mode=True,
        )  # fmt: skip
        for node in ("m1", "m2")
    ]
    running = {("slurm-a", "m1"): [(6, hours(1))], ("slurm-a", "m2"): [(6, hours(1))]}
    book = Reservations(AFTER, NOW, {}, running)
    decisions = CycleDecisions(policy, CapacityView.build({"slurm-a": units}), FairShare({}, {}), book)
    gang = Job(waited=timedelta(hours=2), nodes=2, gpus=2, isolation="hardware", gpu_memory_gb=5)
    outcome = decisions.decide(gang)
    assert isinstance(outcome, Waiting) and "reserved" not in outcome.reason
    assert book.held == {}
    longer = decisions.decide(Job(gpus=1, isolation="hardware", gpu_memory_gb=5, time_limit="10h"))
    assert isinstance(longer, Placed) and longer.placement.node == "m1"


# -- the jobs ahead of a gang in the queue are not held back for it --------------------------


def test_a_job_that_came_before_the_gang_is_not_held_back_by_its_reservation_but_one_after_it_is():
    """As Slurm's backfill plans reservations in priority order: the gang's reservation
    (kept from the last cycle) does not delay a job ahead of it in the queue, which the next
    cycle decides before the gang; a job behind it still waits, unless it ends in time."""
    earlier = Job(waited=timedelta(hours=3), gpus=2, time_limit="4h")  # in the queue before the gang
    earlier_low = Job(waited=timedelta(hours=3), gpus=2, time_limit="4h", priority=-1)  # before, but lower
    gang = Job(waited=timedelta(hours=2), nodes=2, gpus=8)
    later = Job(waited=timedelta(hours=1), gpus=2, time_limit="5h")  # after it
    urgent = Job(gpus=2, time_limit="5h", priority=5)  # after it, at a higher priority
    _, book, decisions = cycle()
    decisions.decide(gang)
    assert book.held[gang.job_id].nodes == ("a1", "a2")
    # the next cycle: a1's 4 free GPUs are the only free ones
    view, book, decisions = cycle(book.held)
    first = decisions.decide(earlier)
    assert isinstance(first, Placed) and first.placement.node == "a1"
    assert book.backfilled == {}  # ahead of the gang: not backfilled onto its nodes
    low = decisions.decide(earlier_low)
    assert isinstance(low, Waiting) and "held for a multi-node job until ~13:00 UTC" in low.reason
    decisions.decide(gang)
    assert book.held[gang.job_id].start_by == hours(4)  # its nodes now free when that ends
    # the next cycle (a1 free again here): a job behind the gang that would run past 16:00
    # waits; one that ends in time is backfilled
    view, book, decisions = cycle(book.held)
    for behind in (later, urgent):
        outcome = decisions.decide(behind)
        assert isinstance(outcome, Waiting) and "held for a multi-node job until ~16:00 UTC" in outcome.reason
    backfilled = Job(gpus=2, time_limit="4h")
    assert isinstance(decisions.decide(backfilled), Placed) and book.backfilled == {backfilled.job_id: 2}
