"""What a replay records: per job (:class:`JobRecord`), over time (:class:`Timeline`),
and in sum (:class:`ReplayResult`: waits by kind, tenants' shares and quota time)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.simulation.workload import TenantTerms, tenant_of

KINDS = ("training", "inference", "batch")
# Multi-node jobs' size classes for their waits: (label, fewest nodes, most nodes).
GANG_CLASSES = (
    ("2 nodes", 2, 2),
    ("3-4 nodes", 3, 4),
    ("5-8 nodes", 5, 8),
    ("9-16 nodes", 9, 16),
    ("17+ nodes", 17, 10**9),
)
PERCENTILES = (50, 95, 99)

# What the measures a reader may not know mean, each in one line with its unit and which
# way is good: the terminal summary and report.md use these words (the plots' captions are
# broker.simulation.plots.CAPTIONS).
ALLOCATION_NOTE = (
    "GPU allocation (held): the % of the fleet's {gpus} GPUs that jobs hold, time-weighted. The same jobs "
    "need the same GPU (the row of what running jobs need), so for the same need lower is better: less held for "
    "the same work."
)
STRANDED_NOTE = (
    "stranded GPU: GPU-equivalents (1 = one whole GPU) free while jobs wait for capacity that none of them "
    "fits, time-weighted over the whole replay (0 while none waits for capacity). Lower is better."
)
FRAGMENTATION_NOTE = (
    "fragmentation (FGD's measure): GPU-equivalents free that a typical job of the workload could not use. "
    "Lower is better."
)


def run_label(who: str, placement: str) -> str:
    """A run's name wherever it shows (summary, report.md, plots, results.json): who ran it
    and its placement in ``--placement``'s words: "gpush (fgd)", "whole GPUs (best-fit)"."""
    return f"{who} ({placement})"


# -- what a replay records ------------------------------------------------------------------


@dataclass
class JobRecord:
    """One job of a replay. Times are seconds from the start of the replay."""

    job_id: int
    name: str | None
    kind: str
    tenant: str | None
    arrival: float
    start: float | None = None
    end: float | None = None
    cluster: str | None = None
    sharing: str | None = None
    node: str | None = None
    gpu_equivalents: float = 0.0  # physical GPU-equivalents it held
    demand: float = 0.0  # GPU it asked for, in GPU-equivalents (below what it held with whole GPUs)
    state: str = "waiting"  # waiting | running | succeeded | failed | held
    reason: str | None = None
    quota_wait: float = 0.0  # seconds it waited at its tenant's quota
    waited_for: str | None = None  # why it last waited in the queue before it was placed
    placement: dict[str, Any] | None = None  # where the decision put it (Placement.to_dict())
    priority: int = 0
    preempted: bool = False  # stopped by a preemption (state requeued); requeue_of: the run it continues
    requeue_of: int | None = None
    nodes: int = 1  # a multi-node job's nodes (its gang size)
    backfilled: bool = False  # placed on nodes reserved for a gang, ending before the gang starts

    @property
    def wait(self) -> float | None:
        return None if self.start is None else self.start - self.arrival

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Timeline:
    """Samples taken after every event; each holds until the next sample."""

    t: list[float] = field(default_factory=list)
    allocated: list[float] = field(default_factory=list)  # GPU-equivalents held
    demand: list[float] = field(default_factory=list)  # GPU-equivalents the running jobs asked for
    tiers: dict[str, list[float]] = field(default_factory=dict)  # flavor -> GPU-equivalents held
    queue: list[int] = field(default_factory=list)  # jobs waiting (broker queue and cluster queues)
    stranded: list[float] = field(default_factory=list)  # free GPU-equivalents while jobs wait for capacity
    fragmentation: list[float] = field(default_factory=list)  # FGD measure, GPU-equivalents (shared nodes)
    tenants: dict[str, list[float]] = field(default_factory=dict)  # tenant -> GPU-equivalents held (its ledger)
    at_quota: dict[str, list[int]] = field(default_factory=dict)  # tenant -> jobs waiting at its quota

    def add(self, t, allocated, demand, tiers, queue, stranded, fragmentation, tenants=None, at_quota=None) -> None:
        if self.t and self.t[-1] == t:  # several events at one instant: keep the last state
            for column in (self.t, self.allocated, self.demand, self.queue, self.stranded, self.fragmentation):
                column.pop()
            for values in (*self.tiers.values(), *self.tenants.values(), *self.at_quota.values()):
                values.pop()
        self.t.append(t)
        self.allocated.append(allocated)
        self.demand.append(demand)
        for tier, value in tiers.items():
            self.tiers.setdefault(tier, []).append(value)
        self.queue.append(queue)
        self.stranded.append(stranded)
        self.fragmentation.append(fragmentation)
        for tenant, value in (tenants or {}).items():
            self.tenants.setdefault(tenant, []).append(value)
        for tenant, count in (at_quota or {}).items():
            self.at_quota.setdefault(tenant, []).append(count)

    def mean(self, column: Sequence[float]) -> float:
        """Time-weighted mean from the first to the last sample."""
        if len(self.t) < 2 or self.t[-1] == self.t[0]:
            return float(column[-1]) if column else 0.0
        area = sum(column[i] * (self.t[i + 1] - self.t[i]) for i in range(len(self.t) - 1))
        return area / (self.t[-1] - self.t[0])

    def to_dict(self, limit: int = 20_000) -> dict[str, Any]:
        step = max(1, math.ceil(len(self.t) / limit))  # keep results.json a readable size
        pick = slice(None, None, step)
        return {
            "t": self.t[pick],
            "allocated": self.allocated[pick],
            "demand": self.demand[pick],
            "tiers": {k: v[pick] for k, v in self.tiers.items()},
            "queue": self.queue[pick],
            "stranded": self.stranded[pick],
            "fragmentation": self.fragmentation[pick],
            "tenants": {k: v[pick] for k, v in self.tenants.items()},
            "at_quota": {k: v[pick] for k, v in self.at_quota.items()},
        }

    def shares_mean(self) -> dict[str, float | None]:
        """Each tenant's share of the GPU-equivalents all tenants hold, time-weighted over
        the time anything is held (None: nothing ever was)."""
        area = dict.fromkeys(self.tenants, 0.0)
        span = 0.0
        for i in range(len(self.t) - 1):
            total = sum(column[i] for column in self.tenants.values())
            if total > 1e-9:
                dt = self.t[i + 1] - self.t[i]
                span += dt
                for tenant, column in self.tenants.items():
                    area[tenant] += column[i] / total * dt
        return {tenant: (value / span if span else None) for tenant, value in area.items()}

    def time_at_quota(self, tenant: str) -> float:
        """Seconds during which jobs of the tenant waited at its quota."""
        counts = self.at_quota.get(tenant, [])
        return sum(self.t[i + 1] - self.t[i] for i in range(len(self.t) - 1) if counts[i])


def _percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class ReplayResult:
    """What one replay did: per job, over time, and in sum."""

    label: str
    placement: str
    jobs: list[JobRecord]
    timeline: Timeline
    total_gpus: float
    tier_gpus: dict[str, float]
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    measures_fragmentation: bool = False  # FGD's measure is kept on GPU-sharing nodes only
    tenant_terms: dict[str, TenantTerms] = field(default_factory=dict)  # as the workload gave them
    preemption: dict[str, Any] | None = None  # requeues, GPU-hours lost (a replay with preemption)
    reservations: dict[str, Any] | None = None  # gang reservations made (a fleet replay that makes them)

    def held_reasons(self) -> Counter:
        return Counter(j.reason or "" for j in self.jobs if j.state == "held")

    def waits(self) -> dict[str, dict[str, float | int | None]]:
        """Queue wait (arrival to start) per kind and over all jobs: count and p50/p95/p99."""
        by_kind: dict[str, list[float]] = defaultdict(list)
        for job in self.jobs:
            if job.wait is not None:
                by_kind[job.kind].append(job.wait)
                by_kind["all"].append(job.wait)
        out: dict[str, dict[str, float | int | None]] = {}
        for kind in (*KINDS, "all"):
            values = by_kind.get(kind, [])
            if values or kind == "all":
                out[kind] = {"jobs": len(values), **{f"p{p}": _percentile(values, p) for p in PERCENTILES}}
        return out

    def gang_waits(self) -> dict[str, dict[str, float | int | None]]:
        """Queue wait of multi-node jobs per size class (2, 3-4, 5-8, 9-16, 17+ nodes;
        first runs only): count, p50/p95, and how many never started."""
        out: dict[str, dict[str, float | int | None]] = {}
        for label, low, high in GANG_CLASSES:
            jobs = [j for j in self.jobs if low <= j.nodes <= high and j.requeue_of is None]
            if not jobs:
                continue
            values = [j.wait for j in jobs if j.wait is not None]
            out[label] = {
                "jobs": len(jobs),
                "never_started": len(jobs) - len(values),
                "p50": _percentile(values, 50),
                "p95": _percentile(values, 95),
                "max": max(values, default=None),
            }
        return out

    def backfilled_gpu_hours(self) -> float:
        """GPU-hours of jobs that ran on nodes reserved for a gang, ending before it started."""
        return (
            sum(j.gpu_equivalents * ((j.end or j.start) - j.start) for j in self.jobs if j.backfilled and j.start)
            / 3600
        )

    def tenants(self) -> dict[str, dict[str, Any]]:
        """Per tenant with jobs: its weight and the weight's share of all the tenants'
        weights (the share of GPU in use it converges to while all contend), quota, jobs,
        its time-weighted share of the GPU-equivalents in use, peak held, GPU-hours,
        queue wait p50/p95, and the time it had jobs waiting at its quota."""
        by_tenant: dict[str, list[JobRecord]] = defaultdict(list)
        for job in self.jobs:
            by_tenant[tenant_of(job.tenant)].append(job)
        terms = {name: self.tenant_terms.get(name, TenantTerms()) for name in sorted(by_tenant)}
        weights = sum(t.weight for t in terms.values()) or 1.0
        shares = self.timeline.shares_mean()
        out: dict[str, dict[str, Any]] = {}
        for name, term in terms.items():
            jobs = by_tenant[name]
            waits = [j.wait for j in jobs if j.wait is not None]
            started = [j for j in jobs if j.start is not None]
            out[name] = {
                "weight": term.weight,
                "weight_share": term.weight / weights,
                "gpu_quota": term.gpu_quota,
                "jobs": len(jobs),
                "placed": len(started),
                "held": sum(1 for j in jobs if j.state == "held"),
                "gpu_share_mean": shares.get(name),
                "gpu_peak": max(self.timeline.tenants.get(name, []), default=0.0),
                "gpu_hours": sum(j.gpu_equivalents * ((j.end or j.start) - j.start) for j in started) / 3600,
                "wait_p50": _percentile(waits, 50),
                "wait_p95": _percentile(waits, 95),
                "time_at_quota": self.timeline.time_at_quota(name),
                "jobs_waited_at_quota": sum(1 for j in jobs if j.quota_wait > 0),
            }
        return out

    def summary(self) -> dict[str, Any]:
        states = Counter(job.state for job in self.jobs)
        timeline = self.timeline
        started = [j for j in self.jobs if j.start is not None]
        ends = [j.end for j in self.jobs if j.end is not None]
        total = self.total_gpus or 1.0
        return {
            "label": self.label,
            "placement": self.placement,
            # A preempted job's later runs are records of their own, not more jobs.
            "jobs": sum(1 for j in self.jobs if j.requeue_of is None),
            "placed": sum(1 for j in started if j.requeue_of is None),
            "held": states["held"],
            "succeeded": states["succeeded"],
            "failed": states["failed"],
            "still_waiting": states["waiting"],
            "total_gpus": self.total_gpus,
            "tier_gpus": self.tier_gpus,
            "allocation_mean": timeline.mean(timeline.allocated) / total,
            "allocation_peak": max(timeline.allocated, default=0.0) / total,
            "demand_mean": timeline.mean(timeline.demand) / total,
            "tier_allocation_mean": {
                tier: timeline.mean(values) / (self.tier_gpus.get(tier) or 1.0)
                for tier, values in timeline.tiers.items()
            },
            "queue_mean": timeline.mean(timeline.queue),
            "queue_peak": max(timeline.queue, default=0),
            "stranded_mean_gpus": timeline.mean(timeline.stranded),
            "fragmentation_mean_gpus": timeline.mean(timeline.fragmentation) if self.measures_fragmentation else None,
            "makespan": (max(ends) - min(j.arrival for j in self.jobs)) if ends else None,
            "gpu_hours": sum(j.gpu_equivalents * ((j.end or j.start) - j.start) for j in started) / 3600,
            "waits": self.waits(),
            "tenants": self.tenants(),
            "held_reasons": dict(self.held_reasons().most_common()),
            "wall_seconds": self.wall_seconds,
            "notes": self.notes,
            "protected_waits": self.protected_waits(),
            "preemption": self.preemption,
            "gang_waits": self.gang_waits(),
            "backfilled_gpu_hours": self.backfilled_gpu_hours(),
            "backfilled_jobs": sum(1 for j in self.jobs if j.backfilled),
            "reservations": self.reservations,
        }

    def protected_waits(self) -> dict[str, float | int | None]:
        """Queue wait of the protected work (priority above 0, its first run only): what
        preemption is for."""
        values = [j.wait for j in self.jobs if j.priority > 0 and j.requeue_of is None and j.wait is not None]
        return {"jobs": len(values), **{f"p{p}": _percentile(values, p) for p in PERCENTILES}}

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "jobs": [j.to_dict() for j in self.jobs],
            "timeline": self.timeline.to_dict(),
        }
