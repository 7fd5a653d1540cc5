"""Migrations: one linear history whose head is exactly the ORM metadata, and back to base."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from broker.core.db import alembic_config, current_revision, downgrade, head_revision, make_engine, upgrade
from broker.core.models import Base


@pytest.fixture
def database_url(tmp_path) -> str:
    """An empty database: these tests run the migrations themselves (the shared fixture's
    is migrated already)."""
    return f"sqlite:///{tmp_path / 'empty.db'}"


def test_upgrade_head_equals_the_orm_metadata(database_url):
    engine = make_engine(database_url)
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    engine.dispose()


def test_downgrade_to_base_and_up_again(database_url):
    engine = make_engine(database_url)
    upgrade(engine)
    downgrade(engine, "base")
    assert current_revision(engine) is None
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_history_is_linear_and_every_revision_says_why():
    script = ScriptDirectory.from_config(alembic_config())
    assert len(script.get_heads()) == 1
    revisions = list(script.walk_revisions())
    assert [r.down_revision for r in revisions][-1] is None
    for rev in revisions:
        doc = ast.get_docstring(ast.parse(Path(rev.path).read_text()))
        assert doc and "Why:" in doc, f"{rev.path} must say why in its docstring"
