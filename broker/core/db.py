"""Database engines, sessions and schema migrations.

SQLite (the embedded default) runs in WAL mode with a busy timeout so the API and
the CLI can share one file; PostgreSQL is the production database that several
broker processes share. The schema is owned by Alembic (``migrations/``).

A SQLite database holds what PostgreSQL keeps behind its own login: jobs' environment
values, token hashes. Its file (and so its ``-wal`` and ``-shm``, which SQLite creates
with the database file's mode) is the user's alone (0600), and a directory created for
it is 0700, whatever the umask (:func:`_private_sqlite_file`).
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import orjson
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

import migrations
from broker.core.errors import StorageFull, Unavailable

SQLITE_BUSY_TIMEOUT_MS = 10_000


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            _private_sqlite_file(Path(parsed.database))
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            # SQLite has one writer. One connection per process makes the threads of
            # a process queue for it in order, instead of polling SQLite's busy
            # handler, whose back-off sleeps (up to 100 ms) made latency erratic.
            pool_size=1,
            max_overflow=0,
            pool_timeout=SQLITE_BUSY_TIMEOUT_MS / 1000,
            json_serializer=_json_text,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            # The driver's own transaction handling issues BEGIN lazily, after the
            # first read; BEGIN IMMEDIATE up front avoids SQLITE_BUSY on upgrade to a
            # writer, which the busy timeout cannot wait out.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):  # pragma: no cover - trivial
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # No pool_pre_ping: it costs a round trip per request. A connection the server
    # dropped fails one request, which SQLAlchemy turns into a pool reset and the
    # API into a 503 that clients retry.
    return create_engine(
        url, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800, json_serializer=_json_text
    )


def _private_sqlite_file(path: Path) -> None:
    """Create the database file 0600 (its directory 0700 when it is created here) before
    SQLite opens it, and take group and others' access from one an older gpush left
    0644. Not by umask: that is the whole process's, and other threads create files."""
    if not path.parent.exists():
        # Only the last directory: those above it (a home, /srv) are not gpush's to close.
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        # SQLite gives a new -wal or -shm the database's mode, but keeps one that exists.
        for existing in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            try:
                mode = stat.S_IMODE(existing.stat().st_mode)
                if mode & 0o077:
                    existing.chmod(mode & 0o700)
            except OSError:  # not there, or another user's: SQLite's own open says if it may be used
                continue


# PostgreSQL's SQLSTATE for a write that found no room on its disk (class 53,
# insufficient resources); SQLite says SQLITE_FULL, for a full disk as for a database at
# its max_page_count.
PG_DISK_FULL = "53100"


def storage_full(exc: BaseException, engine: Engine) -> StorageFull | None:
    """What to tell a user whose write failed with ``exc`` (SQLAlchemy's error, or the
    driver's), when it failed because the database's disk is full; None otherwise."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, sqlite3.Error):
        if getattr(orig, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
            return None
        where = f"the disk that holds {engine.url.database}"
        said = "SQLite: database or disk is full"
    elif getattr(orig, "sqlstate", None) == PG_DISK_FULL:
        where = "the PostgreSQL server's disk (its data directory, or the tablespace the table is in)"
        said = "PostgreSQL: SQLSTATE 53100 disk_full"
    else:
        return None
    return StorageFull(
        f"the broker's database cannot store anything more: its disk is full ({said}); nothing was written. "
        f"Free space on {where}, then send this again; reads still work"
    )


def _json_text(value: object) -> str:
    return orjson.dumps(value).decode()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(engine: Engine | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if engine is not None:
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except OperationalError as exc:
        raise Unavailable(f"cannot reach the database {engine.url!r}: {exc.orig}") from None


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def check_schema(engine: Engine) -> None:
    """Raise :class:`Unavailable` unless the database is reachable and at the head revision."""
    try:
        current = current_revision(engine)
    except ProgrammingError as exc:  # pragma: no cover - depends on permissions
        raise Unavailable(f"cannot read the schema version: {exc.orig}") from None
    head = head_revision()
    if current != head:
        raise Unavailable(
            f"the database schema is at {current or 'nothing'}, gpush needs {head}: run `gpush db upgrade`"
        )


def open_database(url: str, *, auto_upgrade: bool | None = None) -> Engine:
    """An engine on ``url`` whose schema is at head.

    SQLite (embedded, one user) is upgraded on open; a shared PostgreSQL is upgraded
    only by ``gpush db upgrade``, an admin's deliberate step, unless asked.
    """
    engine = make_engine(url)
    if auto_upgrade if auto_upgrade is not None else is_sqlite(engine):
        if current_revision(engine) != head_revision():
            upgrade(engine)
    else:
        check_schema(engine)
    return engine
