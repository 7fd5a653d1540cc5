"""The nodes of a placement (:func:`held_on`: a gang's every node), and the nodes
multi-node jobs (gangs) keep from fleet changes: a node lent to the other
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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.adapter import Placement
from broker.core.models import GangReservation, Job
from broker.core.states import JobState

# A placed gang holds its nodes from its placement until it ends (as the ledger counts it).
_PLACED = (JobState.ROUTED.value, JobState.SUBMITTING.value, JobState.SUBMITTED.value, JobState.RUNNING.value)


def held_on(placement: Placement | Mapping[str, Any]) -> tuple[str, ...]:
    """The nodes ``placement`` (or a stored one, :meth:`Placement.to_dict`'s) holds units
    on: a gang's every node, else its one node (none when it names none: replicas spread
    over several nodes, or the cluster chooses)."""
    if isinstance(placement, Placement):
        return placement.nodes or ((placement.node,) if placement.node else ())
    return tuple(placement.get("nodes") or ()) or ((placement["node"],) if placement.get("node") else ())


def gang_nodes(
    reserved: Iterable[tuple[int, str, Sequence[str]]], placed: Iterable[tuple[int, str, Sequence[str]]]
) -> dict[tuple[str, str], str]:
    """(cluster, node) -> why no fleet change may take it: ``reserved``, (job id, cluster,
    nodes) of each gang reservation; ``placed``, (job id, cluster, nodes it holds) of the
    jobs that hold capacity (only those on several nodes count)."""
    out: dict[tuple[str, str], str] = {}
    for job_id, cluster, nodes in placed:
        if len(nodes) > 1:
            for node in nodes:
                out[(cluster, node)] = f"runs a rank of multi-node job {job_id}"
    for job_id, cluster, nodes in reserved:
        for node in nodes:
            out.setdefault((cluster, node), f"is reserved for multi-node job {job_id}")
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
    placed = ((job_id, doc.get("cluster"), held_on(doc)) for job_id, doc in rows if doc)
    reserved = ((r.job_id, r.cluster, tuple(r.nodes)) for r in waiting_reservations(session))
    return gang_nodes(reserved, placed)
