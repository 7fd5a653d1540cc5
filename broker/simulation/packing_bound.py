"""An upper bound on the GPU allocation any placement reaches in the inflation experiment.

What it bounds: the arrivals of :func:`broker.simulation.inflation.inflation_arrivals` up to
the one that brings the arrived GPU demand to the capacity (the tasks an ``at_full``
allocation counts), each placed on at most one node or dropped, by any rule, in any order,
knowing all of them in advance. A placed task sits on one node of a GPU model it allows,
with ``gpus`` GPUs there, each GPU's shares summing to at most one GPU, and within the
node's CPU and host memory, as :class:`broker.placement.fragmentation.SharedGpuNodes` holds
them (CPU-only pods take CPU and memory and add no GPU demand, so leaving them out only
loosens the bound). The allocation is the placed GPU demand over the GPU capacity, so no
variant of the experiment, whole GPUs included (a task placed whole would fit at its
share), reports more at 100% arrived demand.

How: the linear-programming relaxation of that packing, aggregated by task shape and node
type (nodes alike in model, GPUs, CPU and memory). ``y[s, k]`` tasks of shape ``s`` on nodes
of type ``k``, only where one would fit an empty node of the type, and:

* at most as many of a shape as arrived;
* per type, the GPU demand, the CPU and the memory of its tasks within the type's totals
  (each node's constraint summed over the type's nodes);
* per type, the tasks' GPUs holding more than half a GPU within the type's GPUs (two such
  shares never share a GPU): the cut that makes shares of 0.6 count as whole GPUs.

Any placement is a solution, so the optimum is at least its allocation. The LP is solved by
HiGHS (``highspy``, imported when a bound is asked for: the broker runs without it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from broker.placement.fgd import MILLI, TaskShape
from broker.placement.fragmentation import SharedNode

HALF = MILLI // 2


def arrived_at_capacity(arrivals: Iterable, capacity_milli: int) -> list[TaskShape]:
    """The GPU tasks among the arrivals up to the one that brings the arrived demand to
    ``capacity_milli`` (it included): the tasks an allocation at 100% counts."""
    arrived = 0
    known: list[TaskShape] = []
    for task in arrivals:
        if arrived >= capacity_milli:
            break
        arrived += task.demand_milli
        if isinstance(task, TaskShape):
            known.append(task)
    return known


def allocation_bound(nodes: Sequence[SharedNode], arrivals: Iterable) -> float:
    """The LP bound (see the module docstring) on the allocation at 100% arrived demand:
    placed GPU demand over GPU capacity, for every placement of ``arrivals`` on ``nodes``."""
    capacity = sum(node.gpus for node in nodes) * MILLI
    if capacity == 0:
        return 0.0
    shapes = Counter(arrived_at_capacity(arrivals, capacity))
    return packing_bound_milli(nodes, shapes) / capacity


def packing_bound_milli(nodes: Sequence[SharedNode], shapes: Counter[TaskShape]) -> float:
    """The LP optimum: the most GPU demand (milli-GPU) of ``shapes`` (shape -> count) that
    the relaxation places on ``nodes``."""
    types = Counter((n.model, n.gpus, n.cpu_milli, n.memory_mib) for n in nodes)
    kinds = list(types.items())
    shape_list = [s for s in shapes if shapes[s] > 0]
    # Columns: (shape, type) pairs where one task would fit an empty node of the type.
    columns = [
        (i, k)
        for i, shape in enumerate(shape_list)
        for k, ((model, gpus, cpu, memory), _) in enumerate(kinds)
        if shape.allows(model)
        and gpus >= shape.gpus
        and (cpu is None or cpu >= shape.cpu_milli)
        and (memory is None or memory >= shape.memory_mib)
    ]
    if not columns:
        return 0.0
    # Rows: one per shape (its count), then per type: GPU, CPU, memory, shares over half.
    row_upper: list[float] = [float(shapes[s]) for s in shape_list]
    type_rows: list[dict[str, int]] = []
    for (_, gpus, cpu, memory), count in kinds:
        rows: dict[str, int] = {}
        for name, total in (
            ("gpu", gpus * MILLI * count),
            ("cpu", None if cpu is None else cpu * count),
            ("memory", None if memory is None else memory * count),
            ("over_half", gpus * count),
        ):
            if total is not None:
                rows[name] = len(row_upper)
                row_upper.append(float(total))
        type_rows.append(rows)
    starts, index, value, cost = [0], [], [], []
    for i, k in columns:
        shape = shape_list[i]
        entries = {i: 1.0}
        rows = type_rows[k]
        entries[rows["gpu"]] = float(shape.demand_milli)
        if "cpu" in rows and shape.cpu_milli:
            entries[rows["cpu"]] = float(shape.cpu_milli)
        if "memory" in rows and shape.memory_mib:
            entries[rows["memory"]] = float(shape.memory_mib)
        if shape.gpu_milli > HALF:
            entries[rows["over_half"]] = float(shape.gpus)
        for row in sorted(entries):
            index.append(row)
            value.append(entries[row])
        starts.append(len(index))
        cost.append(float(shape.demand_milli))
    return _solve_max(cost, [float(shapes[shape_list[i]]) for i, _ in columns], row_upper, starts, index, value)


def _solve_max(
    cost: list[float],
    col_upper: list[float],
    row_upper: list[float],
    starts: list[int],
    index: list[int],
    value: list[float],
) -> float:
    """max cost·y, 0 <= y <= col_upper, A y <= row_upper (A column-wise), by HiGHS."""
    try:
        import highspy
    except ImportError as exc:  # an optional dependency: only the placement experiment asks for it
        raise RuntimeError(
            "the allocation bound needs HiGHS: pip install highspy (it is in gpush's test extras)"
        ) from exc
    lp = highspy.HighsLp()
    lp.num_col_ = len(cost)
    lp.num_row_ = len(row_upper)
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = np.array(cost)
    lp.col_lower_ = np.zeros(len(cost))
    lp.col_upper_ = np.array(col_upper)
    lp.row_lower_ = np.full(len(row_upper), -highspy.kHighsInf)
    lp.row_upper_ = np.array(row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value)
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.passModel(lp)
    solver.run()
    status = solver.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"HiGHS did not solve the packing bound: {solver.modelStatusToString(status)}")
    return float(solver.getInfo().objective_function_value)
