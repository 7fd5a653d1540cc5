"""The state machine: one table of transitions, one compare-and-set that writes the event."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from broker.core.errors import IllegalTransition, NotFound, StateConflict
from broker.core.models import Job, JobEvent
from broker.core.states import (
    CANCEL_NEEDS_CLUSTER,
    CANCELLABLE_AT_ONCE,
    TERMINAL,
    TRANSITIONS,
    JobState,
    allowed_targets,
    check_transition,
    set_reasons,
    set_state,
    set_states,
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
        assert to in allowed_targets(frm), (frm, to)
        check_transition(frm, to)  # raises IllegalTransition for an edge the table lacks


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


# -- set_states: many jobs, one compare-and-set per batch ----------------------------


def _queued_jobs(sessions, clock, n: int) -> list[int]:
    return [_queued_job(sessions, clock) for _ in range(n)]


def _events(sessions, job_id):
    with sessions() as session:
        return session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars().all()


def test_set_states_moves_the_jobs_still_in_the_state_and_says_which(sessions, clock):
    first, moved_away, third = _queued_jobs(sessions, clock, 3)
    with sessions() as session, session.begin():
        set_state(session, moved_away, S.QUEUED, S.HELD, reason="no route", now=clock())
    clock.advance(5)
    with sessions() as session, session.begin():
        moved = set_states(
            session,
            [third, moved_away, 424242, first],
            S.QUEUED,
            S.ROUTED,
            reasons=["third's route", "late", "no such job", "first's route"],
            now=clock(),
            actor="scheduler",
        )
    assert moved == [third, first]
    with sessions() as session:
        rows = {j.id: j for j in session.execute(select(Job)).scalars()}
    assert (rows[first].state, rows[first].state_reason, rows[first].updated_at) == ("routed", "first's route", clock())
    assert (rows[third].state, rows[third].state_reason) == ("routed", "third's route")
    assert (rows[moved_away].state, rows[moved_away].state_reason) == ("held", "no route")
    assert [(e.from_state, e.to_state, e.reason, e.actor, e.at) for e in _events(sessions, first)] == [
        ("queued", "routed", "first's route", "scheduler", clock())
    ]
    assert [e.to_state for e in _events(sessions, moved_away)] == ["held"]


def test_set_states_writes_other_columns_with_the_state_and_clears_them_to_null(sessions, clock):
    a, b = _queued_jobs(sessions, clock, 2)
    placement = {"cluster": "slurm-a", "sharing": "slurm/mig", "units": 1, "mig_profile": "1g.5gb"}
    with sessions() as session, session.begin():
        moved = set_states(
            session,
            [a, b],
            S.QUEUED,
            S.ROUTED,
            reasons="placed",
            now=clock(),
            values={"cluster": ["slurm-a", "k8s-a"], "placement": [placement, None], "gpu_equivalents": [1 / 7, None]},
        )
    assert moved == [a, b]
    with sessions() as session:
        job_a, job_b = session.get(Job, a), session.get(Job, b)
        assert (job_a.cluster, job_a.placement, job_a.gpu_equivalents) == ("slurm-a", placement, pytest.approx(1 / 7))
        assert (job_b.cluster, job_b.placement, job_b.gpu_equivalents) == ("k8s-a", None, None)
        # None is SQL NULL, not the JSON document null: queries on IS NULL find it.
        assert session.scalars(select(Job.id).where(Job.placement.is_(None))).all() == [b]
        assert session.scalars(select(Job.state_reason).where(Job.id == b)).one() == "placed"


def test_set_states_through_a_state_writes_each_edge_as_an_event_in_order(sessions, clock):
    a, b, cancelled = _queued_jobs(sessions, clock, 3)
    with sessions() as session, session.begin():
        set_state(session, cancelled, S.QUEUED, S.CANCELLED, reason="cancelled by alice", now=clock())
    with sessions() as session, session.begin():
        moved = set_states(
            session,
            [a, b, cancelled],
            S.QUEUED,
            S.SUBMITTING,
            via=[(S.ROUTED, ["placed a", "placed b", "placed c"])],
            reasons="submitting to slurm-a",
            now=clock(),
            actor="scheduler",
            values={"cluster": ["slurm-a"] * 3},
        )
        with pytest.raises(IllegalTransition):  # every edge of the path is checked
            set_states(session, [a], S.QUEUED, S.SUBMITTED, via=[(S.ROUTED, None)], reasons=None, now=clock())
    assert moved == [a, b]
    assert [(e.from_state, e.to_state, e.reason) for e in _events(sessions, a)] == [
        ("queued", "routed", "placed a"),
        ("routed", "submitting", "submitting to slurm-a"),
    ]
    assert [e.to_state for e in _events(sessions, cancelled)] == ["cancelled"]
    with sessions() as session:
        job = session.get(Job, b)
        assert (job.state, job.state_reason, job.cluster) == ("submitting", "submitting to slurm-a", "slurm-a")


def test_set_states_keeps_any_text_byte_for_byte(sessions, clock):
    tricky = ['say "hi", {then} \\ NULL', "NULL", "", "ünïcødé 🚀\ttab", None]
    ids = _queued_jobs(sessions, clock, len(tricky))
    placement = {"node": 'n"1\\', "note": tricky[0], "gpu_memory_gb": 1.5}
    with sessions() as session, session.begin():
        set_states(
            session,
            ids,
            S.QUEUED,
            S.HELD,
            reasons=tricky,
            now=clock(),
            values={"placement": [placement] * len(ids), "backend_id": tricky},
        )
    with sessions() as session:
        rows = {j.id: j for j in session.execute(select(Job)).scalars()}
    assert [rows[i].state_reason for i in ids] == tricky
    assert [rows[i].backend_id for i in ids] == tricky
    assert all(rows[i].placement == placement for i in ids)
    assert [e.reason for i in ids for e in _events(sessions, i)] == tricky


def test_set_states_in_batches_moves_them_all(sessions, clock, monkeypatch):
    from broker.core import states

    monkeypatch.setattr(states, "BATCH", {"postgresql": 3, "sqlite": 3})
    ids = _queued_jobs(sessions, clock, 8)
    with sessions() as session, session.begin():
        moved = set_states(session, ids, S.QUEUED, S.HELD, reasons=[f"r{i}" for i in ids], now=clock())
    assert moved == ids
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 8
        assert {j.state_reason for j in session.execute(select(Job)).scalars()} == {f"r{i}" for i in ids}


def test_set_states_refuses_an_illegal_edge_and_bad_arguments_and_touches_nothing(sessions, clock):
    ids = _queued_jobs(sessions, clock, 2)
    with sessions() as session, session.begin():
        with pytest.raises(IllegalTransition):
            set_states(session, ids, S.QUEUED, S.SUCCEEDED, reasons=None, now=clock())
        with pytest.raises(ValueError, match="appears twice"):
            set_states(session, [ids[0], ids[0]], S.QUEUED, S.ROUTED, reasons=None, now=clock())
        with pytest.raises(ValueError, match="one reason and one value per job"):
            set_states(session, ids, S.QUEUED, S.ROUTED, reasons=["only one"], now=clock())
        with pytest.raises(ValueError, match="state"):
            set_states(session, ids, S.QUEUED, S.ROUTED, reasons=None, now=clock(), values={"state": ["x", "y"]})
        assert set_states(session, [], S.QUEUED, S.ROUTED, reasons=None, now=clock()) == []
    with sessions() as session:
        assert {j.state for j in session.execute(select(Job)).scalars()} == {"queued"}
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 0


def test_set_states_rolls_back_with_its_events(sessions, clock):
    ids = _queued_jobs(sessions, clock, 3)
    with sessions() as session:
        session.begin()
        assert set_states(session, ids, S.QUEUED, S.ROUTED, reasons="r", now=clock()) == ids
        session.rollback()
    with sessions() as session:
        assert {j.state for j in session.execute(select(Job)).scalars()} == {"queued"}
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 0


def test_set_reasons_rewrites_what_jobs_in_a_state_wait_for_without_events(sessions, clock):
    waiting, same, held = _queued_jobs(sessions, clock, 3)
    with sessions() as session, session.begin():
        set_state(session, held, S.QUEUED, S.HELD, reason="no route", now=clock())
        assert set_reasons(session, S.QUEUED, {same: "waiting for a 1g.5gb slice"}) == 1
    with sessions() as session, session.begin():
        changed = set_reasons(
            session,
            S.QUEUED,
            {waiting: "waiting for 2 whole GPUs", same: "waiting for a 1g.5gb slice", held: "not in this state"},
        )
    assert changed == 1  # `same` already said so; `held` is not queued
    with sessions() as session:
        reasons = {j.id: j.state_reason for j in session.execute(select(Job)).scalars()}
    assert reasons == {waiting: "waiting for 2 whole GPUs", same: "waiting for a 1g.5gb slice", held: "no route"}
    assert [e.to_state for e in _events(sessions, waiting)] == []
