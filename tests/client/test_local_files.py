"""The files of the local server (broker.client.local): its data directory holds the
database, the local admin token's server state and the server's log, so it is the
user's alone from the moment it exists (issue 32, finding 7: it was made 0755 under the
usual umask, before the database code saw it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from broker.client import local
from broker.core.config import data_dir


@pytest.fixture
def umask():
    """``umask(mask)`` for the test; the process's own comes back after."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o000])
def test_the_data_directory_and_the_servers_are_created_0700_whatever_the_umask(umask, mask):
    umask(mask)
    assert not data_dir().exists()
    with local._starting("sqlite:///x.db"):
        assert mode(data_dir()) == 0o700
        assert mode(local.state_dir()) == 0o700
        lock = next(local.state_dir().glob("*.lock"))
        assert mode(lock) & 0o077 == 0


def test_directories_above_the_data_directory_keep_the_usual_mode(umask, tmp_path, monkeypatch):
    umask(0o022)
    monkeypatch.setenv("GPUSH_DATA_DIR", str(tmp_path / "share" / "gpush"))
    with local._starting("sqlite:///x.db"):
        pass
    assert mode(tmp_path / "share") == 0o755  # a home's .local/share is not gpush's to close
    assert mode(tmp_path / "share" / "gpush") == 0o700


def test_a_data_directory_that_exists_is_left_as_it_is(umask, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    shared.chmod(0o750)
    monkeypatch.setenv("GPUSH_DATA_DIR", str(shared))
    with local._starting("sqlite:///x.db"):
        pass
    assert mode(shared) == 0o750  # an admin's choice (group access) is theirs
    assert mode(shared / "server") == 0o700
