"""The allocation bound of the inflation experiment: no placement of the arrivals up to
100% arrived demand allocates more (broker.simulation.packing_bound)."""

from __future__ import annotations

import random

import pytest

from broker.placement.fgd import TaskShape
from broker.placement.fragmentation import SharedNode
from broker.simulation.inflation import (
    INFLATION_VARIANTS,
    CpuTask,
    inflate,
    inflation_arrivals,
    inflation_experiment,
    offline_best_fit,
)
from broker.simulation.packing_bound import allocation_bound


def test_the_bound_is_what_a_trivial_packing_places():
    # Four halves fill two GPUs: every rule places them all, and the bound says so.
    nodes = [SharedNode("a", 1, cpu_milli=8000), SharedNode("b", 1, cpu_milli=8000)]
    arrivals = [TaskShape(500, 1, 1000)] * 4
    assert allocation_bound(nodes, arrivals) == pytest.approx(1.0)
    assert inflate(nodes, arrivals, placement="best-fit", distribution=None).at_full == pytest.approx(1.0)


def test_the_bound_counts_cpu_and_shares_over_half_a_gpu():
    # Three 0.6 shares on one GPU: only one fits (two shares over half never share a GPU).
    assert allocation_bound([SharedNode("a", 1)], [TaskShape(600)] * 3) == pytest.approx(0.6)
    # Each task takes the node's 4 cores: one task a node, whatever the GPUs have free.
    nodes = [SharedNode("a", 1, cpu_milli=4000), SharedNode("b", 1, cpu_milli=4000)]
    arrivals = [TaskShape(400, 1, 4000), TaskShape(600, 1, 4000), TaskShape(800, 1, 4000), TaskShape(200, 1, 4000)]
    assert allocation_bound(nodes, arrivals) == pytest.approx(0.7)  # the 0.8 and the 0.6
    # Offline best fit ignores CPU: it reads 1.0 here, more than any placement can do.
    assert offline_best_fit(nodes, arrivals) == pytest.approx(1.0)
    # Pinned work keeps its models; a task too big for every node places nothing.
    pinned = [SharedNode("a", 1, model="A100"), SharedNode("b", 1, model="T4")]
    assert allocation_bound(pinned, [TaskShape(1000, models=("A100",))] * 2) == pytest.approx(0.5)
    assert allocation_bound([SharedNode("a", 2)], [TaskShape(1000, 4)]) == 0.0


def _random_instance(rng: random.Random) -> tuple[list[SharedNode], list]:
    models = ("A", "B")
    nodes = [
        SharedNode(
            f"n{i}",
            rng.choice((1, 2, 4)),
            model=rng.choice(models),
            cpu_milli=rng.choice((4000, 8000, 16000)),
            memory_mib=rng.choice((16384, 65536)),
        )
        for i in range(rng.randint(2, 5))
    ]
    tasks: list = []
    for _ in range(rng.randint(3, 12)):
        if rng.random() < 0.15:
            tasks.append(CpuTask(rng.choice((1000, 4000)), rng.choice((1024, 8192))))
            continue
        gpus = rng.choice((1, 1, 1, 2, 4))
        milli = rng.choice((100, 250, 300, 500, 600, 700, 1000)) if gpus == 1 else 1000
        pin = rng.choice(((), (), ("A",), ("B",)))
        tasks.append(TaskShape(milli, gpus, rng.choice((0, 1000, 2000, 6000)), rng.choice((0, 4096, 32768)), pin))
    if not any(isinstance(t, TaskShape) for t in tasks):
        tasks.append(TaskShape(500))
    return nodes, tasks


@pytest.mark.parametrize("instance", range(40))
def test_no_rule_allocates_more_than_the_bound(instance):
    rng = random.Random(instance)
    nodes, tasks = _random_instance(rng)
    result = inflation_experiment(nodes, tasks, seeds=[instance], variants=INFLATION_VARIANTS, bound=True)
    bound = result["allocation_bound"]
    assert 0.0 <= bound <= 1.0 + 1e-9
    for name, runs in result["runs"].items():
        (run,) = runs
        assert run["at_full"] <= bound + 1e-9, (name, run["at_full"], bound)
    # The same arrivals placed by the rules one by one, in the order they came.
    capacity = sum(n.gpus for n in nodes) * 1000
    arrivals = inflation_arrivals(tasks, seed=instance, capacity_milli=capacity)
    assert allocation_bound(nodes, arrivals) == pytest.approx(bound)
