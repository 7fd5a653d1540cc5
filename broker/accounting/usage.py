"""GPU-hours in physical GPU-equivalents, from the job events: what ``gpush usage``,
``GET /v1/usage`` and the Prometheus counter ``gpush_gpu_equivalent_seconds_total`` count.

A job is charged while it is ``running`` (from the event that moved it to running to the
event that moved it away; a running job up to now), at the GPU-equivalents its
placement holds (:func:`broker.accounting.equivalents.per_replica`, the one definition
that the ledger, tenants and inventory read too): a MIG slice its fraction of its GPU
(3g.20gb of an A100: 3/7), an MPS share its percent, a time-slice replica 1/replicas of
its GPU, whole GPUs whole.

Each replica of an elastic job is charged alike; a ``scaled`` event changes the count from
then on. A job that ran, was requeued and ran again is charged for each run at its last
placement (the only one the row keeps). Totals are sums over jobs, so a tenant's total
is the sum of its jobs' usage by construction.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from broker.accounting.equivalents import per_replica
from broker.core.auth import Principal
from broker.core.errors import InvalidRequest
from broker.core.models import Job, JobEvent, Preemption
from broker.intake.queue import job_filters

RUNNING = "running"
GROUPS = ("tenant", "user", "cluster", "sharing", "kind")
_SCALED = re.compile(r"scaled from (\d+) to (\d+) replicas")
_CHUNK = 2000


@dataclass(frozen=True)
class Interval:
    """One stretch of a job's run at one replica count."""

    start: datetime
    end: datetime | None  # None: still running
    replicas: int


def run_intervals(events: Sequence[JobEvent], replicas_now: int) -> list[Interval]:
    """The stretches a job ran, from its events (oldest first), split where it was
    scaled; ``replicas_now`` is its placement's count (after the last scale)."""
    scaled = [_SCALED.search(e.reason or "") for e in events if e.type == "scaled"]
    replicas = next((int(m.group(1)) for m in scaled if m), replicas_now)
    out: list[Interval] = []
    start: datetime | None = None
    for event in events:
        if event.type == "scaled":
            match = _SCALED.search(event.reason or "")
            if match is None:
                continue
            if start is not None:
                out.append(Interval(start, event.at, replicas))
                start = event.at
            replicas = int(match.group(2))
        elif event.to_state == RUNNING and event.from_state != RUNNING:
            start = event.at
        elif event.from_state == RUNNING and event.to_state != RUNNING and start is not None:
            out.append(Interval(start, event.at, replicas))
            start = None
    if start is not None:
        out.append(Interval(start, None, replicas))
    return out


def seconds_within(interval: Interval, since: datetime | None, until: datetime) -> float:
    start = interval.start if since is None else max(interval.start, since)
    end = until if interval.end is None else min(interval.end, until)
    return max((end - start).total_seconds(), 0.0)


@dataclass(frozen=True)
class JobUsage:
    job_id: int
    tenant: str
    user: str
    cluster: str | None
    sharing: str | None
    kind: str
    gpu_seconds: float  # GPU-equivalent seconds within the window
    run_seconds: float  # wall seconds it ran within the window


def job_usage(
    session: Session,
    principal: Principal,
    *,
    since: datetime | None,
    until: datetime,
    tenant: str | None = None,
) -> list[JobUsage]:
    """Every job that ran within [since, until) and the caller may see, with its usage there."""
    if since is not None and since >= until:
        raise InvalidRequest(f"--since ({since.isoformat()}) is not before --until ({until.isoformat()})")
    scope = job_filters(principal, tenant=tenant, user=None, kind=None, cluster=None, labels=None)
    if scope is None:
        return []
    ran = select(JobEvent.job_id).where(JobEvent.to_state == RUNNING, JobEvent.at < until)
    # A job queued again after a preemption has no placement of its own until it is placed
    # again: its preemption keeps the placement of the run it stopped.
    placed = or_(Job.placement.is_not(None), Job.id.in_(select(Preemption.victim_id)))
    query = select(Job).where(*scope, Job.id.in_(ran), placed)
    if since is not None:  # a job that ended before the window began used none of it
        query = query.where(or_(Job.updated_at >= since, Job.state == RUNNING))
    jobs = list(session.execute(query.order_by(Job.id)).scalars())
    out = []
    for start in range(0, len(jobs), _CHUNK):
        chunk = jobs[start : start + _CHUNK]
        ids = [j.id for j in chunk]
        events: dict[int, list[JobEvent]] = defaultdict(list)
        rows = session.execute(
            select(JobEvent)
            .where(JobEvent.job_id.in_(ids))
            .where(or_(JobEvent.to_state == RUNNING, JobEvent.from_state == RUNNING))
            .order_by(JobEvent.job_id, JobEvent.at, JobEvent.id)
        ).scalars()
        for event in rows:
            events[event.job_id].append(event)
        stopped = preempted_runs(session, ids)
        for job in chunk:
            current = job.placement or {}
            intervals = run_intervals(events[job.id], int(current.get("replicas") or 1))
            # Each run is charged to the placement it ran on: its preemption's, else the job's.
            by_run: dict[str, list[tuple[float, int, float]]] = defaultdict(list)
            runs: dict[str, dict] = {}
            for interval in intervals:
                placement = run_placement(interval, stopped.get(job.id, ()), current)
                if not placement:
                    continue
                key = orjson.dumps(placement, option=orjson.OPT_SORT_KEYS).decode()
                runs[key] = placement
                by_run[key].append((seconds_within(interval, since, until), interval.replicas, per_replica(placement)))
            for key, run in by_run.items():
                seconds = sum(s for s, _, _ in run)
                if seconds <= 0:
                    continue
                placement = runs[key]
                out.append(
                    JobUsage(
                        job.id,
                        job.tenant,
                        job.user,
                        placement.get("cluster") or job.cluster,
                        placement.get("sharing"),
                        job.kind,
                        sum(s * r * share for s, r, share in run),
                        seconds,
                    )
                )
    return out


def preempted_runs(session: Session, job_ids: Sequence[int]) -> dict[int, list[tuple[datetime, dict]]]:
    """When each of these jobs was chosen for a preemption, with the placement of the run it
    stopped, oldest first."""
    out: dict[int, list[tuple[datetime, dict]]] = defaultdict(list)
    for victim, at, placement in session.execute(
        select(Preemption.victim_id, Preemption.requested_at, Preemption.placement)
        .where(Preemption.victim_id.in_(list(job_ids)))
        .order_by(Preemption.requested_at)
    ):
        out[victim].append((at, placement))
    return out


def run_placement(interval: Interval, stopped: Sequence[tuple[datetime, dict]], current: dict) -> dict:
    """The placement a run of a job had: that of a preemption chosen while it ran (the run
    it stopped), else the job's own (its latest run's)."""
    for at, placement in stopped:
        if interval.start <= at and (interval.end is None or at <= interval.end):
            return placement
    return current


def parse_groups(text: str | Iterable[str] | None) -> tuple[str, ...]:
    names = text.split(",") if isinstance(text, str) else list(text or ["tenant"])
    groups = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise InvalidRequest(
            f"--by {','.join(bad) or '(nothing)'}: group by one or more of {', '.join(GROUPS)}",
            details=[{"field": "by", "value": ",".join(names)}],
        )
    return groups


def summarize(usages: Iterable[JobUsage], groups: Sequence[str]) -> list[dict[str, Any]]:
    """GPU-hours (and jobs, run hours) per group, largest first."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    jobs: dict[tuple, set[int]] = defaultdict(set)  # a job whose runs ran in two places is one job
    for usage in usages:
        key = tuple(getattr(usage, g) or "" for g in groups)
        total = totals[key]
        total[0] += usage.gpu_seconds
        total[1] += usage.run_seconds
        jobs[key].add(usage.job_id)
    rows = [
        {**dict(zip(groups, key)), "gpu_hours": gpu / 3600, "jobs": len(jobs[key]), "run_hours": run / 3600}
        for key, (gpu, run) in totals.items()
    ]
    rows.sort(key=lambda r: (-r["gpu_hours"], *(r[g] for g in groups)))
    return rows


def to_csv(rows: list[dict[str, Any]], groups: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*groups, "gpu_hours", "jobs", "run_hours"])
    for row in rows:
        writer.writerow([*(row[g] for g in groups), f"{row['gpu_hours']:.6f}", row["jobs"], f"{row['run_hours']:.6f}"])
    return out.getvalue()


Labels = tuple[str, str, str]  # tenant, cluster, sharing


class UsageLedger:
    """All-time GPU-equivalent seconds by tenant, cluster and sharing mode, kept up to
    date from the events appended since the last call (the Prometheus counter): one pass
    over the history on first use, then only the new events. Running jobs count up to
    ``now``; a total never goes down (an end recorded a moment before the last reading
    does not take back what that reading counted)."""

    def __init__(self) -> None:
        self.watermark = 0  # the last event id read
        self.closed: dict[Labels, float] = defaultdict(float)
        self.open: dict[int, tuple[datetime, int, float, Labels]] = {}  # job -> (since, replicas, share, labels)
        self.reported: dict[Labels, float] = {}

    def update(
        self, session: Session, now: datetime, *, page: int = 20_000, max_pages: int | None = None
    ) -> dict[Labels, float]:
        """The totals at ``now`` after reading the events appended since the last call: all
        of them, or at most ``max_pages`` pages (a scrape stays short on a long history; the
        totals catch up over the next calls)."""
        pages = 0
        while max_pages is None or pages < max_pages:
            pages += 1
            events = list(
                session.execute(
                    select(JobEvent)
                    .where(JobEvent.id > self.watermark)
                    .where(or_(JobEvent.to_state == RUNNING, JobEvent.from_state == RUNNING))
                    .order_by(JobEvent.id)
                    .limit(page)
                ).scalars()
            )
            if not events:
                break
            self._read(session, events)
            self.watermark = events[-1].id
            if len(events) < page:
                break
        totals = dict(self.closed)
        for start, replicas, share, labels in self.open.values():
            totals[labels] = totals.get(labels, 0.0) + share * replicas * max((now - start).total_seconds(), 0.0)
        for labels, value in totals.items():
            self.reported[labels] = max(value, self.reported.get(labels, 0.0))
        return dict(self.reported)

    def _read(self, session: Session, events: list[JobEvent]) -> None:
        ids = {e.job_id for e in events}
        jobs = {
            j.id: j
            for j in session.execute(select(Job.id, Job.tenant, Job.cluster, Job.placement).where(Job.id.in_(ids)))
        }
        # The replica count a run started with: the first later scale's "from", else the placement's.
        later_scales: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for job_id, event_id, reason in session.execute(
            select(JobEvent.job_id, JobEvent.id, JobEvent.reason)
            .where(JobEvent.job_id.in_(ids), JobEvent.type == "scaled")
            .order_by(JobEvent.id)
        ):
            match = _SCALED.search(reason or "")
            if match:
                later_scales[job_id].append((event_id, int(match.group(1))))
        stopped = preempted_runs(session, [j.id for j in jobs.values() if not j.placement])
        for event in events:
            job = jobs.get(event.job_id)
            if job is None:
                continue
            placement = job.placement
            if not placement:  # queued again after a preemption: the run it stopped
                placement = run_placement(Interval(event.at, None, 1), stopped.get(job.id, ()), {})
                if not placement:
                    continue
            labels = (job.tenant, placement.get("cluster") or job.cluster or "", str(placement.get("sharing") or ""))
            if event.type == "scaled":
                match = _SCALED.search(event.reason or "")
                if match and event.job_id in self.open:
                    self._close(event.job_id, event.at)
                    self.open[event.job_id] = (event.at, int(match.group(2)), per_replica(placement), labels)
            elif event.to_state == RUNNING and event.from_state != RUNNING:
                after = [frm for eid, frm in later_scales[event.job_id] if eid > event.id]
                replicas = after[0] if after else int(placement.get("replicas") or 1)
                self.open[event.job_id] = (event.at, replicas, per_replica(placement), labels)
            elif event.from_state == RUNNING and event.to_state != RUNNING and event.job_id in self.open:
                self._close(event.job_id, event.at)

    def _close(self, job_id: int, at: datetime) -> None:
        start, replicas, share, labels = self.open.pop(job_id)
        self.closed[labels] += share * replicas * max((at - start).total_seconds(), 0.0)
