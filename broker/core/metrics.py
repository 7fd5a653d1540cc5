"""What the broker exports to Prometheus (``GET /metrics``), and the hooks that feed it.

Two kinds of metrics, kept apart because they live in different places:

- **Process metrics** live in :data:`REGISTRY`, gpush's own registry (never
  prometheus_client's global one, which other libraries write to): scheduling cycles
  (timed by :func:`observe_cycle` around ``Scheduler.run_cycle``), adapter calls (timed
  and counted by :class:`InstrumentedAdapter`, which ``AdapterPool`` puts around every
  adapter it hands out), each cluster's GPU-equivalents (set by
  :func:`observe_inventory` whenever an adapter's inventory is read through the pool),
  and drift findings (set by :func:`observe_findings`). They describe what this process
  did, so ``gpush server`` exports the scheduler's metrics only from the process that
  holds leadership; with several ``--workers`` a scrape reaches one of them at random,
  so scrape a single-worker broker, or each worker.
- **Queue depth** is read from the database at scrape time (:class:`QueueDepth`, one
  ``GROUP BY``), so every broker process on one database exports the same numbers.
  Each app gets its own registry (broker.api.metrics.app_registry) holding its engine's
  collectors (this one, and the GPU-equivalent seconds of broker.accounting.metrics)
  beside the process metrics: two apps in one process (tests) never clash.

Labels stay few: clusters, sharing modes, tenants, job kinds and states, adapter
methods and error classes. Never a job id, node or message.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from broker.core.adapter import (
    CAPABILITIES,
    AdapterError,
    BackendJob,
    BatchSubmitter,
    CapacityUnit,
    ChangeNotifier,
    Closable,
    ClusterAdapter,
    Health,
    JobOutput,
    LogReader,
    MigPublisher,
    NodeConfigurer,
    NodeFencer,
    Owner,
    Placement,
    Preemptor,
    RenderedConfig,
    Scaler,
    StatusPage,
    SubmitItem,
    TenantQuotaKeeper,
    TimesliceConfigurator,
    declared,
)
from broker.core.db import session_factory
from broker.core.errors import Unauthenticated
from broker.core.models import Job
from broker.core.schemas import JobSpec
from broker.core.states import TERMINAL, JobState

log = logging.getLogger("gpush.metrics")

# Set it to require `Authorization: Bearer <value>` on GET /metrics (no token by default,
# as most exporters: the metrics name tenants and clusters, never jobs or users).
TOKEN_ENV = "GPUSH_METRICS_TOKEN"

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)

# A cycle takes milliseconds on an idle fleet and seconds with thousands of jobs placed.
_CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# An adapter call is a local simulator call (microseconds) or a REST/RPC round trip.
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

CYCLE_SECONDS = Histogram(
    "gpush_scheduler_cycle_seconds",
    "Wall time of one scheduling cycle, failed cycles included.",
    buckets=_CYCLE_BUCKETS,
    registry=REGISTRY,
)
CYCLE_STEP_SECONDS = Histogram(
    "gpush_scheduler_cycle_step_seconds",
    "Wall time of each step of a cycle (broker.scheduling.cycle.CycleReport.seconds); steps overlap.",
    ["step"],
    buckets=_CYCLE_BUCKETS,
    registry=REGISTRY,
)
CYCLES_FAILED = Counter(
    "gpush_scheduler_cycles_failed",
    "Cycles that raised instead of returning a report (the next cycle retries).",
    registry=REGISTRY,
)
CYCLE_JOBS = Counter(
    "gpush_scheduler_jobs",
    "Jobs each cycle decided or repaired, by outcome: placed (committed for submission), "
    "held, failed (a cluster refused it), recovered (found or requeued after a crash), "
    "preempted (running jobs told to stop for a job of higher standing).",
    ["outcome"],
    registry=REGISTRY,
)
LAST_CYCLE = Gauge(
    "gpush_scheduler_last_cycle_timestamp_seconds",
    "When this process last finished a cycle (Unix time); absent in processes that never led.",
    registry=REGISTRY,
)
ADAPTER_SECONDS = Histogram(
    "gpush_adapter_call_seconds",
    "Wall time of adapter calls, failed ones included.",
    ["cluster", "kind", "method"],
    buckets=_CALL_BUCKETS,
    registry=REGISTRY,
)
ADAPTER_ERRORS = Counter(
    "gpush_adapter_call_errors",
    "Adapter calls that failed, by error: the AdapterError class (Unreachable, Rejected, ...) "
    "or 'unexpected' for anything else (a bug). submit_many counts each job it could not submit.",
    ["cluster", "kind", "method", "error"],
    registry=REGISTRY,
)

_OUTCOMES = ("placed", "held", "failed", "recovered", "preempted")


# -- scheduling cycles -------------------------------------------------------------------


def observe_cycle(run_cycle: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``Scheduler.run_cycle``: its duration, its steps and the jobs it decided."""

    @functools.wraps(run_cycle)
    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            report = run_cycle(*args, **kwargs)
        except BaseException:
            CYCLES_FAILED.inc()
            raise
        finally:
            CYCLE_SECONDS.observe(time.perf_counter() - begin)
        for step, seconds in report.seconds.items():
            CYCLE_STEP_SECONDS.labels(step).observe(seconds)
        for outcome in _OUTCOMES:
            CYCLE_JOBS.labels(outcome).inc(getattr(report, outcome))
        LAST_CYCLE.set_to_current_time()
        return report

    return timed


# -- adapter calls -----------------------------------------------------------------------


class InstrumentedAdapter:
    """An adapter whose protocol calls are timed and whose failures are counted, labelled
    with the cluster, its kind and the method. Reading an inventory through it also sets
    the cluster's GPU-equivalent gauges (:func:`observe_inventory`).

    It has the protocol's methods and, of the optional capabilities
    (broker.core.adapter), exactly those the wrapped adapter declares: :func:`instrument`
    builds it from this class and one forwarding class per declared capability, so a
    capability check, or ``hasattr``, answers for the wrapper as for the adapter.
    ``submit_many`` is timed and counts each job it could not submit; the others pass
    through. Anything else the adapter has (simulator hooks) is on ``adapter``.
    """

    __slots__ = ("adapter", "cluster", "kind", "capabilities")

    def __init__(self, adapter: ClusterAdapter, cluster: str, kind: str):
        self.adapter, self.cluster, self.kind = adapter, cluster, kind
        self.capabilities = declared(adapter)

    @property
    def name(self) -> str:
        return self.adapter.name

    def __repr__(self) -> str:
        return f"InstrumentedAdapter({self.adapter!r})"

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        return self._call("submit", self.adapter.submit, job_id, spec, placement, owner)

    def cancel(self, job_id: int) -> None:
        return self._call("cancel", self.adapter.cancel, job_id)

    def find(self, job_id: int) -> BackendJob | None:
        return self._call("find", self.adapter.find, job_id)

    def statuses(self, cursor: str | None = None) -> StatusPage:
        return self._call("statuses", self.adapter.statuses, cursor)

    def inventory(self) -> list[CapacityUnit]:
        return self._call("inventory", self.adapter.inventory)

    def health(self) -> Health:
        return self._call("health", self.adapter.health)

    def _call(self, method: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            result = call(*args, **kwargs)
        except BaseException as exc:
            ADAPTER_ERRORS.labels(self.cluster, self.kind, method, _error_label(exc)).inc()
            if method == "inventory" and isinstance(exc, AdapterError):
                observe_inventory(self.cluster, None)  # unknown now: not the last numbers read
            raise
        finally:
            ADAPTER_SECONDS.labels(self.cluster, self.kind, method).observe(time.perf_counter() - begin)
        if method == "inventory":
            if not isinstance(result, list | tuple):  # read once here, once by the caller
                result = list(result)
            observe_inventory(self.cluster, result)
        return result


# One forwarding class per optional capability; instrument() mixes in those declared.


class _SubmitsMany:
    __slots__ = ()

    def submit_many(self: Any, items: Sequence[SubmitItem]) -> list[str | AdapterError]:
        results = self._call("submit_many", self.adapter.submit_many, items)
        for result in results:
            if isinstance(result, AdapterError):
                ADAPTER_ERRORS.labels(self.cluster, self.kind, "submit_many", _error_label(result)).inc()
        return results


class _Scales:
    __slots__ = ()

    def scale(self: Any, job_id: int, replicas: int) -> int:
        return self.adapter.scale(job_id, replicas)


class _ConfiguresTimeslicing:
    __slots__ = ()

    def timeslice(self: Any, replicas: int, node_label: str | None = None) -> RenderedConfig:
        return self.adapter.timeslice(replicas, node_label=node_label)

    def apply_timeslice(self: Any, plan: Any) -> list[str]:
        return self.adapter.apply_timeslice(plan)


class _Closes:
    __slots__ = ()

    def close(self: Any) -> None:
        self.adapter.close()


class _ReadsLogs:
    __slots__ = ()

    def logs(
        self: Any,
        job_id: int,
        backend_id: str,
        *,
        stream: str = "stdout",
        replica: int | None = None,
        offset: int = 0,
        tail: int | None = None,
    ) -> JobOutput:
        return self._call(
            "logs", self.adapter.logs, job_id, backend_id, stream=stream, replica=replica, offset=offset, tail=tail
        )


class _Notifies:
    __slots__ = ()

    def notify_changes(self: Any, callback: Callable[[], None] | None) -> None:
        self.adapter.notify_changes(callback)


class _KeepsTenantQuotas:
    __slots__ = ()

    def tenant_quotas(self: Any, quotas: Mapping[str, float]) -> RenderedConfig:
        return self.adapter.tenant_quotas(quotas)

    def apply_tenant_quotas(self: Any, plan: Any) -> list[str]:
        return self.adapter.apply_tenant_quotas(plan)


class _Preempts:
    __slots__ = ()

    def preempt(self: Any, job_id: int, signal: str, grace_seconds: int) -> None:
        return self._call("preempt", self.adapter.preempt, job_id, signal, grace_seconds)


class _Fences:
    __slots__ = ()

    def fence(self: Any, node: str, reason: str) -> None:
        return self._call("fence", self.adapter.fence, node, reason)

    def unfence(self: Any, node: str) -> None:
        return self._call("unfence", self.adapter.unfence, node)

    def fenced(self: Any) -> dict[str, str]:
        return self._call("fenced", self.adapter.fenced)


class _PublishesMig:
    __slots__ = ()

    @property
    def changes_gpus(self: Any) -> bool:
        return bool(getattr(self.adapter, "changes_gpus", False))

    @property
    def needs_empty_node(self: Any) -> bool:
        return bool(getattr(self.adapter, "needs_empty_node", False))

    def publish_mig(self: Any, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        return self._call("publish_mig", self.adapter.publish_mig, node, gpu, instances, reported)

    def mig_published(self: Any, node: str, gpu: int) -> tuple[str, ...] | None:
        return self._call("mig_published", self.adapter.mig_published, node, gpu)


class _ConfiguresNodes:
    __slots__ = ()

    def configure_node(self: Any, node: str, setup: Mapping[str, str]) -> None:
        return self._call("configure_node", self.adapter.configure_node, node, setup)

    def node_configured(self: Any, node: str, setup: Mapping[str, str]) -> bool | None:
        return self._call("node_configured", self.adapter.node_configured, node, setup)


_FORWARDERS: dict[type, type] = {
    Preemptor: _Preempts,
    NodeFencer: _Fences,
    MigPublisher: _PublishesMig,
    NodeConfigurer: _ConfiguresNodes,
    BatchSubmitter: _SubmitsMany,
    Scaler: _Scales,
    TimesliceConfigurator: _ConfiguresTimeslicing,
    Closable: _Closes,
    LogReader: _ReadsLogs,
    ChangeNotifier: _Notifies,
    TenantQuotaKeeper: _KeepsTenantQuotas,
}
assert _FORWARDERS.keys() == CAPABILITIES.keys(), "a capability the metrics wrapper cannot forward"


@functools.cache
def _instrumented_class(capabilities: frozenset[type]) -> type[InstrumentedAdapter]:
    if not capabilities:
        return InstrumentedAdapter
    mixins = tuple(_FORWARDERS[c] for c in CAPABILITIES if c in capabilities)  # a stable order
    name = "InstrumentedAdapter[" + ", ".join(c.__name__ for c in CAPABILITIES if c in capabilities) + "]"
    return type(name, (InstrumentedAdapter, *mixins), {"__slots__": ()})


def instrument(adapter: ClusterAdapter, cluster: str, kind: str) -> InstrumentedAdapter:
    """``adapter`` with its calls measured (once: an instrumented adapter is returned as is)."""
    if isinstance(adapter, InstrumentedAdapter):
        return adapter
    capabilities = declared(adapter)
    unknown = capabilities - _FORWARDERS.keys()
    if unknown:  # supports() would refuse them too; say which adapter declared them
        raise ValueError(f"{type(adapter).__name__} declares {sorted(c.__name__ for c in unknown)}: not capabilities")
    return _instrumented_class(capabilities)(adapter, cluster, kind)


def _error_label(exc: BaseException) -> str:
    # AdapterError classes are a handful the adapters define; anything else is a bug, and
    # its class would be an open-ended label: the log has it.
    return type(exc).__name__ if isinstance(exc, AdapterError) else "unexpected"


# -- GPU-equivalents per cluster and sharing mode ----------------------------------------


class _Inventory(Collector):
    """Each cluster's last inventory read in this process, summed per sharing mode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # cluster -> sharing -> (capacity, allocated, free), in physical GPU-equivalents
        self._clusters: dict[str, dict[str, tuple[float, float, float]]] = {}

    def set(self, cluster: str, units: Iterable[CapacityUnit] | None) -> None:
        if units is None:
            with self._lock:
                self._clusters.pop(cluster, None)
            return
        sums: dict[str, list[float]] = {}
        for unit in units:
            row = sums.setdefault(_label(unit.sharing), [0.0, 0.0, 0.0])
            row[0] += unit.capacity * unit.gpu_equivalent
            row[1] += unit.allocated * unit.gpu_equivalent
            if not unit.broken:  # a drift finding closed it: its room is not free to place on
                row[2] += unit.free * unit.gpu_equivalent
        with self._lock:
            self._clusters[cluster] = {sharing: (c, a, f) for sharing, (c, a, f) in sums.items()}

    def collect(self) -> Iterator[Metric]:
        families = [
            GaugeMetricFamily(
                "gpush_cluster_gpu_equivalents_capacity",
                "Physical GPU-equivalents a cluster offers, per sharing mode (its last inventory).",
                labels=["cluster", "sharing"],
            ),
            GaugeMetricFamily(
                "gpush_cluster_gpu_equivalents_allocated",
                "Physical GPU-equivalents the cluster reports in use, per sharing mode.",
                labels=["cluster", "sharing"],
            ),
            GaugeMetricFamily(
                "gpush_cluster_gpu_equivalents_free",
                "Physical GPU-equivalents free to place on, per sharing mode "
                "(room on units a drift finding marks broken is not counted).",
                labels=["cluster", "sharing"],
            ),
        ]
        with self._lock:
            rows = [(c, s, v) for c, modes in sorted(self._clusters.items()) for s, v in sorted(modes.items())]
        for cluster, sharing, values in rows:
            for family, value in zip(families, values):
                family.add_metric([cluster, sharing], value)
        yield from families


_INVENTORY = _Inventory()
REGISTRY.register(_INVENTORY)


def observe_inventory(cluster: str, units: Iterable[CapacityUnit] | None) -> None:
    """Set ``cluster``'s GPU-equivalent gauges from the inventory just read; ``None`` (its
    inventory could not be read, or it was removed) takes its series away."""
    _INVENTORY.set(cluster, units)


# -- drift findings ----------------------------------------------------------------------


class _Findings(Collector):
    """The findings of the last reconciliation, counted; a kind seen once and gone since
    is exported as 0, so a fixed drift shows 0 rather than a gap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}
        self._seen: set[tuple[str, str, str]] = set()

    def set(self, findings: Iterable[Any], cluster: str | None) -> None:
        counts: dict[tuple[str, str, str], int] = {}
        for finding in findings:
            where = cluster if cluster is not None else _label(getattr(finding, "cluster", None))
            key = (where, _label(finding.kind), _label(finding.severity))
            counts[key] = counts.get(key, 0) + 1
        with self._lock:
            if cluster is None:
                self._counts = counts
            else:
                kept = {k: v for k, v in self._counts.items() if k[0] != cluster}
                self._counts = {**kept, **counts}
            self._seen.update(counts)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpush_drift_findings",
            "Drift findings of the last inventory reconciliation, by cluster, kind and severity.",
            labels=["cluster", "kind", "severity"],
        )
        with self._lock:
            counts = [(key, self._counts.get(key, 0)) for key in sorted(self._seen)]
        for labels, count in counts:
            family.add_metric(list(labels), count)
        yield family


def _label(value: Any) -> str:
    if value is None:
        return ""
    return str(getattr(value, "value", value))  # enums by their value


_FINDINGS = _Findings()
REGISTRY.register(_FINDINGS)


def observe_findings(findings: Iterable[Any], *, cluster: str | None = None) -> None:
    """Replace the drift-finding gauges with ``findings`` (objects with ``kind`` and
    ``severity``, and ``cluster`` when they have one): all of them, or with ``cluster``
    given only that cluster's, as the reconciliation that produced them covered."""
    _FINDINGS.set(list(findings), cluster)


# -- queue depth (from the database, at scrape time) -------------------------------------

_LIVE = [s.value for s in JobState if s not in TERMINAL]


class QueueDepth(Collector):
    """Jobs not yet finished per state, tenant and kind: one ``GROUP BY`` per scrape.

    Finished jobs are left out: their count only grows, and counting them would read the
    whole history at every scrape. A combination seen once is exported as 0 when its jobs
    are gone, so a queue that drains shows 0 rather than a gap.
    """

    def __init__(self, engine: Engine):
        self._sessions = session_factory(engine)
        self._seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gpush_database_up", "1 if the database answered this scrape's queue-depth query, else 0."
        )
        query = (
            select(Job.state, Job.tenant, Job.kind, func.count())
            .where(Job.state.in_(_LIVE))
            .group_by(Job.state, Job.tenant, Job.kind)
        )
        try:
            with self._sessions() as session:
                counts = {(state, tenant, kind): n for state, tenant, kind, n in session.execute(query)}
        except SQLAlchemyError as exc:
            log.warning("metrics: queue depth unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        with self._lock:
            self._seen.update(counts)
            seen = sorted(self._seen)
        depth = GaugeMetricFamily(
            "gpush_queue_jobs",
            "Jobs not yet finished, by state, tenant and kind (read from the database at scrape time).",
            labels=["state", "tenant", "kind"],
        )
        for key in seen:
            depth.add_metric(list(key), counts.get(key, 0))
        yield depth


class Forward(Collector):
    """Another registry's metrics, as part of this one."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        return self._registry.collect()


def check_scrape_token(authorization: str | None) -> None:
    """Refuse a scrape without ``Bearer $GPUSH_METRICS_TOKEN`` when that variable is set."""
    expected = os.environ.get(TOKEN_ENV)
    if not expected:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise Unauthenticated(f"/metrics needs `Authorization: Bearer` with the value of {TOKEN_ENV}")


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry in the format the scraper asked for (OpenMetrics or Prometheus text)."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type
