"""The inflation experiment of the FGD paper (Weng et al., ATC '23): the trace's tasks
sampled again and again onto the nodes until one fails to fit, per placement
(:func:`inflation_arrivals`, :func:`inflate`, :func:`inflation_experiment`)."""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from broker.core.errors import InvalidRequest
from broker.placement.fragmentation import (
    MILLI,
    SharedGpuNodes,
    SharedNode,
    TaskShape,
    WorkloadDistribution,
)
from broker.simulation.results import run_label

# -- the inflation experiment ------------------------------------------------------------


@dataclass(frozen=True)
class InflationRun:
    """One inflation run: tasks arrive and never leave, each placed or dropped.
    Allocation is GPU demand placed over GPU capacity."""

    placement: str
    whole_gpus: bool
    seed: int
    capacity_gpus: float
    at_full: float  # allocation once the arrived demand reached capacity
    at_end: float  # allocation after every arrival (ratio x capacity)
    at_first_failure: float  # allocation when the first task could not be placed
    arrived_at_first_failure: float  # arrived demand over capacity at that moment
    placed: int
    failed: int
    seconds: float
    curve: tuple[tuple[float, float], ...]  # (arrived, allocation) at each 1% of arrived demand

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "curve": [list(point) for point in self.curve]}


def inflation_arrivals(
    tasks: Sequence[TaskShape], *, seed: int, capacity_milli: int, ratio: float = 1.3
) -> list[TaskShape]:
    """The FGD paper's arrival sequence: the tasks in a random order (``seed``), then
    tasks drawn from them with replacement until the arrived GPU demand reaches
    ``ratio`` times the capacity."""
    if not tasks:
        raise InvalidRequest("no GPU tasks to inflate")
    rng = random.Random(seed)
    order = list(tasks)
    rng.shuffle(order)
    arrived = sum(t.demand_milli for t in order)
    while arrived < ratio * capacity_milli:
        task = rng.choice(tasks)
        order.append(task)
        arrived += task.demand_milli
    return order


def inflate(
    nodes: Sequence[SharedNode],
    arrivals: Sequence[TaskShape],
    *,
    placement: str,
    distribution: WorkloadDistribution | None,
    whole_gpus: bool = False,
    seed: int = 0,
) -> InflationRun:
    """Place ``arrivals`` in order on empty ``nodes``; a task that fits nowhere is dropped."""
    began = time.perf_counter()
    shapes = sorted({t.whole() if whole_gpus else t for t in arrivals})
    cluster = SharedGpuNodes(nodes, placement=placement, distribution=distribution, shapes=shapes)
    capacity = cluster.capacity_milli
    arrived = placed_demand = placed = failed = 0
    at_full = first_failure = arrived_at_failure = None
    curve: list[tuple[float, float]] = []
    next_point = 0.0
    for task in arrivals:
        arrived += task.demand_milli
        if cluster.place(task.whole() if whole_gpus else task) is not None:
            placed_demand += task.demand_milli
            placed += 1
        else:
            if first_failure is None:
                first_failure = placed_demand / capacity
                arrived_at_failure = (arrived - task.demand_milli) / capacity
            failed += 1
        if at_full is None and arrived >= capacity:
            at_full = placed_demand / capacity
        while arrived / capacity >= next_point:
            curve.append((round(next_point, 2), placed_demand / capacity))
            next_point += 0.01
    end = placed_demand / capacity
    return InflationRun(
        placement,
        whole_gpus,
        seed,
        capacity / MILLI,
        end if at_full is None else at_full,
        end,
        end if first_failure is None else first_failure,
        arrived / capacity if arrived_at_failure is None else arrived_at_failure,
        placed,
        failed,
        time.perf_counter() - began,
        tuple(curve),
    )


INFLATION_VARIANTS = (("fgd", False), ("best-fit", False), ("best-fit", True))


def variant_name(placement: str, whole: bool) -> str:
    """A variant's name, as a replay with that placement is called (results.run_label)."""
    return run_label("whole GPUs" if whole else "gpush", placement)


def inflation_experiment(
    nodes: Sequence[SharedNode],
    tasks: Sequence[TaskShape],
    *,
    seeds: Iterable[int] = range(10),
    ratio: float = 1.3,
    coverage: float = 1.0,
    variants: Sequence[tuple[str, bool]] = INFLATION_VARIANTS,
    progress: Callable[[InflationRun], None] | None = None,
) -> dict[str, Any]:
    """The FGD paper's experiment: for each seed one arrival sequence, placed by each
    variant (placement, whole GPUs); medians over seeds of the allocation at 100%
    arrived demand and at the first failure. FGD measures fragmentation against the
    distribution of ``tasks`` (all of it, or the most frequent shapes covering
    ``coverage``, as FGD's typical pods)."""
    distribution = WorkloadDistribution.of(tasks, coverage)
    capacity = sum(n.gpus for n in nodes) * MILLI
    runs: dict[str, list[InflationRun]] = defaultdict(list)
    for seed in seeds:
        arrivals = inflation_arrivals(tasks, seed=seed, capacity_milli=capacity, ratio=ratio)
        for placement, whole in variants:
            run = inflate(nodes, arrivals, placement=placement, distribution=distribution, whole_gpus=whole, seed=seed)
            runs[variant_name(placement, whole)].append(run)
            if progress:
                progress(run)
    medians = {
        name: {
            "at_full": statistics.median(r.at_full for r in group),
            "at_first_failure": statistics.median(r.at_first_failure for r in group),
            "arrived_at_first_failure": statistics.median(r.arrived_at_first_failure for r in group),
            "at_end": statistics.median(r.at_end for r in group),
            "seeds": len(group),
            "seconds_per_run": statistics.mean(r.seconds for r in group),
        }
        for name, group in runs.items()
    }
    return {
        "ratio": ratio,
        "coverage": coverage,
        "capacity_gpus": capacity / MILLI,
        "tasks": len(tasks),
        "distribution_shapes": len(distribution.shapes),
        "medians": medians,
        "runs": {name: [r.to_dict() for r in group] for name, group in runs.items()},
    }
