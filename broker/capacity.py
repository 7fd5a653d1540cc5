"""Free GPU capacity as the scheduler sees it, and fitting a job onto it.

Built once per scheduling cycle from each cluster's inventory (what it reports
allocated) and the broker's own placements the cluster has not started yet. Fitting
is best fit: of the nodes where the job fits now, the one it leaves with the least
free room, so large free blocks stay whole for large jobs. A job's units are taken
whole or not at all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
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


@dataclass
class CapacityView:
    """Free units per cluster, mutable within one cycle as the scheduler places jobs."""

    slots: dict[str, dict[Sharing, list[Slot]]] = field(default_factory=dict)

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
        for slot in self._slots(placement.cluster, placement.sharing):
            if placement.node not in (None, slot.unit.node):
                continue
            if placement.mig_profile and slot.unit.mig_profile != placement.mig_profile:
                continue
            need = placement.units * placement.replicas
            slot.free = max(slot.free - need, 0)
            if slot.memory_free_gb is not None and placement.gpu_memory_gb:
                slot.memory_free_gb -= placement.gpu_memory_gb * need
            return

    def _slots(self, cluster: str, sharing: Sharing) -> list[Slot]:
        return self.slots.get(cluster, {}).get(sharing, [])

    def fit(self, spec: JobSpec, cluster: str, sharing: Sharing, *, partition: str | None = None) -> Fit | NoFit:
        """Place the job on ``cluster`` under ``sharing`` now, or say why not."""
        if cluster not in self.slots:
            return NoFit(f"cluster {cluster} reports no capacity (down, disabled, or not registered)", never=False)
        slots = self._slots(cluster, sharing)
        if not slots:
            return NoFit(f"{cluster} offers no {sharing.value} GPUs", never=True)
        if sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG):
            return self._fit_mig(spec, cluster, sharing, slots, partition)
        if sharing == Sharing.SLURM_MPS:
            return self._fit_mps(spec, cluster, slots, partition)
        if sharing == Sharing.K8S_TIMESLICE:
            return self._fit_timeslice(spec, cluster, slots, partition)
        return self._fit_whole(spec, cluster, sharing, slots, partition)

    # -- per sharing mode ----------------------------------------------------------

    def _fit_whole(self, spec, cluster, sharing, slots, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        able = [s for s in slots if s.unit.unit_memory_gb >= memory and s.unit.capacity >= spec.gpus]
        what = f"{spec.gpus} whole GPU{'s' if spec.gpus > 1 else ''}" + (f" with {memory:g} GB" if memory else "")
        if not able:
            largest = max((s.unit.capacity for s in slots if s.unit.unit_memory_gb >= memory), default=0)
            return NoFit(f"needs {what} on one node; the most {cluster} has is {largest}", never=True)
        return self._take_best(spec, cluster, sharing, able, spec.gpus, None, what, partition)

    def _fit_mig(self, spec, cluster, sharing, slots, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        offered = sorted(
            {s.unit.mig_profile: s.unit.unit_memory_gb for s in slots if s.unit.mig_profile}.items(),
            key=lambda item: (item[1], item[0]),
        )
        profiles = [p for p, mem in offered if mem >= memory]
        if not profiles:
            largest = ", ".join(p for p, _ in offered[-1:]) or "none"
            return NoFit(f"no MIG slice on {cluster} has {memory:g} GB (largest: {largest})", never=True)
        smallest = profiles[0]
        for profile in profiles:  # the smallest profile that covers the memory first
            able = [s for s in slots if s.unit.mig_profile == profile and s.unit.capacity >= spec.gpus]
            fit = self._take_best(spec, cluster, sharing, able, spec.gpus, profile, f"{profile} slice", partition)
            if isinstance(fit, Fit):
                return fit
        able = [s for s in slots if s.unit.mig_profile == smallest]
        if not any(s.unit.capacity >= spec.gpus for s in slots if s.unit.mig_profile in profiles):
            return NoFit(f"needs {spec.gpus} MIG slices of {memory:g} GB on one node of {cluster}", never=True)
        free = sum(s.free for s in able)
        total = sum(s.unit.capacity for s in able)
        return NoFit(
            f"waiting for a {smallest} slice on {cluster} ({free} of {total} free)",
            never=False,
            waiting_for=(cluster, sharing.value, smallest),
        )

    def _fit_mps(self, spec, cluster, slots, partition) -> Fit | NoFit:
        if spec.gpus > 1:
            return NoFit("MPS shares one GPU among processes: a job with gpus > 1 cannot use it", never=True)
        able = []
        for s in slots:
            gpu_memory = s.unit.gpu_memory_gb or s.unit.unit_memory_gb * 100
            share = mps_share(spec.gpu_memory_gb, gpu_memory)
            if share <= 100:
                able.append((s, share))
        if not able:
            return NoFit(f"needs {spec.gpu_memory_gb:g} GB; no MPS GPU on {cluster} has that much", never=True)
        best = None
        for s, share in able:
            if s.free >= share and (best is None or s.free - share < best[0].free - best[1]):
                best = (s, share)
        if best is None:
            share = able[0][1]
            free = max(s.free for s, _ in able)
            return NoFit(
                f"waiting for an MPS share of {share}% on {cluster} (at most {free}% free on one GPU)",
                never=False,
                waiting_for=(cluster, Sharing.SLURM_MPS.value, None),
            )
        slot, share = best
        return self._commit(spec, cluster, Sharing.SLURM_MPS, slot, share, None, 1, partition)

    def _fit_timeslice(self, spec, cluster, slots, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        able = [s for s in slots if (s.unit.gpu_memory_gb or 0) >= memory and s.unit.capacity >= spec.gpus]
        if not able:
            largest = max((s.unit.gpu_memory_gb or 0 for s in slots), default=0)
            return NoFit(
                f"needs {memory:g} GB of GPU memory; the largest time-sliced GPU on {cluster} has {largest:g} GB",
                never=True,
            )
        replicas = replicas_of(spec)
        need_memory = memory * spec.gpus
        candidates = [
            s for s in able if s.free >= spec.gpus and (s.memory_free_gb is None or s.memory_free_gb >= need_memory)
        ]
        if (
            len(candidates) == 0
            or sum(
                min(
                    s.free // spec.gpus,
                    int(s.memory_free_gb // need_memory) if need_memory and s.memory_free_gb else 10**9,
                )
                for s in candidates
            )
            < replicas
        ):
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
            slot = min(
                (
                    s
                    for s in candidates
                    if s.free >= spec.gpus and (s.memory_free_gb is None or s.memory_free_gb >= need_memory)
                ),
                key=lambda s: (s.free - spec.gpus, s.unit.node),
            )
            slot.free -= spec.gpus
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

    # -- helpers -------------------------------------------------------------------

    def _take_best(self, spec, cluster, sharing, able, units, profile, what, partition) -> Fit | NoFit:
        replicas = replicas_of(spec)
        fitting = [s for s in able if s.free >= units * replicas]
        if not fitting:
            free = sum(s.free for s in able)
            total = sum(s.unit.capacity for s in able)
            return NoFit(
                f"waiting for {what} on {cluster} ({free} of {total} free)",
                never=False,
                waiting_for=(cluster, sharing.value, profile),
            )
        slot = min(fitting, key=lambda s: (s.free - units * replicas, s.unit.node))
        return self._commit(spec, cluster, sharing, slot, units, profile, replicas, partition)

    def _commit(self, spec, cluster, sharing, slot, units, profile, replicas, partition) -> Fit:
        slot.free -= units * replicas
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
