"""The state machine: one table of transitions, one compare-and-set that writes the event."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from broker.errors import IllegalTransition, NotFound, StateConflict
from broker.models import Job, JobEvent
from broker.states import (
    CANCEL_NEEDS_CLUSTER,
    CANCELLABLE_AT_ONCE,
    TERMINAL,
    TRANSITIONS,
    JobState,
    allowed_targets,
    check_transition,
    set_state,
)

S = JobState


def _queued_job(sessions, clock) -> int:
    with sessions() as session, session.begin():
        job = Job(
            tenant="ml",
            user="alice",
            kind="training",
            isolation="exclusive",
            priority=0,
            state="queued",
            spec={},
            spec_hash="x",
            created_at=clock(),
            updated_at=clock(),
        )
        session.add(job)
        session.flush()
        return job.id


def test_design_path_is_allowed_end_to_end():
    path = [S.QUEUED, S.ROUTED, S.SUBMITTING, S.SUBMITTED, S.RUNNING, S.SUCCEEDED]
    for frm, to in zip(path, path[1:]):
        check_transition(frm, to)


def test_every_edge_says_why_and_every_state_is_reachable():
    assert all(why.strip() for why in TRANSITIONS.values())
    reachable = {S.QUEUED}
    frontier = [S.QUEUED]
    while frontier:
        for to in allowed_targets(frontier.pop()):
            if to not in reachable:
                reachable.add(to)
                frontier.append(to)
    assert reachable == set(JobState)


def test_final_states_have_no_way_out_and_cancel_sets_cover_the_rest():
    for state in TERMINAL:
        assert allowed_targets(state) == []
    assert CANCELLABLE_AT_ONCE | CANCEL_NEEDS_CLUSTER | TERMINAL == set(JobState)
    assert not CANCELLABLE_AT_ONCE & CANCEL_NEEDS_CLUSTER
    for state in CANCELLABLE_AT_ONCE | CANCEL_NEEDS_CLUSTER - {S.SUBMITTING}:
        assert (state, S.CANCELLED) in TRANSITIONS


@pytest.mark.parametrize(
    "frm,to",
    [(S.QUEUED, S.RUNNING), (S.SUCCEEDED, S.QUEUED), (S.CANCELLED, S.CANCELLED), (S.QUEUED, S.SUBMITTED)],
)
def test_illegal_transitions_are_refused_with_what_is_allowed(frm, to):
    with pytest.raises(IllegalTransition) as err:
        check_transition(frm, to)
    assert f"from {frm.value} to {to.value}" in err.value.message
    assert "may go to" in err.value.message


def test_set_state_moves_the_job_and_appends_the_event(sessions, clock):
    job_id = _queued_job(sessions, clock)
    clock.advance(3)
    with sessions() as session, session.begin():
        set_state(session, job_id, S.QUEUED, S.ROUTED, reason="route slurm-a/mig", now=clock(), actor="scheduler")
    with sessions() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.state_reason, job.updated_at) == ("routed", "route slurm-a/mig", clock())
        events = session.execute(select(JobEvent).where(JobEvent.job_id == job_id)).scalars().all()
        assert [(e.from_state, e.to_state, e.reason, e.actor) for e in events] == [
            ("queued", "routed", "route slurm-a/mig", "scheduler")
        ]


def test_compare_and_set_loses_when_the_job_moved_and_writes_nothing(sessions, clock):
    job_id = _queued_job(sessions, clock)
    with sessions() as session, session.begin():
        set_state(session, job_id, S.QUEUED, S.HELD, reason="no route", now=clock())
    with sessions() as session, session.begin():
        with pytest.raises(StateConflict) as err:
            set_state(session, job_id, S.QUEUED, S.ROUTED, reason="late", now=clock())
    assert (err.value.expected, err.value.actual) == ("queued", "held")
    with sessions() as session:
        assert session.get(Job, job_id).state == "held"
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 1


def test_illegal_transition_touches_nothing(sessions, clock):
    job_id = _queued_job(sessions, clock)
    with sessions() as session, session.begin():
        with pytest.raises(IllegalTransition):
            set_state(session, job_id, S.QUEUED, S.SUCCEEDED, reason=None, now=clock())
    with sessions() as session:
        assert session.get(Job, job_id).state == "queued"


def test_state_and_event_roll_back_together(sessions, clock):
    job_id = _queued_job(sessions, clock)
    with sessions() as session:
        session.begin()
        set_state(session, job_id, S.QUEUED, S.ROUTED, reason="r", now=clock())
        session.rollback()
    with sessions() as session:
        assert session.get(Job, job_id).state == "queued"
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 0


def test_missing_job_is_not_found(sessions, clock):
    with sessions() as session, session.begin():
        with pytest.raises(NotFound):
            set_state(session, 424242, S.QUEUED, S.ROUTED, reason=None, now=clock())
