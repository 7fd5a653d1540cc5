"""Job states and the functions that change them.

This module owns the transition table. Every state change anywhere in gpush goes
through :func:`set_state` (one job) or :func:`set_states` (many jobs, the scheduler's
bulk form); both are a compare-and-set on the jobs' rows and append the events in the
same transaction (the caller's session; the caller commits). :func:`set_reasons`
rewrites what a job in a state waits for, which is not a change of state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import JSON, Float, Integer, Text, bindparam, insert, select, text, update
from sqlalchemy.orm import Session

from broker.core.errors import IllegalTransition, NotFound, StateConflict
from broker.core.models import Job, JobEvent
from broker.core.names import JobState

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
    (S.RUNNING, S.SUBMITTED): "the cluster requeued the job itself (its node failed): it waits there to run again",
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


# -- many jobs at once ------------------------------------------------------------------

JOBS = Job.__table__
EVENTS = JobEvent.__table__
# Jobs per statement: PostgreSQL takes a batch as one JSON document, whatever its size;
# SQLite binds each row's values one by one.
BATCH = {"postgresql": 5000, "sqlite": 500}
# Columns set_states writes itself; ``values`` may set any other column of the job.
_STATE_COLUMNS = frozenset({"id", "state", "state_reason", "updated_at"})
_NOW = bindparam("now", type_=JOBS.c.updated_at.type)

Reasons = Sequence[str | None] | str | None


def set_states(
    session: Session,
    job_ids: Sequence[int],
    from_state: str,
    to_state: str,
    *,
    reasons: Reasons,
    now: datetime,
    actor: str | None = None,
    values: Mapping[str, Sequence[Any]] | None = None,
    via: Sequence[tuple[str, Reasons]] = (),
) -> list[int]:
    """Move the jobs of ``job_ids`` still in ``from_state`` to ``to_state``, with their events.

    The bulk form of :func:`set_state`: one compare-and-set statement per batch of
    jobs instead of one per job. A job that another process moved first, or that does
    not exist, is left as it is and has no event; the ids that moved are returned, in
    the order given. ``reasons`` is one reason per job, or one for all.

    ``values`` sets other columns of the same rows in the same statement, column ->
    one value per job (a placement, a backend id; None clears). ``via`` lists states
    the jobs pass through on the way, each with its reasons: every edge is checked
    and has its event, in order, but the row is written once (``queued → routed →
    submitting`` in one transaction, where nobody could see ``routed`` anyway, costs
    one write of the row, not two). Raises :class:`IllegalTransition` for an edge the
    table does not have. The caller commits.
    """
    path = [str(from_state), *(str(state) for state, _ in via), str(to_state)]
    for frm, to in zip(path, path[1:]):
        check_transition(frm, to)
    ids = list(job_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("set_states: a job id appears twice")
    edge_reasons = [_per_job(r, len(ids)) for _, r in via] + [_per_job(reasons, len(ids))]
    columns = dict(values or {})
    bad = [c for c in columns if c in _STATE_COLUMNS or c not in JOBS.c]
    if bad or any(r is None for r in edge_reasons) or any(len(v) != len(ids) for v in columns.values()):
        raise ValueError(
            "set_states: give one reason and one value per job (or one reason for all), for columns of jobs "
            f"other than {', '.join(sorted(_STATE_COLUMNS))}; got {', '.join(bad) or 'lists of another length'}"
        )
    if not ids:
        return []
    session.flush()  # pending ORM writes first: these statements bypass the unit of work
    dialect = session.get_bind().dialect.name
    move = _move_postgresql if dialect == "postgresql" else _move_one_by_one
    size = BATCH.get(dialect, BATCH["sqlite"])
    moved: set[int] = set()
    for start in range(0, len(ids), size):
        end = start + size
        moved.update(
            move(
                session,
                path,
                ids[start:end],
                [r[start:end] for r in edge_reasons],
                {c: v[start:end] for c, v in columns.items()},
                now,
                actor,
            )
        )
    return [i for i in ids if i in moved]


def _per_job(reasons: Reasons, n: int) -> list[str | None] | None:
    if reasons is None or isinstance(reasons, str):
        return [reasons] * n
    reasons = list(reasons)
    return reasons if len(reasons) == n else None


def set_reasons(session: Session, state: str, reasons: Mapping[int, str | None]) -> int:
    """Set what jobs still in ``state`` wait for (``reasons``: job id -> reason), without
    an event: the state did not change. Rows whose reason is already that are not
    written. Returns how many rows changed. The caller commits."""
    if not reasons:
        return 0
    session.flush()
    items = list(reasons.items())
    if session.get_bind().dialect.name == "postgresql":
        size = BATCH["postgresql"]
        return sum(
            session.execute(
                _SET_REASONS_POSTGRESQL,
                {
                    "ids": _pg_ints([i for i, _ in items[start : start + size]]),
                    "reasons": _pg_texts([r for _, r in items[start : start + size]]),
                    "state": str(state),
                },
            ).rowcount
            for start in range(0, len(items), size)
        )
    return session.execute(
        _SET_REASON_ONE, [{"b_id": i, "b_reason": r, "b_state": str(state)} for i, r in items]
    ).rowcount


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


# PostgreSQL: a batch arrives as one array literal per field, unnested side by side
# and joined to the jobs by id, and the updated rows feed the event insert of the same
# statement: a batch is one round trip, and only rows that moved get events. Array
# literals are text the server parses in C; psycopg's list adaptation and JSON
# recordsets both cost several times more per row. ``jobs.id = ANY(ids)`` lets the
# planner find the rows by primary key: without it, knowing the batch's size, it
# prefers reading every queued job into a hash table.
def _move_postgresql(session, path, ids, edge_reasons, columns, now, actor) -> set[int]:
    names = list(columns)
    last = len(edge_reasons) - 1
    arrays = ["CAST(:ids AS bigint[])"] + [f"CAST(:r{n} AS text[])" for n in range(last + 1)]
    arrays += [f"CAST(:c{n} AS {_pg_array_type(c)})" for n, c in enumerate(names)]
    fields = ["id"] + [f"r{n}" for n in range(last + 1)] + [f"c{n}" for n in range(len(names))]
    sets = "".join(f', "{c}" = {_pg_value(c, f"v.c{n}")}' for n, c in enumerate(names))
    steps = ", ".join(f"({n}, CAST(:s{n} AS text), CAST(:s{n + 1} AS text), moved.r{n})" for n in range(last + 1))
    statement = text(
        f"""WITH v AS (SELECT * FROM unnest({", ".join(arrays)}) AS v({", ".join(fields)})),
        moved AS (
            UPDATE jobs SET state = :s{last + 1}, state_reason = v.r{last}, updated_at = :now{sets}
            FROM v WHERE jobs.id = v.id AND jobs.id = ANY(CAST(:ids AS bigint[])) AND jobs.state = :s0
            RETURNING jobs.id, {", ".join(f"v.r{n}" for n in range(last + 1))}
        )
        INSERT INTO job_events (job_id, at, type, from_state, to_state, reason, actor)
        SELECT moved.id, :now, 'transition', e.from_state, e.to_state, e.reason, :actor
        FROM moved CROSS JOIN LATERAL (VALUES {steps}) AS e(step, from_state, to_state, reason)
        ORDER BY e.step, moved.id
        RETURNING job_id"""
    ).bindparams(_NOW)
    params = {
        "ids": _pg_ints(ids),
        "now": now,
        "actor": actor,
        **{f"s{n}": state for n, state in enumerate(path)},
        **{f"r{n}": _pg_texts(reasons) for n, reasons in enumerate(edge_reasons)},
        **{f"c{n}": _pg_column(c, columns[c]) for n, c in enumerate(names)},
    }
    return set(session.execute(statement, params).scalars().all())


def _pg_ints(values: Sequence[int]) -> str:
    """A PostgreSQL array literal of integers."""
    return "{" + ",".join(map(str, values)) + "}"


def _pg_texts(values: Sequence[str | None]) -> str:
    """A PostgreSQL array literal of text: each element quoted, its backslashes and
    quotes escaped, None as NULL."""
    return (
        "{"
        + ",".join("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


def _pg_column(column: str, values: Sequence[Any]) -> str:
    """The array literal of one column's values (JSON as its text, cast per element)."""
    kind = JOBS.c[column].type
    if isinstance(kind, JSON):
        return _pg_texts([None if v is None else _json(v) for v in values])
    if isinstance(kind, Float | Integer):
        return "{" + ",".join("NULL" if v is None else _pg_number(v) for v in values) + "}"
    return _pg_texts([None if v is None else v.isoformat() if isinstance(v, datetime) else str(v) for v in values])


def _pg_number(value: float) -> str:
    return repr(value) if math.isfinite(value) else f'"{value}"'


def _pg_array_type(column: str) -> str:
    kind = JOBS.c[column].type
    if isinstance(kind, JSON):
        return "text[]"  # cast to jsonb per element (_pg_value)
    if isinstance(kind, Float):
        return "float8[]"
    if isinstance(kind, Integer):
        return "bigint[]"
    if column in ("created_at", "updated_at", "cancel_requested_at"):
        return "timestamptz[]"
    return "text[]"


def _pg_value(column: str, ref: str) -> str:
    return f"CAST({ref} AS jsonb)" if isinstance(JOBS.c[column].type, JSON) else ref


_SET_REASONS_POSTGRESQL = text(
    """UPDATE jobs SET state_reason = v.reason
    FROM unnest(CAST(:ids AS bigint[]), CAST(:reasons AS text[])) AS v(id, reason)
    WHERE jobs.id = v.id AND jobs.id = ANY(CAST(:ids AS bigint[])) AND jobs.state = :state
    AND jobs.state_reason IS DISTINCT FROM v.reason"""
)
_SET_REASON_ONE = (
    update(JOBS)
    .where(
        JOBS.c.id == bindparam("b_id"),
        JOBS.c.state == bindparam("b_state"),
        JOBS.c.state_reason.is_distinct_from(bindparam("b_reason")),
    )
    .values(state_reason=bindparam("b_reason"))
)


def _move_one_by_one(session, path, ids, edge_reasons, columns, now, actor) -> set[int]:
    # SQLite: the transaction holds the database's one write lock from its first
    # statement (BEGIN IMMEDIATE, broker.core.db), so the rows read in from_state here
    # are still in it when the update runs; the update checks the state all the same.
    # Statements are in-process calls, so one per row costs no round trips.
    in_state = set(session.execute(select(JOBS.c.id).where(JOBS.c.id.in_(ids), JOBS.c.state == path[0])).scalars())
    moving = [i for i, job_id in enumerate(ids) if job_id in in_state]
    if not moving:
        return set()
    statement = (
        update(JOBS)
        .where(JOBS.c.id == bindparam("b_id"), JOBS.c.state == path[0])
        .values(
            state=path[-1],
            state_reason=bindparam("b_reason"),
            updated_at=now,
            **{c: _bind(c) for c in columns},
        )
    )
    session.execute(
        statement,
        [
            {
                "b_id": ids[i],
                "b_reason": edge_reasons[-1][i],
                **{f"b_{c}": _json_as_text(c, columns[c][i]) for c in columns},
            }
            for i in moving
        ],
    )
    session.execute(
        insert(EVENTS),
        [
            {
                "job_id": ids[i],
                "at": now,
                "type": "transition",
                "from_state": path[step],
                "to_state": path[step + 1],
                "reason": reasons[i],
                "actor": actor,
            }
            for step, reasons in enumerate(edge_reasons)
            for i in moving
        ],
    )
    return {ids[i] for i in moving}


def _bind(column: str):
    kind = JOBS.c[column].type
    return bindparam(f"b_{column}", type_=Text() if isinstance(kind, JSON) else kind)


def _json_as_text(column: str, value: Any) -> Any:
    # JSON goes as its text, and None as SQL NULL: bound through the JSON type, None
    # would be stored as the JSON document 'null', which IS NOT NULL.
    if value is not None and isinstance(JOBS.c[column].type, JSON):
        return _json(value)
    return value
