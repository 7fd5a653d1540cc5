"""The nodes multi-node jobs (gangs) keep from fleet changes: a node lent to the other
cluster of a lending pool (broker.placement.lending) or re-cut for a MIG layout
(broker.mig.plan) is never one that

- a gang reservation holds for a waiting gang (broker.placement.reservation: it would
  be fenced under the gang that waits for it), or
- runs a rank of a placed gang (draining it stops the whole gang, on every node).

:func:`gang_nodes` is the rule, on what the caller knows: the live broker's stored
reservations and placements (:func:`kept_for_gangs`), or a replay's in memory, so that
``gpush simulate`` keeps the same nodes. The other direction, that a gang is never
placed on nor reserves a node being lent or fenced for a MIG change, is the capacity
view's (broker.placement.capacity: such a node offers nothing, and is no candidate).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.adapter import Placement
from broker.core.models import GangReservation, Job
from broker.core.states import JobState

# A placed gang holds its nodes from its placement until it ends (as the ledger counts it).
_PLACED = (JobState.ROUTED.value, JobState.SUBMITTING.value, JobState.SUBMITTED.value, JobState.RUNNING.value)


def gang_nodes(
    reserved: Iterable[tuple[int, str, Sequence[str]]], placed: Iterable[tuple[int, Placement]]
) -> dict[tuple[str, str], str]:
    """(cluster, node) -> why no fleet change may take it: ``reserved``, (job id, cluster,
    nodes) of each gang reservation; ``placed``, (job id, placement) of the jobs that hold
    capacity (only gangs' count)."""
    out: dict[tuple[str, str], str] = {}
    for job_id, placement in placed:
        if placement.gang:
            for node in placement.nodes:
                out[(placement.cluster, node)] = f"runs a rank of multi-node job {job_id}"
    for job_id, cluster, nodes in reserved:
        for node in nodes:
            out.setdefault((cluster, node), f"reserved for multi-node job {job_id}")
    return out


def waiting_reservations(session: Session, cluster: str | None = None) -> list[GangReservation]:
    """The stored gang reservations of jobs that still wait (on ``cluster``)."""
    query = (
        select(GangReservation).join(Job, Job.id == GangReservation.job_id).where(Job.state == JobState.QUEUED.value)
    )
    if cluster is not None:
        query = query.where(GangReservation.cluster == cluster)
    return list(session.execute(query).scalars())


def kept_for_gangs(session: Session) -> dict[tuple[str, str], str]:
    """:func:`gang_nodes` of the stored reservations and the placed jobs' placements."""
    rows = session.execute(select(Job.id, Job.placement).where(Job.state.in_(_PLACED), Job.placement.is_not(None)))
    placed = ((job_id, Placement.from_dict(doc)) for job_id, doc in rows if doc and len(doc.get("nodes") or ()) > 1)
    reserved = ((r.job_id, r.cluster, tuple(r.nodes)) for r in waiting_reservations(session))
    return gang_nodes(reserved, placed)
