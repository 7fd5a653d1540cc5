"""What the broker holds on its clusters, as the cycle reads it before it decides: each
tenant's GPU-equivalents (the fair-share and quota ledger), the placements clusters have not
started yet, and the GPU memory time-sliced jobs hold per node; the nodes fleet changes fence.
Each read counts the status changes of step 2 as made (they are written beside the steps that
read this)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from sqlalchemy import delete, func, select

from broker.core.adapter import CapacityUnit, Placement, Sharing
from broker.core.clusters import ClusterInfo
from broker.core.gangs import waiting_reservations
from broker.core.models import GangReservation, Job, JobEvent, Tenant
from broker.core.states import JobState
from broker.placement.reservation import Reservation, expected_end, running_ends
from broker.scheduling.steps import rows_by_id
from broker.scheduling.sync import StatusChanges

S = JobState
ACTIVE = (S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value, S.RUNNING.value)


class Ledger(NamedTuple):
    """GPU-equivalents each tenant holds, and the tenants' weights and quotas."""

    usage: dict[str, float]
    weights: dict[str, float]
    quotas: dict[str, float]


@dataclass
class Booked:
    """What the broker holds on clusters that their inventories may not show yet."""

    pending: list[Placement]  # placements made that clusters have not started yet
    memory: dict[tuple[str, str], float]  # GPU memory of time-sliced jobs per (cluster, node)


def ledger(sessions, sync: StatusChanges) -> Ledger:
    """GPU-equivalents each tenant holds (less what the status changes end), and the
    tenants' weights and quotas."""
    with sessions() as session:
        usage = {
            t: float(ge or 0)
            for t, ge in session.execute(
                select(Job.tenant, func.sum(Job.gpu_equivalents)).where(Job.state.in_(ACTIVE)).group_by(Job.tenant)
            )
        }
        weights, quotas = {}, {}
        for tenant in session.execute(select(Tenant)).scalars():
            weights[tenant.name] = tenant.weight
            if tenant.gpu_quota is not None:
                quotas[tenant.name] = tenant.gpu_quota
    for row in sync.finished.values():
        if row.gpu_equivalents and row.tenant in usage:
            usage[row.tenant] = max(usage[row.tenant] - row.gpu_equivalents, 0.0)
    return Ledger(usage, weights, quotas)


def booked_capacity(sessions, sync: StatusChanges) -> Booked:
    """What the broker holds that clusters' inventories may not show: placements not
    started yet, and GPU memory of time-sliced jobs per node."""
    placement = Job.placement
    with sessions() as session:
        # Placements not started: routed and submitting jobs (few), and submitted ones
        # the status changes do not start or end. Most submitted jobs started since the
        # last cycle (the changes say so), so their ids are read first and only the
        # others' placements parsed.
        not_started = [
            job_id
            for job_id in session.execute(
                select(Job.id).where(
                    Job.state.in_([S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value]),
                    Job.placement.is_not(None),
                )
            ).scalars()
            if job_id not in sync.leaving_submitted
        ]
        pending = [Placement.from_dict(p) for _, p in rows_by_id(session, select(Job.id, Job.placement), not_started)]
        # GPU memory of time-sliced jobs per node, summed by the database: every
        # running job has a placement, and only these few numbers are needed.
        node = placement["node"].as_string()
        memory_gb = placement["gpu_memory_gb"].as_float()
        timesliced = (
            select(
                placement["cluster"].as_string().label("cluster"),
                node.label("node"),
                (
                    memory_gb * placement["units"].as_float() * func.coalesce(placement["replicas"].as_float(), 1.0)
                ).label("memory_gb"),
            )
            .where(
                Job.state.in_(ACTIVE),
                placement["sharing"].as_string() == Sharing.K8S_TIMESLICE.value,
                node.is_not(None),
                node != "",
                memory_gb.is_not(None),
                memory_gb != 0,
            )
            .subquery()
        )
        memory = defaultdict(
            float,
            {
                (cluster, on_node): float(total)
                for cluster, on_node, total in session.execute(
                    select(timesliced.c.cluster, timesliced.c.node, func.sum(timesliced.c.memory_gb)).group_by(
                        timesliced.c.cluster, timesliced.c.node
                    )
                )
            },
        )
    for row in sync.finished.values():  # ending: their memory is free
        p = row.placement or {}
        if p.get("sharing") == Sharing.K8S_TIMESLICE.value and p.get("node") and p.get("gpu_memory_gb"):
            memory[(p["cluster"], p["node"])] -= p["gpu_memory_gb"] * p["units"] * (p.get("replicas") or 1)
    return Booked(pending, dict(memory))


def fence(
    inventory: dict[str, list[CapacityUnit]], fenced: Mapping[tuple[str, str], str]
) -> dict[str, list[CapacityUnit]]:
    """``inventory`` with the units of fenced nodes (a MIG change under way) all taken, with
    why, as a cluster reports a drained or cordoned node: jobs wait for other units."""
    if not fenced:
        return inventory
    return {
        name: [
            unit
            if (name, unit.node) not in fenced
            else dataclasses.replace(
                unit,
                allocated=unit.capacity,
                labels={**unit.labels, "unavailable": f"fenced for {fenced[(name, unit.node)]}"},
            )
            for unit in units
        ]
        for name, units in inventory.items()
    }


def beyond_backlog(pending: list[Placement], clusters: dict[str, ClusterInfo]) -> list[Placement]:
    """The placements not started yet that count against free capacity: all of them, but
    for a cluster whose config allows a backlog (``backlog_jobs``, a Slurm setting), whose
    first that many may wait in the cluster's own queue instead. Slurm starts jobs faster
    with a queue to choose from (400 small jobs: 12.2 s with all queued, 14.1 s with 100 at a
    time); the price is that those jobs are committed to that cluster before they fit."""
    allowance = {name: int(info.config.get("backlog_jobs") or 0) for name, info in clusters.items()}
    if not any(allowance.values()):
        return pending
    out = []
    for placement in pending:
        if allowance.get(placement.cluster, 0) > 0:
            allowance[placement.cluster] -= 1
            continue
        out.append(placement)
    return out


def reservations(sessions) -> dict[int, Reservation]:
    """The gang reservations kept from the last cycle, of the jobs that still wait."""
    with sessions() as session:
        return held_reservations(session)


def held_reservations(session, cluster: str | None = None) -> dict[int, Reservation]:
    """The stored gang reservations of jobs that still wait (on ``cluster``), by job id,
    with each gang's place in the queue (its priority, and when it joined the queue: the
    jobs ahead of it that its reservation does not hold back)."""
    stored = waiting_reservations(session, cluster)
    if not stored:
        return {}
    places = {
        job_id: (priority, _aware(created_at))
        for job_id, priority, created_at in session.execute(
            select(Job.id, Job.priority, Job.created_at).where(Job.id.in_([r.job_id for r in stored]))
        )
    }
    return {
        r.job_id: Reservation(r.job_id, r.cluster, tuple(r.nodes), r.start_by, r.made_at, *places[r.job_id])
        for r in stored
    }


def keep_reservations(sessions, before: Mapping[int, Reservation], held: Mapping[int, Reservation]) -> None:
    """Store the reservations a cycle leaves (``held``) in place of those it read
    (``before``); nothing is written when they are the same (most cycles: none)."""
    if dict(before) == dict(held):
        return
    with sessions() as session, session.begin():
        session.execute(delete(GangReservation))
        session.add_all(
            GangReservation(
                job_id=r.job_id, cluster=r.cluster, nodes=list(r.nodes), start_by=r.start_by, made_at=r.made_at
            )
            for r in held.values()
        )


def expected_ends(sessions, sync: StatusChanges, before: datetime) -> dict[tuple[str, str], list]:
    """When what runs on each node is expected to end, for reservations
    (broker.placement.reservation.Running): each active job's placement, ending its time
    limit after it was placed (its last ``routed`` event), as a replay counts it. Left out:
    the jobs the status changes end, and those placed from ``before`` on (this cycle's,
    which the reservations count as they are placed, whether their write is in yet or not)."""
    active = select(Job.id).where(Job.state.in_(ACTIVE), Job.placement.is_not(None))
    placed_at = (
        select(JobEvent.job_id, func.max(JobEvent.at).label("at"))
        .where(JobEvent.to_state == S.ROUTED.value, JobEvent.job_id.in_(active))
        .group_by(JobEvent.job_id)
        .subquery()
    )
    with sessions() as session:
        rows = session.execute(
            select(Job.id, Job.placement, Job.spec["time_limit"].as_string(), placed_at.c.at)
            .join(placed_at, placed_at.c.job_id == Job.id)
            .where(placed_at.c.at < before)
        ).all()
    return running_ends(
        (Placement.from_dict(placement), expected_end(_aware(at), limit))
        for job_id, placement, limit, at in rows
        if job_id not in sync.finishing and placement
    )


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
