"""Free GPU capacity as the scheduler sees it, and fitting a job onto it.

This module owns :class:`CapacityView`: built once per scheduling cycle from each
cluster's inventory (what it reports allocated) and the broker's own placements the
cluster has not started yet, then changed by every fit the cycle makes. A job's units
are taken whole or not at all. What callers may assume:

- **Route filters.** ``fit(..., gpu_model=)`` considers only units of that model;
  names compare by gpush's canonical model name (:func:`broker.core.gpus.gpu_model`, so
  aliases match), names gpush does not know by exact string. :meth:`CapacityView.take`
  and :meth:`CapacityView.give_back` charge and refund the unit a placement names (its
  node, model, MIG profile and, for MPS and time-slicing, its GPU) or nothing: never
  another unit that happens to have room.
- **Whole GPUs and MIG instances: best fit.** Of the nodes where the job fits now,
  the one it leaves with the least free room, so large free blocks stay whole for
  large jobs. A job whose route names no model keeps off a model whose free units
  jobs pinned to it (a route's ``gpu_model``) waited for at the end of the last cycle
  (:attr:`CapacityView.pinned`, from :class:`broker.placement.decision.CycleDecisions`):
  it goes there only when no other model has room, so work that can run anywhere does
  not fill the GPUs that pinned work can only get there.
- **Topology** (issue 35; the rules in :mod:`broker.placement.topology_fit`). A one-node
  whole-GPU job goes to the node whose free GPUs are closest (NVLink island, PCIe switch,
  socket), then best fit; a unit that says which GPUs are free gets them named in
  ``Placement.gpus`` and its free set (``Slot.free_gpus``) follows every take and give
  back. A gang's nodes are in one network domain when one has room, else the fewest. A
  job's ``topology`` ask that is required waits for it, or is held when it can never be.
- **MPS shares and time-slice replicas: per physical GPU, fragmentation-aware.** A
  share or a replica lives on one GPU, so an inventory that reports these modes per
  GPU (``CapacityUnit.gpus`` of one index) is fitted per GPU, and the placement names
  the GPU (``Placement.gpus``). Among the GPUs where the job fits, the choice is
  FGD's (:func:`broker.placement.fgd.choose`, after Weng et al., ATC '23): the GPU
  whose use raises its node's fragmentation least, with FGD's tolerance band
  (:data:`broker.placement.fgd.TOLERANCE_MILLI`) across nodes and best fit by the
  node's free shared GPU among near-equals. Fragmentation is measured against the
  view's ``workload`` (its one-GPU shapes, :func:`broker.placement.fgd.single_gpu`:
  nothing else lands on a shared GPU). Without one, each cluster and mode learns its
  own: the shares of the jobs the view was asked to fit there so far (placed or not:
  a job that waits is demand too), plus one pseudo-job each of 1/8, 1/4, 1/2 and a
  whole GPU. The pseudo-jobs are the shares time-slicing (2, 4 or 8 replicas) and
  memory-sized MPS shares usually come in; the whole GPU among them keeps fresh GPUs
  whole for the jobs that ask a full share until the jobs actually seen say
  otherwise, and four of them weigh little once a cycle has fitted a few dozen jobs.
  The replicas of an elastic time-sliced job go to one node when one holds them all
  (the placement then names a GPU per replica), else GPU by GPU over several nodes
  (the placement names no node; give_back of it still returns exactly what it took).
- **Per-node units still work.** A cluster that only knows per-node counts for these
  modes (a unit spanning several GPUs) is fitted by node, by best fit, as before;
  the placement then names no GPU and the cluster picks one.
- **Time-slice memory guard per GPU.** Time-slicing has no memory isolation: a job
  fits a GPU only if the ``gpu_memory_gb`` of the jobs on it stays within its memory.
  A per-GPU unit's memory in use is what the cluster reports for it
  (``memory_allocated_gb``), else the caller's per-node figure spread over the node's
  GPUs by the replicas allocated on each (exact when the node's jobs ask alike).

Fitting is fast. A cycle fits thousands of jobs against thousands of nodes, so no fit
scans every node. The slots of one cluster and sharing mode are grouped by *shape*
(model, MIG profile, unit memory, capacity, GPU memory, per GPU or per node:
everything the per-job filters look at). Each shape keeps its slots sorted. Per-node
slots by (free units, node, inventory order), so a shape's best fit is the first slot
with enough free units, found by bisection. Per-GPU slots as one entry per node and
free level (free units, the node's free shared milli-GPU, node order), so a node's
change moves one entry per level it has, not one per GPU. FGD scores a bounded
candidate set: one node per distinct free level of each shape (at most
:data:`~broker.placement.slots.LEVELS` levels from the fullest up, each found by
bisection; the first node of a level is the one with the least free, FGD's tie-break;
at most :data:`~broker.placement.slots.PER_LEVEL` looked at for one whose GPU passes
the memory guard), then the GPUs of the chosen node; the increase of a level is
computed once per workload and cached. Within those bounds the result is :func:`~broker.placement.fgd.choose`'s over
every node: MPS (101 levels) and time-slicing with up to 127 replicas a GPU always
are. Running totals per shape give the "n of m free" of a waiting job without a
scan. Every change of a slot's free units goes through the view, which keeps that
order. The index, and FGD's bounded search over it (:func:`~broker.placement.slots.fgd_gpu`),
are :mod:`broker.placement.slots`.

This module is one piece of about 1,100 lines on purpose: :class:`CapacityView` is one
invariant (every change of free units goes through it, so the index, the replicas it
spread and the memory guard stay in step), and its per-mode fits (whole GPUs, MIG, MPS,
time-slicing) take, refund and record through that one state; split across modules,
the invariant would be too. What does not touch that state lives elsewhere: the index
and FGD's search over it in :mod:`broker.placement.slots`, the measure in
:mod:`broker.placement.fgd`, the topology rules and their words in
:mod:`broker.placement.topology_fit`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from broker.accounting.equivalents import held
from broker.core.adapter import CapacityUnit, Placement, Sharing
from broker.core.gpus import gpu_model
from broker.core.schemas import JobSpec
from broker.core.topology import GPU_LEVELS, choose_nodes, domain_of
from broker.placement.fgd import MILLI, WorkloadDistribution
from broker.placement.slots import (
    MEMORY_SLACK,
    PER_GPU_SHARING,
    Shape,
    Slot,
    SlotGroup,
    canonical_model,
    fgd_gpu,
    fgd_gpu_on_node,
)
from broker.placement.topology_fit import (
    WHOLE,
    ask_of,
    closest,
    gang_domain_reason,
    gpu_level_reason,
    gpu_level_unkept,
    initial_free_gpus,
    most_in_group,
    rank_of,
    return_gpus,
    take_gpus,
    unknown_level,
)


@dataclass(frozen=True)
class Fit:
    placement: Placement


@dataclass(frozen=True)
class NoFit:
    """Why a route cannot take the job: now (``never`` False) or ever (``never`` True)."""

    reason: str
    never: bool
    # What the job waits for, so jobs queued behind it can be counted:
    # (cluster, sharing, MIG profile, canonical GPU model of the route).
    waiting_for: tuple[str, str, str | None, str | None] | None = None


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
    """Free units per cluster, mutable within one cycle as the scheduler places jobs.

    ``slots`` is for reading; change free units through :meth:`take`, :meth:`give_back`
    and :meth:`fit`, which keep the fitting index in step. ``workload``: what MPS and
    time-slice placement measures fragmentation against (None: learned, see the
    module docstring).
    """

    slots: dict[str, dict[Sharing, list[Slot]]] = field(default_factory=dict)
    workload: WorkloadDistribution | None = None
    # Clusters whose inventory could not be read this cycle, and why (their adapter's error).
    unavailable: dict[str, str] = field(default_factory=dict)
    _groups: dict[tuple[str, Sharing], SlotGroup] = field(default_factory=dict, repr=False, compare=False)
    # Where the replicas of multi-replica fits of shared modes went, so that they come
    # back exactly: (position, units) per replica, by the placement as one replica on
    # that replica's node (what give_back receives when a caller returns them node by
    # node), and the nodes of each placement whose replicas went to several nodes.
    _replicas: dict[tuple, list[tuple[int, int]]] = field(default_factory=dict, repr=False, compare=False)
    _spread: dict[Placement, list[list[str]]] = field(default_factory=dict, repr=False, compare=False)
    # The whole GPUs each rank of a gang this view fitted took, by (placement, node): a gang's
    # placement names none (its cluster picks), yet undo must give back exactly those.
    _rank_gpus: dict[tuple[Placement, str], tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    # Units marked broken (a drift finding, or the adapter), by cluster: never placed on.
    # A job only they could hold waits for the repair instead of being held for good,
    # so ``_mended`` (the same inventory, nothing broken; made on first need) is fitted too.
    broken: dict[str, list[CapacityUnit]] = field(default_factory=dict)
    _inventory: dict[str, list[CapacityUnit]] = field(default_factory=dict, repr=False, compare=False)
    _mended: CapacityView | None = field(default=None, repr=False, compare=False)
    # GPUs (units) that jobs pinned to a model (a route's gpu_model) waited for at the end of
    # the last cycle, by (cluster, model): a job that may run on any model keeps off a
    # model whose free units those jobs already need (see _take_best).
    pinned: dict[tuple[str, str], int] = field(default_factory=dict)
    # Nodes whose units their cluster offers none of now (drained, cordoned, fenced for a
    # MIG change or a move), by (cluster, sharing, profile): node -> why, for waiting reasons.
    closed: dict[tuple[str, Sharing, str | None], dict[str, str]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        inventory: Mapping[str, Iterable[CapacityUnit]],
        not_yet_started: Iterable[Placement] = (),
        timeslice_memory_used: Mapping[tuple[str, str], float] | None = None,
        *,
        workload: WorkloadDistribution | None = None,
        unavailable: Mapping[str, str] | None = None,
    ) -> CapacityView:
        """``not_yet_started``: placements the broker made that clusters do not count yet.
        ``timeslice_memory_used``: GPU memory of gpush's active time-sliced jobs per
        (cluster, node), the placements not yet started included (as the scheduler
        counts it); used for units that do not report ``memory_allocated_gb``.
        ``workload``: see the class docstring. ``unavailable``: clusters that did not
        answer, with why; jobs routed there wait with that reason."""
        view = cls(workload=workload, unavailable=dict(unavailable or {}))
        pending = list(not_yet_started)
        memory_used = timeslice_memory_used or {}
        pending_memory: dict[tuple[str, str], float] = defaultdict(float)
        for p in pending:
            if p.sharing == Sharing.K8S_TIMESLICE and p.node and p.gpu_memory_gb:
                pending_memory[(p.cluster, p.node)] += p.gpu_memory_gb * p.units * p.replicas
        for cluster, units in inventory.items():
            # A drift finding marks a unit broken: never place there.
            units = list(units)
            live = [unit for unit in units if not unit.broken]
            if len(live) < len(units):
                view.broken[cluster] = [unit for unit in units if unit.broken]
                view._inventory[cluster] = units

            def running(node: str, cluster: str = cluster) -> float:
                # The caller's figure counts placements not started yet; take() charges
                # those to their own GPU below.
                return max(memory_used.get((cluster, node), 0.0) - pending_memory.get((cluster, node), 0.0), 0.0)

            memory_free = _timeslice_memory_free(live, running)
            by_sharing: dict[Sharing, list[Slot]] = defaultdict(list)
            for unit, memory in zip(live, memory_free, strict=True):
                by_sharing[unit.sharing].append(Slot(unit, unit.free, memory, initial_free_gpus(unit)))
                if unit.labels.get("unavailable") and unit.capacity > 0:
                    key = (cluster, unit.sharing, unit.mig_profile)
                    view.closed.setdefault(key, {})[unit.node] = unit.labels["unavailable"]
            view.slots[cluster] = dict(by_sharing)
            for sharing, slots in by_sharing.items():
                view._groups[(cluster, sharing)] = SlotGroup(slots, sharing, workload)
        for placement in pending:
            view.take(placement)
        return view

    def _closed(self, cluster: str, sharing: Sharing, profile: str | None) -> str:
        """``; mig01 offers none: node mig01 is drain: gpush: MIG change 3`` for a waiting
        reason, when nodes with such units offer none now (at most two named)."""
        nodes = self.closed.get((cluster, sharing, profile))
        if not nodes:
            return ""
        # brackets for the why's own parentheses: the reason's last ")" is the count's, which
        # the decision extends ("2 jobs ahead")
        named = sorted((node, why.replace("(", "[").replace(")", "]")) for node, why in nodes.items())
        more = f" and {len(named) - 2} more nodes" if len(named) > 2 else ""
        return "; " + "; ".join(f"{node} offers none: {why}" for node, why in named[:2]) + more

    def clusters(self) -> list[str]:
        return list(self.slots)

    def total_gpu_equivalents(self) -> float:
        return sum(
            s.unit.capacity * s.unit.gpu_equivalent for c in self.slots.values() for ss in c.values() for s in ss
        )

    def free_gpu_equivalents(self) -> float:
        return sum(s.free * s.unit.gpu_equivalent for c in self.slots.values() for ss in c.values() for s in ss)

    def take(self, placement: Placement) -> None:
        """Count ``placement`` against free capacity: on its node (any node, best effort,
        when it names none), on a unit of its model and MIG profile, and on the GPU it
        names; nothing when no such unit is left (never on another unit). A gang's
        units are counted on each of its nodes."""
        if placement.gang:
            for rank in _ranks(placement):
                self.take(rank)
            return
        group = self._group(placement.cluster, Sharing(placement.sharing))
        if group is None:
            return
        for gpu, units in _charges(placement):
            position = self._slot_for(group, placement, gpu, units, refund=False)
            if position is not None:
                slot = group.slots[position]
                if slot.free_gpus is not None:
                    take_gpus(slot, min(units, slot.free), placement.gpus)
                group.set_free(position, max(slot.free - units, 0))
                if slot.memory_free_gb is not None and placement.gpu_memory_gb:
                    slot.memory_free_gb -= placement.gpu_memory_gb * units

    def give_back(self, placement: Placement) -> None:
        """Return what a fit took when the job cannot use it after all (its tenant's
        quota), or what a placement held once it ended: to the unit on its node with its
        model and MIG profile, on the GPU(s) it names. The replicas of a multi-replica
        fit of this view come back from exactly where the fit put them, whether the
        placement is given back whole or node by node (``replace(placement, node=n,
        replicas=k)``: k of the replicas it put on node n). A gang's units come back
        on each of its nodes."""
        if placement.gang:
            for rank in _ranks(placement):
                gpus = self._rank_gpus.pop((placement, rank.node), ())
                self.give_back(replace(rank, gpus=gpus) if len(gpus) == rank.units else rank)
            return
        sharing = Sharing(placement.sharing)
        group = self._group(placement.cluster, sharing)
        if group is None:
            return
        memory = placement.gpu_memory_gb or 0
        if sharing in PER_GPU_SHARING and (self._replicas or placement.node is None):
            nodes = [placement.node] * placement.replicas
            if placement.node is None:
                spread = self._spread.get(placement)
                if not spread:
                    return  # where its units are is unknown: refunding a guess could free a busy GPU
                nodes = spread.pop()
            refunded = False
            for node in nodes:
                held = self._replicas.get(_replica_key(placement, node))
                if held:
                    position, units = held.pop()
                    self._refund(group, position, units, memory * units)
                    refunded = True
            if refunded:
                return
        for gpu, units in _charges(placement):
            position = self._slot_for(group, placement, gpu, units, refund=True)
            if position is not None:
                slot = group.slots[position]
                if slot.free_gpus is not None:
                    return_gpus(slot, min(units, slot.unit.capacity - slot.free), placement.gpus)
                self._refund(group, position, units, memory * units)

    def _slots(self, cluster: str, sharing: Sharing) -> list[Slot]:
        return self.slots.get(cluster, {}).get(sharing, [])

    def _group(self, cluster: str, sharing: Sharing) -> SlotGroup | None:
        """The index of ``slots[cluster][sharing]``, made on first use for a view built by hand."""
        group = self._groups.get((cluster, sharing))
        if group is None:
            slots = self._slots(cluster, sharing)
            if not slots:
                return None
            group = self._groups[(cluster, sharing)] = SlotGroup(slots, Sharing(sharing), self.workload)
        return group

    @staticmethod
    def _slot_for(group: SlotGroup, placement: Placement, gpu: int | None, units: int, *, refund: bool) -> int | None:
        """The slot ``placement`` holds (or takes) ``units`` on: its node, model and MIG
        profile, and the unit on device ``gpu`` when it names one; among several, the
        first with room for the change."""
        model = canonical_model(placement.gpu_model) if placement.gpu_model else None
        found = None
        for position in group.positions(placement.node):
            slot = group.slots[position]
            unit = slot.unit
            if unit.mig_profile != placement.mig_profile:
                continue
            if model is not None and group.shape_at[position].model != model:
                continue
            if gpu is not None and unit.gpus:
                if gpu in unit.gpus:
                    return position
                continue
            room = unit.capacity - slot.free if refund else slot.free
            if room >= units:
                return position
            if found is None:
                found = position
        return found

    @staticmethod
    def _refund(group: SlotGroup, position: int, units: int, memory_gb: float) -> None:
        slot = group.slots[position]
        group.set_free(position, min(slot.free + units, slot.unit.capacity))
        if slot.memory_free_gb is not None and memory_gb:
            slot.memory_free_gb += memory_gb

    def fit(
        self,
        spec: JobSpec,
        cluster: str,
        sharing: Sharing,
        *,
        partition: str | None = None,
        gpu_model: str | None = None,
    ) -> Fit | NoFit:
        """Place the job on ``cluster`` under ``sharing`` (on ``gpu_model`` GPUs only,
        when the route names a model) now, or say why not. A job that fits only units
        marked broken waits (``never`` False) with their reason, not held: they come back
        once repaired (a drift finding goes away; the adapter stops saying so)."""
        fit = self._fit(spec, cluster, sharing, partition=partition, gpu_model=gpu_model)
        if isinstance(fit, NoFit) and fit.never and cluster in self.broken:
            return self._wait_for_repair(spec, cluster, sharing, partition, gpu_model) or fit
        return fit

    def fit_route(self, job, route) -> Fit | NoFit:
        """:meth:`fit` of ``job.spec`` on a policy route (the decision's call,
        :class:`broker.placement.decision.Capacity`)."""
        return self.fit(
            job.spec, route.cluster, Sharing(route.sharing), partition=route.partition, gpu_model=route.gpu_model
        )

    def undo(self, fit: Fit) -> None:
        """Give back what ``fit`` took: the job will not use it after all (its tenant's quota)."""
        self.give_back(fit.placement)

    @contextmanager
    def hiding(self, cluster: str, nodes: Iterable[str]) -> Iterator[None]:
        """Within the block, the units of ``nodes`` on ``cluster`` look full: a fit goes
        elsewhere or waits (nodes reserved for a gang, broker.placement.reservation).
        Afterwards they have what they had, plus what a give_back in the block returned."""
        hidden = []
        for (c, _sharing), group in self._groups.items():
            if c != cluster:
                continue
            for node in nodes:
                for position in group.positions(node):
                    free = group.slots[position].free
                    if free:
                        hidden.append((group, position, free))
                        group.set_free(position, 0)
        try:
            yield
        finally:
            for group, position, free in reversed(hidden):
                group.set_free(position, group.slots[position].free + free)

    def gang_candidates(self, spec: JobSpec, route) -> dict[str, int]:
        """The nodes of ``route`` that could ever hold one rank of the multi-node ``spec``
        (whole GPUs of the route's model with the memory it asks), with their units free
        now, in inventory order: where a reservation may hold nodes for it. A node whose
        cluster offers none of its units now (``labels["unavailable"]``: drained or
        cordoned, as a node being lent to another cluster is, or fenced for a MIG change)
        is none: it is not the gang's to wait for, and a reservation that held it picks
        another."""
        sharing = Sharing(route.sharing)
        if sharing not in (Sharing.SLURM_EXCLUSIVE, Sharing.K8S_EXCLUSIVE):
            return {}
        group = self._group(route.cluster, sharing)
        if group is None:
            return {}
        model = canonical_model(route.gpu_model) if route.gpu_model else None
        memory = spec.gpu_memory_gb or 0
        found: dict[str, tuple[int, int]] = {}  # node -> (first position, most free)
        for shape in group.shapes_of(model):
            if shape.capacity < spec.gpus or shape.unit_memory_gb < memory:
                continue
            for entry in shape.order:
                position = entry[-1]
                slot = group.slots[position]
                if slot.unit.labels.get("unavailable"):
                    continue
                first, free = found.get(slot.unit.node, (position, 0))
                found[slot.unit.node] = (min(first, position), max(free, slot.free))
        return {node: free for node, (_, free) in sorted(found.items(), key=lambda item: item[1][0])}

    def gang_domains(self, spec: JobSpec, route) -> dict[str, str] | None:
        """For a multi-node ``spec`` that requires one domain of a network level its route's
        cluster has, each node's domain at that level (a node with none is left out), so a
        reservation holds nodes of one domain; None for any other job."""
        level, required = ask_of(spec)
        group = self._group(route.cluster, Sharing(route.sharing))
        if not required or group is None or level not in group.levels:
            return None
        out = {}
        for slot in group.slots:
            domain = domain_of(slot.unit.topology, level)
            if domain is not None:
                out[slot.unit.node] = domain
        return out

    def _wait_for_repair(self, spec, cluster, sharing, partition, gpu_model) -> NoFit | None:
        """Why the job waits when the broken units of ``cluster`` could hold it; None if not even they could."""
        if self._mended is None:
            mended = {
                c: [replace(u, broken=None) if u.broken else u for u in units] for c, units in self._inventory.items()
            }
            self._mended = CapacityView.build(mended, workload=self.workload)
        # Fitting takes from the mended view: a later job finding it full still gets never=False.
        fit = self._mended.fit(spec, cluster, sharing, partition=partition, gpu_model=gpu_model)
        if isinstance(fit, NoFit) and fit.never:
            return None
        broken = [u for u in self.broken[cluster] if u.sharing is sharing]
        if isinstance(fit, Fit):
            p = fit.placement
            broken = [u for u in broken if u.node == p.node and u.mig_profile == p.mig_profile] or broken
        profile = next((u.mig_profile for u in broken if u.mig_profile), None)
        what = profile or sharing.value
        reasons = "; ".join(dict.fromkeys(str(u.broken) for u in broken))
        return NoFit(
            f"waiting for the {what} units of {cluster} marked broken to be repaired ({reasons}; "
            "`gpush inventory drift` says how)",
            never=False,
            waiting_for=(cluster, sharing.value, profile, canonical_model(gpu_model) if gpu_model else None),
        )

    def _fit(
        self,
        spec: JobSpec,
        cluster: str,
        sharing: Sharing,
        *,
        partition: str | None = None,
        gpu_model: str | None = None,
    ) -> Fit | NoFit:
        if cluster not in self.slots:
            if cluster in self.unavailable:
                return NoFit(f"waiting for {cluster}, which does not answer: {self.unavailable[cluster]}", never=False)
            return NoFit(f"cluster {cluster} reports no capacity (down, disabled, or not registered)", never=False)
        if not self._slots(cluster, sharing):
            return NoFit(f"{cluster} offers no {sharing.value} GPUs", never=True)
        group = self._group(cluster, sharing)
        model = canonical_model(gpu_model) if gpu_model else None
        shapes = group.shapes_of(model)
        if not shapes:
            return NoFit(f"{cluster} has no {gpu_model} GPUs offering {sharing.value}", never=True)
        of = f" of {shapes[0].model_name}" if model else ""
        ask = spec.topology
        if ask is not None and ask.level not in GPU_LEVELS + tuple(group.levels):
            return NoFit(unknown_level(ask.level, cluster, group.levels, ask.mode == "required"), never=True)
        if ask is not None and ask.mode == "required" and ask.level in GPU_LEVELS and spec.gpus > 1:
            unkept = gpu_level_unkept(ask.level, spec.gpus, cluster, sharing.value, replicas_of(spec))
            if unkept:
                return NoFit(unkept, never=True)
        if spec.nodes > 1:
            return self._fit_gang(spec, cluster, sharing, group, shapes, model, partition)
        if sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG):
            return self._fit_mig(spec, cluster, sharing, group, shapes, model, of, partition)
        if sharing == Sharing.SLURM_MPS:
            return self._fit_mps(spec, cluster, group, shapes, model, of, partition)
        if sharing == Sharing.K8S_TIMESLICE:
            return self._fit_timeslice(spec, cluster, group, shapes, model, of, partition)
        return self._fit_whole(spec, cluster, sharing, group, shapes, model, partition)

    # -- per sharing mode ----------------------------------------------------------

    def _fit_whole(self, spec, cluster, sharing, group: SlotGroup, shapes, model, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        able = [s for s in shapes if s.unit_memory_gb >= memory and s.capacity >= spec.gpus]
        kind = f"{shapes[0].model_name} GPU" if model else "GPU"
        what = f"{spec.gpus} whole {kind}{'s' if spec.gpus > 1 else ''}" + (f" with {memory:g} GB" if memory else "")
        if not able:
            roomy = [s for s in shapes if s.unit_memory_gb >= memory]
            if not roomy:  # no GPU is large enough, however many a node has
                most = max(s.unit_memory_gb for s in shapes)
                return NoFit(
                    f"needs {what}; no {kind} of {cluster} has {memory:g} GB (the most: {most:g} GB)", never=True
                )
            largest = max(s.capacity for s in roomy)
            per = f" with {memory:g} GB" if memory else ""
            return NoFit(
                f"needs {what} on one node; no node of {cluster} has more than {largest} {kind}{'s' * (largest != 1)}"
                + per,
                never=True,
            )
        ask = spec.topology
        level = ask.level if ask is not None and ask.mode == "required" else None
        limit = GPU_LEVELS.index(level) if level in GPU_LEVELS else None
        fit = self._take_best(spec, cluster, sharing, group, able, spec.gpus, None, model, what, partition, limit)
        if limit is not None and isinstance(fit, NoFit) and not fit.never:
            now, ever = most_in_group(group, able, level)
            reason, never = gpu_level_reason(level, spec.gpus, cluster, now, ever)
            fit = NoFit(reason, never=never, waiting_for=None if never else fit.waiting_for)
        return fit

    def _fit_mig(self, spec, cluster, sharing, group: SlotGroup, shapes, model, of, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        offered = sorted(group.offered.get(model, {}).items(), key=lambda item: (item[1], item[0]))
        profiles = [p for p, mem in offered if mem >= memory]
        if not profiles:
            largest = ", ".join(p for p, _ in offered[-1:]) or "none"
            return NoFit(f"no MIG slice{of} on {cluster} has {memory:g} GB (largest: {largest})", never=True)
        smallest = profiles[0]
        for profile in profiles:  # the smallest profile that covers the memory first
            able = [s for s in shapes if s.profile == profile and s.capacity >= spec.gpus]
            fit = self._take_best(
                spec, cluster, sharing, group, able, spec.gpus, profile, model, f"{profile} slice{of}", partition
            )
            if isinstance(fit, Fit):
                return fit
        if not any(s.capacity >= spec.gpus for s in shapes if s.profile in profiles):
            return NoFit(f"needs {spec.gpus} MIG slices{of} of {memory:g} GB on one node of {cluster}", never=True)
        able = [s for s in shapes if s.profile == smallest]
        free = sum(s.free for s in able)
        total = sum(s.total for s in able)
        closed = self._closed(cluster, sharing, smallest)
        return NoFit(
            f"waiting for a {smallest} slice{of} on {cluster} ({free} of {total} free{closed})",
            never=False,
            waiting_for=(cluster, sharing.value, smallest, model),
        )

    def _fit_mps(self, spec, cluster, group: SlotGroup, shapes, model, of, partition) -> Fit | NoFit:
        if spec.gpus > 1:
            return NoFit("MPS shares one GPU among processes: a job with gpus > 1 cannot use it", never=True)
        key = ("mps", model, spec.gpu_memory_gb)
        cached = group.able.get(key)
        if cached is None:
            able: list[tuple[Shape, int]] = []
            for shape in shapes:
                gpu_memory = shape.gpu_memory_gb or shape.unit_memory_gb * 100
                share = mps_share(spec.gpu_memory_gb, gpu_memory)
                if share <= 100:
                    able.append((shape, share))
            cached = group.able[key] = (able, {shape: share for shape, share in able if shape.per_gpu})
        able, per_gpu = cached
        if not able:
            return NoFit(f"needs {spec.gpu_memory_gb:g} GB; no MPS GPU{of} on {cluster} has that much", never=True)
        # One share per job, as before elastic replicas existed for MPS: Slurm runs it as one job.
        if per_gpu:
            picks = self._pick(group, per_gpu, 1, 0.0)
            if picks is not None:
                return Fit(self._shared_placement(spec, cluster, Sharing.SLURM_MPS, group, picks, 1, partition))
        # Per-node units: best fit, the least free after taking the share; ties go to inventory order.
        best = None
        for shape, share in able:
            if shape.per_gpu:
                continue
            entry = shape.first_with(share, group.slots)
            if entry is not None and (best is None or (entry[0] - share, entry[-1]) < best[0]):
                best = ((entry[0] - share, entry[-1]), share)
        if best is not None:
            (_, position), share = best
            return self._commit(spec, cluster, Sharing.SLURM_MPS, group, position, share, None, 1, partition)
        share = min(able, key=lambda item: item[0].first)[1]
        free = max(shape.most_free for shape, _ in able)
        return NoFit(
            f"waiting for an MPS share of {share}%{of} on {cluster} (at most {free}% free on one GPU)",
            never=False,
            waiting_for=(cluster, Sharing.SLURM_MPS.value, None, model),
        )

    def _fit_timeslice(self, spec, cluster, group: SlotGroup, shapes, model, of, partition) -> Fit | NoFit:
        memory = spec.gpu_memory_gb or 0
        units = spec.gpus
        key = ("timeslice", model, memory, units)
        cached = group.able.get(key)
        if cached is None:
            # A replica's units live on one GPU: per GPU, their memory adds up there.
            able = [
                s
                for s in shapes
                if s.capacity >= units and (s.gpu_memory_gb or 0) >= (memory * units if s.per_gpu else memory)
            ]
            per_gpu = {shape: units for shape in able if shape.per_gpu}
            cached = group.able[key] = (able, per_gpu, [shape for shape in able if not shape.per_gpu])
        able, per_gpu, by_node = cached
        if not able:
            if not any(s.capacity >= units for s in shapes):
                most = max(s.capacity for s in shapes)
                return NoFit(
                    f"needs {units} time-slice replicas on one GPU; the GPUs{of} of {cluster} are split "
                    f"at most {most} ways",
                    never=True,
                )
            largest = max((s.gpu_memory_gb or 0 for s in shapes), default=0)
            need = memory * units if all(s.per_gpu for s in shapes) else memory
            return NoFit(
                f"needs {need:g} GB of GPU memory; the largest time-sliced GPU{of} on {cluster} has {largest:g} GB",
                never=True,
            )
        replicas = replicas_of(spec)
        if per_gpu:
            picks = self._pick(group, per_gpu, replicas, memory * units)
            if picks is not None:
                return Fit(
                    self._shared_placement(spec, cluster, Sharing.K8S_TIMESLICE, group, picks, replicas, partition)
                )
        if by_node:
            fit = self._timeslice_by_node(spec, cluster, group, by_node, replicas, partition)
            if fit is not None:
                return fit
        free = sum(s.free for s in able)
        return NoFit(
            f"waiting for {replicas * units} time-slice replica(s) with {memory:g} GB{of} on {cluster} "
            f"({free} replicas free; GPU memory is not over-committed, to avoid OOM kills)",
            never=False,
            waiting_for=(cluster, Sharing.K8S_TIMESLICE.value, None, model),
        )

    def _timeslice_by_node(self, spec, cluster, group: SlotGroup, able, replicas, partition) -> Fit | None:
        """Per-node time-slice units: best fit for each replica, the memory guard per node."""
        need_memory = (spec.gpu_memory_gb or 0) * spec.gpus
        slots = group.slots

        def has_memory(s: Slot) -> bool:
            return s.memory_free_gb is None or s.memory_free_gb >= need_memory - MEMORY_SLACK

        def best() -> tuple | None:
            found = None
            for shape in able:
                entry = shape.first_with(spec.gpus, slots, has_memory)
                if entry is not None and (found is None or entry < found):
                    found = entry
            return found

        if not self._replicas_fit(able, slots, spec.gpus, need_memory, replicas, has_memory):
            return None
        # Replicas of a Deployment may land on different nodes: best fit for each.
        first = None
        shares = []
        for _ in range(replicas):
            position = best()[-1]
            slot = slots[position]
            group.set_free(position, slot.free - spec.gpus)
            if slot.memory_free_gb is not None:
                slot.memory_free_gb -= need_memory
            first = first or slot
            shares.append((spec.gpus, slot.unit.gpu_equivalent))
        unit = first.unit
        return Fit(
            Placement(
                cluster=cluster,
                sharing=Sharing.K8S_TIMESLICE,
                units=spec.gpus,
                gpu_equivalents=held(shares),
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
                s = slots[order[i][-1]]
                if not has_memory(s):
                    continue
                room += min(
                    s.free // gpus,
                    int(s.memory_free_gb // need_memory) if need_memory and s.memory_free_gb else 10**9,
                )
                if room >= replicas:
                    return True
        return False

    # -- several nodes at once -----------------------------------------------------

    def _fit_gang(self, spec, cluster, sharing, group: SlotGroup, shapes, model, partition) -> Fit | NoFit:
        """``spec.nodes`` distinct nodes that each have ``spec.gpus`` units free now, all
        of one model and (MIG) one profile, the smallest with room on enough nodes, taken
        together, or nothing taken. Each rank goes where a one-node job would: best fit,
        the nodes left with the least free, so whole free nodes stay whole. Per (model,
        profile) the candidates are counted before anything is taken, so a gang that does
        not fit takes nothing."""
        n, units = spec.nodes, spec.gpus
        memory = spec.gpu_memory_gb or 0
        mig = sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG)
        if sharing not in (Sharing.SLURM_EXCLUSIVE, Sharing.K8S_EXCLUSIVE) and not mig:
            return NoFit(
                f"a job on {n} nodes needs whole GPUs or MIG slices on each; {sharing.value} on {cluster} shares "
                "a GPU within one node",
                never=True,
            )
        # The kinds of unit a rank may take, smallest MIG profile first: (model, profile) -> shapes.
        kinds: dict[tuple[str, str | None], list[Shape]] = {}
        if mig:
            offered = sorted(group.offered.get(model, {}).items(), key=lambda item: (item[1], item[0]))
            for profile, _memory in (item for item in offered if item[1] >= memory):
                for shape in shapes:
                    if shape.profile == profile:
                        kinds.setdefault((shape.model, profile), []).append(shape)
        else:
            for shape in shapes:
                if shape.unit_memory_gb >= memory:
                    kinds.setdefault((shape.model, None), []).append(shape)
        # A MIG gang takes the smallest profile that has room on enough nodes, as a one-node
        # job does (_fit_mig); best fit (the least left free) only among kinds of one size.
        size = {profile: rank for rank, profile in enumerate(dict.fromkeys(prof for _m, prof in kinds))}
        # Topology (broker.placement.topology_fit): the nodes as close as the network allows,
        # within one domain of the level the job asks when it requires one.
        level, required = ask_of(spec)
        net = level if level is not None and level in group.levels else None
        gpu_limit = GPU_LEVELS.index(level) if required and level in GPU_LEVELS and not mig else None
        apart = bool(group.levels)
        ever_at: dict[str, tuple] = {}  # node -> its position, of nodes that could ever hold a rank
        now_at: dict[str, tuple] = {}  # the same, of nodes with room now
        best = None  # ((profile rank, domains, free left on the chosen nodes), picks, profile)
        most_ever = most_now = 0
        first_named = None
        for (_model, profile), members in kinds.items():
            ever: set[str] = set()
            now: dict[str, tuple] = {}  # node -> its best-fit entry with room for a rank
            for shape in members:
                for entry in shape.order:  # per node: (free, node, position)
                    node = group.slots[entry[-1]].unit.node
                    if shape.capacity >= units:
                        ever.add(node)
                    if entry[0] >= units and (node not in now or entry < now[node]):
                        now[node] = entry
            if gpu_limit is not None:
                now = {node: e for node, e in now.items() if rank_of(group.slots[e[-1]], units)[0] <= gpu_limit}
            if len(ever) > most_ever or first_named is None:
                first_named = (members[0], profile)
            most_ever = max(most_ever, len(ever))
            most_now = max(most_now, min(len(now), len(ever)))
            if apart:
                for node in ever:
                    ever_at.setdefault(node, group.slots[group.by_node[node][0]].unit.topology)
                for node, entry in now.items():
                    now_at.setdefault(node, group.slots[entry[-1]].unit.topology)
            if len(now) >= n:
                candidates = sorted(now.values())
                domains = 0
                if apart:
                    at = {entry: group.slots[entry[-1]].unit.topology for entry in candidates}
                    choice = choose_nodes(candidates, n, at, level=net, required=required and net is not None)
                    if choice is None:
                        continue
                    picks, domains = list(choice.nodes), choice.domains
                else:
                    picks = candidates[:n]
                left = (size[profile], domains, sum(free - units for free, *_ in picks))
                if best is None or left < best[0]:
                    best = (left, picks, profile)
        shape, profile = first_named if first_named else (shapes[0], None)
        what = (
            f"{units} free {profile} slice{'s' * (units != 1)}"
            if profile
            else f"{units} free {shape.model_name}{'s' * (units != 1)}"
        ) + (f" of {memory:g} GB" if memory and not profile else "")
        if best is None and required and net is not None and most_ever >= n:
            reason, never = gang_domain_reason(n, net, cluster, what, list(now_at.items()), ever_at)
            return NoFit(reason, never=never, waiting_for=None if never else (cluster, sharing.value, profile, model))
        if best is None and gpu_limit is not None and most_ever >= n:
            # Each rank's GPUs in one group of the level: held when no node's topology could.
            _now, ever_in_one = most_in_group(group, [s for members in kinds.values() for s in members], level)
            if ever_in_one < units:
                return NoFit(gpu_level_reason(level, units, cluster, 0, ever_in_one)[0], never=True)
        if best is None:
            if most_ever < n:
                return NoFit(
                    f"needs {n} nodes with {what.replace(' free', '')} each; {cluster} has "
                    f"{most_ever or 'no'} such node{'s' * (most_ever != 1)}",
                    never=True,
                )
            return NoFit(
                f"waiting for {n} nodes with {what} on {cluster}: {most_now} "
                f"{'has' if most_now == 1 else 'have'} them now",
                never=False,
                waiting_for=(cluster, sharing.value, profile, model),
            )
        _left, picks, profile = best
        shares = []
        taken: dict[str, tuple[int, ...]] = {}
        for free, _node, position in picks:
            slot = group.slots[position]
            if slot.free_gpus is not None:
                taken[slot.unit.node] = take_gpus(slot, units)  # the GPUs its cluster picks
            group.set_free(position, free - units)
            shares.append((units, slot.unit.gpu_equivalent))
        first = group.slots[picks[0][-1]].unit
        # Rank 0 on the first node in inventory order: the rendezvous host is stable for a given fit.
        nodes = tuple(group.slots[p].unit.node for p in sorted(position for *_, position in picks))
        placement = Placement(
            cluster=cluster,
            sharing=sharing,
            units=units,
            gpu_equivalents=held(shares),
            node=nodes[0],
            mig_profile=profile,
            gpu_model=first.gpu_model,
            gpu_memory_gb=spec.gpu_memory_gb,
            partition=partition,
            nodes=nodes,
        )
        for node, gpus in taken.items():  # so that undo gives back exactly these
            self._rank_gpus[(placement, node)] = gpus
        return Fit(placement)

    # -- shared GPUs: FGD over a bounded candidate set ----------------------------------

    def _pick(
        self, group: SlotGroup, able: dict[Shape, int], replicas: int, memory_gb: float
    ) -> list[tuple[int, int]] | None:
        """A per-GPU slot for each replica, chosen by FGD and taken; (position, units)
        per replica, or None (nothing taken) when they do not all fit now. ``able``:
        the shapes the job may use and the units a replica takes on each;
        ``memory_gb``: what a replica needs of its GPU's memory (time-slicing).

        Replicas go to one node when one can hold them all (FGD's choice among those),
        so that the placement names their GPUs and a cluster runs them there, as the
        simulator does; else each goes where FGD puts it, over several nodes."""
        for shape, units in able.items():
            # TaskShape's range: a share too small to count in milli-GPU counts as 1.
            group.fragmentation.observe(max(units * MILLI // shape.capacity, 1), replicas)
            break
        if replicas == 1:  # the common case, without the bookkeeping of several
            position = fgd_gpu(group, able, memory_gb)
            if position is None:
                return None
            units = able[group.shape_at[position]]
            slot = group.slots[position]
            group.set_free(position, slot.free - units)
            if memory_gb and slot.memory_free_gb is not None:
                slot.memory_free_gb -= memory_gb
            return [(position, units)]
        picks: list[tuple[int, int]] = []
        node = None
        if replicas > 1:
            node = fgd_gpu(group, able, memory_gb, replicas)
            node = None if node is None else group.node_of[node]
        for _ in range(replicas):
            if node is not None:
                position = fgd_gpu_on_node(group, able, memory_gb, node)
            else:
                position = fgd_gpu(group, able, memory_gb)
            if position is None:
                for taken, units in reversed(picks):
                    self._refund(group, taken, units, memory_gb)
                return None
            units = able[group.shape_at[position]]
            slot = group.slots[position]
            group.set_free(position, slot.free - units)
            if slot.memory_free_gb is not None and memory_gb:
                slot.memory_free_gb -= memory_gb
            picks.append((position, units))
        return picks

    def _shared_placement(self, spec, cluster, sharing, group: SlotGroup, picks, replicas, partition) -> Placement:
        slots = group.slots
        first = slots[picks[0][0]].unit
        units = picks[0][1]
        one_node = replicas == 1 or all(slots[p].unit.node == first.node for p, _ in picks)
        placement = Placement(
            cluster=cluster,
            sharing=sharing,
            units=units,
            gpu_equivalents=held((u, slots[p].unit.gpu_equivalent) for p, u in picks),
            node=first.node if one_node else None,
            gpu_model=first.gpu_model,
            gpu_memory_gb=spec.gpu_memory_gb,
            replicas=replicas,
            partition=partition,
            gpus=tuple(slots[p].unit.gpus[0] for p, _ in picks) if one_node else (),
        )
        if replicas > 1:
            for position, units in picks:
                node = slots[position].unit.node
                self._replicas.setdefault(_replica_key(placement, node), []).append((position, units))
            if not one_node:
                self._spread.setdefault(placement, []).append([slots[p].unit.node for p, _ in picks])
        return placement

    # -- helpers -------------------------------------------------------------------

    def _take_best(
        self, spec, cluster, sharing, group: SlotGroup, able, units, profile, model, what, partition, limit=None
    ) -> Fit | NoFit:
        replicas = replicas_of(spec)
        need = units * replicas
        spoken_for = self._spoken_for(cluster, able) if model is None and self.pinned else frozenset()
        # Cheap for a fleet that reports no topology: one flag per cluster and mode.
        topology = replicas == 1 and (limit is not None or (units > 1 and group.topology and sharing in WHOLE))
        if topology:
            # The closest GPUs first, then best fit (broker.placement.topology_fit).
            found = closest(group, able, units, spoken_for, limit)
            if found is not None:
                _key, position, gpus = found
                return self._commit(spec, cluster, sharing, group, position, units, profile, 1, partition, gpus)
        best = None
        for shape in able if not topology else ():
            entry = shape.first_with(need, group.slots)
            if entry is None:
                continue
            if spoken_for:  # best fit, but a model whose free units waiting pinned jobs need comes last
                entry = (shape.model_name in spoken_for, *entry)
            if best is None or entry < best:
                best = entry
        if best is None:
            free = sum(s.free for s in able)
            total = sum(s.total for s in able)
            closed = self._closed(cluster, sharing, profile)
            return NoFit(
                f"waiting for {what} on {cluster} ({free} of {total} free{closed})",
                never=False,
                waiting_for=(cluster, sharing.value, profile, model),
            )
        return self._commit(spec, cluster, sharing, group, best[-1], units, profile, replicas, partition)

    def _spoken_for(self, cluster: str, shapes) -> frozenset[str]:
        """The models (inventory names) of ``shapes`` whose free units jobs pinned to them
        waited for at least all of, last cycle."""
        free: dict[str, int] = defaultdict(int)
        for shape in shapes:
            free[shape.model_name] += shape.free
        return frozenset(
            name for name, units in free.items() if self.pinned.get((cluster, canonical_model(name)), 0) >= units
        )

    def _commit(
        self, spec, cluster, sharing, group: SlotGroup, position, units, profile, replicas, partition, gpus=()
    ) -> Fit:
        slot = group.slots[position]
        # Whole GPUs whose free ones are known: the placement names those taken (one replica).
        taken = take_gpus(slot, units * replicas, gpus) if slot.free_gpus is not None else ()
        group.set_free(position, slot.free - units * replicas)
        unit = slot.unit
        return Fit(
            Placement(
                cluster=cluster,
                sharing=sharing,
                units=units,
                gpu_equivalents=held([(units, unit.gpu_equivalent)] * replicas),
                node=unit.node,
                mig_profile=profile,
                gpu_model=unit.gpu_model,
                gpu_memory_gb=spec.gpu_memory_gb,
                replicas=replicas,
                partition=partition,
                gpus=taken if replicas == 1 else (),
            )
        )


def _replica_key(placement: Placement, node: str | None) -> tuple:
    """What identifies one replica of ``placement`` on ``node``: every field but the node
    and the replica count, so ``replace(placement, node=n, replicas=k)`` finds it."""
    p = placement
    return (p.cluster, p.sharing, node, p.units, p.gpu_equivalents, p.gpu_model, p.gpu_memory_gb, p.partition, p.gpus)


def _ranks(placement: Placement) -> list[Placement]:
    """A gang as one one-node placement per node, each with its share of the figure."""
    share = placement.gpu_equivalents / len(placement.nodes)
    return [replace(placement, node=node, nodes=(), gpu_equivalents=share) for node in placement.nodes]


def _charges(placement: Placement) -> list[tuple[int | None, int]]:
    """What ``placement`` holds, as (device index or None, units): one entry per replica
    when it names a GPU per replica (or per replica of a shared mode, GPU unknown)."""
    gpus = placement.gpus
    if gpus and len(gpus) == placement.replicas:
        return [(gpu, placement.units) for gpu in gpus]
    if len(gpus) == 1:
        return [(gpus[0], placement.units * placement.replicas)]
    if Sharing(placement.sharing) in PER_GPU_SHARING:
        return [(None, placement.units)] * placement.replicas
    return [(None, placement.units * placement.replicas)]


def _timeslice_memory_free(units: list[CapacityUnit], running: Callable[[str], float]) -> list[float | None]:
    """Per unit, the GPU memory still unclaimed: of its GPU for a per-GPU time-slice
    unit, of its node for a per-node one; None for units without a memory guard.
    ``running(node)``: memory of gpush's started time-sliced jobs on the node, for
    units that do not report their own."""
    out: list[float | None] = [None] * len(units)
    spread: dict[str, list[int]] = defaultdict(list)  # node -> per-GPU units that share its figure
    for i, unit in enumerate(units):
        if unit.sharing != Sharing.K8S_TIMESLICE or not unit.gpu_memory_gb:
            continue
        per_gpu = len(unit.gpus) == 1
        physical = unit.gpu_memory_gb if per_gpu else unit.capacity * unit.gpu_equivalent * unit.gpu_memory_gb
        if unit.memory_allocated_gb is not None:
            out[i] = physical - unit.memory_allocated_gb
        elif per_gpu:
            out[i] = physical
            spread[unit.node].append(i)
        else:
            out[i] = physical - running(unit.node)
    for node, members in spread.items():
        used = running(node)
        if used <= 0:
            continue
        # Which GPU holds which job is not known: spread the node's figure by the
        # replicas each GPU has allocated (evenly if the cluster shows none yet).
        weights = [units[i].allocated for i in members]
        total = sum(weights)
        if not total:
            weights, total = [1] * len(members), len(members)
        for i, weight in zip(members, weights, strict=True):
            out[i] -= used * weight / total
    return out


def model_memory(name: str) -> float | None:
    try:
        return gpu_model(name).memory_gb
    except ValueError:
        return None
