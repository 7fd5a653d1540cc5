"""Integration fixtures: the real PostgreSQL of this machine.

Each test gets a fresh database cloned from a template that was migrated once per
run (``CREATE DATABASE ... TEMPLATE``), so tests are isolated and fast. PostgreSQL
that does not answer is a failure, never a skip: `make test` starts it first.
"""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
from psycopg import sql

from broker.core.db import make_engine, upgrade
from integration.slurm.cluster import NOT_A_SLURM_TEST
from integration.slurm_fixtures import (  # noqa: F401  (Slurm test clusters, one of each per session)
    slurm_chroots,
    slurm_cluster,
    slurm_site,
)

ADMIN_DSN = os.environ.get("GPUSH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

# A test marked `alone` changes the machine under every other test (restarts PostgreSQL,
# fills a disk): `make test-integration` runs it in a pass of its own, after the rest.
#
# A test marked `slurm` starts or uses a Slurm test cluster, whose ports are fixed: the
# Slurm tests run in one process, the others beside each other (pytest-xdist). A test that
# uses a fixture of the Slurm test clusters, directly or through other fixtures, is marked
# here; one that starts a cluster of its own in another way (a bench) is marked by hand,
# and one that is not marked fails when it starts a cluster (integration/slurm/cluster.py).
SLURM_FIXTURES = frozenset({"slurm_cluster", "slurm_site", "slurm_chroots"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs in a pass of its own in make test-integration, after the rest")
    config.addinivalue_line(
        "markers", "slurm: starts or uses a Slurm test cluster: make test-integration runs it in one process"
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLURM_FIXTURES & set(item.fixturenames) and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.slurm)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """While a test not marked `slurm` runs (its fixtures included), starting a Slurm test
    cluster fails, in this process and in those it starts."""
    before = os.environ.get(NOT_A_SLURM_TEST)
    if item.get_closest_marker("slurm") is None:
        os.environ[NOT_A_SLURM_TEST] = item.nodeid
    else:
        os.environ.pop(NOT_A_SLURM_TEST, None)
    try:
        return (yield)
    finally:
        if before is None:
            os.environ.pop(NOT_A_SLURM_TEST, None)
        else:
            os.environ[NOT_A_SLURM_TEST] = before


def _sqlalchemy_url(dsn: str, dbname: str) -> str:
    base = dsn.rsplit("/", 1)[0]
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{dbname}"


def _admin() -> psycopg.Connection:
    try:
        return psycopg.connect(ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL at {ADMIN_DSN} does not answer ({exc}); run integration/scripts/ensure-postgres.sh",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def pg_template() -> str:
    name = f"gpush_tpl_{os.getpid()}"
    with _admin() as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    engine = make_engine(_sqlalchemy_url(ADMIN_DSN, name))
    upgrade(engine)
    engine.dispose()
    yield name
    drop_database(name)


def create_database(template: str | None = None) -> str:
    name = f"gpush_t_{uuid.uuid4().hex[:12]}"
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with _admin() as conn:
        conn.execute(statement)
    return name


def drop_database(name: str) -> None:
    with _admin() as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def empty_pg_url() -> str:
    """A new PostgreSQL database with no schema, dropped after the test."""
    name = create_database()
    yield _sqlalchemy_url(ADMIN_DSN, name)
    drop_database(name)


@pytest.fixture
def database_url(pg_template) -> str:
    """Overrides the SQLite URL of the shared fixtures with a migrated PostgreSQL clone."""
    name = create_database(template=pg_template)
    yield _sqlalchemy_url(ADMIN_DSN, name)
    drop_database(name)
