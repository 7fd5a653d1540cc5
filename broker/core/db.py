"""Database engines, sessions and schema migrations.

SQLite (the embedded default) runs in WAL mode with a busy timeout so the API and
the CLI can share one file; PostgreSQL is the production database that several
broker processes share. The schema is owned by Alembic (``migrations/``).
"""

from __future__ import annotations

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
from broker.core.errors import Unavailable

SQLITE_BUSY_TIMEOUT_MS = 10_000


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
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
