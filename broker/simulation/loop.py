"""What both replay engines share: virtual time, a job inside a replay, the waiting
queue, and the loop that decides waiting jobs through the one decision
(:class:`broker.placement.decision.CycleDecisions`) in the scheduler's fair-share order.
The engines are :mod:`broker.simulation.replay` (a simulated fleet, as the live cycle)
and :mod:`broker.simulation.shared` (GPU-sharing nodes of a trace)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from broker.core.adapter import Placement
from broker.core.schemas import JobSpec
from broker.placement.capacity import replicas_of
from broker.placement.decision import Held, Outcome, Placed, WaitCause
from broker.placement.fairshare import FairShare
from broker.placement.fragmentation import (
    Slot,
)
from broker.routing.policy import Policy, evaluate
from broker.simulation.results import JobRecord
from broker.simulation.workload import (
    Arrival,
    TenantTerms,
    tenant_of,
)

# Events between two calls of a replay's progress callback: often enough for a bar,
# rare enough to cost nothing.
PROGRESS_EVERY = 256


class VirtualClock:
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

    def at(self, seconds: float) -> datetime:
        return self.start + timedelta(seconds=seconds)


@dataclass
class ReplayJob:
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
    waiting_since: datetime | None = None  # when it joined the queue (a fleet replay's gang reservations)
    placed_at: datetime | None = None  # when the decision placed it (its expected end: this + time limit)
    tenant: str = field(init=False)  # as fair share counts it

    def __post_init__(self) -> None:
        self.tenant = tenant_of(self.arrival.tenant)

    @property
    def job_id(self) -> int:  # what a reservation is held for
        return self.seq

    @property
    def order(self) -> tuple[int, int]:
        return (-self.spec.priority, self.seq)

    @property
    def asked(self) -> JobSpec:
        return self.arrival.spec


def signature(spec: JobSpec, routes: list) -> tuple:
    """Jobs with equal signatures fit or fail alike on the same free capacity: the
    routes as the fit reads them, and the fields of the job it reads."""
    return (
        tuple((r.cluster, r.sharing, r.partition, r.gpu_model) for r in routes),
        spec.gpus,
        spec.gpu_memory_gb,
        replicas_of(spec),
        spec.isolation,
        spec.nodes,
    )


class WaitingQueue:
    """Waiting jobs in priority, then arrival, order, with how many of each kind wait
    (``kinds``: key -> count), so a pass can stop once every kind has failed, and how
    many of each tenant (``tenants``), the tenants that share."""

    def __init__(self, kind: Callable[[ReplayJob], tuple]) -> None:
        self._keys: list[tuple[int, int]] = []
        self._entries: list[ReplayJob] = []
        self._kind = kind
        self.kinds: Counter = Counter()
        self.tenants: Counter = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: ReplayJob) -> None:
        at = bisect.bisect(self._keys, entry.order)
        self._keys.insert(at, entry.order)
        self._entries.insert(at, entry)
        self.kinds[self._kind(entry)] += 1
        self.tenants[entry.tenant] += 1

    def remove(self, entry: ReplayJob) -> None:
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


class ReplayLoop:
    """What both event loops share: the arriving jobs queued, the waiting ones decided
    by :class:`broker.placement.decision.CycleDecisions` in the scheduler's order
    (:class:`broker.placement.fairshare.FairShare`), and the time jobs wait at their
    tenant's quota. Subclasses say what a kind of job is (:meth:`_kind`: jobs of one
    kind fit or fail alike) and what placing one means (:meth:`_place`)."""

    policy: Policy
    queue: WaitingQueue

    def __init__(self, entries: list[ReplayJob], tenants: Mapping[str, TenantTerms] | None) -> None:
        self.entries = entries
        terms = tenants or {}
        self.weights = {name: t.weight for name, t in terms.items()}
        self.quotas = {name: t.gpu_quota for name, t in terms.items() if t.gpu_quota is not None}
        self.fair = FairShare(self.weights, self.quotas)
        self.tenant_names = sorted({e.tenant for e in entries})
        self.at_quota: dict[int, ReplayJob] = {}  # by seq: waiting at their tenant's quota
        self.quota_counts: Counter = Counter()  # tenant -> its jobs waiting at its quota

    def _kind(self, entry: ReplayJob) -> tuple:
        raise NotImplementedError

    def _place(self, t: float, entry: ReplayJob, placed: Placed) -> None:
        raise NotImplementedError

    def _arrive(self, fresh: list[ReplayJob]) -> None:
        """Queue the jobs that arrived; their routes (evaluated again, and cached, by the
        decision) say what kind of job each is."""
        for entry in fresh:
            entry.routes = evaluate(self.policy, entry.arrival.spec, entry.arrival.tenant).routes
            entry.signature = signature(entry.spec, entry.routes)
            self.queue.add(entry)

    def _heads(self, candidates: Iterable[ReplayJob], limit: int | None) -> dict[str, deque[ReplayJob]]:
        """Each tenant's waiting jobs in its own order, at most ``limit`` of them (the
        scheduler's claim: ``claim_limit`` per tenant and cycle)."""
        by_tenant: dict[str, deque[ReplayJob]] = {}
        for entry in candidates:
            waiting = by_tenant.setdefault(entry.tenant, deque())
            if limit is None or len(waiting) < limit:
                waiting.append(entry)
        return by_tenant

    def _next(self, by_tenant: dict[str, deque[ReplayJob]]) -> ReplayJob:
        tenant = self.fair.next_tenant((name, q[0].spec.priority, q[0].seq) for name, q in by_tenant.items())
        waiting = by_tenant[tenant]
        entry = waiting.popleft()
        if not waiting:
            del by_tenant[tenant]
        return entry

    def _apply(self, t: float, entry: ReplayJob, outcome: Outcome) -> None:
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

    def _quota_begins(self, t: float, entry: ReplayJob) -> None:
        if entry.quota_since is None:
            entry.quota_since = t
            self.at_quota[entry.seq] = entry
            self.quota_counts[entry.tenant] += 1

    def _quota_ends(self, t: float, entry: ReplayJob) -> None:
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


def fair_share_note(tenants: Mapping[str, TenantTerms] | None) -> str:
    quotas = ", ".join(f"{name} {t.gpu_quota:g}" for name, t in (tenants or {}).items() if t.gpu_quota is not None)
    return (
        "fair share as the scheduler keeps it: jobs are tried by priority, then the tenant furthest below its "
        "weighted share of the GPU-equivalents in use, then arrival"
        + (f"; quotas (GPU-equivalents): {quotas}" if quotas else "")
    )
