"""A database whose disk is full (issue 32, finding 6): a write it refuses is 507
``storage_full``, saying so and what to do, never the 503 "does not answer" that clients
retry for ever; /readyz answers 503 for a while after, so a load balancer sends writes
elsewhere; reads still work.

SQLite makes the database full for real here: ``PRAGMA max_page_count`` at its present
size, so the next page a write needs is refused with SQLITE_FULL, as a full disk refuses
it (integration/test_disk_full.py fills a real filesystem, on SQLite and PostgreSQL).
"""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import Engine, event

from broker.api.health import NOT_READY_AFTER_DISK_FULL
from broker.core.db import storage_full
from broker.core.errors import StorageFull

TRAIN = {"kind": "training", "gpus": 1, "command": ["echo", "x" * 2000]}


@pytest.fixture
def fill(engine):
    """``fill()``: from then on, hold the database at the pages it has, on every SQLite
    connection of this process (the CLI's embedded broker opens its own engine)."""
    listeners = []

    def hold() -> None:
        with engine.connect() as conn:
            pages = conn.exec_driver_sql("PRAGMA page_count").scalar()

        def at_most(dbapi_conn, _record):
            dbapi_conn.execute(f"PRAGMA max_page_count={pages}")

        event.listen(Engine, "connect", at_most)
        listeners.append(at_most)
        engine.dispose()

    yield hold
    for listener in listeners:
        event.remove(Engine, "connect", listener)


def submit_until_refused(client, tries: int = 500):
    """Submit jobs until one is refused; the answers before it must all be 201."""
    for n in range(tries):
        answer = client.post("/v1/jobs", json={**TRAIN, "idempotency_key": f"k{n}"})
        if answer.status_code != 201:
            return answer
    raise AssertionError(f"{tries} jobs went into a database held at its size")


def test_a_write_into_a_full_database_is_507_saying_the_disk_is_full_and_reads_still_work(engine, http, fill):
    client = http()
    assert client.post("/v1/jobs", json=TRAIN).status_code == 201
    fill()
    refused = submit_until_refused(client)

    assert refused.status_code == 507, refused.text
    assert "Retry-After" not in refused.headers  # a moment later it fails again
    error = refused.json()["error"]
    assert error["code"] == "storage_full"
    assert "disk is full" in error["message"] and "database or disk is full" in error["message"]
    assert str(engine.url.database) in error["message"] and "Free space" in error["message"]
    listed = client.get("/v1/jobs")
    assert listed.status_code == 200 and listed.json()["jobs"]


def test_readyz_says_not_ready_after_a_write_was_refused_for_a_full_disk_then_ready_again(http, clock, fill):
    client = http()
    assert client.get("/readyz").status_code == 200
    fill()
    submit_until_refused(client)

    answer = client.get("/readyz")
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "storage_full" and "disk is full" in error["message"]
    clock.advance(NOT_READY_AFTER_DISK_FULL - 1)
    assert client.get("/readyz").status_code == 503
    clock.advance(1)
    assert client.get("/readyz").status_code == 200


def test_the_client_does_not_retry_a_full_disk_and_raises_it_as_such(sdk, fill):
    client = sdk()
    fill()
    with pytest.raises(StorageFull, match="disk is full"):
        for n in range(500):
            client.submit({**TRAIN, "idempotency_key": f"k{n}"})


def test_the_cli_says_the_disk_is_full_and_exits_1(engine, gpush, monkeypatch, fill):
    monkeypatch.setenv("GPUSH_DATABASE_URL", str(engine.url))
    assert gpush("list").code == 0  # the local admin token is written while there is room
    fill()
    for _ in range(500):
        done = gpush("submit", "--kind", "training", "--gpus", "1", "--", "echo", "x" * 2000)
        if done.code != 0:
            break
    assert done.code == 1, done
    assert "disk is full" in done.err and "Traceback" not in done.err


# -- PostgreSQL's disk_full, as psycopg raises it ----------------------------------------
# (integration/test_disk_full.py makes a real PostgreSQL raise it from a full tablespace)


def wrapped(error: Exception) -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("INSERT INTO jobs ...", {}, error)


def test_postgresql_disk_full_is_storage_full_and_other_operational_errors_are_not(engine):
    full = storage_full(wrapped(psycopg.errors.DiskFull('could not extend file "base/1/2"')), engine)
    assert isinstance(full, StorageFull) and "53100" in full.message and "PostgreSQL" in full.message
    for other in (
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.errors.TooManyConnections("sorry, too many clients already"),
        psycopg.OperationalError("connection refused"),
    ):
        assert storage_full(wrapped(other), engine) is None


def test_a_postgresql_disk_full_is_507_and_a_dropped_connection_still_503(http, monkeypatch):
    from broker.intake import queue

    def raising(error):
        def submit_jobs(*_args, **_kwargs):
            raise wrapped(error)

        return submit_jobs

    client = http()
    monkeypatch.setattr(queue, "submit_jobs", raising(psycopg.errors.DiskFull("could not extend file")))
    full = client.post("/v1/jobs", json=TRAIN)
    assert full.status_code == 507 and full.json()["error"]["code"] == "storage_full"
    monkeypatch.setattr(queue, "submit_jobs", raising(psycopg.errors.AdminShutdown("terminating connection")))
    dropped = client.post("/v1/jobs", json=TRAIN)
    assert dropped.status_code == 503 and dropped.headers["Retry-After"] == "1"
