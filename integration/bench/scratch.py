"""A scratch PostgreSQL database for one benchmark run: created fresh, dropped after.

The benchmarks run as scripts (``python integration/bench/NAME.py``), so they import
this module by its bare name, from their own directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.engine import make_url


@contextmanager
def scratch_database(pg_url: str, name: str, *, migrate: bool = False) -> Iterator[tuple[str, str]]:
    """Database ``name`` on the server of ``pg_url``, dropped first if a crashed run left
    it, migrated to head when ``migrate``; yields (SQLAlchemy URL, psycopg conninfo)."""
    admin = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    scratch = make_url(pg_url).set(drivername="postgresql+psycopg", database=name)

    def drop(conn: psycopg.Connection) -> None:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    with psycopg.connect(admin, autocommit=True) as conn:
        drop(conn)
        conn.execute(f"CREATE DATABASE {name}")
    url = scratch.render_as_string(hide_password=False)
    try:
        if migrate:
            from broker.core.db import make_engine, upgrade

            engine = make_engine(url, pool_size=1)
            upgrade(engine)
            engine.dispose()
        yield url, scratch.set(drivername="postgresql").render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            drop(conn)
