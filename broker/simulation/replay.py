"""The replay engines: a workload through gpush's routing and placement in virtual time.

Both engines decide through the one decision of the live scheduler
(:class:`broker.placement.decision.CycleDecisions`): what differs is only the capacity
they bring and what they do with an outcome.

- **Replay on a simulated fleet** (:func:`replay`): one
  :class:`broker.simulation.fleet.SimulatedCluster` per fleet cluster, driven from event
  to event (an arrival or a job's end). Each event is one scheduling cycle as
  :class:`broker.scheduling.cycle.Scheduler` runs it: the clusters' status changes are
  read, the capacity is built from their inventories less what they have not started,
  the tenants' usage is what their placed jobs hold, and every waiting job (at most the
  scheduler's claim limit per tenant) is decided in fair-share order; placed jobs are
  submitted to the simulated clusters. ``tests/simulation/test_differential.py`` runs
  workloads through this and through the live scheduler and compares them cycle by
  cycle.
- **Fair share and quotas**, in every replay: jobs are tried in the scheduler's order
  (:class:`broker.placement.fairshare.FairShare`: priority, then the tenant furthest
  below its weighted share of the GPU-equivalents in use, then arrival); a job that
  would take its tenant over its quota waits with the broker's reason ("tenant nlp at
  quota (8/8 GPU)"). The report gives, per tenant, its share of the GPU-equivalents in
  use over time beside its weight's share, its jobs, queue wait and time at its quota.
- **Replay on GPU-sharing nodes** (:func:`replay_shared`): the policy's routes placed
  on :class:`broker.placement.fragmentation.SharedGpuNodes` (per-GPU milli-GPU, whole
  and fractional tasks on the same GPU, FGD or best fit). This is how a trace of a
  GPU-sharing cluster (Alibaba's openb, :mod:`broker.simulation.traces`) is replayed: a
  simulated fleet's GPU has one sharing mode and cannot do that.

The workload and its whole-GPU variant are :mod:`broker.simulation.workload`; what a
replay records, :mod:`broker.simulation.results`; the report and plots,
:mod:`broker.simulation.report` and :mod:`broker.simulation.plots`.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from broker.core.adapter import BackendState, Placement, Rejected, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import Isolation, JobSpec, parse_memory_mib
from broker.placement.capacity import CapacityView, Fit, NoFit, replicas_of
from broker.placement.decision import CycleDecisions, Held, Outcome, Placed, WaitCause, Waiting
from broker.placement.fairshare import FairShare
from broker.placement.fragmentation import (
    MILLI,
    PLACEMENTS,
    SharedGpuNodes,
    SharedNode,
    Slot,
    TaskShape,
    WorkloadDistribution,
)
from broker.routing.policy import Policy, evaluate
from broker.simulation.fleet import Fleet, SimulatedCluster
from broker.simulation.results import JobRecord, ReplayResult, Timeline
from broker.simulation.workload import (
    Arrival,
    TenantTerms,
    tenant_of,
    whole_gpu_fleet,
    whole_gpu_policy,
    whole_gpu_spec,
)

# Where virtual time starts; any fixed instant does, the reports count seconds from it.
T0 = datetime(2025, 1, 1, tzinfo=UTC)
_MIG = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
# How a replay on a fleet places, as the live scheduler does (broker.placement.capacity).
PLACEMENT_ON_FLEET = "gpush's: best fit for whole GPUs and MIG, FGD per GPU for MPS and time-slicing"
_SHARED = (Sharing.K8S_TIMESLICE, Sharing.SLURM_MPS)


# -- what both engines share ----------------------------------------------------------------


class _VirtualClock:
    """The replay's time: set by the driver, read by the simulated clusters."""

    def __init__(self, start: datetime) -> None:
        self.start = start
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def set(self, seconds: float) -> None:
        self.now = self.start + timedelta(seconds=seconds)

    def seconds(self, moment: datetime) -> float:
        return (moment - self.start).total_seconds()


@dataclass
class _Entry:
    """A job inside a replay: its record, what it asks, where it may go, what it holds.

    ``spec`` and ``tenant`` are what :class:`broker.placement.decision.CycleDecisions`
    reads of it (the :class:`~broker.placement.decision.Ask` protocol)."""

    seq: int
    arrival: Arrival
    spec: JobSpec  # as fitted (whole GPUs: exclusive)
    record: JobRecord
    routes: list = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)  # shared nodes: what it holds
    placement: Placement | None = None
    signature: tuple = ()
    quota_since: float | None = None  # waiting at its tenant's quota since then
    tenant: str = field(init=False)  # as fair share counts it

    def __post_init__(self) -> None:
        self.tenant = tenant_of(self.arrival.tenant)

    @property
    def order(self) -> tuple[int, int]:
        return (-self.spec.priority, self.seq)

    @property
    def asked(self) -> JobSpec:
        return self.arrival.spec


def _signature(spec: JobSpec, routes: list) -> tuple:
    """Jobs with equal signatures fit or fail alike on the same free capacity: the
    routes as the fit reads them, and the fields of the job it reads."""
    return (
        tuple((r.cluster, r.sharing, r.partition, r.gpu_model) for r in routes),
        spec.gpus,
        spec.gpu_memory_gb,
        replicas_of(spec),
        spec.isolation,
    )


class _Queue:
    """Waiting jobs in priority, then arrival, order, with how many of each kind wait
    (``kinds``: key -> count), so a pass can stop once every kind has failed, and how
    many of each tenant (``tenants``), the tenants that share."""

    def __init__(self, kind: Callable[[_Entry], tuple]) -> None:
        self._keys: list[tuple[int, int]] = []
        self._entries: list[_Entry] = []
        self._kind = kind
        self.kinds: Counter = Counter()
        self.tenants: Counter = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: _Entry) -> None:
        at = bisect.bisect(self._keys, entry.order)
        self._keys.insert(at, entry.order)
        self._entries.insert(at, entry)
        self.kinds[self._kind(entry)] += 1
        self.tenants[entry.tenant] += 1

    def remove(self, entry: _Entry) -> None:
        at = bisect.bisect_left(self._keys, entry.order)
        del self._keys[at]
        del self._entries[at]
        kind = self._kind(entry)
        self.kinds[kind] -= 1
        if not self.kinds[kind]:
            del self.kinds[kind]
        self.tenants[entry.tenant] -= 1
        if not self.tenants[entry.tenant]:
            del self.tenants[entry.tenant]

    def __iter__(self):
        return iter(list(self._entries))


class _Loop:
    """What both event loops share: the arriving jobs queued, the waiting ones decided
    by :class:`broker.placement.decision.CycleDecisions` in the scheduler's order
    (:class:`broker.placement.fairshare.FairShare`), and the time jobs wait at their
    tenant's quota. Subclasses say what a kind of job is (:meth:`_kind`: jobs of one
    kind fit or fail alike) and what placing one means (:meth:`_place`)."""

    policy: Policy
    queue: _Queue

    def __init__(self, entries: list[_Entry], tenants: Mapping[str, TenantTerms] | None) -> None:
        self.entries = entries
        terms = tenants or {}
        self.weights = {name: t.weight for name, t in terms.items()}
        self.quotas = {name: t.gpu_quota for name, t in terms.items() if t.gpu_quota is not None}
        self.fair = FairShare(self.weights, self.quotas)
        self.tenant_names = sorted({e.tenant for e in entries})
        self.at_quota: dict[int, _Entry] = {}  # by seq: waiting at their tenant's quota
        self.quota_counts: Counter = Counter()  # tenant -> its jobs waiting at its quota

    def _kind(self, entry: _Entry) -> tuple:
        raise NotImplementedError

    def _place(self, t: float, entry: _Entry, placed: Placed) -> None:
        raise NotImplementedError

    def _arrive(self, fresh: list[_Entry]) -> None:
        """Queue the jobs that arrived; their routes (evaluated again, and cached, by the
        decision) say what kind of job each is."""
        for entry in fresh:
            entry.routes = evaluate(self.policy, entry.arrival.spec, entry.arrival.tenant).routes
            entry.signature = _signature(entry.spec, entry.routes)
            self.queue.add(entry)

    def _heads(self, candidates: Iterable[_Entry], limit: int | None) -> dict[str, deque[_Entry]]:
        """Each tenant's waiting jobs in its own order, at most ``limit`` of them (the
        scheduler's claim: ``claim_limit`` per tenant and cycle)."""
        by_tenant: dict[str, deque[_Entry]] = {}
        for entry in candidates:
            waiting = by_tenant.setdefault(entry.tenant, deque())
            if limit is None or len(waiting) < limit:
                waiting.append(entry)
        return by_tenant

    def _next(self, by_tenant: dict[str, deque[_Entry]]) -> _Entry:
        tenant = self.fair.next_tenant((name, q[0].spec.priority, q[0].seq) for name, q in by_tenant.items())
        waiting = by_tenant[tenant]
        entry = waiting.popleft()
        if not waiting:
            del by_tenant[tenant]
        return entry

    def _apply(self, t: float, entry: _Entry, outcome: Outcome) -> None:
        """What an outcome does to the job's record and the queue."""
        if isinstance(outcome, Placed):
            self.queue.remove(entry)
            self._quota_ends(t, entry)
            self._place(t, entry, outcome)
        elif isinstance(outcome, Held):
            self.queue.remove(entry)
            self._quota_ends(t, entry)
            entry.record.state, entry.record.reason = "held", outcome.reason
        else:
            entry.record.reason = outcome.reason
            if outcome.cause is WaitCause.QUOTA:
                self._quota_begins(t, entry)
            else:
                self._quota_ends(t, entry)

    def _quota_begins(self, t: float, entry: _Entry) -> None:
        if entry.quota_since is None:
            entry.quota_since = t
            self.at_quota[entry.seq] = entry
            self.quota_counts[entry.tenant] += 1

    def _quota_ends(self, t: float, entry: _Entry) -> None:
        if entry.quota_since is not None:
            entry.record.quota_wait += t - entry.quota_since
            entry.quota_since = None
            del self.at_quota[entry.seq]
            self.quota_counts[entry.tenant] -= 1

    def _finish(self, t: float) -> list[JobRecord]:
        for entry in list(self.at_quota.values()):
            self._quota_ends(t, entry)
        for entry in self.queue:
            entry.record.reason = entry.record.reason or "still waiting when the replay ended"
        return [e.record for e in self.entries]

    def _tenant_columns(self, usage: Mapping[str, float]) -> dict[str, dict[str, float]]:
        """What a timeline sample keeps per tenant: GPU-equivalents held, jobs at quota."""
        return {
            "tenants": {name: usage.get(name, 0.0) for name in self.tenant_names},
            "at_quota": {name: self.quota_counts[name] for name in self.tenant_names},
        }


# -- replay on a simulated fleet ----------------------------------------------------------

# Jobs per tenant a replay's cycle decides: the scheduler's default claim limit.
CLAIM_LIMIT = 1000


class _FleetReplay(_Loop):
    """The event loop of :func:`replay` (one use): at each event, one scheduling cycle
    as :class:`broker.scheduling.cycle.Scheduler` runs it. The clusters' status changes
    are read; the capacity is built afresh from their inventories, less the placements
    they have not started, as step 4 of the cycle builds it; the tenants' usage is what
    their placed jobs hold, as the ledger of step 5 reads it; every waiting job (at most
    ``claim_limit`` per tenant) is decided in fair-share order; placed jobs are
    submitted to the simulated clusters."""

    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        workload: Sequence[Arrival],
        whole: bool,
        start: datetime,
        demand_of: Callable[[int], float | None] | None,
        tenants: Mapping[str, TenantTerms] | None = None,
        claim_limit: int = CLAIM_LIMIT,
        observe: Callable[[float, list[JobRecord]], None] | None = None,
    ):
        self.whole = whole
        self.observe = observe
        self.demand_of = demand_of
        self.claim_limit = claim_limit
        self.fleet = whole_gpu_fleet(fleet) if whole else fleet
        self.policy = whole_gpu_policy(policy) if whole else policy
        self.clock = _VirtualClock(start)
        self.sims = {
            name: SimulatedCluster.from_fleet(self.fleet, name, clock=self.clock) for name in self.fleet.clusters
        }
        self.cursors = {name: sim.statuses().cursor for name, sim in self.sims.items()}
        self.flavor = {name: cluster.flavor for name, cluster in self.fleet.clusters.items()}
        self.tier_gpus: dict[str, float] = defaultdict(float)
        for cluster in self.fleet.clusters.values():
            self.tier_gpus[cluster.flavor] += cluster.gpu_count
        order = sorted(range(len(workload)), key=lambda i: (workload[i].at, i))
        entries: list[_Entry] = []
        for seq, i in enumerate(order, 1):
            arrival = workload[i]
            spec = whole_gpu_spec(arrival.spec) if whole else arrival.spec
            record = JobRecord(seq, spec.name, spec.kind.value, arrival.tenant, arrival.at)
            entries.append(_Entry(seq, arrival, spec, record))
        super().__init__(entries, tenants)
        self.by_id = {e.seq: e for e in self.entries}
        self.queue = _Queue(self._kind)
        self.holding: dict[int, _Entry] = {}  # by seq: placed, not ended (the ledger's active jobs)
        self.held_in_clusters = 0  # submitted, waiting in a cluster's own queue
        self.queued_in_clusters = 0  # placements that ever waited there
        self.allocated: dict[str, float] = defaultdict(float)  # by flavor
        self.demand = 0.0  # GPU-equivalents the running jobs need
        self.timeline = Timeline()

    def run(self) -> tuple[Timeline, list[JobRecord]]:
        entries, n, i = self.entries, len(self.entries), 0
        while True:
            times = [entries[i].arrival.at] if i < n else []
            for sim in self.sims.values():
                moment = sim.next_event_time()
                if moment is not None:
                    times.append(self.clock.seconds(moment))
            if not times:
                break
            t = min(times)
            self.clock.set(t)
            self._collect()
            fresh = []
            while i < n and entries[i].arrival.at <= t:
                fresh.append(entries[i])
                i += 1
            self._arrive(fresh)
            self._cycle(t)
            self._collect()
            self._sample(t)
            if self.observe is not None:
                self.observe(t, [e.record for e in self.entries])
        return self.timeline, self._finish(self.timeline.t[-1] if self.timeline.t else 0.0)

    def _cycle(self, t: float) -> None:
        if not self.queue:
            return
        # The ledger and the shares as the cycle reads them: what placed jobs hold, the
        # tenants holding GPUs and those with jobs waiting.
        self.fair = FairShare(self.weights, self.quotas, self._usage(), waiting=self.queue.tenants)
        decisions = CycleDecisions(self.policy, self._capacity(), self.fair)
        by_tenant = self._heads(self.queue, self.claim_limit)
        while by_tenant:
            entry = self._next(by_tenant)
            self._apply(t, entry, decisions.decide(entry))

    def _capacity(self) -> CapacityView:
        """Step 4 of the cycle: each cluster's inventory, less the placements it has not
        started, and the GPU memory of the time-sliced jobs per node."""
        not_started, memory = [], defaultdict(float)
        for entry in self.holding.values():
            p = entry.placement
            if entry.record.state != "running":
                not_started.append(p)
            if p.sharing is Sharing.K8S_TIMESLICE and p.node and p.gpu_memory_gb:
                memory[(p.cluster, p.node)] += p.gpu_memory_gb * p.units * p.replicas
        inventory = {name: sim.inventory() for name, sim in self.sims.items()}
        return CapacityView.build(inventory, not_started, memory)

    def _collect(self) -> None:
        """Read every cluster's status changes."""
        for name, sim in self.sims.items():
            page = sim.statuses(self.cursors[name])
            self.cursors[name] = page.cursor
            for backend in page.jobs:
                entry = self.by_id[backend.job_id]
                record = entry.record
                at = self.clock.seconds(backend.at)
                if backend.state is BackendState.PENDING:
                    if record.state == "waiting":
                        self.held_in_clusters += 1
                        self.queued_in_clusters += 1
                    record.state, record.reason = "queued in cluster", backend.reason
                elif backend.state is BackendState.RUNNING:
                    if record.state == "queued in cluster":
                        self.held_in_clusters -= 1
                    record.state, record.start, record.node, record.reason = "running", at, backend.node, None
                    self.allocated[self.flavor[name]] += record.gpu_equivalents
                    self.demand += record.demand
                else:
                    if record.state == "running":
                        self.allocated[self.flavor[name]] -= record.gpu_equivalents
                        self.demand -= record.demand
                    elif record.state == "queued in cluster":
                        self.held_in_clusters -= 1
                    record.end = at
                    record.state = "succeeded" if backend.state is BackendState.SUCCEEDED else "failed"
                    record.reason = backend.reason
                    self._ended(entry)

    def _ended(self, entry: _Entry) -> None:
        self.holding.pop(entry.seq, None)

    def _kind(self, entry: _Entry) -> tuple:
        return entry.signature

    def _place(self, t: float, entry: _Entry, placed: Placed) -> None:
        placement = placed.placement
        record = entry.record
        entry.placement = placement
        record.placement = placement.to_dict()
        self.holding[entry.seq] = entry
        record.waited_for = record.reason
        record.cluster, record.sharing = placement.cluster, placement.sharing.value
        record.gpu_equivalents = placement.gpu_equivalents
        need = self.demand_of(entry.seq) if self.demand_of else None
        record.demand = placement.gpu_equivalents if need is None else need
        record.node = placement.node
        labels = {**entry.spec.labels, "sim-duration": f"{entry.arrival.duration:g}"}
        spec = entry.spec.model_copy(update={"labels": labels})
        try:
            self.sims[placement.cluster].submit(entry.seq, spec, placement)
        except Rejected as exc:
            # As the scheduler records a refusal: failed; what it took counts until the
            # next cycle reads the capacity again.
            record.state, record.reason = "failed", f"{placement.cluster} refused the job: {exc}"
            record.end = self.clock.seconds(self.clock())
            self.holding.pop(entry.seq, None)

    def _sample(self, t: float) -> None:
        total = sum(self.tier_gpus.values())
        queued = len(self.queue)
        reserved = sum(e.placement.gpu_equivalents for e in self.holding.values())
        stranded = max(total - reserved, 0.0) if queued else 0.0
        tiers = {tier: max(self.allocated.get(tier, 0.0), 0.0) for tier in self.tier_gpus}
        self.timeline.add(
            t,
            sum(tiers.values()),
            max(self.demand, 0.0),
            tiers,
            queued + self.held_in_clusters,
            stranded,
            0.0,
            **self._tenant_columns(self._usage()),
        )

    def _usage(self) -> dict[str, float]:
        """GPU-equivalents each tenant's placed jobs hold (the ledger)."""
        usage: dict[str, float] = defaultdict(float)
        for entry in self.holding.values():
            usage[entry.tenant] += entry.placement.gpu_equivalents
        return usage


def replay(
    fleet: Fleet,
    policy: Policy,
    workload: Sequence[Arrival],
    *,
    whole_gpus: bool = False,
    start: datetime = T0,
    label: str | None = None,
    demand_of: Callable[[int], float | None] | None = None,
    tenants: Mapping[str, TenantTerms] | None = None,
    claim_limit: int = CLAIM_LIMIT,
    observe: Callable[[float, list[JobRecord]], None] | None = None,
) -> ReplayResult:
    """Replay ``workload`` on simulated clusters of ``fleet`` under ``policy``
    (``whole_gpus``: the same on whole GPUs only; see the module docstring), with the
    fair-share weights and quotas of ``tenants`` (a tenant not in it: weight 1, no quota).

    A job's ``demand`` is the GPU-equivalents its placement holds, or
    ``demand_of(job_id)`` when that gives a number: what the job needs as another
    replay sized it (a whole-GPU run measured against gpush's sharing).

    ``claim_limit``: jobs per tenant each cycle decides, as the scheduler's. ``observe``
    is called after each cycle with its virtual time and every job's record (the
    differential test compares them with the live scheduler's, step by step)."""
    began = time.perf_counter()
    loop = _FleetReplay(fleet, policy, workload, whole_gpus, start, demand_of, tenants, claim_limit, observe)
    timeline, jobs = loop.run()
    notes = [
        _fair_share_note(tenants),
        "stranded: free GPU-equivalents while jobs wait (none of the waiting jobs fits them)",
    ]
    if loop.queued_in_clusters:
        notes.append(
            f"{loop.queued_in_clusters} placement(s) waited in a cluster's own queue: CapacityView found room "
            "the cluster did not have (an MPS share needs it on one GPU, time-sliced memory counts per GPU)"
        )
    oom = sum(1 for j in jobs if j.state == "failed" and (j.reason or "").startswith("OOMKilled"))
    if oom:
        notes.append(f"{oom} job(s) OOM-killed on over-committed time-sliced GPUs")
    return ReplayResult(
        label or ("whole GPUs" if whole_gpus else "gpush"),
        PLACEMENT_ON_FLEET,
        jobs,
        timeline,
        float(sum(loop.tier_gpus.values())),
        dict(loop.tier_gpus),
        time.perf_counter() - began,
        notes,
        tenant_terms=dict(tenants or {}),
    )


def _fair_share_note(tenants: Mapping[str, TenantTerms] | None) -> str:
    quotas = ", ".join(f"{name} {t.gpu_quota:g}" for name, t in (tenants or {}).items() if t.gpu_quota is not None)
    return (
        "fair share as the scheduler keeps it: jobs are tried by priority, then the tenant furthest below its "
        "weighted share of the GPU-equivalents in use, then arrival"
        + (f"; quotas (GPU-equivalents): {quotas}" if quotas else "")
    )


# -- replay on GPU-sharing nodes ---------------------------------------------------------


def _memory_mib(spec: JobSpec) -> int:
    return parse_memory_mib(spec.memory) if spec.memory else 0


def task_of(arrival: Arrival, spec: JobSpec, sharing: Sharing, reference_memory_gb: float) -> TaskShape:
    """What one replica of a job asks of a GPU-sharing node under ``sharing``: its
    trace shape when it has one, else from the spec (a shared job's gpu_memory_gb as a
    share of the reference GPU's memory)."""
    base = arrival.task
    if base is None:
        cpu, memory = spec.cpus * 1000, _memory_mib(spec)
        if sharing in _SHARED and spec.gpus == 1 and spec.gpu_memory_gb:
            share = min(MILLI, max(1, math.ceil(spec.gpu_memory_gb / reference_memory_gb * MILLI)))
            base = TaskShape(share, 1, cpu, memory)
        else:
            base = TaskShape(MILLI, spec.gpus, cpu, memory)
    if sharing not in _SHARED or spec.isolation is Isolation.EXCLUSIVE:
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

    def fit_route(self, entry: _Entry, route) -> Fit | NoFit:
        sharing = Sharing(route.sharing)
        if route.cluster != self.cluster:
            return NoFit(f"cluster {route.cluster} is not in this fleet (it has {self.cluster})", never=True)
        if sharing in _MIG:
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


class _SharedReplay(_Loop):
    """The event loop of :func:`replay_shared` (one use).

    A trace has thousands of pods, so a cycle here decides only what may have changed
    since the last one: the jobs that arrived, or every waiting job once capacity was
    freed. Within a cycle capacity only shrinks and usage only grows, so a job of a kind
    that found no room (or whose tenant is at its quota) says what that job said, with
    its count of jobs ahead (:meth:`broker.placement.decision.CycleDecisions.behind`),
    without fitting again, and the cycle ends once every kind waiting has found none."""

    def __init__(self, nodes, cluster, policy, workload, placement, whole, distribution, tenants=None):
        self.cluster = cluster
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
                _Entry(seq, arrival, spec, JobRecord(seq, spec.name, spec.kind.value, arrival.tenant, arrival.at))
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
        self.queue = _Queue(self._kind)
        self.ends: list[tuple[float, int, _Entry]] = []
        self.timeline = Timeline()
        self.demand = 0.0

    def run(self) -> tuple[Timeline, list[JobRecord]]:
        entries, n, i = self.entries, len(self.entries), 0
        while i < n or self.ends:
            t = min(entries[i].arrival.at if i < n else math.inf, self.ends[0][0] if self.ends else math.inf)
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
            fresh = []
            while i < n and entries[i].arrival.at <= t:
                fresh.append(entries[i])
                i += 1
            self._arrive(fresh)
            self._cycle(t, list(self.queue) if freed else sorted(fresh, key=lambda e: e.order), every=freed)
            self._sample(t)
        return self.timeline, self._finish(self.timeline.t[-1] if self.timeline.t else 0.0)

    def _cycle(self, t: float, candidates: list[_Entry], every: bool) -> None:
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

    def _kind(self, entry: _Entry) -> tuple:
        return (entry.signature, entry.arrival.task, entry.arrival.gpu_models)

    def _place(self, t: float, entry: _Entry, placed: Placed) -> None:
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
            free if queued else 0.0,
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
) -> ReplayResult:
    """Replay ``workload`` on GPU-sharing ``nodes`` (one Kubernetes cluster called
    ``cluster``) under ``policy``. Routes to ``k8s/timeslice`` (or ``slurm/mps``) take
    a share of one GPU, exclusive routes whole GPUs; ``placement`` picks the node and
    GPU (``fgd`` measures fragmentation against ``distribution``, by default the
    workload's own). ``whole_gpus``: every job on whole GPUs, see :func:`whole_gpu_policy`.
    Fair share and quotas as in :func:`replay`."""
    if placement not in PLACEMENTS:
        raise InvalidRequest(f"unknown placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    began = time.perf_counter()
    loop = _SharedReplay(nodes, cluster, policy, workload, placement, whole_gpus, distribution, tenants)
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
            "fragmentation: FGD's measure, the expected free GPU a job of the workload could not use",
            _fair_share_note(tenants),
        ],
        measures_fragmentation=True,
        tenant_terms=dict(tenants or {}),
    )
