"""Migrations on PostgreSQL: from an empty database, head equals the ORM metadata; down to base."""

import pytest

from tests.core.test_migrations import *  # noqa: F401,F403


@pytest.fixture
def database_url(empty_pg_url):
    return empty_pg_url
