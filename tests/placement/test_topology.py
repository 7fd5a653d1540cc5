"""Topology in the one placement decision (issue 35): a multi-GPU job's GPUs on one NVLink
island, a gang's nodes in as few network blocks as possible, what a job that asks for
closeness waits or is held for, and the free GPUs a view keeps in step with its fits."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from broker.core.adapter import CapacityUnit, Placement, Sharing
from broker.core.schemas import JobSpec
from broker.core.topology import GpuTopology
from broker.placement.capacity import CapacityView, Fit, NoFit
from broker.placement.decision import CycleDecisions, Held, Placed, Waiting
from broker.placement.fairshare import FairShare
from broker.placement.preemption import Blocked, Planner, Running, Terms
from broker.placement.preemption import Waiting as Asking
from broker.placement.reservation import Reservations
from broker.placement.topology_fit import strip_topology
from broker.routing.policy import load_policy

A100 = "A100-SXM4-80GB"
POLICY = load_policy("rules:\n  - {name: all, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}\n")
NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
# Eight GPUs joined in pairs by NVLink, two PCIe switches of four, one socket.
PAIRS = GpuTopology.from_links(
    range(8), [(0, 1), (2, 3), (4, 5), (6, 7)], pcie=[range(4), range(4, 8)], socket=[range(8)]
)
SWITCH = GpuTopology.from_links(range(8), [(i, i + 1) for i in range(7)], pcie=[range(4), range(4, 8)])


class Job:
    def __init__(self, job_id: int = 1, **fields) -> None:
        self.job_id, self.tenant, self.priority = job_id, "ml", 10
        self.waiting_since = NOW - timedelta(hours=1)
        self.spec = JobSpec.model_validate({"kind": "training", "command": ["run"], **fields})

    @property
    def asked(self) -> JobSpec:
        return self.spec


def node(name: str, free=None, topology=PAIRS, block: str | None = None, busy: int | None = None) -> CapacityUnit:
    """A node of 8 A100s: ``free`` its free GPUs (None: all free) or ``busy`` GPUs taken
    with which ones unknown; ``block`` its network block."""
    if busy is not None:
        allocated, free_gpus = busy, None
    else:
        free_gpus = tuple(range(8)) if free is None else tuple(free)
        allocated = 8 - len(free_gpus)
    return CapacityUnit(
        "slurm-a", name, Sharing.SLURM_EXCLUSIVE, A100, 80.0, 8, allocated, 1.0, gpus=tuple(range(8)),
        free_gpus=free_gpus, gpu_topology=topology, topology=(("block", block),) if block else (),
    )  # fmt: skip


def view_of(*units: CapacityUnit, not_started=()) -> CapacityView:
    return CapacityView.build({"slurm-a": list(units)}, not_started)


def fit(view: CapacityView, **fields) -> Fit | NoFit:
    return view.fit(Job(**fields).spec, "slurm-a", Sharing.SLURM_EXCLUSIVE)


def free_gpus(view: CapacityView) -> dict[str, tuple[int, ...] | None]:
    return {s.unit.node: s.free_gpus for s in view.slots["slurm-a"][Sharing.SLURM_EXCLUSIVE]}


def decide(view: CapacityView, job: Job, book: Reservations | None = None):
    return CycleDecisions(POLICY, view, FairShare({}, {}), book).decide(job)


# -- one node, whole GPUs ----------------------------------------------------------------


def test_a_multi_gpu_job_goes_to_the_node_where_its_gpus_share_an_island_before_best_fit():
    # a: 3 free, none of them a pair (best fit); b: 4 free, two whole pairs.
    units = [node("a", free=(1, 3, 5)), node("b", free=(0, 1, 4, 5))]
    placed = fit(view_of(*units), gpus=2).placement
    assert (placed.node, placed.gpus) == ("b", (0, 1))
    # Blind to topology, best fit alone takes a, and names no GPU.
    blind = fit(view_of(*strip_topology(units)), gpus=2).placement
    assert (blind.node, blind.gpus) == ("a", ())


def test_among_nodes_with_an_island_that_fits_best_fit_keeps_the_larger_island_whole():
    # Both hold 2 GPUs on one island; the NVSwitch node's 8 stay whole for an 8-GPU job.
    view = view_of(node("big", topology=SWITCH), node("small", free=(2, 3, 6)))
    placed = fit(view, gpus=2).placement
    assert (placed.node, placed.gpus) == ("small", (2, 3))
    assert fit(view, gpus=8).placement.node == "big"


def test_a_one_gpu_job_takes_the_gpu_of_the_island_with_fewest_free_and_names_it():
    view = view_of(node("a", free=(0, 1, 2)))  # the pair 0-1 whole; 2's partner busy
    placed = fit(view, gpus=1).placement
    assert placed.gpus == (2,)
    assert free_gpus(view) == {"a": (0, 1)}


def test_a_node_whose_free_gpus_are_unknown_ranks_after_a_node_where_an_island_fits():
    # a: best fit (4 free), which ones unknown; b: 5 free, a pair among them.
    view = view_of(node("a", busy=4), node("b", free=(0, 1, 2, 4, 6)))
    placed = fit(view, gpus=2).placement
    assert (placed.node, placed.gpus) == ("b", (0, 1))
    # Where only the unknown node has room, it is placed there with no GPUs named.
    alone = fit(view_of(node("a", busy=4)), gpus=2).placement
    assert (alone.node, alone.gpus) == ("a", ())


def test_placements_not_started_that_name_gpus_take_those_and_give_back_returns_them():
    started_not = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="a", gpu_model=A100, gpus=(4, 5))
    view = view_of(node("a"), not_started=[started_not])
    assert free_gpus(view) == {"a": (0, 1, 2, 3, 6, 7)}
    taken = fit(view, gpus=4)
    assert taken.placement.gpus == (0, 1, 2, 3)
    assert free_gpus(view) == {"a": (6, 7)}
    view.undo(taken)
    assert free_gpus(view) == {"a": (0, 1, 2, 3, 6, 7)}
    view.give_back(started_not)
    assert free_gpus(view) == {"a": tuple(range(8))}
    view.take(started_not)
    assert free_gpus(view) == {"a": (0, 1, 2, 3, 6, 7)}


def test_a_free_gpu_list_that_disagrees_with_the_free_count_is_taken_as_unknown():
    unit = replace(node("a", free=(0, 1)), allocated=4)  # 4 free, 2 named
    view = view_of(unit)
    assert free_gpus(view) == {"a": None}
    assert fit(view, gpus=2).placement.gpus == ()


# -- a one-node job that asks for a GPU level --------------------------------------------


def test_a_job_that_requires_one_nvlink_island_waits_saying_how_many_one_island_has_free():
    view = view_of(node("pairs"), node("switch", free=(0, 1), topology=SWITCH))
    ask = {"gpus": 4, "topology": {"level": "nvlink", "mode": "required"}}
    outcome = fit(view, **ask)
    assert isinstance(outcome, NoFit) and not outcome.never
    assert outcome.reason == "waiting for 4 GPUs in one NVLink island on slurm-a: the most free in one island is 2"
    # Preferred: the closest there is now (two pairs on one PCIe switch).
    preferred = fit(view, gpus=4, topology={"level": "nvlink", "mode": "preferred"}).placement
    assert (preferred.node, preferred.gpus) == ("pairs", (0, 1, 2, 3))


def test_a_job_that_requires_an_island_no_node_has_is_held_saying_the_largest():
    view = view_of(node("pairs"), node("plain", topology=GpuTopology.from_links(range(8))))
    outcome = fit(view, gpus=4, topology={"level": "nvlink", "mode": "required"})
    assert outcome.never
    assert outcome.reason == (
        "needs 4 GPUs in one NVLink island; no node of slurm-a has an NVLink island of more than 2 GPUs"
    )
    held = decide(view, Job(gpus=4, topology={"level": "nvlink", "mode": "required"}))
    assert isinstance(held, Held) and "no node of slurm-a has an NVLink island of more than 2 GPUs" in held.reason


def test_a_required_pcie_level_takes_only_a_node_whose_set_is_on_one_switch():
    # a (best fit): 4 free over both switches; b: 4 free on switch 4-7.
    view = view_of(node("a", free=(0, 1, 4, 5)), node("b", free=(0, 4, 5, 6, 7)))
    placed = fit(view, gpus=4, topology={"level": "pcie", "mode": "required"}).placement
    assert (placed.node, placed.gpus) == ("b", (4, 5, 6, 7))


def test_a_required_level_the_cluster_does_not_have_is_held_saying_which_it_has():
    view = view_of(node("a", block="b1"))
    held = fit(view, gpus=1, topology={"level": "rack", "mode": "required"})
    assert held.never
    assert held.reason == (
        "requires topology level 'rack', which slurm-a does not have: it has the GPU levels nvlink, pcie, socket "
        "and network level block; ask for one of nvlink, pcie, socket, block"
    )
    # A level it has: one node is always in one block.
    assert isinstance(fit(view, gpus=1, topology={"level": "block", "mode": "required"}), Fit)
    # Preferred alike: a level the cluster does not have is a mistake in the ask (a typo), held, not ignored.
    preferred = fit(view, gpus=1, topology={"level": "nvlnk", "mode": "preferred"})
    assert isinstance(preferred, NoFit) and preferred.never
    assert preferred.reason.startswith("prefers topology level 'nvlnk', which slurm-a does not have")


# -- gangs -------------------------------------------------------------------------------


def blocks(layout: dict[str, int], busy: dict[str, int] | None = None) -> list[CapacityUnit]:
    """Nodes named <block>-<i> per block; ``busy``: node -> GPUs taken (the first ones)."""
    units = []
    for block, count in layout.items():
        for i in range(1, count + 1):
            name = f"{block}-{i}"
            taken = (busy or {}).get(name, 0)
            units.append(node(name, free=range(taken, 8), topology=SWITCH, block=block))
    return units


def test_a_gang_goes_to_one_block_when_one_has_room_though_best_fit_would_spread_it():
    view = view_of(*blocks({"a": 3, "b": 4}))
    placed = fit(view, gpus=8, nodes=4).placement
    assert placed.nodes == ("b-1", "b-2", "b-3", "b-4")
    blind = view_of(*strip_topology(blocks({"a": 3, "b": 4})))
    assert fit(blind, gpus=8, nodes=4).placement.nodes == ("a-1", "a-2", "a-3", "b-1")


def test_a_gang_that_no_block_holds_takes_the_fewest_blocks():
    view = view_of(*blocks({"a": 2, "b": 3, "c": 2}))
    placed = fit(view, gpus=8, nodes=5).placement
    assert {n.split("-")[0] for n in placed.nodes} in ({"b", "a"}, {"b", "c"})


def test_a_gang_best_fits_blocks_so_the_larger_block_stays_whole():
    view = view_of(*blocks({"big": 4, "small": 2}))
    assert fit(view, gpus=8, nodes=2).placement.nodes == ("small-1", "small-2")


def test_a_gang_that_requires_one_block_waits_saying_the_most_free_in_one():
    units = blocks({"a": 4, "b": 4}, busy={"a-1": 8, "b-1": 4})
    outcome = fit(view_of(*units), gpus=8, nodes=4, topology={"level": "block", "mode": "required"})
    assert isinstance(outcome, NoFit) and not outcome.never
    assert outcome.reason == (
        "waiting for 4 nodes with 8 free A100-SXM4-80GBs in one block of slurm-a: at most 3 in one block have them now"
    )
    # Preferred: over two blocks now.
    placed = fit(view_of(*units), gpus=8, nodes=4, topology={"level": "block", "mode": "preferred"}).placement
    assert len({n.split("-")[0] for n in placed.nodes}) == 2


def test_a_gang_that_requires_one_block_no_block_could_ever_hold_is_held():
    view = view_of(*blocks({"a": 3, "b": 3}))
    outcome = decide(view, Job(gpus=8, nodes=4, topology={"level": "block", "mode": "required"}))
    assert isinstance(outcome, Held)
    assert "needs 4 nodes with 8 A100-SXM4-80GBs in one block; the most in one block of slurm-a is 3" in outcome.reason


def test_a_gang_level_the_cluster_does_not_have_is_held_saying_it_has_none():
    view = view_of(*strip_topology(blocks({"a": 4})))
    outcome = fit(view, gpus=8, nodes=2, topology={"level": "block", "mode": "required"})
    assert outcome.never and "which slurm-a does not have" in outcome.reason and "no network levels" in outcome.reason


def test_a_gangs_ranks_take_gpus_off_each_nodes_free_set_and_undo_returns_exactly_those():
    view = view_of(*blocks({"a": 2}, busy={"a-1": 4, "a-2": 4}))
    fit(view, gpus=4, nodes=2)
    assert free_gpus(view) == {"a-1": (), "a-2": ()}
    # Free: the pairs 2-3 and 6-7; each rank takes the pair of lowest index, as its cluster would.
    view = view_of(node("p1", free=(2, 3, 6, 7), block="x"), node("p2", free=(2, 3, 6, 7), block="x"))
    taken = fit(view, gpus=2, nodes=2)
    assert free_gpus(view) == {"p1": (6, 7), "p2": (6, 7)}
    view.undo(taken)
    assert free_gpus(view) == {"p1": (2, 3, 6, 7), "p2": (2, 3, 6, 7)}


def test_a_gang_whose_ranks_require_one_island_takes_only_nodes_with_one_free_or_is_held():
    ask = {"gpus": 4, "nodes": 2, "topology": {"level": "nvlink", "mode": "required"}}
    # Two NVSwitch nodes with 4 free each, and one of NVLink pairs that best fit would take first.
    units = [node("s1", free=(0, 1, 2, 3), topology=SWITCH), node("s2", free=(4, 5, 6, 7), topology=SWITCH)]
    units.append(node("p1", free=(0, 1, 2, 3)))  # no island of 4
    assert fit(view_of(*units), **ask).placement.nodes == ("s1", "s2")
    held = fit(view_of(node("p1"), node("p2")), **ask)
    assert held.never
    assert (
        held.reason == "needs 4 GPUs in one NVLink island; no node of slurm-a has an NVLink island of more than 2 GPUs"
    )


# -- reservations and preemption fit through the same rules --------------------------------


def test_a_reservation_for_a_gang_that_requires_one_block_holds_nodes_of_one_block():
    # Everything busy; a's nodes free soonest one by one, b's all at once a little later.
    units = blocks({"a": 2, "b": 2}, busy={"a-1": 8, "a-2": 8, "b-1": 8, "b-2": 8})
    units += [node("c-1", free=(), topology=SWITCH, block="c")]
    running = {
        ("slurm-a", "a-1"): [(8, NOW + timedelta(minutes=10))],
        ("slurm-a", "c-1"): [(8, NOW + timedelta(minutes=20))],
        ("slurm-a", "a-2"): [(8, NOW + timedelta(hours=3))],
        ("slurm-a", "b-1"): [(8, NOW + timedelta(hours=1))],
        ("slurm-a", "b-2"): [(8, NOW + timedelta(hours=1))],
    }
    ask = {"gpus": 8, "nodes": 2, "time_limit": "1h"}
    for topology, nodes in (
        (None, ("a-1", "c-1")),
        ({"level": "block", "mode": "required"}, ("b-1", "b-2")),
    ):
        book = Reservations(timedelta(minutes=10), NOW, {}, running)
        job = Job(**ask, **({"topology": topology} if topology else {}))
        outcome = decide(view_of(*units), job, book)
        assert isinstance(outcome, Waiting)
        assert book.held[job.job_id].nodes == nodes


def test_preemption_for_a_gang_that_requires_one_block_frees_nodes_of_one_block():
    # a-1 and b-1 run work that loses least; a-2 and b-2 lose more; only a-1 with b-1 spans blocks.
    def running(job_id: int, name: str, minutes: int) -> Running:
        placement = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 8, 8.0, node=name, gpu_model=A100)
        return Running(job_id, "ml", 0, True, NOW - timedelta(minutes=minutes), None, placement=placement)

    victims = [running(1, "a-1", 1), running(2, "b-1", 1), running(3, "a-2", 50), running(4, "b-2", 60)]
    for topology, expected in ((None, [1, 2]), ({"level": "block", "mode": "required"}, [1, 3])):
        view = view_of(*blocks({"a": 2, "b": 2}, busy={"a-1": 8, "a-2": 8, "b-1": 8, "b-2": 8}))
        decisions = CycleDecisions(POLICY, view, FairShare({}, {}))
        job = Job(100, gpus=8, nodes=2, **({"topology": topology} if topology else {}))
        blocked = [Blocked(Asking(100, "ml", 10), job, decisions.routing(job.asked, job.tenant).routes)]
        chosen = Planner(victims, terms=Terms(), share_gap={}, now=NOW).plan(blocked, decisions)
        assert [sorted(v.job_id for v in choice.victims) for _item, choice in chosen] == [expected]


def test_a_placed_gang_in_one_block_through_the_decision():
    outcome = decide(view_of(*blocks({"a": 3, "b": 4})), Job(gpus=8, nodes=4))
    assert isinstance(outcome, Placed) and outcome.placement.nodes[0] == "b-1"


def test_a_required_gpu_level_where_gpush_does_not_keep_it_is_held_not_ignored():
    # MIG slices: gpush places them by profile, not by island.
    mig = CapacityUnit(
        "slurm-a", "m", Sharing.SLURM_MIG, A100, 10.0, 7, 0, 1 / 7, mig_profile="1g.10gb", gpus=(0,),
        gpu_topology=PAIRS,
    )  # fmt: skip
    view = CapacityView.build({"slurm-a": [mig]})
    spec = Job(gpus=2, isolation="hardware", gpu_memory_gb=10, topology={"level": "nvlink", "mode": "required"}).spec
    held = view.fit(spec, "slurm-a", Sharing.SLURM_MIG)
    assert isinstance(held, NoFit) and held.never
    assert held.reason.startswith("requires its 2 GPUs in one NVLink island, which gpush keeps for whole GPUs, not")
    # Elastic replicas of whole GPUs: each replica's GPUs are not kept on one island.
    elastic = fit(
        view_of(node("a")), kind="inference", isolation="exclusive", gpus=2, elastic={"min_replicas": 2,
        "max_replicas": 4}, image="serve", topology="nvlink:required",
    )  # fmt: skip
    assert isinstance(elastic, NoFit) and elastic.never and "each of its 2 replicas" in elastic.reason
    # Preferred, or one GPU (always within one island): placed.
    assert isinstance(view.fit(spec.model_copy(update={"topology": None}), "slurm-a", Sharing.SLURM_MIG), Fit)
