"""A full disk for real (issue 32, finding 6), under SQLite and under PostgreSQL: a small
tmpfs filled to the last byte holds the SQLite database, or the PostgreSQL tablespace
of the jobs table. A submission is then refused 507 ``storage_full`` with what to do,
/readyz says not ready, reads still work, and once space is freed writes work again.

Mounting needs root, as `make test`'s Slurm does; a mount that fails is a failure.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import subprocess
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest
from a2wsgi import ASGIMiddleware
from psycopg import sql
from sqlalchemy import text

from broker.api.app import create_app
from broker.api.health import NOT_READY_AFTER_DISK_FULL
from broker.core import auth
from broker.core.db import open_database, session_factory
from broker.core.schemas import Role
from integration.conftest import _admin

# It changes the machine under every other test (see integration/conftest.py).
pytestmark = pytest.mark.alone


def mount_tmpfs(where: Path, size: str, **options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size}", *(f"{k}={v}" for k, v in options.items())])
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a {size} tmpfs on {where} (needs root): {done.stderr.strip()}", pytrace=False)


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill_up(directory: Path) -> Path:
    """A file that takes every free byte of ``directory``'s filesystem."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def client_for(engine, clock) -> httpx.Client:
    app = create_app(engine, clock=clock, token_cache_ttl=0)
    with session_factory(engine)() as session, session.begin():
        _row, token = auth.create_token(
            session, user="alice", tenant="ml", role=Role.USER, description=None, now=clock()
        )
    return httpx.Client(
        base_url="http://gpush.test",
        transport=httpx.WSGITransport(app=ASGIMiddleware(app)),
        headers={"Authorization": f"Bearer {token}"},
    )


def job(n: int) -> dict:
    # Incompressible, so that PostgreSQL's TOAST needs pages for it.
    return {"kind": "training", "gpus": 1, "command": ["echo", secrets.token_hex(1500)], "idempotency_key": f"k{n}"}


def submit_until_refused(client: httpx.Client, tries: int = 5000) -> tuple[int, httpx.Response]:
    for n in range(tries):
        answer = client.post("/v1/jobs", json=job(n))
        if answer.status_code != 201:
            return n, answer
    raise AssertionError(f"{tries} jobs went onto a full disk")


def assert_full_then_recovers(client: httpx.Client, clock, filler: Path, says: str) -> None:
    stored, refused = submit_until_refused(client)
    assert refused.status_code == 507, refused.text
    assert "Retry-After" not in refused.headers
    error = refused.json()["error"]
    assert error["code"] == "storage_full" and "disk is full" in error["message"] and says in error["message"]
    assert "Free space" in error["message"]

    listed = client.get("/v1/jobs", params={"limit": 5})
    assert listed.status_code == 200 and len(listed.json()["jobs"]) == min(stored + 1, 5)
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "storage_full", ready.text

    filler.unlink()
    clock.advance(NOT_READY_AFTER_DISK_FULL)
    assert client.get("/readyz").status_code == 200
    again = client.post("/v1/jobs", json=job(10_000))
    assert again.status_code == 201, again.text


def test_sqlite_on_a_full_filesystem(tmp_path, clock):
    small = tmp_path / "small"
    mount_tmpfs(small, "2m")
    try:
        engine = open_database(f"sqlite:///{small / 'gpush.db'}")
        try:
            with client_for(engine, clock) as client:
                assert client.post("/v1/jobs", json=job(-1)).status_code == 201
                filler = fill_up(small)
                assert os.statvfs(small).f_bavail == 0
                assert_full_then_recovers(client, clock, filler, "SQLite: database or disk is full")
        finally:
            engine.dispose()
    finally:
        unmount(small)


@pytest.fixture
def small_tablespace():
    """A PostgreSQL tablespace on a 1 MiB tmpfs, and its mount point (the server's user
    owns it; outside pytest's own directories, which the server may not enter)."""
    where = Path(tempfile.mkdtemp(prefix="gpush-pgspace-"))
    where.chmod(0o755)
    postgres = pwd.getpwnam("postgres")
    mount_tmpfs(where, "1m", uid=str(postgres.pw_uid), gid=str(postgres.pw_gid), mode="0700")
    name = f"gpush_small_{uuid.uuid4().hex[:8]}"
    try:
        with _admin() as conn:
            conn.execute(
                sql.SQL("CREATE TABLESPACE {} LOCATION {}").format(sql.Identifier(name), sql.Literal(str(where)))
            )
        yield name, where
        with _admin() as conn:
            conn.execute(sql.SQL("DROP TABLESPACE IF EXISTS {}").format(sql.Identifier(name)))
    finally:
        unmount(where)
        where.rmdir()


def test_postgresql_with_its_jobs_on_a_full_tablespace(small_tablespace, engine, clock):
    name, where = small_tablespace
    with engine.begin() as conn:
        conn.execute(text(f'ALTER TABLE jobs SET TABLESPACE "{name}"'))
    try:
        with client_for(engine, clock) as client:
            assert client.post("/v1/jobs", json=job(-1)).status_code == 201
            filler = fill_up(where)
            assert_full_then_recovers(client, clock, filler, "SQLSTATE 53100 disk_full")
    finally:
        with engine.begin() as conn:  # back home, so that the tablespace can be dropped
            conn.execute(text("ALTER TABLE jobs SET TABLESPACE pg_default"))
