"""Replay on GPU-sharing nodes (:func:`replay_shared`): the policy's routes placed on
:class:`broker.placement.fragmentation.SharedGpuNodes` (per-GPU milli-GPU, whole and
fractional tasks on the same GPU, FGD or best fit), through the one decision. This is
how a trace of a GPU-sharing cluster (Alibaba's openb, :mod:`broker.simulation.traces`)
is replayed: a simulated fleet's GPU has one sharing mode and cannot do that.

CPU-only work (:class:`CpuWork`, the trace's pods that ask for no GPU) is not gpush's to
schedule, but on a real fleet it holds the same nodes' CPU and memory: the replay places
it beside the GPU jobs by the same placement rule
(:meth:`broker.placement.fragmentation.SharedGpuNodes.place_cpu`) when it arrives (ahead
of the GPU jobs that arrive at the same instant); one that finds no room waits, as a
pending pod does, and takes what is freed after the waiting GPU jobs had their turn."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from broker.core.adapter import Placement, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import Isolation, JobSpec
from broker.core.spec_values import parse_memory_mib
from broker.placement.capacity import Fit, NoFit, replicas_of
from broker.placement.decision import CycleDecisions, Placed, WaitCause, Waiting
from broker.placement.fgd import MILLI, TaskShape, WorkloadDistribution
from broker.placement.fragmentation import PLACEMENTS, SharedGpuNodes, SharedNode, Slot
from broker.routing.policy import Policy
from broker.simulation.loop import PROGRESS_EVERY, ReplayJob, ReplayLoop, WaitingQueue, fair_share_note
from broker.simulation.results import FRAGMENTATION_NOTE, STRANDED_NOTE, JobRecord, ReplayResult, Timeline
from broker.simulation.workload import (
    Arrival,
    TenantTerms,
    whole_gpu_policy,
    whole_gpu_spec,
)

MIG = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
SHARED = (Sharing.K8S_TIMESLICE, Sharing.SLURM_MPS)


@dataclass(frozen=True)
class CpuWork:
    """A task that takes CPU and host memory of a node and no GPU (a CPU-only pod)."""

    at: float
    duration: float
    cpu_milli: int
    memory_mib: int = 0


@dataclass
class CpuCounts:
    """What became of the CPU-only work in one replay."""

    arrived: int = 0
    waited: int = 0  # found no room when it arrived and waited for some
    never: int = 0  # larger than any node's CPU or memory: never placed
    unplaced: int = 0  # still waiting when the replay ended

    def note(self) -> str | None:
        if not self.arrived:
            return None
        text = (
            f"{self.arrived} CPU-only pods (not gpush's to schedule) held the nodes' CPU and memory beside the "
            f"GPU jobs, placed by the same rule"
        )
        parts = [
            f"{self.waited} waited for room" if self.waited else "",
            f"{self.never} fit no node" if self.never else "",
            f"{self.unplaced} never found room" if self.unplaced else "",
        ]
        parts = [p for p in parts if p]
        return text + (f" ({', '.join(parts)})" if parts else "")


def _memory_mib(spec: JobSpec) -> int:
    return parse_memory_mib(spec.memory) if spec.memory else 0


def task_of(arrival: Arrival, spec: JobSpec, sharing: Sharing, reference_memory_gb: float) -> TaskShape:
    """What one replica of a job asks of a GPU-sharing node under ``sharing``: its
    trace shape when it has one, else from the spec (a shared job's gpu_memory_gb as a
    share of the reference GPU's memory)."""
    base = arrival.task
    if base is None:
        cpu, memory = spec.cpus * 1000, _memory_mib(spec)
        if sharing in SHARED and spec.gpus == 1 and spec.gpu_memory_gb:
            share = min(MILLI, max(1, math.ceil(spec.gpu_memory_gb / reference_memory_gb * MILLI)))
            base = TaskShape(share, 1, cpu, memory)
        else:
            base = TaskShape(MILLI, spec.gpus, cpu, memory)
    if sharing not in SHARED or spec.isolation is Isolation.EXCLUSIVE:
        return base.whole()
    return base


@dataclass(frozen=True)
class _SlotsFit(Fit):
    """A fit on GPU-sharing nodes, with the slots its replicas hold."""

    slots: tuple[Slot, ...] = ()


class _SharedCapacity:
    """GPU-sharing nodes (one Kubernetes cluster called ``cluster``) as the decision's
    capacity (:class:`broker.placement.decision.Capacity`): routes to ``k8s/timeslice``
    or ``slurm/mps`` take a share of one GPU per replica, exclusive routes whole GPUs."""

    def __init__(self, nodes: SharedGpuNodes, cluster: str, reference_memory_gb: float) -> None:
        self.nodes = nodes
        self.cluster = cluster
        self.reference_memory_gb = reference_memory_gb

    def fit_route(self, entry: ReplayJob, route) -> Fit | NoFit:
        sharing = Sharing(route.sharing)
        if route.cluster != self.cluster:
            return NoFit(f"cluster {route.cluster} is not in this fleet (it has {self.cluster})", never=True)
        if sharing in MIG:
            return NoFit(f"{self.cluster} shares GPUs by milli-GPU; it has no MIG slices", never=True)
        task = task_of(entry.arrival, entry.spec, sharing, self.reference_memory_gb)
        if sharing is Sharing.SLURM_MPS and task.gpus > 1:
            return NoFit("MPS shares one GPU among processes: a job with gpus > 1 cannot use it", never=True)
        models = entry.arrival.gpu_models
        if not self.nodes.could_ever_hold(task, models):
            return NoFit(f"no node of {self.cluster} could ever hold {_describe_task(task)}", never=True)
        replicas = replicas_of(entry.spec)
        slots = []
        for _ in range(replicas):
            slot = self.nodes.place(task, models)
            if slot is None:
                break
            slots.append(slot)
        if len(slots) < replicas:
            for slot in slots:
                self.nodes.release(slot)
            return NoFit(
                f"waiting for {_describe_task(task)} on {self.cluster}",
                never=False,
                waiting_for=(self.cluster, sharing.value, task, models),
            )
        placement = Placement(
            cluster=self.cluster,
            sharing=sharing,
            units=task.gpus,
            gpu_equivalents=sum(s.task.demand_milli for s in slots) / MILLI,
            node=self.nodes.nodes[slots[0].node].name,
            replicas=replicas,
        )
        return _SlotsFit(placement, tuple(slots))

    def undo(self, fit: Fit) -> None:
        for slot in fit.slots:
            self.nodes.release(slot)


class _SharedReplay(ReplayLoop):
    """The event loop of :func:`replay_shared` (one use).

    A trace has thousands of pods, so a cycle here decides only what may have changed
    since the last one: the jobs that arrived, or every waiting job once capacity was
    freed. Within a cycle capacity only shrinks and usage only grows, so a job of a kind
    that found no room (or whose tenant is at its quota) says what that job said, with
    its count of jobs ahead (:meth:`broker.placement.decision.CycleDecisions.behind`),
    without fitting again, and the cycle ends once every kind waiting has found none."""

    def __init__(
        self, nodes, cluster, policy, workload, placement, whole, distribution, tenants=None, progress=None, cpu_work=()
    ):
        self.cluster = cluster
        self.cpu_work = sorted(cpu_work, key=lambda w: w.at)
        self.cpu_ends: list[tuple[float, int, int, CpuWork]] = []  # (end, order, node, work)
        self.cpu_waiting: list[CpuWork] = []
        self.cpu_counts = CpuCounts()
        self._cpu_order = itertools.count()
        self.progress = progress
        self.whole = whole
        self.policy = whole_gpu_policy(policy) if whole else policy
        memories = Counter(n.gpu_memory_gb for n in nodes if n.gpu_memory_gb)
        self.reference_memory_gb = memories.most_common(1)[0][0] if memories else 16.0
        order = sorted(range(len(workload)), key=lambda i: (workload[i].at, i))
        entries = []
        for seq, i in enumerate(order, 1):
            arrival = workload[i]
            spec = whole_gpu_spec(arrival.spec) if whole else arrival.spec
            entries.append(
                ReplayJob(seq, arrival, spec, JobRecord(seq, spec.name, spec.kind.value, arrival.tenant, arrival.at))
            )
        super().__init__(entries, tenants)
        if distribution is None:
            # The workload as submitted, also for whole GPUs: both runs' fragmentation
            # is measured against the same jobs.
            distribution = WorkloadDistribution.of(
                task_of(e.arrival, e.arrival.spec, Sharing.K8S_TIMESLICE, self.reference_memory_gb)
                for e in self.entries
            )
        shapes = {
            task_of(e.arrival, e.spec, sharing, self.reference_memory_gb)
            for e in self.entries
            for sharing in (Sharing.K8S_TIMESLICE, Sharing.K8S_EXCLUSIVE)
        }
        self.nodes = SharedGpuNodes(nodes, placement=placement, distribution=distribution, shapes=sorted(shapes))
        self.capacity = _SharedCapacity(self.nodes, cluster, self.reference_memory_gb)
        self.queue = WaitingQueue(self._kind)
        self.ends: list[tuple[float, int, ReplayJob]] = []
        self.timeline = Timeline()
        self.demand = 0.0

    def run(self) -> tuple[Timeline, list[JobRecord]]:
        entries, n, i = self.entries, len(self.entries), 0
        cpu, m, j = self.cpu_work, len(self.cpu_work), 0
        events = 0
        # CPU-only work matters while GPU jobs run or wait for the room it holds.
        while i < n or self.ends or (len(self.queue) and self.cpu_ends):
            events += 1
            if self.progress is not None and not events % PROGRESS_EVERY:
                self.progress(i)
            t = min(
                entries[i].arrival.at if i < n else math.inf,
                self.ends[0][0] if self.ends else math.inf,
                cpu[j].at if j < m else math.inf,
                self.cpu_ends[0][0] if self.cpu_ends else math.inf,
            )
            freed = False
            while self.ends and self.ends[0][0] <= t:
                _, _, entry = heapq.heappop(self.ends)
                for slot in entry.slots:
                    self.nodes.release(slot)
                entry.slots = []
                entry.record.end, entry.record.state = t, "succeeded"
                self.demand -= entry.record.demand
                self.fair.release(entry.tenant, entry.record.gpu_equivalents)
                freed = True
            while self.cpu_ends and self.cpu_ends[0][0] <= t:
                _, _, node, work = heapq.heappop(self.cpu_ends)
                self.nodes.release_cpu(node, work.cpu_milli, work.memory_mib)
                freed = True
            while j < m and cpu[j].at <= t:
                self._place_cpu(t, cpu[j], first=True)
                j += 1
            fresh = []
            while i < n and entries[i].arrival.at <= t:
                fresh.append(entries[i])
                i += 1
            self._arrive(fresh)
            self._cycle(t, list(self.queue) if freed else sorted(fresh, key=lambda e: e.order), every=freed)
            if freed and self.cpu_waiting:
                waiting, self.cpu_waiting = self.cpu_waiting, []
                for work in waiting:
                    self._place_cpu(t, work, first=False)
            self._sample(t)
        self.cpu_counts.unplaced = len(self.cpu_waiting)
        return self.timeline, self._finish(self.timeline.t[-1] if self.timeline.t else 0.0)

    def _place_cpu(self, t: float, work: CpuWork, *, first: bool) -> None:
        counts = self.cpu_counts
        if first:
            counts.arrived += 1
            if not self.nodes.could_ever_hold_cpu(work.cpu_milli, work.memory_mib):
                counts.never += 1
                return
        node = self.nodes.place_cpu(work.cpu_milli, work.memory_mib)
        if node is None:
            counts.waited += first
            self.cpu_waiting.append(work)
            return
        heapq.heappush(self.cpu_ends, (t + work.duration, next(self._cpu_order), node, work))

    def _cycle(self, t: float, candidates: list[ReplayJob], every: bool) -> None:
        by_tenant = self._heads(candidates, None)
        self.fair.contend(self.queue.tenants)
        decisions = CycleDecisions(self.policy, self.capacity, self.fair)
        no_room: dict[tuple, Waiting] = {}  # kind -> what its first job said
        at_quota: dict[tuple, Waiting] = {}  # (tenant, kind) -> what its first job said
        while by_tenant and len(no_room) < len(self.queue.kinds):
            entry = self._next(by_tenant)
            kind = self._kind(entry)
            if kind in no_room:
                outcome = decisions.behind(no_room[kind])
            elif (entry.tenant, kind) in at_quota:
                outcome = at_quota[(entry.tenant, kind)]
            else:
                outcome = decisions.decide(entry)
                if isinstance(outcome, Waiting):
                    memo = no_room if outcome.cause is WaitCause.CAPACITY else at_quota
                    memo[kind if memo is no_room else (entry.tenant, kind)] = outcome
            self._apply(t, entry, outcome)
        if every:
            # Every waiting job was decided or is of a kind that found no room: those no
            # longer at their quota wait for capacity (the decision fits before the quota).
            for entry in list(self.at_quota.values()):
                kind = self._kind(entry)
                if (entry.tenant, kind) not in at_quota:
                    self._quota_ends(t, entry)
                    if kind in no_room:
                        entry.record.reason = no_room[kind].reason

    def _kind(self, entry: ReplayJob) -> tuple:
        return (entry.signature, entry.arrival.task, entry.arrival.gpu_models)

    def _place(self, t: float, entry: ReplayJob, placed: Placed) -> None:
        slots = list(placed.fit.slots)
        record = entry.record
        entry.slots = slots
        record.waited_for = record.reason
        record.start, record.state, record.reason = t, "running", None
        record.cluster, record.sharing = self.cluster, placed.placement.sharing.value
        record.node = placed.placement.node
        record.gpu_equivalents = placed.placement.gpu_equivalents
        record.placement = placed.placement.to_dict()
        asked = entry.arrival.task
        record.demand = (asked.demand_milli / MILLI * len(slots)) if asked else record.gpu_equivalents
        self.demand += record.demand
        heapq.heappush(self.ends, (t + entry.arrival.duration, entry.seq, entry))

    def _sample(self, t: float) -> None:
        held = self.nodes.held_milli / MILLI
        queued = len(self.queue)
        free = (self.nodes.capacity_milli - self.nodes.held_milli) / MILLI
        self.timeline.add(
            t,
            held,
            self.demand,
            {"k8s": held},
            queued,
            free if queued > len(self.at_quota) else 0.0,  # as the fleet replay: waiting for capacity
            self.nodes.fragmentation_milli() / MILLI,
            **self._tenant_columns(self.fair.usage),
        )


def _describe_task(task: TaskShape) -> str:
    if task.fractional:
        return f"{task.gpu_milli} milli-GPU of one GPU"
    return f"{task.gpus} whole GPU{'s' if task.gpus > 1 else ''}"


def replay_shared(
    nodes: Sequence[SharedNode],
    cluster: str,
    policy: Policy,
    workload: Sequence[Arrival],
    *,
    placement: str = "fgd",
    whole_gpus: bool = False,
    distribution: WorkloadDistribution | None = None,
    label: str | None = None,
    tenants: Mapping[str, TenantTerms] | None = None,
    progress: Callable[[int], None] | None = None,
    cpu_work: Sequence[CpuWork] = (),
) -> ReplayResult:
    """Replay ``workload`` on GPU-sharing ``nodes`` (one Kubernetes cluster called
    ``cluster``) under ``policy``. Routes to ``k8s/timeslice`` (or ``slurm/mps``) take
    a share of one GPU, exclusive routes whole GPUs; ``placement`` picks the node and
    GPU (``fgd`` measures fragmentation against ``distribution``, by default the
    workload's own). ``whole_gpus``: every job on whole GPUs, see :func:`whole_gpu_policy`.
    Fair share and quotas as in :func:`replay`; ``progress`` is called now and then with
    the number of jobs arrived so far. ``cpu_work``: CPU-only tasks that hold the nodes'
    CPU and memory beside the jobs (see the module docstring)."""
    if placement not in PLACEMENTS:
        raise InvalidRequest(f"unknown placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    began = time.perf_counter()
    loop = _SharedReplay(
        nodes, cluster, policy, workload, placement, whole_gpus, distribution, tenants, progress, cpu_work
    )
    timeline, jobs = loop.run()
    total = loop.nodes.capacity_milli / MILLI
    return ReplayResult(
        label or ("whole GPUs" if whole_gpus else "gpush"),
        placement,
        jobs,
        timeline,
        total,
        {"k8s": total},
        time.perf_counter() - began,
        [
            "GPU-sharing nodes: any GPU takes a whole-GPU job or fractional jobs up to 1000 milli-GPU in all",
            STRANDED_NOTE,
            FRAGMENTATION_NOTE,
            fair_share_note(tenants),
            *filter(None, [loop.cpu_counts.note()]),
        ],
        measures_fragmentation=True,
        tenant_terms=dict(tenants or {}),
    )
