"""Leader election: one broker process schedules at a time.

On PostgreSQL the leader holds a session-level advisory lock on a connection of its
own; if the process dies, PostgreSQL drops the connection and the lock with it, and
another broker takes over at its next try (every ``interval`` seconds). On SQLite,
an exclusive lock on a file beside the database plays the same part for the
processes of one machine. API replicas never need to be leaders.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
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


class Wakeup:
    """Wakes the scheduling loop before its interval ends: the API sets it when a job is
    submitted or cancelled (broker.api.jobs), so a job starts at once on an idle cluster
    rather than at the next tick. In one process; on PostgreSQL, API processes also
    ``NOTIFY gpush_wake`` and the loop listens (:func:`run_scheduler_loop`)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool:
        woken = self._event.wait(timeout)
        if woken:  # a wake-up that comes after a wait timed out is kept for the next one
            self._event.clear()
        return woken


WAKE_CHANNEL = "gpush_wake"

# After a cycle that placed jobs, cycles come FOLLOW_UP_PAUSE apart for FOLLOW_UP_S seconds:
# they read the start of those jobs, which the cluster decides in a pass of its own (the
# Slurm test cluster starts pending jobs once a second, 0 to 1 s after their submission), so
# a start is read within FOLLOW_UP_PAUSE (and a cycle) of it rather than up to an interval
# later. A single follow-up cycle mostly came before that pass: submit to running on the
# idle test cluster, p50 1.18 s through gpush against 0.43 s for sbatch; with the window,
# 0.68 s against 0.51 s (integration/bench/slurm.py, 20 jobs each).
FOLLOW_UP_PAUSE = 0.2
FOLLOW_UP_S = 2.0


def notify(connection: Connection) -> None:
    """Wake the leader in whichever process it runs (PostgreSQL; delivered at commit)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text(f"NOTIFY {WAKE_CHANNEL}"))


class _Listener:
    """A PostgreSQL connection that LISTENs on the wake channel; ``wait`` returns early
    when a notification arrives. Any failure turns it into a plain sleep."""

    def __init__(self, engine: Engine):
        self._conn = None
        if engine.dialect.name != "postgresql":
            return
        try:
            import psycopg

            url = engine.url.set(drivername="postgresql")
            self._conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
            self._conn.execute(f"LISTEN {WAKE_CHANNEL}")
        except Exception as exc:  # no listener: the loop still runs every interval
            log.warning("cannot listen for wake-ups (%s): the scheduler runs every interval", exc)
            self._conn = None

    @property
    def listening(self) -> bool:
        return self._conn is not None

    def wait(self, timeout: float) -> bool:
        if self._conn is None:
            return False
        try:
            woken = False
            for _ in self._conn.notifies(timeout=timeout, stop_after=1):
                woken = True
            return woken
        except Exception as exc:
            log.warning("lost the wake-up listener (%s): the scheduler runs every interval", exc)
            self.close()
            return False

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


def run_scheduler_loop(
    engine: Engine,
    make_scheduler: Callable[[], object],
    stop: threading.Event,
    *,
    interval: float = 1.0,
    wakeup: Wakeup | None = None,
) -> None:
    """Elect, then run cycles while leader, until ``stop`` is set: every ``interval``
    seconds, or sooner when ``wakeup`` is set or (PostgreSQL) another process NOTIFYs.
    A cycle that placed jobs is followed by quicker ones for a while, which read their
    start (``FOLLOW_UP_PAUSE`` apart for ``FOLLOW_UP_S``)."""
    leadership = Leadership(engine)
    listener: _Listener | None = None
    scheduler = None
    follow_up_until = 0.0
    try:
        while not stop.is_set():
            if _try_lead(leadership):
                if scheduler is None:
                    log.info("this process is now the scheduler")
                    scheduler = make_scheduler()
                    listener = _Listener(engine)
                try:
                    report = scheduler.run_cycle()
                    for error in report.errors:
                        log.warning("cycle: %s", error)
                    if report.placed or report.submitted:
                        follow_up_until = time.monotonic() + FOLLOW_UP_S
                    if report.placed or report.held or report.synced or report.failed or report.recovered:
                        log.info(
                            "cycle: placed %d, submitted %d, held %d, waiting %d, status changes %d, failed %d",
                            report.placed,
                            report.submitted,
                            report.held,
                            report.waiting,
                            report.synced,
                            report.failed,
                        )
                except Exception:  # a bad cycle must not kill the broker; the next one retries
                    log.exception("scheduling cycle failed")
            else:
                scheduler = None
                follow_up_until = 0.0
                if listener is not None:
                    listener.close()
                    listener = None
            quick = time.monotonic() < follow_up_until
            _pause(stop, wakeup, listener, min(interval, FOLLOW_UP_PAUSE) if quick else interval)
    finally:
        if listener is not None:
            listener.close()
        leadership.release()


def _try_lead(leadership: Leadership) -> bool:
    """Whether this process leads now; False, not an exception, while the database does not
    answer (a restart): the loop must outlive it and take leadership again after."""
    try:
        return leadership.try_acquire()
    except (DBAPIError, OSError) as exc:
        log.warning("cannot reach the database to take scheduler leadership (%s); trying again", exc)
        return False


def _pause(stop: threading.Event, wakeup: Wakeup | None, listener: _Listener | None, seconds: float) -> None:
    """Sleep ``seconds``, waking early for ``stop``, ``wakeup`` or a NOTIFY."""
    deadline = time.monotonic() + seconds
    listening = listener is not None and listener.listening
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        chunk = min(left, 0.05 if listening and wakeup is not None else 0.5)
        if listening:
            if listener.wait(chunk) or (wakeup is not None and wakeup.wait(0)):
                return
        elif wakeup is not None:
            if wakeup.wait(chunk):
                return
        else:
            stop.wait(chunk)
