"""The fitting index of a capacity view: free units grouped by shape, kept in order.

:class:`broker.placement.capacity.CapacityView` fits thousands of jobs a cycle against
thousands of nodes, so no fit scans every node. The slots of one cluster and sharing
mode (:class:`SlotGroup`) are grouped by :class:`Shape` (model, MIG profile, unit memory,
capacity, GPU memory, per GPU or per node: everything the per-job filters look at), each
shape's slots sorted by free units, with running totals for "n of m free"; FGD's measure
for shared GPUs is cached per (capacity, free, units) until the workload it is measured
against changes (:class:`SharedFragmentation`). The view changes free units only through
:meth:`SlotGroup.set_free`, which keeps that order. FGD's choice over the index lives
beside it: :func:`fgd_gpu` scores a bounded candidate set (one node per free level of a
shape) and :func:`fgd_gpu_on_node` picks that node's GPU. The capacity module's docstring
says how fits use them.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.gpus import gpu_model
from broker.core.topology import levels_of
from broker.placement.fgd import (
    MILLI,
    TOLERANCE_MILLI,
    TaskShape,
    WorkloadDistribution,
    gpu_increase,
    single_gpu,
)

# Sharing modes fitted per physical GPU when the inventory reports them so.
PER_GPU_SHARING = (Sharing.SLURM_MPS, Sharing.K8S_TIMESLICE)

# The shares (milli-GPU) a learned workload starts from, one pseudo-job each: see the module docstring.
DEFAULT_SHARES = (125, 250, 500, 1000)
LEVELS = 128  # distinct free levels of one shape that FGD scores per pick
PER_LEVEL = 32  # slots of one level looked at for one that passes the job's filters
MEMORY_SLACK = 1e-9  # GB: sums of memory limits that equal a GPU's memory fit it
REFRESH = 32  # jobs between refreshes of a learned workload, at least


@cache
def canonical_model(name: str) -> str:
    """gpush's canonical name of a GPU model, or ``name`` itself if gpush does not know it."""
    try:
        return gpu_model(name).name
    except ValueError:
        return name


def milli(units: int, capacity: int) -> int:
    """``units`` of a GPU divided into ``capacity`` units, in milli-GPU."""
    return units * MILLI // capacity if capacity > 0 else 0


@dataclass(slots=True)  # thousands per cycle: no per-instance dict
class Slot:
    """One CapacityUnit with what is still free this cycle."""

    unit: CapacityUnit
    free: int
    # Time-slicing has no memory isolation: the GPU memory still unclaimed on the
    # unit's GPU (a per-GPU unit) or on its node (a per-node unit).
    memory_free_gb: float | None = None
    # Whole GPUs: which device indexes are free, sorted (None: unknown); kept in step with
    # ``free`` by the view (broker.placement.topology_fit.take_gpus, return_gpus).
    free_gpus: tuple[int, ...] | None = None


class Shape:
    """Slots of one cluster and sharing mode that every fitting filter treats alike,
    in fitting order (see the module docstring), with their free and total units summed."""

    __slots__ = (
        "model",
        "model_name",
        "profile",
        "unit_memory_gb",
        "capacity",
        "gpu_memory_gb",
        "per_gpu",
        "first",
        "order",
        "free",
        "total",
        "topology",
    )

    def __init__(self, unit: CapacityUnit, first: int, per_gpu: bool):
        self.model = canonical_model(unit.gpu_model)
        self.model_name = unit.gpu_model  # as the inventory names it, for reasons
        self.profile = unit.mig_profile
        self.unit_memory_gb = unit.unit_memory_gb
        self.capacity = unit.capacity
        self.gpu_memory_gb = unit.gpu_memory_gb
        self.per_gpu = per_gpu
        self.first = first  # the position of its first slot in the inventory
        # Per node: (free, node, position), or (free, "", position) under MPS, where
        # ties go to inventory order. Per GPU: (free, node's free milli, node number),
        # one entry per node and free level above 0 (SlotGroup.node_levels counts its GPUs).
        self.order: list[tuple] = []
        self.free = 0
        self.total = 0
        # Whether a unit of this shape says how its GPUs are grouped: only then does a
        # multi-GPU fit look at the topology (broker.placement.topology_fit).
        self.topology = False

    def first_with(self, need: int, slots: list[Slot], ok: Callable[[Slot], bool] | None = None) -> tuple | None:
        """The best-fit entry among slots with at least ``need`` free that pass ``ok``."""
        order = self.order
        for i in range(bisect_left(order, (need,)), len(order)):
            entry = order[i]
            if ok is None or ok(slots[entry[-1]]):
                return entry
        return None

    @property
    def most_free(self) -> int:
        return self.order[-1][0] if self.order else 0


class SharedFragmentation:
    """FGD's measure for the shared GPUs of one cluster and mode: the increase of
    placing a share on a GPU, per (GPU capacity, free units, units), cached until the
    workload it is measured against changes."""

    __slots__ = ("given", "seen", "fitted", "refresh_at", "distribution", "known")

    def __init__(self, workload: WorkloadDistribution | None):
        self.given = single_gpu(workload) if workload is not None else None
        self.seen: Counter[int] = Counter()  # milli-GPU share -> replicas fitted here
        self.fitted = 0
        self.refresh_at = 0
        self.distribution = self.given or self._learned()
        self.known: dict[tuple[int, int, int], float] = {}  # increases computed so far

    def _learned(self) -> WorkloadDistribution:
        counts = Counter(DEFAULT_SHARES)
        counts.update(self.seen)
        total = sum(counts.values())
        shares = sorted(counts)
        return WorkloadDistribution(tuple(TaskShape(m) for m in shares), tuple(counts[m] / total for m in shares))

    def observe(self, share_milli: int, replicas: int) -> None:
        """Count a job about to be fitted into the learned workload."""
        if self.given is not None:
            return
        seen = self.seen
        new = share_milli not in seen
        seen[share_milli] += replicas
        self.fitted += replicas
        # Weights move little between refreshes: refresh on a new share, and when the
        # count has grown by a quarter (and by REFRESH at least), so that cached
        # increases serve many fits.
        if new or self.fitted >= self.refresh_at:
            self.distribution = self._learned()
            self.known.clear()
            self.refresh_at = self.fitted + max(self.fitted // 4, REFRESH)

    def increase(self, capacity: int, free: int, units: int) -> float:
        key = (capacity, free, units)
        value = self.known.get(key)
        if value is None:
            before = milli(free, capacity)
            value = gpu_increase(before, before - milli(free - units, capacity), self.distribution)
            self.known[key] = value
        return value


class SlotGroup:
    """The slots of one cluster under one sharing mode, indexed for fitting."""

    __slots__ = (
        "slots",
        "keys",
        "shapes",
        "shape_at",
        "by_model",
        "by_node",
        "offered",
        "node_of",
        "node_free",
        "node_slots",
        "node_levels",
        "fragmentation",
        "able",
        "levels",
        "topology",
    )

    def __init__(self, slots: list[Slot], sharing: Sharing, workload: WorkloadDistribution | None):
        self.slots = slots
        shared = sharing in PER_GPU_SHARING
        by_node_order = sharing != Sharing.SLURM_MPS
        self.keys = [s.unit.node if by_node_order else "" for s in slots]
        # Per-GPU slots of shared modes: their node's number (in inventory order), each
        # node's free milli-GPU over its shared GPUs, its per-GPU slots, and how many of
        # them each (shape, free units) has: a shape's order holds one entry per node
        # and free level, not per GPU, so a node's change moves few entries.
        self.node_of = [-1] * len(slots)
        self.node_free: list[int] = []
        self.node_slots: list[list[int]] = []
        self.node_levels: list[dict[tuple[Shape, int], int]] = []
        numbers: dict[str, int] = {}
        for position, slot in enumerate(slots):
            unit = slot.unit
            if shared and len(unit.gpus) == 1:
                k = numbers.get(unit.node)
                if k is None:
                    k = numbers[unit.node] = len(self.node_free)
                    self.node_free.append(0)
                    self.node_slots.append([])
                    self.node_levels.append({})
                self.node_of[position] = k
                self.node_free[k] += milli(slot.free, unit.capacity)
                self.node_slots[k].append(position)
        self.shapes: dict[tuple, Shape] = {}
        self.shape_at: list[Shape] = []
        self.by_model: dict[str | None, list[Shape]] = defaultdict(list)
        self.by_node: dict[str, list[int]] = defaultdict(list)
        # MIG profiles on offer and their memory, per model and in all (None), as the
        # inventory lists them (the last wins).
        self.offered: dict[str | None, dict[str, float]] = defaultdict(dict)
        for position, slot in enumerate(slots):
            unit = slot.unit
            per_gpu = self.node_of[position] >= 0
            model = canonical_model(unit.gpu_model)
            key = (model, unit.mig_profile, unit.unit_memory_gb, unit.capacity, unit.gpu_memory_gb, per_gpu)
            shape = self.shapes.get(key)
            if shape is None:
                shape = self.shapes[key] = Shape(unit, position, per_gpu)
                self.by_model[None].append(shape)
                self.by_model[model].append(shape)
            self.shape_at.append(shape)
            k = self.node_of[position]
            if k < 0:
                shape.order.append((slot.free, self.keys[position], position))
            else:
                levels = self.node_levels[k]
                level = (shape, slot.free)
                levels[level] = levels.get(level, 0) + 1
                if slot.free and levels[level] == 1:
                    shape.order.append((slot.free, self.node_free[k], k))
            shape.free += slot.free
            shape.total += unit.capacity
            if unit.gpu_topology is not None and unit.gpu_topology.known:
                shape.topology = True
            self.by_node[unit.node].append(position)
            if unit.mig_profile:
                self.offered[None][unit.mig_profile] = unit.unit_memory_gb
                self.offered[model][unit.mig_profile] = unit.unit_memory_gb
        for shape in self.shapes.values():
            shape.order.sort()
        self.fragmentation = SharedFragmentation(workload) if shared else None
        # What a job's filters leave of the shapes, by the job's fields: shapes never change.
        self.able: dict[tuple, tuple] = {}
        # The network levels its units' positions name, widest first (broker.core.topology).
        self.levels = levels_of(slot.unit.topology for slot in slots)
        self.topology = any(shape.topology for shape in self.shapes.values())  # a fit may look at it

    def shapes_of(self, model: str | None) -> list[Shape]:
        return self.by_model.get(model, [])

    def set_free(self, position: int, free: int) -> None:
        slot = self.slots[position]
        old = slot.free
        if free == old:
            return
        shape = self.shape_at[position]
        shape.free += free - old
        slot.free = free
        k = self.node_of[position]
        if k < 0:
            order = shape.order
            key = self.keys[position]
            del order[bisect_left(order, (old, key, position))]
            insort(order, (free, key, position))
            return
        # A per-GPU slot: the node's entries are (free level, node's free milli, node),
        # one per shape and level it has GPUs at (a full GPU is never a candidate: none
        # for level 0). Its node's free changes, so they all move: a few, not a GPU each.
        capacity = slot.unit.capacity
        before = self.node_free[k]
        after = before + free * MILLI // capacity - old * MILLI // capacity
        self.node_free[k] = after
        levels = self.node_levels[k]
        if after != before:
            for other, level in levels:
                if level:
                    order = other.order
                    del order[bisect_left(order, (level, before, k))]
        elif levels[(shape, old)] == 1 and old:
            del shape.order[bisect_left(shape.order, (old, before, k))]
        leaving = (shape, old)
        if levels[leaving] == 1:
            del levels[leaving]
        else:
            levels[leaving] -= 1
        arriving = (shape, free)
        levels[arriving] = levels.get(arriving, 0) + 1
        if after != before:
            for other, level in levels:
                if level:
                    insort(other.order, (level, after, k))
        elif levels[arriving] == 1 and free:
            insort(shape.order, (free, after, k))

    def positions(self, node: str | None) -> Iterable[int]:
        """Positions of the slots on ``node`` (every slot when None), in inventory order."""
        return range(len(self.slots)) if node is None else self.by_node.get(node, ())


def fgd_gpu_on_node(group: SlotGroup, able: dict[Shape, int], memory_gb: float, k: int) -> int | None:
    """FGD's GPU on node ``k``: of the per-GPU slots of ``able`` shapes with room and
    ``memory_gb`` unclaimed, the least increase, then least left free, then lowest index."""
    fragmentation = group.fragmentation
    known = fragmentation.known
    slots, shape_at = group.slots, group.shape_at
    need = memory_gb - MEMORY_SLACK
    best = None
    for position in group.node_slots[k]:
        slot = slots[position]
        free = slot.free
        units = able.get(shape_at[position])
        if units is None or free < units:
            continue
        if memory_gb and slot.memory_free_gb is not None and slot.memory_free_gb < need:
            continue
        capacity = slot.unit.capacity
        increase = known.get((capacity, free, units))
        if increase is None:
            increase = fragmentation.increase(capacity, free, units)
        key = (increase, (free - units) * MILLI // capacity, slot.unit.gpus[0], position)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]


def node_holds(group: SlotGroup, k: int, able: dict[Shape, int], memory_gb: float, replicas: int) -> bool:
    """Whether node ``k`` has room for ``replicas`` replicas (each on one GPU)."""
    slots, shape_at = group.slots, group.shape_at
    room = 0
    for position in group.node_slots[k]:
        units = able.get(shape_at[position])
        if units is None:
            continue
        slot = slots[position]
        fit = slot.free // units
        if memory_gb and slot.memory_free_gb is not None:
            fit = min(fit, int((slot.memory_free_gb + MEMORY_SLACK) // memory_gb))
        room += fit
        if room >= replicas:
            return True
    return False


def gpu_has_memory(group: SlotGroup, k: int, shape: Shape, free: int, need: float) -> bool:
    """Whether node ``k`` has a GPU of ``shape`` with ``free`` units and ``need`` GB unclaimed."""
    slots, shape_at = group.slots, group.shape_at
    for position in group.node_slots[k]:
        slot = slots[position]
        if slot.free == free and shape_at[position] is shape:
            memory = slot.memory_free_gb
            if memory is None or memory >= need:
                return True
    return False


def fgd_gpu(group: SlotGroup, able: dict[Shape, int], memory_gb: float, replicas: int = 1) -> int | None:
    """FGD's choice among the per-GPU slots of ``able`` shapes with ``memory_gb`` of
    GPU memory unclaimed (on nodes with room for ``replicas`` such replicas): the
    least increase of fragmentation; within :data:`TOLERANCE_MILLI` of it, the node
    left with the least free shared GPU, then the earlier node; on that node, its
    GPU of least increase, then least left free, then lowest index. Scores one node
    per free level of a shape (the first of a level is the node with the least
    free: the tie-break's choice), looking at a few for one that passes the filters."""
    fragmentation = group.fragmentation
    known = fragmentation.known
    need = memory_gb - MEMORY_SLACK
    found: list[tuple[float, int, int]] = []  # (increase, node's free milli after, node)
    least = math.inf
    for shape, units in able.items():
        order = shape.order
        size = len(order)
        capacity = shape.capacity
        demand = units * MILLI // capacity
        i = bisect_left(order, (units,))
        levels = 0
        while i < size and levels < LEVELS:
            entry = order[i]
            free = entry[0]
            end = bisect_left(order, (free + 1,), i)
            if memory_gb or replicas > 1:
                # The first node at this level whose GPU there has the memory (a few looked at).
                j, stop = i, min(end, i + PER_LEVEL)
                while j < stop and not (
                    (not memory_gb or gpu_has_memory(group, order[j][2], shape, free, need))
                    and (replicas == 1 or node_holds(group, order[j][2], able, memory_gb, replicas))
                ):
                    j += 1
                if j == stop:
                    i = end
                    levels += 1
                    continue
                entry = order[j]
            increase = known.get((capacity, free, units))
            if increase is None:
                increase = fragmentation.increase(capacity, free, units)
            found.append((increase, entry[1] - demand, entry[2]))
            if increase < least:
                least = increase
            i = end
            levels += 1
    if not found:
        return None
    limit = least + TOLERANCE_MILLI
    node = None
    for increase, after, k in found:
        if increase <= limit and (node is None or (after, k) < node):
            node = (after, k)
    return fgd_gpu_on_node(group, able, memory_gb, node[1])
