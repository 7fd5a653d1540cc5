"""Fragmentation-aware placement on every kind of demand (issue 17): GPU models, first
fit, CPU-only tasks, and joint placement of a window of arrivals."""

from __future__ import annotations

import pytest

from broker.placement.fgd import TaskShape, WorkloadDistribution
from broker.placement.fragmentation import SharedGpuNodes, SharedNode
from broker.simulation.inflation import (
    CpuTask,
    inflate,
    inflation_arrivals,
    inflation_experiment,
    offline_best_fit,
    windows,
)


def test_a_pinned_task_lands_only_on_its_models_under_every_rule():
    nodes = [SharedNode("a", 2, model="T4"), SharedNode("b", 2, model="G2")]
    workload = WorkloadDistribution.of([TaskShape(1000), TaskShape(1000, models=("G2",))])
    for placement in ("fgd", "best-fit", "first-fit"):
        cluster = SharedGpuNodes(nodes, placement=placement, distribution=workload)
        slots = [cluster.place(TaskShape(1000, models=("G2",))) for _ in range(3)]
        assert [s and cluster.nodes[s.node].name for s in slots] == ["b", "b", None], placement


def test_work_that_may_run_anywhere_keeps_off_the_model_pinned_work_needs():
    # Half of the demand is pinned to the scarce T4 (2 of 6 GPUs): an unpinned task goes
    # to G2 even though T4 is listed first, and the pinned ones still find their GPUs.
    nodes = [SharedNode("t4", 2, model="T4"), SharedNode("g2", 4, model="G2")]
    workload = WorkloadDistribution.of([TaskShape(1000), TaskShape(1000, models=("T4",))])
    cluster = SharedGpuNodes(nodes, placement="fgd", distribution=workload)
    unpinned = [cluster.place(TaskShape(1000)) for _ in range(4)]
    assert {cluster.nodes[s.node].name for s in unpinned} == {"g2"}
    assert all(cluster.place(TaskShape(1000, models=("T4",))) is not None for _ in range(2))


def test_the_pressure_on_a_pinned_for_model_rises_as_it_fills_faster_than_the_cluster():
    nodes = [SharedNode("t4", 2, model="T4"), SharedNode("g2", 6, model="G2")]
    workload = WorkloadDistribution.of([TaskShape(1000)] * 3 + [TaskShape(1000, models=("T4",))])
    cluster = SharedGpuNodes(nodes, placement="fgd", distribution=workload)
    before = cluster._avoidance()
    assert before[1] == 0 and before[0] > 0  # nothing is pinned to G2
    cluster.place(TaskShape(1000, models=("T4",)))
    assert cluster._avoidance()[0] > before[0]  # T4 half full, the cluster an eighth
    assert SharedGpuNodes(nodes, placement="fgd", distribution=workload, pinned_avoidance=0)._avoidance().sum() == 0


def test_first_fit_takes_the_first_node_and_the_first_gpus_with_room():
    nodes = [SharedNode("a", 4), SharedNode("b", 4)]
    cluster = SharedGpuNodes(nodes, placement="first-fit")
    assert cluster.place(TaskShape(300)).gpus == (0,)
    assert cluster.place(TaskShape(800)).gpus == (1,)
    slot = cluster.place(TaskShape(1000, 2))
    assert (slot.node, slot.gpus) == (0, (2, 3))
    assert cluster.place(TaskShape(1000, 2)).node == 1


def test_a_cpu_only_task_goes_where_it_strands_no_gpu():
    # GPU tasks need 8 cores. Node a has its GPU taken: CPU there serves only CPU work.
    workload = WorkloadDistribution.of([TaskShape(1000, 1, 8000)])
    nodes = [SharedNode("a", 1, cpu_milli=16000), SharedNode("b", 1, cpu_milli=16000)]
    cluster = SharedGpuNodes(nodes, placement="fgd", distribution=workload)
    cluster.place(TaskShape(1000, 1, 8000))  # takes a's GPU (both equal: the first)
    assert cluster.place_cpu(8000) == 0
    # a is full now: the next one can only go to b, and b's GPU still takes a GPU task beside it.
    assert cluster.place_cpu(8000) == 1
    assert cluster.place(TaskShape(1000, 1, 8000)).node == 1
    cluster.release_cpu(0, 8000)
    assert cluster.state(0).cpu_free == 8000


def test_cpu_only_tasks_count_in_the_inflation_experiment_but_not_as_gpu_demand():
    nodes = [SharedNode(f"n{i}", 2, cpu_milli=16000) for i in range(4)]
    tasks = [TaskShape(1000, 1, 4000)] * 6 + [CpuTask(4000)] * 2
    arrivals = inflation_arrivals(tasks, seed=1, capacity_milli=8000)
    assert any(isinstance(t, CpuTask) for t in arrivals)
    result = inflation_experiment(nodes, tasks, seeds=[1, 2])
    assert result["cpu_only_tasks"] == 2 and result["tasks"] == 8
    assert set(result["medians"]) >= {"gpush (fgd)", "gpush (fgd, joint)", "gpush (first-fit)"}


def test_offline_best_fit_knows_every_arrival_and_ignores_cpu():
    # Two 1-GPU nodes with 4 cores. Online, the 0.4 and the 0.6 each take a node's CPU
    # and the 0.8 finds no GPU with room; offline best fit places 0.8 + 0.2 on one GPU and
    # 0.6 + 0.4 on the other: all of it. What came after 100% arrived is not counted.
    nodes = [SharedNode("a", 1, cpu_milli=4000), SharedNode("b", 1, cpu_milli=4000)]
    arrivals = [TaskShape(400, 1, 4000), TaskShape(600, 1, 4000), TaskShape(800), TaskShape(200), TaskShape(1000)]
    assert offline_best_fit(nodes, arrivals) == 1.0
    assert inflate(nodes, arrivals, placement="best-fit", distribution=None).at_full < 1.0
    # Pinned work keeps its models.
    pinned = [SharedNode("a", 1, model="A100"), SharedNode("b", 1, model="T4")]
    assert offline_best_fit(pinned, [TaskShape(1000, models=("A100",))] * 2) == 0.5
    result = inflation_experiment(nodes, arrivals, seeds=[1], offline=True)
    assert 0 < result["offline_best_fit"] <= 1.0


def test_joint_windows_end_where_the_arrived_demand_reaches_the_capacity():
    tasks = [TaskShape(1000)] * 10
    cut = windows(tasks, 4, capacity_milli=6000)
    assert [len(w) for w in cut] == [4, 2, 4]  # the second ends at the 6th task: 6000 arrived


@pytest.mark.parametrize("joint", [0, 256])
def test_joint_placement_places_pinned_and_multi_gpu_work_first_in_a_window(joint):
    # One 2-GPU node and one 1-GPU node; the 2-GPU task comes last. One by one, the two
    # 1-GPU tasks spread and the 2-GPU task fails; jointly it goes first and all fit.
    nodes = [SharedNode("a", 2), SharedNode("b", 1)]
    arrivals = [TaskShape(500), TaskShape(500), TaskShape(1000, 2)]
    workload = WorkloadDistribution.of(arrivals)
    run = inflate(nodes, arrivals, placement="first-fit", distribution=workload, joint=joint)
    assert run.joint == joint
    assert run.failed == (0 if joint else 1)


def test_work_only_some_node_kinds_can_hold_by_size_weighs_on_those_kinds():
    # Eight-GPU tasks that need 120 cores fit only the 128-core nodes: a one-GPU task
    # pays to land there, and more so as those nodes fill faster than the rest.
    nodes = [SharedNode("big", 8, model="G3", cpu_milli=128000), SharedNode("g2", 8, model="G2", cpu_milli=96000)]
    workload = WorkloadDistribution.of([TaskShape(1000, 1, 4000)] * 3 + [TaskShape(1000, 8, 120000)])
    cluster = SharedGpuNodes(nodes, placement="fgd", distribution=workload)
    cost = cluster._size_avoidance(TaskShape(1000, 1, 4000))
    assert cost[0] > 0 and cost[1] == 0
    assert cluster._size_avoidance(TaskShape(1000, 8, 120000)).sum() == 0  # it is what is protected
    slot = cluster.place(TaskShape(1000, 1, 4000))
    assert cluster.nodes[slot.node].name == "g2"
    assert cluster.place(TaskShape(1000, 8, 120000)) is not None
    assert SharedGpuNodes(nodes, placement="fgd", distribution=workload, size_avoidance=0)._restricted == {}
