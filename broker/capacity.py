"""Free GPU capacity as the scheduler sees it, and fitting a job onto it.

Built once per scheduling cycle from each cluster's inventory (what it reports
allocated) and the broker's own placements the cluster has not started yet. Fitting
is best fit: of the nodes where the job fits now, the one it leaves with the least
free room, so large free blocks stay whole for large jobs. A job's units are taken
whole or not at all.

A cycle fits thousands of jobs against thousands of nodes, so fitting must not scan
every node per job. The slots of one cluster and sharing mode are grouped by *shape*
(MIG profile, unit memory, capacity, GPU memory: everything the per-job filters look
at), and each shape keeps its slots sorted by (free units, node, inventory order):
the best fit of a shape is the first slot with enough free units, found by bisection,
and the best of the job is the best of the shapes that pass its filters. Running
totals per shape give the "n of m free" of a waiting job without a scan. Every
change of a slot's free units goes through the view, which keeps that order.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from broker.adapter import CapacityUnit, Placement, Sharing
from broker.gpus import gpu_model
from broker.schemas import JobSpec


@dataclass
class Slot:
    """One CapacityUnit with what is still free this cycle."""

    unit: CapacityUnit
    free: int
    # Time-slicing has no memory isolation: the GPU memory still unclaimed on the node.
    memory_free_gb: float | None = None


@dataclass(frozen=True)
class Fit:
    placement: Placement


@dataclass(frozen=True)
class NoFit:
    """Why a route cannot take the job: now (``never`` False) or ever (``never`` True)."""

    reason: str
    never: bool
    # What the job waits for, so jobs queued behind it can be counted: (cluster, sharing, profile).
    waiting_for: tuple[str, str, str | None] | None = None


@dataclass
class Demand:
    """What one replica of a job needs under one sharing mode."""

    units: int
    unit_memory_gb: float | None  # each unit must have at least this much memory
    replicas: int


def replicas_of(spec: JobSpec) -> int:
    return max(spec.elastic.min_replicas, 1) if spec.elastic else 1


def mps_share(gpu_memory_gb: float | None, gpu_memory: float) -> int:
    """MPS share (percent of one GPU) sized from the job's memory, at least 1."""
    if not gpu_memory_gb:
        return 100
    return max(1, math.ceil(gpu_memory_gb / gpu_memory * 100))


class _Shape:
    """Slots of one cluster and sharing mode that every fitting filter treats alike,
    in best-fit order: (free, node, position) — or (free, "", position) under MPS,
    where ties go to inventory order — with their free and total units summed."""

    __slots__ = ("profile", "unit_memory_gb", "capacity", "gpu_memory_gb", "first", "order", "free", "total")

    def __init__(self, unit: CapacityUnit, first: int):
        self.profile = unit.mig_profile
        self.unit_memory_gb = unit.unit_memory_gb
        self.capacity = unit.capacity
        self.gpu_memory_gb = unit.gpu_memory_gb
        self.first = first  # the position of its first slot in the inventory
        self.order: list[tuple[int, str, int]] = []
        self.free = 0
        self.total = 0

    def first_with(self, need: int, slots: list[Slot], ok: Callable[[Slot], bool] | None = None) -> tuple | None:
        """The best-fit entry among slots with at least ``need`` free that pass ``ok``."""
        order = self.order
        for i in range(bisect_left(order, (need,)), len(order)):
            entry = order[i]
            if ok is None or ok(slots[entry[2]]):
                return entry
        return None

    @property
    def most_free(self) -> int:
        return self.order[-1][0] if self.order else 0


class _Group:
    """The slots of one cluster under one sharing mode, indexed for fitting."""

    __slots__ = ("slots", "keys", "shapes", "shape_at", "by_node", "offered", "largest_gpu_memory")

    def __init__(self, slots: list[Slot], sharing: Sharing):
        self.slots = slots
        by_node_order = sharing != Sharing.SLURM_MPS
        self.keys = [s.unit.node if by_node_order else "" for s in slots]
        self.shapes: dict[tuple, _Shape] = {}
        self.shape_at: list[_Shape] = []
        self.by_node: dict[str, list[int]] = defaultdict(list)
        # MIG profiles on offer and their memory, as the inventory lists them (the last wins).
        self.offered: dict[str, float] = {}
        for position, slot in enumerate(slots):
            unit = slot.unit
            key = (unit.mig_profile, unit.unit_memory_gb, unit.capacity, unit.gpu_memory_gb)
            shape = self.shapes.get(key)
            if shape is None:
                shape = self.shapes[key] = _Shape(unit, position)
            self.shape_at.append(shape)
            shape.order.append((slot.free, self.keys[position], position))
            shape.free += slot.free
            shape.total += unit.capacity
            self.by_node[unit.node].append(position)
            if unit.mig_profile:
                self.offered[unit.mig_profile] = unit.unit_memory_gb
        for shape in self.shapes.values():
            shape.order.sort()
        self.largest_gpu_memory = max((s.unit.gpu_memory_gb or 0 for s in slots), default=0)

    def set_free(self, position: int, free: int) -> None:
        slot = self.slots[position]
        if free == slot.free:
            return
        shape = self.shape_at[position]
        key = self.keys[position]
        order = shape.order
        del order[bisect_left(order, (slot.free, key, position))]
        insort(order, (free, key, position))
        shape.free += free - slot.free
        slot.free = free

    def positions(self, node: str | None) -> Iterable[int]:
        """Positions of the slots on ``node`` (every slot when None), in inventory order."""
        return range(len(self.slots)) if node is None else self.by_node.get(node, ())


@dataclass
class CapacityView:
    """Free units per cluster, mutable within one cycle as the scheduler places jobs.

    ``slots`` is for reading; change free units through :meth:`take`, :meth:`give_back`
    and :meth:`fit`, which keep the fitting index in step.
    """

    slots: dict[str, dict[Sharing, list[Slot]]] = field(default_factory=dict)
    _groups: dict[tuple[str, Sharing], _Group] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        inventory: Mapping[str, Iterable[CapacityUnit]],
        not_yet_started: Iterable[Placement] = (),
        timeslice_memory_used: Mapping[tuple[str, str], float] | None = None,
    ) -> CapacityView:
        """``not_yet_started``: placements the broker made that clusters do not count yet.
        ``timeslice_memory_used``: GPU memory of gpush's time-sliced jobs per (cluster, node)."""
        view = cls()
        memory_used = timeslice_memory_used or {}
        for cluster, units in inventory.items():
            by_sharing: dict[Sharing, list[Slot]] = defaultdict(list)
            for unit in units:
                if unit.broken:
                    continue  # a drift finding marks it: never place here
                memory_free = None
                if unit.sharing == Sharing.K8S_TIMESLICE and unit.gpu_memory_gb:
                    physical = unit.capacity * unit.gpu_equivalent
                    memory_free = physical * unit.gpu_memory_gb - memory_used.get((cluster, unit.node), 0.0)
                by_sharing[unit.sharing].append(Slot(unit, unit.free, memory_free))
            view.slots[cluster] = dict(by_sharing)
            for sharing, slots in by_sharing.items():
                view._groups[(cluster, sharing)] = _Group(slots, sharing)
        for placement in not_yet_started:
            view.take(placement)
        return view

    def clusters(self) -> list[str]:
        return list(self.slots)

    def total_gpu_equivalents(self) -> float:
        return sum(
            s.unit.capacity * s.unit.gpu_equivalent for c in self.slots.values() for ss in c.values() for s in ss
        )

    def free_gpu_equivalents(self) -> float:
        return sum(s.free * s.unit.gpu_equivalent for c in self.slots.values() for ss in c.values() for s in ss)

    def take(self, placement: Placement) -> None:
        """Count ``placement`` against free capacity (best effort if the node is unknown)."""
        group = self._group(placement.cluster, placement.sharing)
        if group is None:
            return
        for position in group.positions(placement.node):
            slot = group.slots[position]
            if placement.mig_profile and slot.unit.mig_profile != placement.mig_profile:
                continue
            need = placement.units * placement.replicas
            group.set_free(position, max(slot.free - need, 0))
            if slot.memory_free_gb is not None and placement.gpu_memory_gb:
                slot.memory_free_gb -= placement.gpu_memory_gb * need
            return

    def give_back(self, placement: Placement) -> None:
        """Return what a fit took when the job cannot use it after all (its tenant's quota):
        the units go back to the slot on the placement's node with its MIG profile."""
        group = self._group(placement.cluster, placement.sharing)
        if group is None or placement.node is None:
            return
        for position in group.positions(placement.node):
            slot = group.slots[position]
            if slot.unit.mig_profile == placement.mig_profile:
                need = placement.units * placement.replicas
                group.set_free(position, slot.free + need)
                if slot.memory_free_gb is not None and placement.gpu_memory_gb:
                    slot.memory_free_gb += placement.gpu_memory_gb * need
                return

    def _slots(self, cluster: str, sharing: Sharing) -> list[Slot]:
        return self.slots.get(cluster, {}).get(sharing, [])

    def _group(self, cluster: str, sharing: Sharing) -> _Group | None:
        """The index of ``slots[cluster][sharing]``, made on first use for a view built by hand."""
        group = self._groups.get((cluster, sharing))
        if group is None:
            slots = self._slots(cluster, sharing)
            if not slots:
                return None
            group = self._groups[(cluster, sharing)] = _Group(slots, Sharing(sharing))
        return group

    def fit(self, spec: JobSpec, cluster: str, sharing: Sharing, *, partition: str | None = None) -> Fit | NoFit:
        """Place the job on ``cluster`` under ``sharing`` now, or say why not."""
        if cluster not in self.slots:
            return NoFit(f"cluster {cluster} reports no capacity (down, disabled, or not registered)", never=False)
        if not self._slots(cluster, sharing):
            return NoFit(f"{cluster} offers no {sharing.value} GPUs", never=True)
        group = self._group(cluster, sharing)
        if sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG):
            return self._fit_mig(spec, cluster, sharing, group, partition)
        if sharing == Sharing.SLURM_MPS:
            return self._fit_mps(spec, cluster, group, partition)
        if sharing == Sharing.K8S_TIMESLICE:
            return self._fit_timeslice(spec, cluster, group, partition)
        return self._fit_whole(spec, cluster, sharing, group, partition)

    # -- per sharing mode ----------------------------------------------------------

    def _fit_whole(self, spec, cluster, sharing, group: _Group, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        able = [s for s in group.shapes.values() if s.unit_memory_gb >= memory and s.capacity >= spec.gpus]
        what = f"{spec.gpus} whole GPU{'s' if spec.gpus > 1 else ''}" + (f" with {memory:g} GB" if memory else "")
        if not able:
            largest = max((s.capacity for s in group.shapes.values() if s.unit_memory_gb >= memory), default=0)
            return NoFit(f"needs {what} on one node; the most {cluster} has is {largest}", never=True)
        return self._take_best(spec, cluster, sharing, group, able, spec.gpus, None, what, partition)

    def _fit_mig(self, spec, cluster, sharing, group: _Group, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        offered = sorted(group.offered.items(), key=lambda item: (item[1], item[0]))
        profiles = [p for p, mem in offered if mem >= memory]
        if not profiles:
            largest = ", ".join(p for p, _ in offered[-1:]) or "none"
            return NoFit(f"no MIG slice on {cluster} has {memory:g} GB (largest: {largest})", never=True)
        smallest = profiles[0]
        shapes = group.shapes.values()
        for profile in profiles:  # the smallest profile that covers the memory first
            able = [s for s in shapes if s.profile == profile and s.capacity >= spec.gpus]
            fit = self._take_best(
                spec, cluster, sharing, group, able, spec.gpus, profile, f"{profile} slice", partition
            )
            if isinstance(fit, Fit):
                return fit
        if not any(s.capacity >= spec.gpus for s in shapes if s.profile in profiles):
            return NoFit(f"needs {spec.gpus} MIG slices of {memory:g} GB on one node of {cluster}", never=True)
        able = [s for s in shapes if s.profile == smallest]
        free = sum(s.free for s in able)
        total = sum(s.total for s in able)
        return NoFit(
            f"waiting for a {smallest} slice on {cluster} ({free} of {total} free)",
            never=False,
            waiting_for=(cluster, sharing.value, smallest),
        )

    def _fit_mps(self, spec, cluster, group: _Group, partition) -> Fit | NoFit:
        if spec.gpus > 1:
            return NoFit("MPS shares one GPU among processes: a job with gpus > 1 cannot use it", never=True)
        able: list[tuple[_Shape, int]] = []
        for shape in group.shapes.values():
            gpu_memory = shape.gpu_memory_gb or shape.unit_memory_gb * 100
            share = mps_share(spec.gpu_memory_gb, gpu_memory)
            if share <= 100:
                able.append((shape, share))
        if not able:
            return NoFit(f"needs {spec.gpu_memory_gb:g} GB; no MPS GPU on {cluster} has that much", never=True)
        # Best fit: the least free after taking the share; ties go to inventory order.
        best = None
        for shape, share in able:
            entry = shape.first_with(share, group.slots)
            if entry is not None and (best is None or (entry[0] - share, entry[2]) < best[0]):
                best = ((entry[0] - share, entry[2]), share)
        if best is None:
            share = min(able, key=lambda item: item[0].first)[1]
            free = max(shape.most_free for shape, _ in able)
            return NoFit(
                f"waiting for an MPS share of {share}% on {cluster} (at most {free}% free on one GPU)",
                never=False,
                waiting_for=(cluster, Sharing.SLURM_MPS.value, None),
            )
        (_, position), share = best
        return self._commit(spec, cluster, Sharing.SLURM_MPS, group, position, share, None, 1, partition)

    def _fit_timeslice(self, spec, cluster, group: _Group, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        able = [s for s in group.shapes.values() if (s.gpu_memory_gb or 0) >= memory and s.capacity >= spec.gpus]
        if not able:
            return NoFit(
                f"needs {memory:g} GB of GPU memory; the largest time-sliced GPU on {cluster} "
                f"has {group.largest_gpu_memory:g} GB",
                never=True,
            )
        replicas = replicas_of(spec)
        need_memory = memory * spec.gpus
        slots = group.slots

        def has_memory(s: Slot) -> bool:
            return s.memory_free_gb is None or s.memory_free_gb >= need_memory

        def best() -> tuple | None:
            found = None
            for shape in able:
                entry = shape.first_with(spec.gpus, slots, has_memory)
                if entry is not None and (found is None or entry < found):
                    found = entry
            return found

        if not self._replicas_fit(able, slots, spec.gpus, need_memory, replicas, has_memory):
            free = sum(s.free for s in able)
            return NoFit(
                f"waiting for {replicas * spec.gpus} time-slice replica(s) with {memory:g} GB on {cluster} "
                f"({free} replicas free; GPU memory is not over-committed, to avoid OOM kills)",
                never=False,
                waiting_for=(cluster, Sharing.K8S_TIMESLICE.value, None),
            )
        # Replicas of a Deployment may land on different nodes: best fit for each.
        first = None
        for _ in range(replicas):
            position = best()[2]
            slot = slots[position]
            group.set_free(position, slot.free - spec.gpus)
            if slot.memory_free_gb is not None:
                slot.memory_free_gb -= need_memory
            first = first or slot
        unit = first.unit
        return Fit(
            Placement(
                cluster=cluster,
                sharing=Sharing.K8S_TIMESLICE,
                units=spec.gpus,
                gpu_equivalents=spec.gpus * unit.gpu_equivalent * replicas,
                node=unit.node if replicas == 1 else None,
                gpu_model=unit.gpu_model,
                gpu_memory_gb=spec.gpu_memory_gb,
                replicas=replicas,
                partition=partition,
            )
        )

    @staticmethod
    def _replicas_fit(able, slots, gpus, need_memory, replicas, has_memory) -> bool:
        """Whether the slots with room for one replica hold ``replicas`` of them together."""
        room = 0
        for shape in able:
            order = shape.order
            for i in range(bisect_left(order, (gpus,)), len(order)):
                s = slots[order[i][2]]
                if not has_memory(s):
                    continue
                room += min(
                    s.free // gpus,
                    int(s.memory_free_gb // need_memory) if need_memory and s.memory_free_gb else 10**9,
                )
                if room >= replicas:
                    return True
        return False

    # -- helpers -------------------------------------------------------------------

    def _take_best(self, spec, cluster, sharing, group: _Group, able, units, profile, what, partition) -> Fit | NoFit:
        replicas = replicas_of(spec)
        need = units * replicas
        best = None
        for shape in able:
            entry = shape.first_with(need, group.slots)
            if entry is not None and (best is None or entry < best):
                best = entry
        if best is None:
            free = sum(s.free for s in able)
            total = sum(s.total for s in able)
            return NoFit(
                f"waiting for {what} on {cluster} ({free} of {total} free)",
                never=False,
                waiting_for=(cluster, sharing.value, profile),
            )
        return self._commit(spec, cluster, sharing, group, best[2], units, profile, replicas, partition)

    def _commit(self, spec, cluster, sharing, group: _Group, position, units, profile, replicas, partition) -> Fit:
        slot = group.slots[position]
        group.set_free(position, slot.free - units * replicas)
        unit = slot.unit
        return Fit(
            Placement(
                cluster=cluster,
                sharing=sharing,
                units=units,
                gpu_equivalents=units * unit.gpu_equivalent * replicas,
                node=unit.node,
                mig_profile=profile,
                gpu_model=unit.gpu_model,
                gpu_memory_gb=spec.gpu_memory_gb,
                replicas=replicas,
                partition=partition,
            )
        )


def model_memory(name: str) -> float | None:
    try:
        return gpu_model(name).memory_gb
    except ValueError:
        return None
