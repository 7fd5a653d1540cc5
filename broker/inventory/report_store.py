"""Node reports in the database, and the reconciled inventory built from them.

The agent's newest report per node is one row of ``node_reports`` (replaced on each
report). :func:`reconciled` reads every enabled cluster's inventory through its
adapter and the stored reports, and merges them with broker.inventory.reconcile; the API's
inventory routes and the scheduler call it, so both see the same findings. Callers own
the transaction (the API route, the scheduler's cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.core import metrics
from broker.core.adapter import AdapterError, CapacityUnit
from broker.core.clusters import AdapterPool, ClusterInfo, list_clusters
from broker.core.models import NodeReport as NodeReportRow
from broker.core.topology import GpuTopology
from broker.inventory.agent_report import NodeReport
from broker.inventory.reconcile import DEFAULT_STALE_AFTER, reconcile
from broker.inventory.view import ClusterInventory, Finding, Inventory, mark_broken, with_gpu_topology


def facts_of(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """What a stored report says of the GPUs that the scheduler's findings depend on: all
    but when it was collected and the processes (whose memory moves all the time)."""
    gpus = [{k: v for k, v in gpu.items() if k != "processes"} for gpu in body.get("gpus") or []]
    return {**{k: v for k, v in body.items() if k not in ("collected_at", "gpus")}, "gpus": gpus}


def save_report(session: Session, report: NodeReport, *, by: str, now: datetime) -> NodeReportRow:
    """Keep ``report`` as its node's newest (an older report than the stored one is ignored:
    two agents racing, or a retry that arrived late). ``changed_at`` moves only when the
    GPU facts differ from the stored report's."""
    row = session.get(NodeReportRow, report.node)
    body = report.model_dump(mode="json")
    if row is None:
        row = NodeReportRow(
            node=report.node,
            report=body,
            collected_at=report.collected_at,
            received_at=now,
            changed_at=now,
            reported_by=by,
        )
        session.add(row)
    elif report.collected_at >= row.collected_at:
        if facts_of(row.report) != facts_of(body):
            row.changed_at = now
        row.report, row.collected_at, row.received_at, row.reported_by = body, report.collected_at, now, by
    session.flush()
    return row


def load_reports(session: Session) -> dict[str, NodeReport]:
    """Every node's newest report. A row this broker cannot read (written by a newer
    agent with fields it does not know) is skipped, not fatal: the node then shows as
    one no agent reports."""
    reports: dict[str, NodeReport] = {}
    for row in session.execute(select(NodeReportRow)).scalars():
        try:
            reports[row.node] = NodeReport.model_validate(row.report)
        except ValidationError:
            continue
    return reports


def cluster_inventories(clusters: Mapping[str, ClusterInfo], pool: AdapterPool) -> dict[str, ClusterInventory]:
    """Each cluster's own view: its adapter's inventory, or why it could not be read."""
    out: dict[str, ClusterInventory] = {}
    for name, info in clusters.items():
        try:
            units = list(pool.get(info).inventory())
            out[name] = ClusterInventory(name=name, kind=info.kind, units=units)
        except AdapterError as exc:
            out[name] = ClusterInventory(name=name, kind=info.kind, units=[], error=str(exc))
    return out


def read_sources(session: Session, cluster: str | None = None) -> tuple[dict[str, ClusterInfo], dict[str, NodeReport]]:
    """What reconciling needs from the database: the enabled clusters (or only ``cluster``)
    and the reports. Read in the caller's transaction; the clusters are asked afterwards,
    outside it (:func:`reconciled`), so no transaction waits on a cluster."""
    clusters = {c.name: c for c in list_clusters(session) if c.enabled}
    if cluster is not None:
        clusters = {k: v for k, v in clusters.items() if k == cluster}
    return clusters, load_reports(session)


def reconciled(
    clusters: Mapping[str, ClusterInfo],
    reports: Mapping[str, NodeReport],
    pool: AdapterPool,
    *,
    now: datetime,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> Inventory:
    """The one inventory: each cluster's adapter inventory merged with the agents' reports;
    its findings also go to /metrics (gpush_drift_findings)."""
    inventory = reconcile(cluster_inventories(clusters, pool), reports, now=now, stale_after=stale_after)
    metrics.observe_findings(inventory.findings)
    return inventory


class DriftWatch:
    """The findings the scheduler honours, kept between cycles.

    Reconciling a large fleet takes a good part of a second, so the scheduler does not
    do it every cycle: the findings are recomputed when a report says something new of
    its GPUs (``changed_at``; agents repeating themselves every half minute do not count)
    or a node's agent appeared or went, at most every ``soonest`` seconds, and at least
    every ``refresh`` seconds (the clusters' own view and the reports' age change too);
    in between the last findings mark the fresh units broken (:func:`mark_broken` is a
    lookup per node) and the last NVML readings set their ``gpu_topology``
    (:func:`with_gpu_topology`, the same lookup). Without any report there is nothing to reconcile and nothing is
    marked: a fleet without agents schedules as it always did.
    """

    def __init__(
        self,
        refresh: timedelta = timedelta(seconds=30),
        stale_after: timedelta = DEFAULT_STALE_AFTER,
        soonest: timedelta = timedelta(seconds=2),
    ):
        self.refresh = refresh
        self.soonest = soonest
        self.stale_after = stale_after
        self._stamp: tuple[int, datetime | None] | None = None
        self._at: datetime | None = None
        self._findings: list[Finding] = []
        self._topologies: dict[tuple[str, str], GpuTopology] = {}

    def apply(
        self,
        session: Session,
        inventories: Mapping[str, list[CapacityUnit]],
        clusters: Mapping[str, ClusterInfo],
        *,
        now: datetime,
    ) -> dict[str, list[CapacityUnit]]:
        """``inventories`` (cluster -> units) with the units critical findings break marked, and
        each unit's ``gpu_topology`` the one its node's agent read through NVML, where one did."""
        count, newest = session.execute(select(func.count(), func.max(NodeReportRow.changed_at))).one()
        if not count:
            self._stamp, self._findings, self._topologies = None, [], {}
            return dict(inventories)
        stamp = (count, newest)
        since = None if self._at is None else now - self._at
        if since is None or since >= self.refresh or (stamp != self._stamp and since >= self.soonest):
            sources = {
                name: ClusterInventory(name=name, kind=clusters[name].kind, units=units)
                for name, units in inventories.items()
                if name in clusters
            }
            inventory = reconcile(sources, load_reports(session), now=now, stale_after=self.stale_after)
            self._findings, self._stamp, self._at = inventory.findings, stamp, now
            self._topologies = inventory.gpu_topologies
            metrics.observe_findings(self._findings)
        placed = {name: with_gpu_topology(units, self._topologies) for name, units in inventories.items()}
        if not any(f.breaks for f in self._findings):
            return placed
        return {name: mark_broken(units, self._findings) for name, units in placed.items()}
