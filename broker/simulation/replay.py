"""Replay on a simulated fleet: a workload through gpush's routing and placement in
virtual time, cycle by cycle as the live scheduler runs.

Both replay engines (this one, and :mod:`broker.simulation.shared` for the GPU-sharing
nodes of a trace) decide through the one decision of the live scheduler
(:class:`broker.placement.decision.CycleDecisions`): what differs is only the capacity
they bring and what they do with an outcome.

- **Replay on a simulated fleet** (:func:`replay`): one
  :class:`broker.simulation.cluster.SimulatedCluster` per fleet cluster, driven from event
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

What both engines share (virtual time, the waiting queue, the loop) is
:mod:`broker.simulation.loop`. The workload and its whole-GPU variant are :mod:`broker.simulation.workload`; what a
replay records, :mod:`broker.simulation.results`; the report and plots,
:mod:`broker.simulation.report` and :mod:`broker.simulation.plots`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace as _replace
from datetime import UTC, datetime, timedelta

from broker.core.adapter import BackendState, Rejected, Sharing
from broker.placement.capacity import CapacityView
from broker.placement.decision import CycleDecisions, Placed
from broker.placement.fairshare import FairShare
from broker.placement.preemption import Blocked, Planner, Running, Terms, Waiting
from broker.placement.reservation import Reservation, Reservations, expected_end, running_ends
from broker.placement.topology_fit import strip_topology
from broker.routing.policy import Policy
from broker.simulation.cluster import SimulatedCluster
from broker.simulation.fleet import Fleet
from broker.simulation.loop import PROGRESS_EVERY, ReplayJob, ReplayLoop, VirtualClock, WaitingQueue, fair_share_note
from broker.simulation.results import STRANDED_NOTE, JobRecord, ReplayResult, Timeline
from broker.simulation.workload import (
    Arrival,
    TenantTerms,
    whole_gpu_fleet,
    whole_gpu_policy,
    whole_gpu_spec,
)

# Where virtual time starts; any fixed instant does, the reports count seconds from it.
T0 = datetime(2025, 1, 1, tzinfo=UTC)
# How a replay on a fleet places, as the live scheduler does (broker.placement.capacity).
PLACEMENT_ON_FLEET = "gpush's: best-fit for whole GPUs and MIG, fgd per GPU for MPS and time-slicing"


# -- replay on a simulated fleet ----------------------------------------------------------

# Jobs per tenant a replay's cycle decides: the scheduler's default claim limit.
CLAIM_LIMIT = 1000


class _FleetReplay(ReplayLoop):
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
        progress: Callable[[int], None] | None = None,
        preemption: Terms | None = None,
        reservations: bool = True,
        topology: bool = True,
    ):
        self.whole = whole
        self.topology = topology
        self.preemption = preemption
        self.preempted: set[int] = set()  # seqs stopped by a preemption (their end is not a finish)
        self.reclaims: list[datetime] = []  # when fair-share reclaims happened (the hourly budget)
        self.requeues = 0
        self.gpu_seconds_lost = 0.0
        self.observe = observe
        self.progress = progress
        self.demand_of = demand_of
        self.claim_limit = claim_limit
        self._pinned_waiting: dict[tuple[str, str], int] = {}  # as Scheduler's: CapacityView.pinned
        self.fleet = whole_gpu_fleet(fleet) if whole else fleet
        self.policy = whole_gpu_policy(policy) if whole else policy
        # Gang reservations as the scheduler keeps them (broker.placement.reservation): by
        # job, from cycle to cycle, as the live scheduler's gang_reservations table.
        after = self.policy.gang_reservation_after if reservations else None
        self.reserve_after = None if after is None else timedelta(seconds=after)
        self.reservations: dict[int, Reservation] = {}
        self.reserved_jobs: set[int] = set()  # gangs that ever had a reservation
        self.clock = VirtualClock(start)
        self.sims = {
            name: SimulatedCluster.from_fleet(self.fleet, name, clock=self.clock) for name in self.fleet.clusters
        }
        self.cursors = {name: sim.statuses().cursor for name, sim in self.sims.items()}
        self.flavor = {name: cluster.flavor for name, cluster in self.fleet.clusters.items()}
        self.tier_gpus: dict[str, float] = defaultdict(float)
        for cluster in self.fleet.clusters.values():
            self.tier_gpus[cluster.flavor] += cluster.gpu_count
        order = sorted(range(len(workload)), key=lambda i: (workload[i].at, i))
        entries: list[ReplayJob] = []
        for seq, i in enumerate(order, 1):
            arrival = workload[i]
            spec = whole_gpu_spec(arrival.spec) if whole else arrival.spec
            record = JobRecord(
                seq, spec.name, spec.kind.value, arrival.tenant, arrival.at, priority=spec.priority, nodes=spec.nodes
            )
            entries.append(ReplayJob(seq, arrival, spec, record))
        super().__init__(entries, tenants)
        self.by_id = {e.seq: e for e in self.entries}
        self.queue = WaitingQueue(self._kind)
        self.holding: dict[int, ReplayJob] = {}  # by seq: placed, not ended (the ledger's active jobs)
        self.held_in_clusters = 0  # submitted, waiting in a cluster's own queue
        self.queued_in_clusters = 0  # placements that ever waited there
        self.allocated: dict[str, float] = defaultdict(float)  # by flavor
        self.demand = 0.0  # GPU-equivalents the running jobs need
        self.timeline = Timeline()

    def run(self) -> tuple[Timeline, list[JobRecord]]:
        entries, n, i = self.entries, len(self.entries), 0
        events = 0
        while True:
            events += 1
            if self.progress is not None and not events % PROGRESS_EVERY:
                self.progress(i)
            times = [entries[i].arrival.at] if i < n else []
            for sim in self.sims.values():
                moment = sim.next_event_time()
                if moment is not None:
                    times.append(self.clock.seconds(moment))
            timer = self._next_timer(bool(times))
            if timer is not None:
                times.append(timer)
            if not times:
                break
            t = min(times)
            self.clock.set(t)
            self._collect()
            self._on_time(t)
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

    def _arrive(self, fresh: list[ReplayJob]) -> None:
        for entry in fresh:  # as the scheduler reads a job's created_at
            entry.waiting_since = self.clock.at(entry.arrival.at)
        super()._arrive(fresh)

    def _next_timer(self, busy: bool) -> float | None:
        """When the replay next acts on its own, beside arrivals and job ends (None: never;
        ``busy``: other events are due). A replay that changes the fleet as it goes
        (broker.simulation.layouts) says when."""
        return None

    def _on_time(self, t: float) -> None:
        """What the replay does at ``t`` before the cycle, beside reading the clusters."""

    def _cycle(self, t: float, preempting: bool = True) -> None:
        if not self.queue:
            return
        # The ledger and the shares as the cycle reads them: what placed jobs hold, the
        # tenants holding GPUs and those with jobs waiting.
        self.fair = FairShare(self.weights, self.quotas, self._usage(), waiting=self.queue.tenants)
        capacity = self._capacity()
        capacity.pinned = dict(self._pinned_waiting)  # as the live cycle: last cycle's waits
        book = None
        if self.reserve_after is not None:
            book = Reservations(self.reserve_after, self.clock(), self.reservations, self._expected_ends)
        decisions = CycleDecisions(self.policy, capacity, self.fair, book)
        by_tenant = self._heads(self.queue, self.claim_limit)
        while by_tenant:
            entry = self._next(by_tenant)
            self._apply(t, entry, decisions.decide(entry))
        self._pinned_waiting = dict(decisions.pinned_waiting)
        if book is not None:
            self.reservations = book.held
            self.reserved_jobs.update(book.held)
            for seq in book.backfilled:
                self.by_id[seq].record.backfilled = True
        if preempting and self.preemption is not None and self._preempt(t, decisions):
            # The victims' capacity is free once their clusters have ended them: the
            # waiting jobs are decided again in this same moment, as the scheduler's next
            # cycle after the grace would.
            self._collect()
            self._cycle(t, preempting=False)

    def _preempt(self, t: float, decisions: CycleDecisions) -> bool:
        """Stop preemptible running jobs of lower standing for waiting jobs that only they
        block, by the planner the scheduler uses (broker.placement.preemption.Planner), on
        this cycle's ``decisions`` (their capacity and gang reservations, as the live
        cycle's): each victim loses the work since its last checkpoint and is queued again
        for the rest. Victims stop at once here (no grace: the replay's capacity frees when
        the cluster reads the cancel; a gang's on every node)."""
        running = [
            self._as_running(e)
            for e in self.holding.values()
            if e.record.state == "running" and e.arrival.preemptible and e.seq not in self.preempted
        ]
        if not running:
            return False
        planner = Planner(
            running,
            terms=self.preemption,
            share_gap=self.fair.gaps(),
            now=self.clock(),
            recent_reclaims=[at for at in self.reclaims if self.clock() - at < timedelta(hours=1)],
        )
        blocked = (
            Blocked(Waiting(e.seq, e.tenant, e.spec.priority), e, e.routes)
            for e in self.queue
            if e.seq not in self.at_quota and e.routes
        )
        chosen = planner.plan(blocked, decisions)
        self.reclaims = planner.recent_reclaims
        for item, choice in chosen:
            for victim in choice.victims:
                self._stop(t, self.by_id[victim.job_id], choice.reason(item.waiting))
        return bool(chosen)

    @staticmethod
    def _saved_at(entry: ReplayJob, t: float) -> float:
        """When the running job last checkpointed before ``t`` (its start if it never did):
        what a preemption at ``t`` keeps of its work."""
        start = t if entry.record.start is None else entry.record.start
        every = entry.arrival.checkpoint_every
        return start + ((t - start) // every) * every if every else start

    def _as_running(self, entry: ReplayJob) -> Running:
        start = entry.record.start or 0.0
        saved = self._saved_at(entry, self.clock.seconds(self.clock()))
        checkpoint = self.clock.at(saved) if saved > start else None
        return Running(
            entry.seq, entry.tenant, entry.spec.priority, True, self.clock.at(start), checkpoint, entry.placement
        )

    def _stop(self, t: float, entry: ReplayJob, reason: str) -> None:
        """Preempt ``entry``: cancel it on its cluster, count the work lost, queue the rest."""
        record = entry.record
        start = t if record.start is None else record.start
        saved = self._saved_at(entry, t)
        lost, kept = t - saved, saved - start
        self.preempted.add(entry.seq)
        self.sims[entry.placement.cluster].cancel(entry.seq)
        self.gpu_seconds_lost += lost * record.gpu_equivalents
        self.requeues += 1
        record.reason = reason
        record.preempted = True
        # The rest of its work, queued again as the broker requeues a preempted job.
        remaining = max(entry.arrival.duration - kept, 1.0)
        seq = len(self.entries) + 1
        arrival = _replace(entry.arrival, at=t, duration=remaining)
        again = ReplayJob(
            seq,
            arrival,
            entry.spec,
            JobRecord(seq, record.name, record.kind, arrival.tenant, t, priority=record.priority, nodes=record.nodes),
        )
        again.record.requeue_of = record.job_id
        self.entries.append(again)
        self.by_id[seq] = again
        self._arrive([again])

    def _expected_ends(self) -> dict:
        """When what holds capacity is expected to end, as the scheduler reads it
        (broker.scheduling.holdings.expected_ends): each placed job's time limit after
        it was placed."""
        return running_ends(
            (e.placement, expected_end(e.placed_at, e.spec.time_limit))
            for e in self.holding.values()
            if e.placed_at is not None and e.placed_at < self.clock()
        )

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
        if not self.topology:
            inventory = {name: strip_topology(units) for name, units in inventory.items()}
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
                    if entry.seq in self.preempted:
                        record.state = "requeued"  # its reason says by which job
                        self._ended(entry)
                        continue
                    record.state = "succeeded" if backend.state is BackendState.SUCCEEDED else "failed"
                    record.reason = backend.reason
                    self._ended(entry)

    def _ended(self, entry: ReplayJob) -> None:
        self.holding.pop(entry.seq, None)

    def _kind(self, entry: ReplayJob) -> tuple:
        return entry.signature

    def _place(self, t: float, entry: ReplayJob, placed: Placed) -> None:
        placement = placed.placement
        record = entry.record
        entry.placement = placement
        entry.placed_at = self.clock()
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
        # Stranded only while a job waits for capacity: one at its tenant's quota would
        # wait on an empty fleet too, and free GPUs then say nothing about placement.
        stranded = max(total - reserved, 0.0) if queued > len(self.at_quota) else 0.0
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
    progress: Callable[[int], None] | None = None,
    preemption: Terms | None = None,
    reservations: bool = True,
    topology: bool = True,
) -> ReplayResult:
    """Replay ``workload`` on simulated clusters of ``fleet`` under ``policy``
    (``whole_gpus``: the same on whole GPUs only; see the module docstring), with the
    fair-share weights and quotas of ``tenants`` (a tenant not in it: weight 1, no quota).

    A job's ``demand`` is the GPU-equivalents its placement holds, or
    ``demand_of(job_id)`` when that gives a number: what the job needs as another
    replay sized it (a whole-GPU run measured against gpush's sharing).

    ``claim_limit``: jobs per tenant each cycle decides, as the scheduler's. ``observe``
    is called after each cycle with its virtual time and every job's record (the
    differential test compares them with the live scheduler's, step by step). ``progress``
    is called now and then with the number of jobs arrived so far. ``preemption``: the terms
    under which waiting jobs preempt the workload's ``preemptible`` jobs (None: never).
    ``reservations``: multi-node jobs get reservations as the policy says (its
    ``scheduling`` section; False: never, to measure what they change). ``topology``:
    False strips the topology fields from the clusters' units before placement sees them
    (:func:`broker.placement.topology_fit.strip_topology`), to measure what topology-aware
    placement changes; the simulated clusters still pick GPUs on their nodes' topology."""
    began = time.perf_counter()
    loop = _FleetReplay(
        fleet,
        policy,
        workload,
        whole_gpus,
        start,
        demand_of,
        tenants,
        claim_limit,
        observe,
        progress,
        preemption,
        reservations,
        topology,
    )
    timeline, jobs = loop.run()
    notes = [
        fair_share_note(tenants),
        STRANDED_NOTE,
    ]
    if loop.queued_in_clusters:
        notes.append(
            f"{loop.queued_in_clusters} placement(s) waited in a cluster's own queue: CapacityView found room "
            "the cluster did not have (an MPS share needs it on one GPU, time-sliced memory counts per GPU)"
        )
    if preemption is not None:
        notes.append(
            f"preemption: {loop.requeues} preemption(s), {loop.gpu_seconds_lost / 3600:.2f} GPU-hours of work lost "
            "(since each victim's last checkpoint); a victim stops at once and runs the rest when placed again"
        )
    if loop.reserved_jobs:
        notes.append(
            f"gang reservations: {len(loop.reserved_jobs)} multi-node job(s) had nodes reserved after waiting "
            f"{loop.reserve_after}; shorter jobs were backfilled onto reserved nodes when they ended in time"
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
        preemption=None
        if preemption is None
        else {"requeues": loop.requeues, "gpu_hours_lost": loop.gpu_seconds_lost / 3600},
        reservations=None
        if loop.reserve_after is None
        else {"after_seconds": loop.reserve_after.total_seconds(), "gangs_reserved": len(loop.reserved_jobs)},
    )
