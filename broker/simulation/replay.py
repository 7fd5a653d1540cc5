"""Replaying a workload through gpush's routing and placement in virtual time, and the reports.

This module owns what ``gpush simulate`` does, without a database:

- **The workload file** (:func:`load_workload`): a YAML list of jobs, each with
  ``at:`` (seconds from the start) and ``duration:`` (seconds it runs once started)
  beside the usual job fields, and optionally ``count:`` copies ``every:`` seconds
  apart; and, optionally, the tenants' fair-share weights and GPU quotas, as
  ``gpush tenant set`` gives them to the live broker (a tenant not listed has weight
  1 and no quota, as in the broker; jobs without a tenant share as one)::

      tenants:
        nlp: {weight: 2, gpu_quota: 8}
        vision: {weight: 1}
      jobs:
        - {at: 0, duration: 3600, count: 4, every: 60, kind: training,
           isolation: hardware, gpu_memory_gb: 5, tenant: nlp}

- **Replay on a simulated fleet** (:func:`replay`): one
  :class:`broker.simulation.fleet.SimulatedCluster` per fleet cluster, driven from event to
  event (an arrival or a job's end). At each event the waiting jobs are routed by
  the policy (:func:`broker.routing.policy.evaluate`, the scheduler's own call) and fitted
  with :class:`broker.placement.capacity.CapacityView` as the scheduling cycle does, then
  submitted with the fitted placement; the view is kept in step with the clusters by
  giving back what a job took when it ends. Jobs no rule matches, or that no route
  could ever hold, are held with the reason.
- **Fair share and quotas**, in every replay (on a fleet, on GPU-sharing nodes, and
  the whole-GPU comparison): at each event the waiting jobs are tried in the
  scheduler's order, by :class:`broker.placement.fairshare.FairShare` (priority, then the
  tenant furthest below its weighted share of the GPU-equivalents in use, then
  arrival); a job that would take its tenant over its quota waits with the broker's
  reason ("tenant nlp at quota (8/8 GPU)"), and what a job held is released when it
  ends. An event is one scheduling cycle: the tenants that share are fixed at its
  start, as in the broker. The report gives, per tenant, its share of the
  GPU-equivalents in use over time beside its weight's share, its jobs, queue wait
  and the time it spent at its quota.
- **Replay on GPU-sharing nodes** (:func:`replay_shared`): the same loop with the
  policy's routes, placed on :class:`broker.placement.fragmentation.SharedGpuNodes` (per-GPU
  milli-GPU, whole and fractional tasks on the same GPU, FGD or best fit). This is
  how a trace of a GPU-sharing cluster (Alibaba's openb, :mod:`broker.simulation.traces`) is
  replayed: a simfleet GPU has one sharing mode and cannot do that.
- **Whole GPUs** (:func:`whole_gpu_fleet`, :func:`whole_gpu_policy`,
  :func:`whole_gpu_spec`): the same workload on the same physical GPUs when nothing is
  shared (what Slurm and Kubernetes do by default): every GPU whole, every route to
  its cluster's exclusive mode, every job one whole GPU per GPU, slice, share or
  replica it asked for.
- **The inflation experiment** of the FGD paper (:func:`inflation_arrivals`,
  :func:`inflate`, :func:`inflation_experiment`).
- **Reports**: :func:`run_simulation` writes ``report.md``, ``results.json`` and PNG
  plots; :func:`summary_lines` is the terminal's short version.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import os
import random
import statistics
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from broker.core.adapter import BackendState, Placement, Rejected, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import Isolation, JobSpec, parse_memory_mib, parse_time_limit
from broker.intake.jobfile import validate_spec
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
from broker.routing.policy import Policy, evaluate, load_policy
from broker.simulation.fleet import Fleet, FleetCluster, SimulatedCluster, load_fleet_file

# Where virtual time starts; any fixed instant does, the reports count seconds from it.
T0 = datetime(2025, 1, 1, tzinfo=UTC)
KINDS = ("training", "inference", "batch")
PERCENTILES = (50, 95, 99)
_MIG = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
# How a replay on a fleet places, as the live scheduler does (broker.placement.capacity).
PLACEMENT_ON_FLEET = "gpush's: best fit for whole GPUs and MIG, FGD per GPU for MPS and time-slicing"
_SHARED = (Sharing.K8S_TIMESLICE, Sharing.SLURM_MPS)


# -- the workload -----------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """One job of a workload: when it arrives and how long it runs once started.

    ``task`` is the exact demand of a trace pod on GPU-sharing nodes (its milli-GPU,
    CPU and memory); ``gpu_models`` the trace models it accepts (empty: any).
    """

    at: float
    spec: JobSpec
    duration: float
    tenant: str | None = None
    task: TaskShape | None = None
    gpu_models: tuple[str, ...] = ()


def _seconds(value: Any, what: str, where: str, *, positive: bool) -> float:
    if isinstance(value, bool) or value is None:
        raise InvalidRequest(f"{where}: {what} is required: seconds, or a duration such as 90m or 1h30m")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = float(parse_time_limit(text))
            except ValueError as exc:
                raise InvalidRequest(f"{where}: {what} {value!r}: {exc}") from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "more than 0" if positive else "0 or more"
        raise InvalidRequest(f"{where}: {what} {value!r} must be {bound} seconds")
    return seconds


@dataclass(frozen=True)
class TenantTerms:
    """A tenant's fair-share weight and GPU quota (GPU-equivalents; None: no cap), as
    ``gpush tenant set`` gives them to the live broker."""

    weight: float = 1.0
    gpu_quota: float | None = None


@dataclass(frozen=True)
class Workload:
    """A workload file: its jobs in file order, and the tenants it lists."""

    arrivals: list[Arrival]
    tenants: dict[str, TenantTerms] = field(default_factory=dict)


def _yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        raise InvalidRequest(f"{where}: not valid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"{source}: not valid YAML: {exc}") from None


def read_workload(text: str, source: str) -> Workload:
    """The jobs and tenants of workload YAML (see the module docstring);
    :class:`InvalidRequest` names the job or tenant and the field that is wrong."""
    raw = _yaml(text, source)
    tenants = _tenants(raw.get("tenants") if isinstance(raw, dict) else None, source)
    return Workload(_arrivals(raw, source), tenants)


def parse_workload(text: str, source: str) -> list[Arrival]:
    """The jobs of workload YAML, in file order (:func:`read_workload` without tenants)."""
    return read_workload(text, source).arrivals


def _arrivals(raw: Any, source: str) -> list[Arrival]:
    entries = raw.get("jobs") if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise InvalidRequest(
            f"{source}: expected jobs: followed by a list of jobs, each with at:, duration: and job fields"
        )
    arrivals: list[Arrival] = []
    for index, entry in enumerate(entries, 1):
        where = f"{source}, job {index}"
        if not isinstance(entry, dict):
            raise InvalidRequest(
                f"{where}: expected a mapping (at:, duration:, kind:, ...), got {type(entry).__name__}"
            )
        fields = dict(entry)
        if fields.get("name"):
            where += f" ({fields['name']})"
        at = _seconds(fields.pop("at", None), "at", where, positive=False)
        duration = _seconds(fields.pop("duration", None), "duration", where, positive=True)
        count = fields.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100_000:
            raise InvalidRequest(f"{where}: count {count!r} must be a whole number from 1 to 100000")
        every = _seconds(fields.pop("every", 0), "every", where, positive=False)
        if "command" not in fields and "image" not in fields:
            # A simulated job runs nothing; a command keeps the spec valid and says so.
            fields["command"] = ["sleep", str(int(duration))]
        name = fields.get("name")
        for copy in range(count):
            if count > 1 and name:
                fields["name"] = f"{name}-{copy + 1}"
            spec = validate_spec(dict(fields), where=where)
            arrivals.append(Arrival(at + copy * every, spec, duration, spec.tenant))
    return arrivals


def _tenants(raw: Any, source: str) -> dict[str, TenantTerms]:
    """The ``tenants:`` section, checked as ``gpush tenant set`` checks its options."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{source}: tenants: expected a mapping of tenant names, such as nlp: {{weight: 2}}")
    tenants: dict[str, TenantTerms] = {}
    for name, terms in raw.items():
        where = f"{source}, tenant {name}"
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}: a tenant's name is text, as jobs' tenant: fields give it")
        terms = {} if terms is None else terms
        if not isinstance(terms, dict):
            raise InvalidRequest(f"{where}: expected weight: and/or gpu_quota:, got {terms!r}")
        unknown = sorted(set(terms) - {"weight", "gpu_quota"})
        if unknown:
            raise InvalidRequest(f"{where}: unknown field {unknown[0]!r}: a tenant has weight: and gpu_quota:")
        weight = _number(terms.get("weight", 1.0), "weight", where)
        if weight <= 0:
            raise InvalidRequest(f"{where}: weight {weight:g} must be more than 0 (1 is the default share)")
        quota = terms.get("gpu_quota")
        if quota is not None:
            quota = _number(quota, "gpu_quota", where)
            if quota < 0:
                raise InvalidRequest(f"{where}: gpu_quota {quota:g} must be 0 or more GPU-equivalents")
        tenants[name] = TenantTerms(weight, quota)
    return tenants


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{where}: {what} {value!r} must be a number")
    return float(value)


def load_workload(path: str | os.PathLike[str]) -> Workload:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read workload file {str(path)!r}: {exc.strerror or exc}") from None
    return read_workload(text, str(path))


# -- whole GPUs ---------------------------------------------------------------------------


def whole_gpu_fleet(fleet: Fleet) -> Fleet:
    """The same nodes and GPUs with nothing shared: MIG, MPS and time-slicing off."""
    clusters = {}
    for name, cluster in fleet.clusters.items():
        nodes = tuple(
            replace(node, gpus=tuple(replace(gpu, mode="whole", mig=(), replicas=1) for gpu in node.gpus))
            for node in cluster.nodes
        )
        clusters[name] = FleetCluster(cluster.name, cluster.flavor, nodes)
    return Fleet(f"{fleet.source} (whole GPUs)", clusters)


def whole_gpu_policy(policy: Policy) -> Policy:
    """The same rules, every route to its cluster's exclusive mode: jobs go where the
    policy sends them, as whole GPUs. Evaluate it on the job as submitted (the matches
    are unchanged) and fit :func:`whole_gpu_spec` of the job."""
    data = policy.model_dump(mode="json", exclude_none=True)
    for rule in data["rules"]:
        routes: list[dict[str, Any]] = []
        for route in [rule["route"], *rule.get("fallbacks", [])]:
            flavor = Sharing(route["sharing"]).flavor
            whole = {**route, "sharing": f"{flavor}/exclusive"}
            if whole not in routes:
                routes.append(whole)
        rule["route"], rule["fallbacks"] = routes[0], routes[1:]
    return Policy.model_validate(data)


def whole_gpu_spec(spec: JobSpec) -> JobSpec:
    """The job taking one whole GPU per GPU, slice, share or replica it asked for."""
    return spec.model_copy(update={"isolation": Isolation.EXCLUSIVE})


# -- what a replay records ------------------------------------------------------------------

NO_TENANT = "(no tenant)"  # jobs of a workload that name no tenant share as one


def _tenant_of(name: str | None) -> str:
    return name or NO_TENANT


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
    stranded: list[float] = field(default_factory=list)  # free GPU-equivalents while jobs wait
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

    def tenants(self) -> dict[str, dict[str, Any]]:
        """Per tenant with jobs: its weight and the weight's share of all the tenants'
        weights (the share of GPU in use it converges to while all contend), quota, jobs,
        its time-weighted share of the GPU-equivalents in use, peak held, GPU-hours,
        queue wait p50/p95, and the time it had jobs waiting at its quota."""
        by_tenant: dict[str, list[JobRecord]] = defaultdict(list)
        for job in self.jobs:
            by_tenant[_tenant_of(job.tenant)].append(job)
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
            "jobs": len(self.jobs),
            "placed": len(started),
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
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "jobs": [j.to_dict() for j in self.jobs],
            "timeline": self.timeline.to_dict(),
        }


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
        self.tenant = _tenant_of(self.arrival.tenant)

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


# -- the inflation experiment ------------------------------------------------------------


@dataclass(frozen=True)
class InflationRun:
    """One inflation run: tasks arrive and never leave, each placed or dropped.
    Allocation is GPU demand placed over GPU capacity."""

    placement: str
    whole_gpus: bool
    seed: int
    capacity_gpus: float
    at_full: float  # allocation once the arrived demand reached capacity
    at_end: float  # allocation after every arrival (ratio x capacity)
    at_first_failure: float  # allocation when the first task could not be placed
    arrived_at_first_failure: float  # arrived demand over capacity at that moment
    placed: int
    failed: int
    seconds: float
    curve: tuple[tuple[float, float], ...]  # (arrived, allocation) at each 1% of arrived demand

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "curve": [list(point) for point in self.curve]}


def inflation_arrivals(
    tasks: Sequence[TaskShape], *, seed: int, capacity_milli: int, ratio: float = 1.3
) -> list[TaskShape]:
    """The FGD paper's arrival sequence: the tasks in a random order (``seed``), then
    tasks drawn from them with replacement until the arrived GPU demand reaches
    ``ratio`` times the capacity."""
    if not tasks:
        raise InvalidRequest("no GPU tasks to inflate")
    rng = random.Random(seed)
    order = list(tasks)
    rng.shuffle(order)
    arrived = sum(t.demand_milli for t in order)
    while arrived < ratio * capacity_milli:
        task = rng.choice(tasks)
        order.append(task)
        arrived += task.demand_milli
    return order


def inflate(
    nodes: Sequence[SharedNode],
    arrivals: Sequence[TaskShape],
    *,
    placement: str,
    distribution: WorkloadDistribution | None,
    whole_gpus: bool = False,
    seed: int = 0,
) -> InflationRun:
    """Place ``arrivals`` in order on empty ``nodes``; a task that fits nowhere is dropped."""
    began = time.perf_counter()
    shapes = sorted({t.whole() if whole_gpus else t for t in arrivals})
    cluster = SharedGpuNodes(nodes, placement=placement, distribution=distribution, shapes=shapes)
    capacity = cluster.capacity_milli
    arrived = placed_demand = placed = failed = 0
    at_full = first_failure = arrived_at_failure = None
    curve: list[tuple[float, float]] = []
    next_point = 0.0
    for task in arrivals:
        arrived += task.demand_milli
        if cluster.place(task.whole() if whole_gpus else task) is not None:
            placed_demand += task.demand_milli
            placed += 1
        else:
            if first_failure is None:
                first_failure = placed_demand / capacity
                arrived_at_failure = (arrived - task.demand_milli) / capacity
            failed += 1
        if at_full is None and arrived >= capacity:
            at_full = placed_demand / capacity
        while arrived / capacity >= next_point:
            curve.append((round(next_point, 2), placed_demand / capacity))
            next_point += 0.01
    end = placed_demand / capacity
    return InflationRun(
        placement,
        whole_gpus,
        seed,
        capacity / MILLI,
        end if at_full is None else at_full,
        end,
        end if first_failure is None else first_failure,
        arrived / capacity if arrived_at_failure is None else arrived_at_failure,
        placed,
        failed,
        time.perf_counter() - began,
        tuple(curve),
    )


INFLATION_VARIANTS = (("fgd", False), ("best-fit", False), ("best-fit", True))


def _variant_name(placement: str, whole: bool) -> str:
    return "whole GPUs" if whole else {"fgd": "gpush FGD", "best-fit": "best fit"}[placement]


def inflation_experiment(
    nodes: Sequence[SharedNode],
    tasks: Sequence[TaskShape],
    *,
    seeds: Iterable[int] = range(10),
    ratio: float = 1.3,
    coverage: float = 1.0,
    variants: Sequence[tuple[str, bool]] = INFLATION_VARIANTS,
    progress: Callable[[InflationRun], None] | None = None,
) -> dict[str, Any]:
    """The FGD paper's experiment: for each seed one arrival sequence, placed by each
    variant (placement, whole GPUs); medians over seeds of the allocation at 100%
    arrived demand and at the first failure. FGD measures fragmentation against the
    distribution of ``tasks`` (all of it, or the most frequent shapes covering
    ``coverage``, as FGD's typical pods)."""
    distribution = WorkloadDistribution.of(tasks, coverage)
    capacity = sum(n.gpus for n in nodes) * MILLI
    runs: dict[str, list[InflationRun]] = defaultdict(list)
    for seed in seeds:
        arrivals = inflation_arrivals(tasks, seed=seed, capacity_milli=capacity, ratio=ratio)
        for placement, whole in variants:
            run = inflate(nodes, arrivals, placement=placement, distribution=distribution, whole_gpus=whole, seed=seed)
            runs[_variant_name(placement, whole)].append(run)
            if progress:
                progress(run)
    medians = {
        name: {
            "at_full": statistics.median(r.at_full for r in group),
            "at_first_failure": statistics.median(r.at_first_failure for r in group),
            "arrived_at_first_failure": statistics.median(r.arrived_at_first_failure for r in group),
            "at_end": statistics.median(r.at_end for r in group),
            "seeds": len(group),
            "seconds_per_run": statistics.mean(r.seconds for r in group),
        }
        for name, group in runs.items()
    }
    return {
        "ratio": ratio,
        "coverage": coverage,
        "capacity_gpus": capacity / MILLI,
        "tasks": len(tasks),
        "distribution_shapes": len(distribution.shapes),
        "medians": medians,
        "runs": {name: [r.to_dict() for r in group] for name, group in runs.items()},
    }


# -- reports ------------------------------------------------------------------------------


def _duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m" if seconds % 60 < 1 else f"{seconds / 60:.1f}m"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _check_policy_names(policy: Policy, cluster: str, source: str) -> None:
    routes = {route.cluster for rule in policy.rules for route in rule.routes}
    if cluster not in routes:
        raise InvalidRequest(
            f"{source} routes to {', '.join(sorted(routes))}, but the trace's fleet is one cluster called "
            f"{cluster!r}: write a policy that routes to {cluster}, or leave the policy out to use the trace's own "
            "(fractional pods share GPUs, whole-GPU pods take whole GPUs)"
        )


def _tenants_text(tenants: Mapping[str, TenantTerms]) -> str:
    """ "nlp (weight 2, quota 8 GPU), vision (weight 1)": the tenants: section in a line."""
    return ", ".join(
        f"{name} (weight {t.weight:g}" + (f", quota {t.gpu_quota:g} GPU)" if t.gpu_quota is not None else ")")
        for name, t in tenants.items()
    )


def _load_policy_file(path: str) -> Policy:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read policy file {path!r}: {exc.strerror or exc}") from None
    return load_policy(text, path)


def run_simulation(
    fleet_path: str | None,
    workload_path: str | None,
    trace_dir: str | None,
    policy_path: str | None,
    compare_policy_path: str | None,
    report_dir: str,
    seed: int = 0,
    *,
    placement: str = "fgd",
    trace_pods: str | None = None,
    trace_nodes: str | None = None,
    inflation: bool = True,
    plots: bool = True,
) -> dict[str, Any]:
    """Replay a workload (``fleet_path`` + ``workload_path``) or the openb trace
    (``trace_dir``; its node list is the fleet) under ``policy_path``, beside
    ``compare_policy_path`` or, without one, the same workload on whole GPUs; write
    ``report.md``, ``results.json`` and PNG plots to ``report_dir``; return the results.

    For a trace, ``policy_path`` None means the trace's own routing
    (:func:`broker.simulation.traces.openb_policy`), ``placement`` is gpush's placement on its
    GPU-sharing nodes (``fgd`` or ``best-fit``), and ``inflation`` adds the FGD
    paper's inflation experiment at ``seed``.
    """
    from broker.simulation import traces

    if (workload_path is None) == (trace_dir is None):
        raise InvalidRequest("give a workload file or a trace directory (one of them)")
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs: dict[str, Any] = {
        "fleet": fleet_path,
        "workload": workload_path,
        "trace": trace_dir,
        "policy": policy_path,
        "compare_policy": compare_policy_path,
        "seed": seed,
    }
    notes: list[str] = []
    inflation_results = None
    if trace_dir is not None:
        trace = traces.load_openb(
            trace_dir, pods_file=trace_pods or traces.DEFAULT_PODS, nodes_file=trace_nodes or traces.DEFAULT_NODES
        )
        if fleet_path:
            notes.append(f"{fleet_path} not used: the trace's node list ({trace.nodes_file}) is the fleet")
        policy = trace.policy() if policy_path is None else _load_policy_file(policy_path)
        if policy_path:
            _check_policy_names(policy, trace.cluster, policy_path)
        nodes = trace.shared_nodes()
        workload = trace.workload()
        inputs.update(
            trace_pods=trace.pods_file,
            trace_nodes=trace.nodes_file,
            placement=placement,
            fleet_description=f"{len(nodes)} GPU nodes, {trace.gpu_count} GPUs (openb)",
            jobs=len(workload),
        )
        notes.append(f"{trace.cpu_only_pods} CPU-only pods of {len(trace.pods)} skipped: gpush schedules GPU jobs only")
        notes.append(
            "the trace's own times are a light load (its README: at most ~1% of the GPUs busy at once): the "
            "replay shows routing and waits; the inflation experiment is the test of placement quality"
        )
        notes.append(
            "fractional pods: isolation none, gpu_memory_gb = share x "
            f"{trace.reference_memory_gb:g} GB (the fleet's most common GPU); packing uses the exact milli-GPU"
        )
        primary = replay_shared(nodes, trace.cluster, policy, workload, placement=placement, label="gpush")
        if compare_policy_path:
            other = _load_policy_file(compare_policy_path)
            _check_policy_names(other, trace.cluster, compare_policy_path)
            comparison = replay_shared(
                nodes, trace.cluster, other, workload, placement=placement, label=Path(compare_policy_path).stem
            )
        else:
            comparison = replay_shared(
                nodes, trace.cluster, policy, workload, placement="best-fit", whole_gpus=True, label="whole GPUs"
            )
        if inflation:
            inflation_results = inflation_experiment(nodes, trace.tasks(), seeds=[seed])
    else:
        if not fleet_path:
            raise InvalidRequest("a workload replays on a fleet: give the fleet file too")
        if not policy_path:
            raise InvalidRequest("a workload replay needs a routing policy file")
        fleet = load_fleet_file(fleet_path)
        policy = _load_policy_file(policy_path)
        loaded = load_workload(workload_path)
        workload, tenants = loaded.arrivals, loaded.tenants
        inputs.update(
            fleet_description=", ".join(
                f"{name} ({c.flavor}, {len(c.nodes)} nodes, {c.gpu_count} GPUs)" for name, c in fleet.clusters.items()
            ),
            jobs=len(workload),
            tenants=_tenants_text(tenants) or None,
            placement=PLACEMENT_ON_FLEET,
        )
        idle = sorted(set(tenants) - {a.tenant for a in workload})
        if idle:
            notes.append(f"tenants: lists {', '.join(idle)}, which no job of the workload names")
        primary = replay(fleet, policy, workload, label=f"gpush ({Path(policy_path).name})", tenants=tenants)
        if compare_policy_path:
            comparison = replay(
                fleet,
                _load_policy_file(compare_policy_path),
                workload,
                label=Path(compare_policy_path).name,
                tenants=tenants,
            )
        else:
            # What each job needs is what gpush's sharing gave it; whole GPUs hold more.
            need = {j.job_id: j.gpu_equivalents for j in primary.jobs if j.start is not None}
            comparison = replay(
                fleet, policy, workload, whole_gpus=True, label="whole GPUs", demand_of=need.get, tenants=tenants
            )

    results: dict[str, Any] = {
        "inputs": inputs,
        "notes": notes,
        "primary": primary.summary(),
        "comparison": comparison.summary(),
        "inflation": None if inflation_results is None else {k: v for k, v in inflation_results.items() if k != "runs"},
        "report_dir": str(out),
    }
    files = ["report.md", "results.json"]
    if plots:
        files += _plots(out, primary, comparison, inflation_results)
    results["files"] = [str(out / name) for name in files]
    detail = {
        **results,
        "primary": primary.to_dict(),
        "comparison": comparison.to_dict(),
        "inflation": inflation_results,
    }
    # Indented for a reader when small; a trace's per-job records are for programs.
    indent = 1 if len(primary.jobs) <= 2000 else None
    (out / "results.json").write_text(json.dumps(detail, indent=indent, default=str))
    (out / "report.md").write_text(
        _report_markdown(results, primary, comparison, [f for f in files if f.endswith(".png")])
    )
    return results


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What ``gpush simulate`` and ``make demo`` print: the two runs side by side."""
    a, b = result["primary"], result["comparison"]
    inputs = result["inputs"]
    source = inputs.get("workload") or f"openb trace {inputs.get('trace_pods', '')}"
    width = max(len(a["label"]), len(b["label"]), 12)

    def row(name: str, left: str, right: str) -> str:
        return f"  {name:<26}{left:>{width}}  {right:>{width}}"

    def waits(s: dict[str, Any]) -> str:
        w = s["waits"]["all"]
        return f"{_duration_text(w['p50'])}/{_duration_text(w['p95'])}/{_duration_text(w['p99'])}"

    lines = [
        f"simulated {inputs.get('jobs')} jobs from {source} on {inputs.get('fleet_description')}",
        row("", a["label"], b["label"]),
        row("jobs placed / held", f"{a['placed']} / {a['held']}", f"{b['placed']} / {b['held']}"),
        row("GPU allocation, mean", _percent(a["allocation_mean"]), _percent(b["allocation_mean"])),
        row("GPU the running jobs need", _percent(a["demand_mean"]), _percent(b["demand_mean"])),
        row("queue wait p50/p95/p99", waits(a), waits(b)),
        row("all jobs done after", _duration_text(a["makespan"]), _duration_text(b["makespan"])),
    ]
    if _shows_tenants(a["tenants"]):
        lines.append(row("GPU share / weight share", "", ""))
        for name, t in a["tenants"].items():
            other = b["tenants"].get(name) or {}
            weight = _percent(t["weight_share"])
            lines.append(
                row(
                    f"  {name}",
                    f"{_percent(t['gpu_share_mean'])} / {weight}",
                    f"{_percent(other.get('gpu_share_mean'))} / {weight}",
                )
            )
            if t["time_at_quota"] or other.get("time_at_quota"):
                lines.append(
                    row(
                        f"  {name} at quota",
                        _duration_text(t["time_at_quota"]),
                        _duration_text(other.get("time_at_quota")),
                    )
                )
    inflation = result.get("inflation")
    if inflation:
        medians = inflation["medians"]
        parts = ", ".join(f"{name} {_percent(m['at_full'])}" for name, m in medians.items())
        lines.append(f"  inflation (FGD paper), allocation at 100% arrived: {parts}")
    for reason, count in list(a["held_reasons"].items())[:3]:
        lines.append(f"  held ({count}): {reason}")
    return lines


def _shows_tenants(tenants: dict[str, dict[str, Any]]) -> bool:
    """Per-tenant figures say something when tenants share or a quota caps one."""
    return len(tenants) > 1 or any(t["gpu_quota"] is not None for t in tenants.values())


def _time_axis(t: Sequence[float]) -> tuple[list[float], str]:
    span = (t[-1] - t[0]) if t else 0
    if span > 3 * 86400:
        return [x / 86400 for x in t], "days"
    if span > 3 * 3600:
        return [x / 3600 for x in t], "hours"
    return [x / 60 for x in t], "minutes"


def _plots(
    out: Path, primary: ReplayResult, comparison: ReplayResult, inflation_results: dict[str, Any] | None
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = (primary, comparison)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def over_time(name: str, title: str, ylabel: str, series: Callable[[ReplayResult], list[tuple[str, list]]]):
        fig, ax = plt.subplots(figsize=(9, 4))
        unit = "minutes"
        for run in runs:
            x, unit = _time_axis(run.timeline.t)
            for label, values in series(run):
                if x:
                    ax.step(x, values, where="post", label=label, linewidth=1)
        ax.set_xlabel(f"virtual time ({unit})")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        save(fig, name)

    def percent_of(run: ReplayResult, values: list[float], total: float | None = None) -> list[float]:
        total = total or run.total_gpus or 1.0
        return [100 * v / total for v in values]

    over_time(
        "allocation.png",
        "GPU allocation (held), and what the running jobs need",
        "% of GPUs",
        lambda r: (
            [(f"{r.label}: held", percent_of(r, r.timeline.allocated))]
            + (
                [(f"{r.label}: needed", percent_of(r, r.timeline.demand))]
                if r.timeline.demand != r.timeline.allocated
                else []
            )
        ),
    )
    over_time(
        "tiers.png",
        "GPU allocation per tier",
        "% of the tier's GPUs",
        lambda r: [
            (f"{r.label}: {tier}", percent_of(r, values, r.tier_gpus.get(tier)))
            for tier, values in r.timeline.tiers.items()
        ],
    )
    over_time("queue.png", "Jobs waiting", "jobs", lambda r: [(r.label, r.timeline.queue)])
    over_time(
        "fragmentation.png",
        "Free GPU no waiting job fits (stranded) and FGD fragmentation",
        "GPU-equivalents",
        lambda r: (
            [(f"{r.label}: stranded", r.timeline.stranded)]
            + ([(f"{r.label}: fragmentation", r.timeline.fragmentation)] if any(r.timeline.fragmentation) else [])
        ),
    )

    fig, ax = plt.subplots(figsize=(9, 4))
    kinds = [k for k in (*KINDS, "all") if any(k in r.waits() for r in runs)]
    bar = 0.8 / (len(runs) * len(PERCENTILES))
    for i, run in enumerate(runs):
        waits = run.waits()
        for j, p in enumerate(PERCENTILES):
            offset = (i * len(PERCENTILES) + j) * bar
            values = [((waits.get(k) or {}).get(f"p{p}") or 0) / 60 for k in kinds]
            ax.bar([x + offset for x in range(len(kinds))], values, bar, label=f"{run.label} p{p}")
    ax.set_xticks([x + 0.4 - bar / 2 for x in range(len(kinds))], kinds)
    ax.set_ylabel("queue wait (minutes)")
    ax.set_title("Queue wait per kind")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    save(fig, "waits.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    columns = ("placed", "succeeded", "failed", "held", "still_waiting")
    for i, run in enumerate(runs):
        s = run.summary()
        ax.bar([x + i * 0.4 for x in range(len(columns))], [s[c] for c in columns], 0.4, label=run.label)
    ax.set_xticks([x + 0.2 for x in range(len(columns))], [c.replace("_", " ") for c in columns])
    ax.set_ylabel("jobs")
    ax.set_title("Jobs placed and held")
    ax.legend()
    save(fig, "jobs.png")

    if inflation_results:
        fig, (whole, zoom) = plt.subplots(1, 2, figsize=(11, 4))
        for ax, low in ((whole, 0), (zoom, 75)):
            for name, group in inflation_results["runs"].items():
                curve = [(100 * a, 100 * b) for a, b in group[0]["curve"] if 100 * a >= low]
                ax.plot([a for a, _ in curve], [b for _, b in curve], label=name)
            ax.plot([low, 130], [low, 130], color="grey", linewidth=0.5, linestyle="--")
            ax.axvline(100, color="grey", linewidth=0.5)
            ax.set_xlabel("arrived GPU demand (% of capacity)")
            ax.grid(alpha=0.3)
        whole.set_ylabel("GPU allocation (% of capacity)")
        whole.set_title("Inflation (FGD paper): tasks arrive, none leave")
        zoom.set_title("from 75% arrived")
        zoom.set_ylim(75, 100)
        zoom.legend()
        save(fig, "inflation.png")
    return written


def _report_markdown(
    results: dict[str, Any], primary: ReplayResult, comparison: ReplayResult, images: list[str]
) -> str:
    a, b = results["primary"], results["comparison"]
    inputs = results["inputs"]
    lines = ["# gpush simulation report", ""]
    lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in inputs.items() if v is not None]
    lines += ["", "## Summary", "", f"| | {a['label']} | {b['label']} |", "| --- | --- | --- |"]

    def add(name: str, left: Any, right: Any) -> None:
        lines.append(f"| {name} | {left} | {right} |")

    add("placement", a["placement"], b["placement"])
    add("jobs", a["jobs"], b["jobs"])
    add("placed (started)", a["placed"], b["placed"])
    add("succeeded / failed", f"{a['succeeded']} / {a['failed']}", f"{b['succeeded']} / {b['failed']}")
    add("held", a["held"], b["held"])
    add("still waiting at the end", a["still_waiting"], b["still_waiting"])
    add("GPU allocation, time-weighted mean", _percent(a["allocation_mean"]), _percent(b["allocation_mean"]))
    add("GPU allocation, peak", _percent(a["allocation_peak"]), _percent(b["allocation_peak"]))
    add("GPU the running jobs need, mean", _percent(a["demand_mean"]), _percent(b["demand_mean"]))
    for tier in sorted(set(a["tier_allocation_mean"]) | set(b["tier_allocation_mean"])):
        add(
            f"{tier} tier allocation, mean",
            _percent(a["tier_allocation_mean"].get(tier)),
            _percent(b["tier_allocation_mean"].get(tier)),
        )
    add(
        "jobs waiting, mean / peak",
        f"{a['queue_mean']:.2f} / {a['queue_peak']}",
        f"{b['queue_mean']:.2f} / {b['queue_peak']}",
    )
    add("stranded GPU while jobs wait, mean", f"{a['stranded_mean_gpus']:.2f}", f"{b['stranded_mean_gpus']:.2f}")
    add(
        "FGD fragmentation, mean (GPUs)",
        *("-" if r["fragmentation_mean_gpus"] is None else f"{r['fragmentation_mean_gpus']:.2f}" for r in (a, b)),
    )
    add("GPU-hours held", f"{a['gpu_hours']:.1f}", f"{b['gpu_hours']:.1f}")
    add("all jobs done after", _duration_text(a["makespan"]), _duration_text(b["makespan"]))
    add("replay wall time", f"{a['wall_seconds']:.2f}s", f"{b['wall_seconds']:.2f}s")

    lines += ["", "## Queue wait per kind (arrival to start)", ""]
    lines += ["| kind | run | jobs | p50 | p95 | p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for run in (a, b):
        for kind, w in run["waits"].items():
            cells = " | ".join(_duration_text(w[f"p{p}"]) for p in PERCENTILES)
            lines.append(f"| {kind} | {run['label']} | {w['jobs']} | {cells} |")

    shown = [run for run in (a, b) if _shows_tenants(run["tenants"])]
    if shown:
        lines += [
            "",
            "## Tenants",
            "",
            "Jobs are tried as the scheduler takes them: priority, then the tenant furthest below its weighted "
            "share of the GPU-equivalents in use, then arrival. Share of GPU in use: the tenant's share of the "
            "GPU-equivalents all tenants hold, time-weighted over the time any are held; while all tenants "
            "contend it converges to its weight's share. At quota: the time it had jobs waiting at its quota.",
        ]
    for run in shown:
        lines += [
            "",
            f"### {run['label']}",
            "",
            "| tenant | weight (share) | quota | jobs placed / held | share of GPU in use | peak GPU held "
            "| GPU-hours | wait p50 | wait p95 | at quota |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, t in run["tenants"].items():
            quota = "-" if t["gpu_quota"] is None else f"{t['gpu_quota']:g}"
            at_quota = _duration_text(t["time_at_quota"]) if t["time_at_quota"] else "-"
            if t["jobs_waited_at_quota"]:
                at_quota += f" ({t['jobs_waited_at_quota']} jobs)"
            lines.append(
                f"| {name} | {t['weight']:g} ({_percent(t['weight_share'])}) | {quota} "
                f"| {t['placed']} / {t['held']} of {t['jobs']} | {_percent(t['gpu_share_mean'])} "
                f"| {t['gpu_peak']:.2f} | {t['gpu_hours']:.1f} | {_duration_text(t['wait_p50'])} "
                f"| {_duration_text(t['wait_p95'])} | {at_quota} |"
            )

    for run in (a, b):
        if run["held_reasons"]:
            lines += ["", f"## Held jobs: {run['label']}", "", "| jobs | reason |", "| --- | --- |"]
            lines += [f"| {count} | {reason} |" for reason, count in run["held_reasons"].items()]

    inflation = results.get("inflation")
    if inflation:
        lines += [
            "",
            "## Inflation (FGD paper, seed " + str(inputs.get("seed")) + ")",
            "",
            f"Tasks in a random order, then drawn with replacement until the arrived GPU demand is "
            f"{inflation['ratio']:.0%} of the {inflation['capacity_gpus']:g} GPUs; nothing leaves. "
            "Allocation: GPU demand placed over capacity.",
            "",
            "| placement | at 100% arrived | at the first failure | at the end |",
            "| --- | --- | --- | --- |",
        ]
        for name, m in inflation["medians"].items():
            lines.append(
                f"| {name} | {_percent(m['at_full'])} | {_percent(m['at_first_failure'])} | {_percent(m['at_end'])} |"
            )

    if images:
        lines += ["", "## Plots", ""]
        lines += [f"![{name}]({name})" for name in images]
    notes = results["notes"] + [n for n in (*a["notes"], *b["notes"]) if n not in results["notes"]]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"
