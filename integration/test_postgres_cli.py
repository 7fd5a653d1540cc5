"""The command-line tests of tests/, with the embedded broker on the real PostgreSQL."""

import pytest

from tests.cli.test_cli import *  # noqa: F401,F403
from tests.routing.test_routing_cli import *  # noqa: F401,F403


@pytest.fixture(autouse=True)
def _embedded_on_postgresql(database_url, monkeypatch):
    monkeypatch.setenv("GPUSH_DATABASE_URL", database_url)
