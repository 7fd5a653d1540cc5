"""The free-capacity view a scheduling cycle fits jobs onto: GPU models on routes, MPS
shares and time-slice replicas per physical GPU, fragmentation-aware placement of
them, the time-slicing memory guard, and what take and give_back charge."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from broker.core.adapter import BackendState, CapacityUnit, Placement, Sharing
from broker.core.schemas import JobSpec
from broker.placement.capacity import CapacityView, Fit, NoFit
from broker.placement.fgd import NodeState, TaskShape, WorkloadDistribution, best_fit, choose, single_gpu
from broker.simulation.cluster import SimulatedCluster
from broker.simulation.fleet import load_fleet

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
DEMO_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"


def frozen() -> datetime:
    """The simulators' clock: time stands still, so every job runs."""
    return T0


def job(**fields) -> JobSpec:
    return JobSpec.model_validate({"kind": "inference", "command": ["python", "serve.py"], **fields})


def whole(node: str, count: int, model: str, allocated: int = 0, cluster: str = "slurm-a") -> CapacityUnit:
    return CapacityUnit(
        cluster, node, Sharing.SLURM_EXCLUSIVE, model, 80.0, count, allocated, 1.0, gpus=tuple(range(count))
    )


def mig(node: str, profile: str, count: int, model: str, memory: float, allocated: int = 0) -> CapacityUnit:
    return CapacityUnit(
        "slurm-a",
        node,
        Sharing.SLURM_MIG,
        model,
        memory,
        count,
        allocated,
        1 / 7,
        mig_profile=profile,
        in_mig_mode=True,
    )


def mps_gpu(node: str, index: int, allocated: int = 0, model: str = "A100-SXM4-40GB") -> CapacityUnit:
    """One MPS GPU, as an adapter that knows per-GPU counts reports it."""
    return CapacityUnit(
        "slurm-a", node, Sharing.SLURM_MPS, model, 0.4, 100, allocated, 0.01, gpus=(index,), gpu_memory_gb=40.0
    )


def ts_gpu(node: str, index: int, allocated: int = 0, memory_allocated: float | None = 0.0) -> CapacityUnit:
    """One T4 time-sliced 4 ways, as an adapter that knows per-GPU counts reports it."""
    return CapacityUnit(
        "k8s-a",
        node,
        Sharing.K8S_TIMESLICE,
        "T4",
        16.0,
        4,
        allocated,
        0.25,
        gpus=(index,),
        gpu_memory_gb=16.0,
        memory_allocated_gb=memory_allocated,
    )


def state(view: CapacityView) -> dict:
    """Every slot's free units and free memory, by (cluster, sharing, node, GPUs, model, profile)."""
    return {
        (c, s.value, slot.unit.node, slot.unit.gpus, slot.unit.gpu_model, slot.unit.mig_profile): (
            slot.free,
            None if slot.memory_free_gb is None else round(slot.memory_free_gb, 9),
        )
        for c, by_sharing in view.slots.items()
        for s, slots in by_sharing.items()
        for slot in slots
    }


# -- GPU models on routes ------------------------------------------------------------------


def test_an_h100_route_never_lands_on_an_a100_unit() -> None:
    view = CapacityView.build(
        {"slurm-a": [whole("a100-01", 8, "A100-SXM4-80GB"), whole("h100-01", 4, "H100-SXM5-80GB", allocated=2)]}
    )
    two = job(kind="training", gpus=2)
    placed = view.fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE, gpu_model="H100")  # an alias names the model too
    assert isinstance(placed, Fit)
    assert (placed.placement.node, placed.placement.gpu_model) == ("h100-01", "H100-SXM5-80GB")
    # The H100s are full now; eight A100s are free, and still the job waits for an H100.
    waiting = view.fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE, gpu_model="H100-SXM5-80GB")
    assert isinstance(waiting, NoFit) and not waiting.never
    assert waiting.reason == "waiting for 2 whole H100-SXM5-80GB GPUs on slurm-a (0 of 4 free)"
    # Jobs waiting for different models are counted apart.
    assert waiting.waiting_for == ("slurm-a", "slurm/exclusive", None, "H100-SXM5-80GB")
    anything = view.fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE)
    assert isinstance(anything, Fit) and anything.placement.node == "a100-01"


@pytest.mark.parametrize(
    ("asked", "reason"),
    [
        (
            {"gpus": 1, "gpu_memory_gb": 200},
            "needs 1 whole GPU with 200 GB; no GPU of slurm-a has 200 GB (the most: 80 GB)",
        ),
        ({"gpus": 100}, "needs 100 whole GPUs on one node; no node of slurm-a has more than 8 GPUs"),
        (
            {"gpus": 5, "gpu_memory_gb": 60},
            "needs 5 whole GPUs with 60 GB on one node; no node of slurm-a has more than 4 GPUs with 60 GB",
        ),
    ],
)
def test_a_job_that_can_never_fit_says_what_is_missing_in_the_clusters_terms(asked, reason) -> None:
    a100s = replace(whole("a100-01", 8, "A100-SXM4-40GB"), unit_memory_gb=40.0)
    view = CapacityView.build({"slurm-a": [a100s, whole("h100-01", 4, "H100-SXM5-80GB")]})
    fit = view.fit(job(kind="training", isolation="exclusive", **asked), "slurm-a", Sharing.SLURM_EXCLUSIVE)
    assert isinstance(fit, NoFit) and fit.never
    assert fit.reason == reason


def test_a_job_for_any_model_keeps_off_a_model_that_waiting_pinned_jobs_need() -> None:
    # The H100 node is the best fit for two GPUs (2 free), the A100 node has 8. Last
    # cycle, jobs routed to H100s waited for 2 of them: a job that may run anywhere now
    # leaves those two to them, and takes them only when nothing else fits.
    inventory = {"slurm-a": [whole("a100-01", 8, "A100-SXM4-80GB"), whole("h100-01", 4, "H100-SXM5-80GB", allocated=2)]}
    two = job(kind="training", gpus=2)
    assert CapacityView.build(inventory).fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE).placement.node == "h100-01"

    view = CapacityView.build(inventory)
    view.pinned = {("slurm-a", "H100-SXM5-80GB"): 2}
    assert view.fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE).placement.node == "a100-01"
    pinned = view.fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE, gpu_model="H100")
    assert isinstance(pinned, Fit) and pinned.placement.node == "h100-01"
    # Fewer waiting than free: the model is not spoken for, best fit as before.
    view = CapacityView.build(inventory)
    view.pinned = {("slurm-a", "H100-SXM5-80GB"): 1}
    assert view.fit(two, "slurm-a", Sharing.SLURM_EXCLUSIVE).placement.node == "h100-01"


def test_the_decision_counts_what_pinned_jobs_wait_for() -> None:
    from broker.placement.decision import CycleDecisions, Waiting
    from broker.placement.fairshare import FairShare
    from broker.routing.policy import load_policy

    policy = load_policy(
        "rules:\n"
        "  - name: h100\n    match: {labels: {want: h100}}\n"
        "    route: {cluster: slurm-a, sharing: slurm/exclusive, gpu_model: H100}\n"
        "  - name: rest\n    match: {}\n    route: {cluster: slurm-a, sharing: slurm/exclusive}\n"
    )
    view = CapacityView.build({"slurm-a": [whole("h100-01", 4, "H100-SXM5-80GB", allocated=4)]})
    decisions = CycleDecisions(policy, view, FairShare({}, {}, {}))

    class Ask:
        tenant = "ml"

        def __init__(self, spec):
            self.spec = self.asked = spec

    outcome = decisions.decide(Ask(job(kind="training", gpus=2, labels={"want": "h100"})))
    assert isinstance(outcome, Waiting)
    decisions.decide(Ask(job(kind="training", gpus=1, labels={"want": "h100"})))
    decisions.decide(Ask(job(kind="training", gpus=1)))  # not pinned: not counted
    assert dict(decisions.pinned_waiting) == {("slurm-a", "H100-SXM5-80GB"): 3}


def test_a_mig_route_with_a_model_names_it_in_its_reasons() -> None:
    view = CapacityView.build(
        {
            "slurm-a": [
                mig("mig-80", "1g.10gb", 7, "A100-SXM4-80GB", 10.0, allocated=7),
                mig("mig-40", "1g.5gb", 7, "A100-SXM4-40GB", 5.0),
            ]
        }
    )
    small = job(kind="training", isolation="hardware", gpu_memory_gb=4)
    waiting = view.fit(small, "slurm-a", Sharing.SLURM_MIG, gpu_model="A100-80GB")
    assert isinstance(waiting, NoFit) and not waiting.never
    assert waiting.reason == "waiting for a 1g.10gb slice of A100-SXM4-80GB on slurm-a (0 of 7 free)"
    never = view.fit(small, "slurm-a", Sharing.SLURM_MIG, gpu_model="H100")
    assert isinstance(never, NoFit) and never.never
    assert never.reason == "slurm-a has no H100 GPUs offering slurm/mig"
    placed = view.fit(small, "slurm-a", Sharing.SLURM_MIG)  # no model: the smallest slice that holds it
    assert isinstance(placed, Fit)
    assert (placed.placement.node, placed.placement.mig_profile) == ("mig-40", "1g.5gb")


def test_a_model_gpush_does_not_know_matches_by_exact_name() -> None:
    view = CapacityView.build({"openb": [whole("g1-01", 8, "G1", cluster="openb")]})
    one = job(kind="training", gpus=1)
    assert isinstance(view.fit(one, "openb", Sharing.SLURM_EXCLUSIVE, gpu_model="G1"), Fit)
    assert view.fit(one, "openb", Sharing.SLURM_EXCLUSIVE, gpu_model="g1").never


def test_a_job_only_broken_units_could_hold_waits_for_the_repair_instead_of_being_held() -> None:
    """A drift finding marks the 3g.20gb slices broken: a 20 GB job waits with the finding
    (and is placed once the units are whole again); a job not even they could hold is held."""
    broken = replace(mig("mig01", "3g.20gb", 2, "A100-SXM4-40GB", 20.0), broken="mig01 has no 3g.20gb MIG instance")
    view = CapacityView.build({"slurm-a": [mig("mig01", "1g.5gb", 7, "A100-SXM4-40GB", 5.0), broken]})
    big = job(kind="training", isolation="hardware", gpu_memory_gb=20)
    for _ in range(3):  # more jobs than the broken units hold: each still waits, none is held
        waiting = view.fit(big, "slurm-a", Sharing.SLURM_MIG)
        assert isinstance(waiting, NoFit) and not waiting.never
        assert waiting.reason.startswith("waiting for the 3g.20gb units of slurm-a marked broken to be repaired")
        assert "mig01 has no 3g.20gb MIG instance" in waiting.reason
        assert waiting.waiting_for == ("slurm-a", "slurm/mig", "3g.20gb", None)
    huge = view.fit(job(kind="training", isolation="hardware", gpu_memory_gb=40), "slurm-a", Sharing.SLURM_MIG)
    assert isinstance(huge, NoFit) and huge.never and "largest: 1g.5gb" in huge.reason
    assert isinstance(
        view.fit(job(kind="training", isolation="hardware", gpu_memory_gb=4), "slurm-a", Sharing.SLURM_MIG), Fit
    )
    mended = CapacityView.build({"slurm-a": [replace(broken, broken=None)]})
    assert isinstance(mended.fit(big, "slurm-a", Sharing.SLURM_MIG), Fit)


def test_take_and_give_back_charge_the_unit_of_the_placements_model() -> None:
    # One node with whole GPUs of two models: the placement says which it holds.
    units = [whole("mixed", 4, "A100-SXM4-80GB"), whole("mixed", 4, "H100-SXM5-80GB")]
    view = CapacityView.build({"slurm-a": units})
    before = state(view)
    h100 = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 3, 3.0, node="mixed", gpu_model="H100-SXM5-80GB")
    view.take(h100)
    frees = {key[4]: free for key, (free, _) in state(view).items()}
    assert frees == {"A100-SXM4-80GB": 4, "H100-SXM5-80GB": 1}
    view.give_back(h100)
    assert state(view) == before
    # A placement of a model the node does not have charges nothing (not "any unit with room").
    view.take(replace(h100, gpu_model="A30"))
    assert state(view) == before


# -- per physical GPU: take and give back ----------------------------------------------------


def shared_inventory() -> dict[str, list[CapacityUnit]]:
    return {
        "slurm-a": [mps_gpu("mps-01", 0, 30), mps_gpu("mps-01", 1), mps_gpu("mps-02", 0, 95), mps_gpu("mps-02", 1)],
        "k8s-a": [ts_gpu("t4-01", i, allocated=a, memory_allocated=3.0 * a) for i, a in enumerate((1, 0, 3, 0))],
    }


SHARED_JOBS = [
    ("slurm-a", Sharing.SLURM_MPS, job(isolation="process", gpu_memory_gb=2)),  # 5%
    ("slurm-a", Sharing.SLURM_MPS, job(isolation="process", gpu_memory_gb=10)),  # 25%
    ("slurm-a", Sharing.SLURM_MPS, job(isolation="process", gpu_memory_gb=24)),  # 60%
    ("k8s-a", Sharing.K8S_TIMESLICE, job(isolation="none", gpu_memory_gb=4)),
    (
        "k8s-a",
        Sharing.K8S_TIMESLICE,
        job(isolation="none", gpu_memory_gb=3, elastic={"min_replicas": 3, "max_replicas": 6}),
    ),
    ("slurm-a", Sharing.SLURM_MPS, job(isolation="process", gpu_memory_gb=4)),  # 10%
]


def fit_all(view: CapacityView) -> list[Placement]:
    placements = []
    for cluster, sharing, spec in SHARED_JOBS:
        fit = view.fit(spec, cluster, sharing)
        assert isinstance(fit, Fit), fit
        placements.append(fit.placement)
    return placements


def test_each_share_and_replica_is_placed_on_a_named_gpu() -> None:
    view = CapacityView.build(shared_inventory())
    for placement in fit_all(view):
        assert placement.node is not None
        assert len(placement.gpus) == placement.replicas
        holds = {(s.unit.node, s.unit.gpus[0]) for s in view.slots[placement.cluster][placement.sharing]}
        assert all((placement.node, gpu) in holds for gpu in placement.gpus)


def test_give_back_returns_exactly_what_fits_took_gpu_by_gpu() -> None:
    view = CapacityView.build(shared_inventory())
    before, total = state(view), view.free_gpu_equivalents()
    placements = fit_all(view)
    assert state(view) != before
    for placement in reversed(placements):
        view.give_back(placement)
    assert state(view) == before
    assert view.free_gpu_equivalents() == pytest.approx(total, abs=1e-12)


def test_give_back_node_by_node_as_a_replay_does_returns_exactly_too() -> None:
    view = CapacityView.build(shared_inventory())
    before = state(view)
    placements = fit_all(view)
    assert any(p.replicas > 1 for p in placements)
    for placement in placements:
        # One replica at a time, on its node, as broker.simulation.replay gives back what a job held.
        for _ in range(placement.replicas):
            view.give_back(replace(placement, replicas=1))
    assert state(view) == before


def test_take_charges_the_gpus_a_fit_chose() -> None:
    # Placements not started yet are taken again by the next cycle's view: on the same GPUs.
    fitted = CapacityView.build(shared_inventory())
    placements = fit_all(fitted)
    rebuilt = CapacityView.build(shared_inventory(), [Placement.from_dict(p.to_dict()) for p in placements])
    assert state(rebuilt) == state(fitted)


def test_replicas_go_to_one_node_when_one_holds_them_all() -> None:
    # t4-01 has 2 replicas left, t4-02 has 8: three replicas land together on t4-02.
    units = [ts_gpu("t4-01", 0, allocated=4), ts_gpu("t4-01", 1, allocated=2), ts_gpu("t4-02", 0), ts_gpu("t4-02", 1)]
    view = CapacityView.build({"k8s-a": units})
    three = job(isolation="none", gpu_memory_gb=2, elastic={"min_replicas": 3, "max_replicas": 6})
    fit = view.fit(three, "k8s-a", Sharing.K8S_TIMESLICE)
    assert isinstance(fit, Fit)
    assert (fit.placement.node, fit.placement.replicas, len(fit.placement.gpus)) == ("t4-02", 3, 3)


def test_replicas_no_node_holds_spread_over_nodes_and_come_back_exactly() -> None:
    units = [ts_gpu("t4-01", 0, allocated=2), ts_gpu("t4-02", 0, allocated=2)]
    view = CapacityView.build({"k8s-a": units})
    before = state(view)
    three = job(isolation="none", gpu_memory_gb=2, elastic={"min_replicas": 3, "max_replicas": 6})
    fit = view.fit(three, "k8s-a", Sharing.K8S_TIMESLICE)
    assert isinstance(fit, Fit)
    assert (fit.placement.node, fit.placement.gpus) == (None, ())  # the cluster cannot be told where
    assert sum(free for free, _ in state(view).values()) == 1
    view.give_back(fit.placement)
    assert state(view) == before


# -- fragmentation-aware placement of shares ------------------------------------------------------


def test_fgd_keeps_a_whole_gpu_free_where_best_fit_by_node_would_break_it() -> None:
    """mps-01 has two MPS GPUs; GPU 1 already holds a 70% share. A 25% job fits either GPU.
    Fitted by node (the old per-node inventory), the placement names no GPU and the
    cluster takes the lowest-indexed one with room: GPU 0 is broken, and a job that
    needs a whole GPU waits in the cluster although the node has 105% free. Fitted per
    GPU, FGD names GPU 1, and GPU 0 stays whole for it."""
    fleet = load_fleet(
        "clusters:\n  slurm-a:\n    flavor: slurm\n    nodes:\n"
        "      - {name: mps-01, gpus: [{model: A100-SXM4-40GB, mps: true, count: 2}]}\n",
        "fleet.yaml",
    )
    quarter = job(isolation="process", gpu_memory_gb=10)  # 25% of a 40 GB A100
    full = job(isolation="process", gpu_memory_gb=40)  # all of one

    def run(inventory) -> tuple[Placement, BackendState]:
        sim = SimulatedCluster.from_fleet(fleet, "slurm-a", clock=frozen)
        busy = Placement("slurm-a", Sharing.SLURM_MPS, 70, 0.7, node="mps-01", gpus=(1,))
        sim.submit(1, job(isolation="process", gpu_memory_gb=28), busy)
        placements = []
        for job_id, spec in ((2, quarter), (3, full)):
            fit = CapacityView.build({"slurm-a": inventory(sim)}).fit(spec, "slurm-a", Sharing.SLURM_MPS)
            assert isinstance(fit, Fit)
            sim.submit(job_id, spec, fit.placement)
            placements.append(fit.placement)
        return placements[0], sim.find(3).state

    by_node, full_job = run(lambda sim: per_node(sim.inventory()))
    assert (by_node.node, by_node.gpus) == ("mps-01", ())
    assert full_job is BackendState.PENDING  # 75% left on GPU 0, 30% on GPU 1
    by_gpu, full_job = run(lambda sim: sim.inventory())
    assert (by_gpu.node, by_gpu.gpus) == ("mps-01", (1,))
    assert full_job is BackendState.RUNNING


def per_node(units: list[CapacityUnit]) -> list[CapacityUnit]:
    """Per-GPU MPS units folded into one per node, as an adapter with per-node counts reports them."""
    merged: dict[str, CapacityUnit] = {}
    for unit in units:
        seen = merged.get(unit.node)
        if seen is None:
            merged[unit.node] = unit
        else:
            merged[unit.node] = replace(
                seen,
                capacity=seen.capacity + unit.capacity,
                allocated=seen.allocated + unit.allocated,
                gpus=seen.gpus + unit.gpus,
            )
    return list(merged.values())


def test_fgd_takes_the_half_gpu_that_fits_exactly_where_best_fit_strands_a_sliver() -> None:
    # a: 60% free on one GPU (the fullest node); b: one idle GPU and one half-free GPU.
    units = [mps_gpu("a", 0, 40), mps_gpu("a", 1, 100), mps_gpu("b", 0), mps_gpu("b", 1, 50)]
    half = job(isolation="process", gpu_memory_gb=20)
    states = [NodeState("a", (600, 0)), NodeState("b", (1000, 500))]
    assert best_fit(states, TaskShape(500)).node.name == "a"  # leaves 10% no job can use
    fit = CapacityView.build({"slurm-a": units}).fit(half, "slurm-a", Sharing.SLURM_MPS)
    assert isinstance(fit, Fit) and (fit.placement.node, fit.placement.gpus) == ("b", (1,))


@pytest.mark.parametrize("seed", range(6))
def test_the_view_chooses_as_fgd_over_every_node_would(seed: int) -> None:
    """The view scores one GPU per free level, not every node: on random fleets its
    choices are those of broker.placement.fgd.choose over all nodes."""
    rng = random.Random(seed)
    workload = WorkloadDistribution(
        (TaskShape(50), TaskShape(100), TaskShape(250), TaskShape(500), TaskShape(1000)), (0.3, 0.3, 0.2, 0.1, 0.1)
    )
    nodes = [f"mps-{i:02d}" for i in range(12)]
    free = {(n, g): 100 - 5 * rng.randint(0, 20) for n in nodes for g in range(4)}
    units = [mps_gpu(n, g, 100 - free[(n, g)]) for n in nodes for g in range(4)]
    view = CapacityView.build({"slurm-a": units}, workload=workload)
    measure = single_gpu(workload)
    for _ in range(200):
        share = rng.choice((5, 10, 25, 50))
        spec = job(isolation="process", gpu_memory_gb=share * 0.4)
        states = [NodeState(n, tuple(10 * free[(n, g)] for g in range(4))) for n in nodes]
        expected = choose(states, TaskShape(10 * share), measure)
        fit = view.fit(spec, "slurm-a", Sharing.SLURM_MPS)
        if expected is None:
            assert isinstance(fit, NoFit)
            continue
        assert isinstance(fit, Fit)
        assert (fit.placement.node, fit.placement.gpus) == (expected.node.name, expected.gpus)
        free[(fit.placement.node, fit.placement.gpus[0])] -= share
        if rng.random() < 0.3:  # jobs end too
            view.give_back(fit.placement)
            free[(fit.placement.node, fit.placement.gpus[0])] += share


# -- the time-slicing memory guard, per GPU ----------------------------------------------------------


def test_two_10_gb_jobs_never_share_a_16_gb_time_sliced_gpu() -> None:
    ten = job(isolation="none", gpu_memory_gb=10)
    view = CapacityView.build({"k8s-a": [ts_gpu("t4-01", 0), ts_gpu("t4-01", 1)]})
    first = view.fit(ten, "k8s-a", Sharing.K8S_TIMESLICE)
    second = view.fit(ten, "k8s-a", Sharing.K8S_TIMESLICE)
    assert isinstance(first, Fit) and isinstance(second, Fit)
    assert {first.placement.gpus, second.placement.gpus} == {(0,), (1,)}
    # Both GPUs have replicas left, but not 10 GB: the third waits.
    third = view.fit(ten, "k8s-a", Sharing.K8S_TIMESLICE)
    assert isinstance(third, NoFit) and not third.never
    assert "GPU memory is not over-committed" in third.reason
    # A small job still fits beside either of them.
    assert isinstance(view.fit(job(isolation="none", gpu_memory_gb=6), "k8s-a", Sharing.K8S_TIMESLICE), Fit)


def test_the_memory_a_cluster_reports_per_gpu_guards_the_next_cycle() -> None:
    # A fresh view from the simulator's inventory: its running 10 GB job sits on one GPU.
    sim = SimulatedCluster("k8s-a", {"fleet": str(DEMO_FLEET)}, clock=frozen)
    ten = job(isolation="none", gpu_memory_gb=10, labels={"sim-duration": "600"})
    for job_id in (1, 2):
        view = CapacityView.build({"k8s-a": sim.inventory()})
        fit = view.fit(ten, "k8s-a", Sharing.K8S_TIMESLICE)
        assert isinstance(fit, Fit)
        sim.submit(job_id, ten, fit.placement)
    assert [sim.find(j).state for j in (1, 2)] == [BackendState.RUNNING] * 2  # no OOM kill
    on = {(u.node, u.gpus) for u in sim.inventory() if u.sharing is Sharing.K8S_TIMESLICE and u.allocated}
    assert len(on) == 2


def test_a_per_node_memory_figure_is_spread_over_the_gpus_holding_replicas() -> None:
    # The cluster does not report memory per GPU; the broker's own figure is per node
    # (10 GB of time-sliced jobs on t4-01), and only GPU 0 has a replica allocated.
    units = [replace(ts_gpu("t4-01", 0, allocated=1), memory_allocated_gb=None)]
    units.append(replace(ts_gpu("t4-01", 1), memory_allocated_gb=None))
    view = CapacityView.build({"k8s-a": units}, timeslice_memory_used={("k8s-a", "t4-01"): 10.0})
    fit = view.fit(job(isolation="none", gpu_memory_gb=10), "k8s-a", Sharing.K8S_TIMESLICE)
    assert isinstance(fit, Fit) and fit.placement.gpus == (1,)


def test_a_placement_not_started_yet_is_charged_to_its_gpu_once() -> None:
    # The scheduler's per-node figure counts the job it placed but the cluster has not
    # started; the view charges that job to its own GPU, not twice.
    units = [replace(ts_gpu("t4-01", i), memory_allocated_gb=None) for i in range(2)]
    pending = Placement("k8s-a", Sharing.K8S_TIMESLICE, 1, 0.25, node="t4-01", gpu_memory_gb=10.0, gpus=(0,))
    view = CapacityView.build({"k8s-a": units}, [pending], {("k8s-a", "t4-01"): 10.0})
    memory = {slot.unit.gpus: slot.memory_free_gb for slot in view.slots["k8s-a"][Sharing.K8S_TIMESLICE]}
    assert memory == {(0,): 6.0, (1,): 16.0}


# -- per-node units, from adapters that know no more ---------------------------------------------------


def test_per_node_units_are_still_fitted_by_node() -> None:
    mps = CapacityUnit(
        "slurm-a", "mps-01", Sharing.SLURM_MPS, "A100-SXM4-40GB", 0.4, 200, 150, 0.01, gpus=(0, 1), gpu_memory_gb=40.0
    )
    replicas = CapacityUnit(
        "k8s-a", "t4-01", Sharing.K8S_TIMESLICE, "T4", 16.0, 16, 0, 0.25, gpus=(0, 1, 2, 3), gpu_memory_gb=16.0
    )
    view = CapacityView.build({"slurm-a": [mps], "k8s-a": [replicas]}, timeslice_memory_used={("k8s-a", "t4-01"): 40.0})
    before = state(view)
    share = view.fit(job(isolation="process", gpu_memory_gb=8), "slurm-a", Sharing.SLURM_MPS)
    assert isinstance(share, Fit)
    assert (share.placement.node, share.placement.units, share.placement.gpus) == ("mps-01", 20, ())
    assert isinstance(view.fit(job(isolation="process", gpu_memory_gb=16), "slurm-a", Sharing.SLURM_MPS), NoFit)
    # 64 GB on the node, 40 GB in use: two 10 GB jobs fit, a third would over-commit it.
    ten = job(isolation="none", gpu_memory_gb=10)
    fits = [view.fit(ten, "k8s-a", Sharing.K8S_TIMESLICE) for _ in range(3)]
    assert [isinstance(f, Fit) for f in fits] == [True, True, False]
    assert fits[0].placement.gpus == ()
    for fit in (share, *fits[:2]):
        view.give_back(fit.placement)
    assert state(view) == before


# -- placements stored before per-GPU placement ----------------------------------------------------------


def test_a_stored_placement_without_gpus_still_loads() -> None:
    old = {
        "cluster": "k8s-a",
        "sharing": "k8s/timeslice",
        "units": 1,
        "gpu_equivalents": 0.25,
        "node": "t4-01",
        "mig_profile": None,
        "gpu_model": "T4",
        "gpu_memory_gb": 3.0,
        "replicas": 1,
        "partition": None,
    }
    placement = Placement.from_dict(old)
    assert (placement.sharing, placement.node, placement.gpus) == (Sharing.K8S_TIMESLICE, "t4-01", ())
    pinned = replace(placement, gpus=(2,))
    again = Placement.from_dict(pinned.to_dict())  # JSON gives a list back
    assert again == pinned and hash(again) == hash(pinned)


# -- through a scheduling cycle ---------------------------------------------------------------------------

H100_FLEET = """
clusters:
  k8s-x:
    flavor: k8s
    pools:
      - {name: a100, nodes: 1, gpus_per_node: 8, model: A100-SXM4-80GB}
      - {name: h100, nodes: 1, gpus_per_node: 8, model: H100-SXM5-80GB}
"""
H100_POLICY = """
rules:
  - name: training-on-h100
    match: {kind: training}
    route: {cluster: k8s-x, sharing: k8s/exclusive, gpu_model: H100}
"""


def test_a_cycle_keeps_an_h100_route_on_h100s(engine, sessions, clock) -> None:
    from broker.core.auth import Principal
    from broker.core.clusters import AdapterPool, add_cluster
    from broker.core.models import Job
    from broker.core.schemas import Role
    from broker.intake import queue
    from broker.routing.policy import load_policy
    from broker.scheduling.cycle import Scheduler

    admin = Principal(user="root", tenant="ops", role=Role.ADMIN)
    pool = AdapterPool(clock)
    with sessions() as session, session.begin():
        add_cluster(session, name="k8s-x", kind="sim", config={"fleet_yaml": H100_FLEET}, actor="root", now=clock())
    # Given to the cycle directly: the policy store caches parsed policies by version
    # number across databases, so an applied version 1 here would leak into other tests.
    policy = load_policy(H100_POLICY, "h100.yaml")
    spec = JobSpec.model_validate({"kind": "training", "gpus": 4, "command": ["python", "x.py"], "tenant": "ml"})
    with sessions() as session, session.begin():
        ids = [r.job["id"] for r in queue.submit_jobs(session, [spec] * 3, admin, now=clock())]
    report = Scheduler(engine, pool, clock=clock, policy_source=lambda session: policy).run_cycle()
    assert report.errors == []
    with sessions() as session:
        jobs = [session.get(Job, i) for i in ids]
        assert [j.placement["node"] for j in jobs[:2]] == ["h100", "h100"]
        assert all(j.placement["gpu_model"] == "H100-SXM5-80GB" for j in jobs[:2])
        # Eight A100s are free, and the third still waits for an H100.
        assert jobs[2].state == "queued"
        assert jobs[2].state_reason == "waiting for 4 whole H100-SXM5-80GB GPUs on k8s-x (0 of 8 free)"
