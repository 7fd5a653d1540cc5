"""Leader election: one broker process schedules at a time.

On PostgreSQL the leader holds a session-level advisory lock on a connection of its
own; if the process dies, PostgreSQL drops the connection and the lock with it, and
another broker takes over at its next try (every ``interval`` seconds). On SQLite,
an exclusive lock on a file beside the database plays the same part for the
processes of one machine. API replicas never need to be leaders.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

log = logging.getLogger("gpush.leader")

# Any constant both sides agree on; "gpush" in ASCII.
ADVISORY_KEY = 0x6770757368


class Leadership:
    """Try to become the scheduler; keep checking that we still are."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._conn: Connection | None = None
        self._file: int | None = None

    @property
    def held(self) -> bool:
        return self._conn is not None or self._file is not None

    def try_acquire(self) -> bool:
        if self.held:
            return self.still_held()
        if self.engine.dialect.name == "postgresql":
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            if conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": ADVISORY_KEY}).scalar():
                self._conn = conn
                return True
            conn.close()
            return False
        return self._try_file_lock()

    def still_held(self) -> bool:
        """False if the lock was lost (the leader's connection broke)."""
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return True
            except DBAPIError:
                log.warning("lost the database connection that held scheduler leadership")
                self._drop_conn()
                return False
        return self._file is not None

    def release(self) -> None:
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": ADVISORY_KEY})
            except DBAPIError:
                pass
            self._drop_conn()
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            os.close(self._file)
            self._file = None

    def _drop_conn(self) -> None:
        try:
            self._conn.close()
        except DBAPIError:
            pass
        self._conn = None

    def _try_file_lock(self) -> bool:
        database = self.engine.url.database
        if not database or database == ":memory:":
            self._file = os.open(os.devnull, os.O_RDONLY)  # one process owns an in-memory database
            return True
        path = Path(database).with_suffix(".scheduler.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._file = fd
        return True


def run_scheduler_loop(
    engine: Engine,
    make_scheduler: Callable[[], object],
    stop: threading.Event,
    *,
    interval: float = 1.0,
) -> None:
    """Elect, then run cycles every ``interval`` seconds while leader, until ``stop`` is set."""
    leadership = Leadership(engine)
    scheduler = None
    try:
        while not stop.is_set():
            if leadership.try_acquire():
                if scheduler is None:
                    log.info("this process is now the scheduler")
                    scheduler = make_scheduler()
                try:
                    report = scheduler.run_cycle()
                    for error in report.errors:
                        log.warning("cycle: %s", error)
                except Exception:  # a bad cycle must not kill the broker; the next one retries
                    log.exception("scheduling cycle failed")
            else:
                scheduler = None
            stop.wait(interval)
    finally:
        leadership.release()
