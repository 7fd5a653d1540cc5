"""The embedded SQLite database holds jobs' environment values: its directory and files
are the user's alone, however permissive the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import text

from broker.core.db import open_database


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_directory_are_private(tmp_path, permissive_umask):
    data = tmp_path / "home" / "gpush"
    engine = open_database(f"sqlite:///{data / 'gpush.db'}")
    try:
        with engine.begin() as conn:  # a write: the WAL and its shared memory exist now
            conn.execute(text("CREATE TABLE probe (x INTEGER)"))
            wal, shm = data / "gpush.db-wal", data / "gpush.db-shm"
            assert wal.exists() and shm.exists()
            assert mode(wal) == 0o600
            assert mode(shm) == 0o600
        assert mode(data) == 0o700
        assert mode(data / "gpush.db") == 0o600
    finally:
        engine.dispose()


def test_a_database_left_world_readable_is_made_private_on_open(tmp_path, permissive_umask):
    tmp_path.chmod(0o755)
    path = tmp_path / "gpush.db"
    engine = open_database(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE probe (x INTEGER)"))
    wal = tmp_path / "gpush.db-wal"
    for left in (path, wal):
        left.chmod(0o644)  # as gpush created them before
    open_database(f"sqlite:///{path}").dispose()
    assert mode(path) == 0o600
    assert mode(wal) == 0o600
    engine.dispose()
    # A directory it did not create (one the admin chose, /srv, /tmp) is left as it is.
    assert mode(tmp_path) == 0o755
