"""Registered clusters and the adapters that talk to them.

An admin registers a cluster (`gpush cluster add NAME --kind sim|slurm|k8s ...`);
its kind picks the adapter class (broker.core.adapter.adapter_class) and its config is
handed to the adapter. :class:`AdapterPool` keeps one adapter per cluster and
process, rebuilt when the cluster's config changes.

A config is checked whole before it is stored (:func:`add_cluster` builds the adapter
from it, and checks the settings the pool itself reads, a simulated cluster's
``speed``). A stored cluster whose adapter still cannot be built (a row written before
that check, a fleet file or kubeconfig since removed) is one unhealthy cluster: the pool
raises :class:`broker.core.adapter.Misconfigured` for it, which the scheduling cycle and
the cluster list handle as any cluster that does not answer, and the others go on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.adapter import (
    ADAPTERS,
    AdapterError,
    ChangeNotifier,
    Closable,
    ClusterAdapter,
    Misconfigured,
    adapter_class,
    capability,
)
from broker.core.clock import Clock, ScaledClock
from broker.core.config import data_dir
from broker.core.errors import Conflict, InvalidRequest, NotFound
from broker.core.metrics import instrument
from broker.core.models import Cluster

log = logging.getLogger("gpush.clusters")
# How long the pool answers with a cluster's build error before it tries to build the
# adapter again: a fleet file or kubeconfig put back is picked up within this, and a
# cycle (four adapter calls per cluster) does not rebuild, and log, four times.
REBUILD_AFTER_S = 30.0


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    kind: str
    config: dict[str, Any]
    enabled: bool
    created_by: str
    created_at: datetime

    @classmethod
    def of(cls, row: Cluster) -> ClusterInfo:
        return cls(row.name, row.kind, dict(row.config), row.enabled, row.created_by, row.created_at)


def _check_kind(kind: str) -> None:
    if kind not in ADAPTERS:
        raise InvalidRequest(
            f"cluster kind {kind!r} is not one gpush knows: use {', '.join(ADAPTERS)}",
            details=[{"field": "kind", "value": kind}],
        )


def sim_speed(name: str, config: dict[str, Any]) -> float:
    """A simulated cluster's ``speed`` (virtual seconds per wall-clock second, default 1),
    or InvalidRequest: the pool, not the simulator, applies it, so the simulator's own
    check of its settings never sees it."""
    value = config.get("speed", 1.0)
    try:
        # bool is an int to Python, but speed=true is a mistake, not a speed of 1.
        speed = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        speed = math.nan
    if not (math.isfinite(speed) and speed > 0):
        raise InvalidRequest(
            f"simulated cluster {name}: speed {value!r} is not a number above 0: give how many times "
            "faster than the wall clock its virtual time runs, e.g. speed=10 (default 1)",
            details=[{"field": "config.speed", "value": value}],
        )
    return speed


def make_adapter(name: str, kind: str, config: dict[str, Any], clock: Clock) -> ClusterAdapter:
    """Build the adapter; a config it refuses is the admin's error (InvalidRequest)."""
    _check_kind(kind)
    if kind == "sim":
        sim_speed(name, config)
    try:
        cls = adapter_class(kind)
    except (ImportError, AttributeError) as exc:
        raise InvalidRequest(
            f"the {kind} adapter is not available in this installation ({exc}): "
            "reinstall gpush with its dependencies (pip install gpush)"
        ) from None
    if kind == "sim":
        # The pool applies a simulated cluster's speed to its clock (AdapterPool._clock_for).
        config = {k: v for k, v in config.items() if k != "speed"}
    return cls(name, config, clock=clock)


def add_cluster(
    session: Session,
    *,
    name: str,
    kind: str,
    config: dict[str, Any],
    actor: str,
    now: datetime,
    replace: bool = False,
    check: Callable[[ClusterAdapter], None] | None = None,
) -> ClusterInfo:
    """Register (or with ``replace`` re-configure) a cluster after its adapter accepts the config.

    A real cluster's jobs carry a tag that names this gpush installation (the
    adapter's ``tag``): unless the admin sets one, a new registration gets its own
    (``gpush`` and eight hex digits: two registrations draw the same one about once in
    four billion; with four digits, two of the integration suite's many brokers on one
    Slurm test cluster once drew the same and one took the other's job for its own) and a
    re-configuration keeps the one it had, so two brokers sharing a cluster do not take
    each other's jobs for theirs.
    """
    row = session.get(Cluster, name)
    if kind != "sim" and "tag" not in config:
        old_tag = (row.config or {}).get("tag") if row is not None else None
        config = {**config, "tag": old_tag or f"gpush{secrets.token_hex(4)}"}
    adapter = make_adapter(name, kind, config, clock=lambda: now)
    try:
        if check is not None:
            check(adapter)
    finally:
        _close(adapter)  # only a check: the pool builds the one that serves
    if row is not None and not replace:
        raise Conflict(f"cluster {name} is already registered: pass --replace to change its configuration")
    if row is None:
        row = Cluster(name=name, created_by=actor, created_at=now, enabled=True)
        session.add(row)
    else:
        row.status_cursor = None  # another backend, another cursor
    row.kind, row.config, row.updated_at = kind, config, now
    session.flush()
    return ClusterInfo.of(row)


def remove_cluster(session: Session, name: str) -> None:
    row = session.get(Cluster, name)
    if row is None:
        raise NotFound(f"no cluster {name}: `gpush cluster list` shows them")
    session.delete(row)
    session.flush()


def list_clusters(session: Session, *, enabled_only: bool = False) -> list[ClusterInfo]:
    query = select(Cluster).order_by(Cluster.name)
    if enabled_only:
        query = query.where(Cluster.enabled.is_(True))
    return [ClusterInfo.of(row) for row in session.execute(query).scalars()]


def summarize(info: ClusterInfo, pool: AdapterPool) -> dict[str, Any]:
    """Health and capacity of one cluster, for `gpush cluster list` and GET /v1/clusters;
    a cluster whose adapter cannot be built is unhealthy, saying why."""
    out: dict[str, Any] = {"name": info.name, "kind": info.kind, "enabled": info.enabled}
    try:
        adapter = pool.get(info)
        health = adapter.health()
        out["health"] = {"ok": health.ok, "detail": health.detail, "version": health.version}
        units = adapter.inventory() if health.ok else []
    except AdapterError as exc:
        out["health"] = {"ok": False, "detail": str(exc), "version": None}
        units = []
    by_sharing: dict[str, dict[str, float]] = {}
    for unit in units:
        row = by_sharing.setdefault(unit.sharing.value, {"gpu_total": 0.0, "gpu_free": 0.0, "units": 0, "free": 0})
        row["gpu_total"] += unit.capacity * unit.gpu_equivalent
        row["gpu_free"] += unit.free * unit.gpu_equivalent
        row["units"] += unit.capacity
        row["free"] += unit.free
    out["capacity"] = by_sharing
    out["gpu_total"] = sum(r["gpu_total"] for r in by_sharing.values())
    out["gpu_free"] = sum(r["gpu_free"] for r in by_sharing.values())
    out["nodes"] = len({u.node for u in units})
    # Capacity the cluster lists but offers none of now (drained, cordoned, fenced: lent to
    # another cluster or under a MIG change): counted in gpu_total as taken, named apart.
    closed = [u for u in units if u.labels.get("unavailable")]
    out["gpu_unavailable"] = sum(u.capacity * u.gpu_equivalent for u in closed)
    out["nodes_unavailable"] = len({u.node for u in closed})
    return out


class AdapterPool:
    """One adapter per registered cluster in this process, rebuilt when its config changes."""

    def __init__(
        self,
        clock: Clock,
        overrides: dict[str, ClusterAdapter] | None = None,
        *,
        on_change: Callable[[], None] | None = None,
    ):
        """``on_change``: told when a cluster that pushes events (a
        :class:`~broker.core.adapter.ChangeNotifier`) reports a change of a job."""
        self.clock = clock
        self.on_change = on_change
        self._adapters: dict[str, tuple[str, ClusterAdapter]] = {}
        # Per cluster: the config's fingerprint, why its adapter could not be built, and
        # when (time.monotonic) to try again.
        self._failed: dict[str, tuple[str, str, float]] = {}
        self._overrides = dict(overrides or {})
        self._lock = threading.Lock()

    def _clock_for(self, info: ClusterInfo) -> Clock:
        """Simulated clusters may run faster than the wall clock (config ``speed``): virtual
        time counts from the cluster's registration, so every process agrees on it."""
        speed = sim_speed(info.name, info.config) if info.kind == "sim" else 1.0
        if speed == 1.0:
            return self.clock
        return ScaledClock(self.clock, info.created_at, speed)

    def _config_for(self, info: ClusterInfo, fingerprint: str) -> dict[str, Any]:
        config = dict(info.config)
        if info.kind == "sim" and "state_file" not in config:
            # A simulated cluster keeps its jobs across broker restarts and CLI runs, as a
            # real one would; a new configuration starts a new simulation.
            state = data_dir() / "sim" / f"{info.name}-{fingerprint[:8]}.json"
            state.parent.mkdir(parents=True, exist_ok=True)
            config["state_file"] = str(state)
        if info.kind == "sim" and config.get("state_file") is None:
            config.pop("state_file", None)
        return config

    def close(self) -> None:
        """Close every adapter this pool built (their watches, connections)."""
        with self._lock:
            built, self._adapters = list(self._adapters.values()), {}
        for _, adapter in built:
            _close(adapter)

    def override(self, name: str, adapter: ClusterAdapter) -> None:
        """Use ``adapter`` for cluster ``name`` in this process (tests, embedded tools)."""
        with self._lock:
            self._overrides[name] = adapter

    def get(self, info: ClusterInfo) -> ClusterAdapter:
        """The cluster's adapter, its calls measured (broker.core.metrics), overrides included.

        :class:`Misconfigured` (an :class:`~broker.core.adapter.Unreachable`) when the
        adapter cannot be built from the stored config: callers handle it as a cluster
        that does not answer, so one bad cluster never stops the others.
        """
        if info.name in self._overrides:
            return instrument(self._overrides[info.name], info.name, info.kind)
        fingerprint = hashlib.sha256(json.dumps([info.kind, info.config], sort_keys=True).encode()).hexdigest()
        with self._lock:
            cached = self._adapters.get(info.name)
            if cached is None or cached[0] != fingerprint:
                failed = self._failed.get(info.name)
                if failed is not None and failed[0] == fingerprint and time.monotonic() < failed[2]:
                    raise Misconfigured(failed[1])
                if cached is not None:
                    del self._adapters[info.name]
                    _close(cached[1])  # the old configuration's watches and connections
                built = self._build(info, fingerprint)
                notifier = capability(built, ChangeNotifier)
                if notifier is not None and self.on_change is not None:
                    notifier.notify_changes(self.on_change)
                cached = (fingerprint, instrument(built, info.name, info.kind))
                self._adapters[info.name] = cached
                self._failed.pop(info.name, None)
            return cached[1]

    def _build(self, info: ClusterInfo, fingerprint: str) -> ClusterAdapter:
        try:
            config = self._config_for(info, fingerprint)
            return make_adapter(info.name, info.kind, config, self._clock_for(info))
        except Exception as exc:  # whatever the adapter raised: this cluster is broken, not the broker
            error = Misconfigured(
                f"cluster {info.name} cannot be used: its {info.kind} adapter refuses its registered config "
                f"({exc}): fix it with `gpush cluster add {info.name} --kind {info.kind} --replace --config ...`"
            )
            log.warning("%s", error, exc_info=not isinstance(exc, InvalidRequest))
            self._failed[info.name] = (fingerprint, str(error), time.monotonic() + REBUILD_AFTER_S)
            raise error from exc


def _close(adapter: ClusterAdapter) -> None:
    closable = capability(adapter, Closable)
    if closable is not None:
        closable.close()
