"""How new jobs reach the database quickly, per dialect.

Submission is the hot path of the queue: one job per request from many clients,
or tens of thousands in one batch. ``broker.intake.queue`` decides *what* to write; this
module writes it with the fewest round trips and the least CPU each database allows:

- one job: one ``INSERT … ON CONFLICT (tenant, idempotency_key) DO NOTHING
  RETURNING id``, so a replayed key costs no savepoint and no lookup unless it
  really is a replay;
- many jobs: ids are drawn up front, then rows are streamed (PostgreSQL: ``COPY``;
  SQLite: ``executemany`` under the write lock that ``BEGIN IMMEDIATE`` holds).

A job's submission is its row (``created_at``, ``user``); ``job_events`` holds
what happened after, so a submission writes one row, not two.
Functions take the caller's session and never commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from sqlalchemy import bindparam, func, insert, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from broker.core.models import Job

JOBS = Job.__table__
JOB_COLUMNS = [c.name for c in JOBS.columns if c.name != "id"]

# Plain SQL rather than SQLAlchemy constructs: building and caching a construct cost
# more CPU (about 0.5 ms a job) than the database spent on the insert. The bound
# parameters keep the columns' own types (UTC datetimes, JSON), as ORM writes do.
_INSERT_ONE = text(
    f"""INSERT INTO jobs ({", ".join(f'"{c}"' for c in JOB_COLUMNS)})
    VALUES ({", ".join(f":{c}" for c in JOB_COLUMNS)})
    ON CONFLICT (tenant, idempotency_key) DO NOTHING
    RETURNING id"""
).bindparams(*(bindparam(c.name, type_=c.type) for c in JOBS.columns if c.name != "id"))


def insert_one(session: Session, row: dict[str, Any]) -> int | None:
    """Insert one queued job; None if its tenant already used its idempotency key."""
    return session.execute(_INSERT_ONE, row).scalar_one_or_none()


class KeyTaken(Exception):
    """An idempotency key of the rows is already in the table (a replay, or a race)."""


def insert_many(session: Session, rows: Sequence[dict[str, Any]]) -> list[int]:
    """Insert queued jobs; returns their ids in order.

    Raises :class:`KeyTaken` if one of their idempotency keys is taken; the caller
    runs this in a savepoint, rolls back to it and looks the keys up.
    """
    if not rows:
        return []
    try:
        if session.bind.dialect.name == "postgresql":
            return _copy_postgresql(session, rows)
        return _executemany(session, rows)
    except (IntegrityError, psycopg.errors.UniqueViolation) as exc:
        # COPY runs on the driver's connection, so its error is psycopg's own.
        raise KeyTaken(str(exc)) from exc


def _copy_postgresql(session: Session, rows: Sequence[dict[str, Any]]) -> list[int]:
    ids = sorted(
        session.execute(
            text("SELECT nextval(pg_get_serial_sequence('jobs', 'id')) FROM generate_series(1, :n)"),
            {"n": len(rows)},
        ).scalars()
    )
    driver = session.connection().connection.driver_connection
    columns = ", ".join(f'"{c}"' for c in ["id", *JOB_COLUMNS])
    with driver.cursor() as cursor, cursor.copy(f"COPY jobs ({columns}) FROM STDIN") as copy:
        for job_id, row in zip(ids, rows, strict=True):
            copy.write_row([job_id, *(orjson.dumps(row[c]).decode() if c == "spec" else row[c] for c in JOB_COLUMNS)])
    return ids


def _executemany(session: Session, rows: Sequence[dict[str, Any]]) -> list[int]:
    # BEGIN IMMEDIATE (broker.core.db) holds SQLite's write lock for the whole
    # transaction, so no other writer can take these ids before we commit.
    start = session.execute(select(func.coalesce(func.max(JOBS.c.id), 0))).scalar_one() + 1
    ids = list(range(start, start + len(rows)))
    session.execute(insert(JOBS), [{"id": job_id, **row} for job_id, row in zip(ids, rows, strict=True)])
    return ids
