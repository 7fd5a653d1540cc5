"""Fixtures shared by tests/ (SQLite) and integration/ (real services).

``database_url`` is the seam: tests/ gets a fresh SQLite file per test, and
integration/conftest.py overrides it with a fresh PostgreSQL database cloned from a
migrated template, so the same API and state tests run on both.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2wsgi import ASGIMiddleware
from sqlalchemy import Engine

from broker.api.app import create_app
from broker.client.embedded import open_database
from broker.client.sdk import GpushClient
from broker.core import auth
from broker.core.db import session_factory
from broker.core.schemas import Role

# Under GPUSH_CI=1 a skip is a failure unless the test is marked may_skip (tests/skips.py);
# pytest-xdist's --dist is one that runs every test (tests/dist.py).
pytest_plugins = ("tests.skips", "tests.dist")


@pytest.fixture(autouse=True)
def _isolated_environment(tmp_path_factory, monkeypatch):
    """No test reads or writes the developer's own gpush data, config or settings."""
    home = tmp_path_factory.mktemp("gpush-home")
    monkeypatch.setenv("GPUSH_DATA_DIR", str(home / "data"))
    monkeypatch.setenv("GPUSH_CONFIG_DIR", str(home / "config"))
    # COLUMNS and LINES too: pytest-xdist's workers set them (80x24), and a piped command's
    # tables are as wide as their content unless COLUMNS says otherwise (broker.cli.console).
    for name in ("GPUSH_URL", "GPUSH_TOKEN", "GPUSH_DATABASE_URL", "COLUMNS", "LINES"):
        monkeypatch.delenv(name, raising=False)
    # Commands run the API in the test's process unless a test asks for the local server
    # (integration/test_local_server.py), so no test leaves a server behind.
    monkeypatch.setenv("GPUSH_LOCAL_SERVER", "0")


@pytest.fixture(scope="session")
def _migrated_sqlite(tmp_path_factory) -> Path:
    """One SQLite file migrated to head, made once a session: each test's database is a copy
    (copying a file costs far less than running every migration again, test after test)."""
    path = tmp_path_factory.mktemp("template") / "gpush.db"
    open_database(f"sqlite:///{path}", auto_upgrade=True).dispose()
    return path


@pytest.fixture
def database_url(tmp_path, _migrated_sqlite) -> str:
    """A fresh database of the test's own, at the head revision."""
    path = tmp_path / "gpush.db"
    shutil.copyfile(_migrated_sqlite, path)
    return f"sqlite:///{path}"


@pytest.fixture
def engine(database_url) -> Iterator[Engine]:
    engine = open_database(database_url, auto_upgrade=True)
    yield engine
    engine.dispose()


@dataclass
class FakeClock:
    """An injected clock that tests move by hand."""

    now: datetime

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 1, 5, 9, 0, tzinfo=UTC))


@pytest.fixture
def sessions(engine):
    return session_factory(engine)


@pytest.fixture
def app(engine, clock):
    return create_app(engine, clock=clock, token_cache_ttl=0)


@pytest.fixture
def make_token(sessions, clock) -> Callable[..., str]:
    def make(user: str = "alice", tenant: str = "ml", role: str = "user") -> str:
        with sessions() as session, session.begin():
            _row, secret = auth.create_token(
                session, user=user, tenant=tenant, role=Role(role), description=None, now=clock()
            )
        return secret

    return make


def in_process(app) -> httpx.WSGITransport:
    """HTTP to the ASGI app without a socket (the embedded broker does the same)."""
    return httpx.WSGITransport(app=ASGIMiddleware(app))


@pytest.fixture
def http(app, make_token) -> Callable[..., httpx.Client]:
    """Raw HTTP to the app: ``http(user=..., tenant=..., role=...)``, or ``http(token=None)``."""
    clients = []

    def make(token: str | None | bool = True, **who: str) -> httpx.Client:
        client = httpx.Client(base_url="http://gpush.test", transport=in_process(app))
        if token is True:
            token = make_token(**who)
        if token:
            client.headers["Authorization"] = f"Bearer {token}"
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def sdk(app, make_token) -> Callable[..., GpushClient]:
    """The client SDK over the app in this process: ``sdk(user=..., tenant=..., role=...)``."""
    clients = []

    def make(**who: str) -> GpushClient:
        client = GpushClient("http://gpush.test", make_token(**who), transport=in_process(app), retries=1)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        """The whole of stdout as JSON (fails if anything else was printed there)."""
        return json.loads(self.out)


@pytest.fixture
def gpush(capsys):
    """Run ``gpush ARGS...`` in this process (embedded broker); returns exit code, stdout, stderr."""
    from broker.cli.main import main

    def run(*args: Any) -> Result:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Result(exited.value.code, out, err)

    return run
