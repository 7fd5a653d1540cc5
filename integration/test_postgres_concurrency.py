"""Races on the real PostgreSQL: the compare-and-set and the idempotency key hold under contention."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select

from broker.core.auth import Principal
from broker.core.errors import StateConflict
from broker.core.models import Job, JobEvent
from broker.core.schemas import JobSpec, Role
from broker.core.states import JobState, set_state
from broker.intake import queue

ALICE = Principal(user="alice", tenant="ml", role=Role.USER)
SPEC = JobSpec(kind="training", gpus=1, command=["python", "train.py"])


def _submit(sessions, clock, spec=SPEC) -> int:
    with sessions() as session, session.begin():
        (result,) = queue.submit_jobs(session, [spec], ALICE, now=clock())
    return result.job["id"]


def test_two_connections_race_to_move_a_job_and_exactly_one_wins(sessions, clock):
    for _round in range(20):
        job_id = _submit(sessions, clock)
        barrier = threading.Barrier(2)

        def move(target: JobState) -> str:
            with sessions() as session:
                session.begin()
                session.execute(select(1))  # both transactions are open before either writes
                barrier.wait()
                try:
                    set_state(session, job_id, JobState.QUEUED, target, reason="race", now=clock())
                    session.commit()
                    return "won"
                except StateConflict:
                    session.rollback()
                    return "lost"

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(move, [JobState.ROUTED, JobState.HELD]))
        assert sorted(outcomes) == ["lost", "won"]
        with sessions() as session:
            state = session.get(Job, job_id).state
            events = (
                session.execute(select(JobEvent.to_state).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
                .scalars()
                .all()
            )
        assert events == [state]  # one stored change: the winner's


def test_concurrent_submissions_with_one_key_create_one_job(sessions, clock):
    spec = SPEC.model_copy(update={"idempotency_key": "retry-storm"})
    barrier = threading.Barrier(8)

    def submit(_i: int) -> tuple[int, bool]:
        barrier.wait()
        with sessions() as session, session.begin():
            (result,) = queue.submit_jobs(session, [spec], ALICE, now=clock())
        return result.job["id"], result.created

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(submit, range(8)))
    assert len({job_id for job_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 1


def test_cancel_racing_the_scheduler_is_never_lost(sessions, clock):
    for _round in range(10):
        job_id = _submit(sessions, clock)
        barrier = threading.Barrier(2)

        def schedule() -> None:
            with sessions() as session, session.begin():
                barrier.wait()
                try:
                    set_state(session, job_id, JobState.QUEUED, JobState.ROUTED, reason="fits", now=clock())
                    set_state(session, job_id, JobState.ROUTED, JobState.SUBMITTING, reason="submit", now=clock())
                except StateConflict:
                    pass  # the cancel came first

        def cancel() -> str:
            barrier.wait()
            with sessions() as session, session.begin():
                _job, outcome = queue.cancel_job(session, job_id, ALICE, now=clock())
            return outcome

        with ThreadPoolExecutor(2) as pool:
            scheduled = pool.submit(schedule)
            outcome = pool.submit(cancel).result()
            scheduled.result()
        with sessions() as session:
            job = session.get(Job, job_id)
        if outcome == "cancelled":
            assert job.state == "cancelled"
        else:
            assert outcome == "cancel_requested"
            assert job.state == "submitting" and job.cancel_requested_at is not None


def test_concurrent_batches_sharing_keys_create_one_job_per_key(sessions, clock):
    shared = [SPEC.model_copy(update={"idempotency_key": f"shard-{i}"}) for i in range(50)]
    barrier = threading.Barrier(4)

    def submit(worker: int) -> list[int]:
        own = [SPEC.model_copy(update={"idempotency_key": f"own-{worker}-{i}"}) for i in range(10)]
        barrier.wait()
        with sessions() as session, session.begin():
            results = queue.submit_jobs(session, shared + own, ALICE, now=clock())
        return [r.job["id"] for r in results]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(submit, range(4)))
    assert len({tuple(a[:50]) for a in answers}) == 1  # every batch got the same 50 shared jobs
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 50 + 4 * 10
