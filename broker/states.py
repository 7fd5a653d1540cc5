"""Job states and the one function that changes them.

This module owns the transition table. Every state change anywhere in gpush goes
through :func:`set_state`, which is a compare-and-set on the job's row and appends
the event in the same transaction (the caller's session; the caller commits).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from broker.errors import IllegalTransition, NotFound, StateConflict
from broker.models import Job, JobEvent


class JobState(StrEnum):
    QUEUED = "queued"
    HELD = "held"
    ROUTED = "routed"
    SUBMITTING = "submitting"
    SUBMITTED = "submitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REQUEUED = "requeued"


S = JobState

# Allowed transitions, (from, to) -> why the edge exists. Nothing else is allowed.
TRANSITIONS: dict[tuple[JobState, JobState], str] = {
    (S.QUEUED, S.ROUTED): "the scheduler found a route and free capacity for the job",
    (S.QUEUED, S.HELD): "no rule routes the job, or its tenant is at quota; the reason says which",
    (S.QUEUED, S.CANCELLED): "cancelled before the broker placed it: nothing to undo anywhere",
    (S.HELD, S.QUEUED): "what held the job went away (policy changed, quota freed)",
    (S.HELD, S.CANCELLED): "cancelled while held: no cluster has it",
    (S.ROUTED, S.SUBMITTING): "intent record written before the adapter call, so a crash cannot lose or double it",
    (S.ROUTED, S.QUEUED): "the placement went stale before submission (capacity taken, cluster down)",
    (S.ROUTED, S.CANCELLED): "cancelled after routing but before any adapter call",
    (S.SUBMITTING, S.SUBMITTED): "the adapter accepted the job; the backend id is recorded",
    (S.SUBMITTING, S.QUEUED): "the adapter refused it or has no job with this id after a crash: route again",
    (S.SUBMITTING, S.FAILED): "the cluster rejected the job for a reason that retrying cannot fix",
    (S.SUBMITTING, S.CANCELLED): "a cancel intent was honoured: the backend confirmed no job exists",
    (S.SUBMITTED, S.RUNNING): "the cluster started the job",
    (S.SUBMITTED, S.SUCCEEDED): "the job ran and ended between two status syncs",
    (S.SUBMITTED, S.FAILED): "the cluster failed the job before or while starting it",
    (S.SUBMITTED, S.CANCELLED): "the cluster cancelled it (a user's cancel intent or an admin there)",
    (S.SUBMITTED, S.REQUEUED): "the backend lost the job (node failure, cluster reset)",
    (S.RUNNING, S.SUCCEEDED): "the job exited 0",
    (S.RUNNING, S.FAILED): "the job exited non-zero, ran out of time or memory, or its node died",
    (S.RUNNING, S.CANCELLED): "the cluster stopped it on a cancel intent",
    (S.RUNNING, S.REQUEUED): "preempted, or its node was lost: it goes back to the queue",
    (S.REQUEUED, S.QUEUED): "the requeued job takes its place in the global queue again",
    (S.REQUEUED, S.CANCELLED): "cancelled while waiting to be requeued",
}

TERMINAL: frozenset[JobState] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
# States in which no cluster has the job: a cancel ends it at once.
CANCELLABLE_AT_ONCE: frozenset[JobState] = frozenset({S.QUEUED, S.HELD, S.ROUTED, S.REQUEUED})
# States in which a cluster has (or may have) the job: a cancel is recorded as intent.
CANCEL_NEEDS_CLUSTER: frozenset[JobState] = frozenset({S.SUBMITTING, S.SUBMITTED, S.RUNNING})


def allowed_targets(state: JobState) -> list[JobState]:
    return [to for (frm, to) in TRANSITIONS if frm == state]


def check_transition(from_state: str, to_state: str) -> None:
    """Raise :class:`IllegalTransition` unless ``from_state -> to_state`` is in the table."""
    try:
        edge = (JobState(from_state), JobState(to_state))
    except ValueError as exc:
        raise IllegalTransition(f"unknown job state: {exc}") from None
    if edge not in TRANSITIONS:
        allowed = ", ".join(allowed_targets(edge[0])) or "nothing (it is final)"
        raise IllegalTransition(
            f"a job cannot go from {from_state} to {to_state}; from {from_state} it may go to {allowed}"
        )


def set_state(
    session: Session,
    job_id: int,
    from_state: str,
    to_state: str,
    *,
    reason: str | None,
    now: datetime,
    actor: str | None = None,
) -> JobEvent:
    """Move job ``job_id`` from ``from_state`` to ``to_state`` and record the event.

    A compare-and-set: the row changes only if the job is still in ``from_state``.
    Raises :class:`IllegalTransition` for an edge the table does not have,
    :class:`StateConflict` when another process moved the job first, and
    :class:`NotFound` when there is no such job. Flushes; the caller commits.
    """
    check_transition(from_state, to_state)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == from_state)
        .values(state=to_state, state_reason=reason, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        actual = session.execute(select(Job.state).where(Job.id == job_id)).scalar_one_or_none()
        if actual is None:
            raise NotFound(f"job {job_id} does not exist")
        raise StateConflict(job_id, expected=from_state, actual=actual)
    event = JobEvent(
        job_id=job_id,
        at=now,
        type="transition",
        from_state=from_state,
        to_state=to_state,
        reason=reason,
        actor=actor,
    )
    session.add(event)
    session.flush()
    return event
