"""Fault drill: the leading `gpush server` killed with SIGKILL while API traffic goes on,
several rounds, two servers on one PostgreSQL and a simulated cluster they share.

Before issue 14's fix, each server process kept its own view of the simulated cluster
and wrote it back over the others', and the server that took the lead reused that stale
view: the jobs the dead leader had in flight stayed ``submitted`` for good, holding
their tenant's share of the ledger (68 and 101 of them in two rounds of four). Here every
round must end with 0 stuck, 0 lost, 0 duplicated cluster jobs, and a ledger equal to
what runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from broker.scheduling.leader import ADVISORY_KEY
from integration.test_servers import gpush, start_server, wait_for

# It changes the machine under every other test (see integration/conftest.py).
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3
JOBS_PER_ROUND = 40
FINISHED = {"succeeded", "failed", "cancelled"}


def submit_all(urls: list[str], token: str, keys: list[str], errors: list[str]) -> None:
    """Submit a job per key, retrying on whichever server answers (the same key twice is
    one job: what a client does when its server dies mid-request)."""
    headers = {"Authorization": f"Bearer {token}"}
    for key in keys:
        body = {
            "kind": "training",
            "isolation": "hardware",
            "gpu_memory_gb": 5,
            "command": ["python", "train.py"],
            "labels": {"sim-duration": "2"},
            "idempotency_key": key,
        }
        for attempt in range(120):
            url = urls[attempt % len(urls)]
            try:
                response = httpx.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=5)
            except httpx.TransportError:
                time.sleep(0.25)  # the server is gone: try again, as a client would
                continue
            if response.status_code in (200, 201):
                break
            if response.status_code in (502, 503, 504):  # retryable, as the SDK treats them
                time.sleep(0.25)
                continue
            if response.status_code >= 500:
                errors.append(f"{key}: {response.status_code} {response.text[:200]}")
                break
        else:
            errors.append(f"{key}: no server answered")


def read_clusters(urls: list[str], token: str, stop: threading.Event) -> None:
    """What dashboards and `gpush cluster list` do all day: every server's API reads the
    clusters (each process's adapters answer health and inventory)."""
    headers = {"Authorization": f"Bearer {token}"}
    while not stop.is_set():
        for url in list(urls):
            try:
                httpx.get(f"{url}/v1/clusters", headers=headers, timeout=5)
            except httpx.TransportError:
                pass
        stop.wait(0.1)


def leading(database_url: str) -> str | None:
    """The application name of the server that leads: the one whose session holds the
    scheduler's advisory lock in this database (broker.scheduling.leader), or None while
    nobody does. Each server's URL names it (``application_name``), so the lock points
    at a process, not at a guess of which one came first."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return conn.execute(
                text(
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                    " WHERE l.locktype = 'advisory' AND l.granted"
                    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    # A bigint key is held as its high half in classid, its low half in objid.
                    " AND l.classid = :high AND l.objid = :low AND l.objsubid = 1"
                ),
                {"high": ADVISORY_KEY >> 32, "low": ADVISORY_KEY & 0xFFFFFFFF},
            ).scalar()
    finally:
        engine.dispose()


def named(database_url: str, name: str) -> str:
    """``database_url`` with PostgreSQL's application_name set, which pg_stat_activity shows."""
    return f"{database_url}{'&' if '?' in database_url else '?'}application_name={name}"


def test_killing_the_leader_under_traffic_loses_strands_and_doubles_nothing(database_url, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSH_DATA_DIR", str(tmp_path / "data"))  # the simulated cluster's shared state file
    admin = ["--database-url", database_url]
    gpush(*admin, "cluster", "add", "slurm-a", "--kind", "sim", "--fleet", str(ROOT / "examples" / "fleet.yaml"))
    gpush(*admin, "cluster", "add", "k8s-a", "--kind", "sim", "--fleet", str(ROOT / "examples" / "fleet.yaml"))
    gpush(*admin, "policy", "apply", str(ROOT / "policies" / "default.yaml"), "-m", "drill")
    token = gpush(*admin, "admin", "token", "create", "--user", "alice", "--tenant", "ml").stdout.strip()
    options = ("--workers", "1", "--cycle-interval", "0.2")
    servers: dict[str, tuple[subprocess.Popen, str]] = {}  # application_name -> (process, URL)

    def start(name: str) -> None:
        servers[name] = start_server(named(database_url, name), *options)

    start("drill-server-0")
    wait_for(lambda: leading(database_url) == "drill-server-0", what="the first server to take the lead")
    start("drill-server-1")
    headers = {"Authorization": f"Bearer {token}"}
    submitted: list[str] = []
    errors: list[str] = []

    def round_states(round_: int) -> set[str]:
        page = httpx.get(
            f"{next(iter(servers.values()))[1]}/v1/jobs", params={"limit": 1000}, headers=headers, timeout=10
        )
        return {j["state"] for j in page.json()["jobs"] if j["spec"]["idempotency_key"].startswith(f"drill-{round_}-")}

    try:
        for round_ in range(ROUNDS):
            keys = [f"drill-{round_}-{n}" for n in range(JOBS_PER_ROUND)]
            submitted += keys
            urls = [url for _, url in servers.values()]
            traffic = threading.Thread(target=submit_all, args=(urls, token, keys, errors))
            traffic.start()
            stop_reading = threading.Event()
            reader = threading.Thread(target=read_clusters, args=(urls, token, stop_reading))
            reader.start()
            # Jobs in flight when the leader dies: some of this round's already handed to a cluster.
            wait_for(
                lambda round_=round_: round_states(round_) & {"submitted", "running"},
                timeout=30,
                what=f"round {round_}: the leader to place some of its jobs",
            )
            killed = leading(database_url)
            assert killed in servers, f"round {round_}: the lock is held by {killed!r}, none of {sorted(servers)}"
            leader, _ = servers.pop(killed)
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(10)
            start(f"drill-server-{round_ + 2}")
            urls.append(servers[f"drill-server-{round_ + 2}"][1])
            # PostgreSQL frees the dead session's lock and a live server takes it.
            successor = wait_for(
                lambda killed=killed: (name := leading(database_url)) not in (None, killed) and name,
                timeout=30,
                what=f"round {round_}: another server to lead after {killed} was killed",
            )
            assert successor in servers, f"round {round_}: {successor!r} leads, none of the live {sorted(servers)}"
            traffic.join(120)
            stop_reading.set()
            reader.join(10)
            assert not errors, errors

        url = servers[f"drill-server-{ROUNDS + 1}"][1]

        def jobs() -> list[dict]:
            page = httpx.get(f"{url}/v1/jobs", params={"limit": 1000}, headers=headers, timeout=10)
            return page.json()["jobs"]

        # Every job ends: 2 s each on 12 MIG slices of slurm-a and the k8s fallback.
        wait_for(
            lambda: {j["state"] for j in jobs()} <= FINISHED and len(jobs()) >= len(submitted),
            timeout=120,
            what="every job to end after the leader was killed",
        )
        done = jobs()
        keys = [j["spec"]["idempotency_key"] for j in done]
        assert sorted(keys) == sorted(submitted), "a job was lost or submitted twice to gpush"
        assert {j["state"] for j in done} == {"succeeded"}, {
            j["id"]: j["state_reason"] for j in done if j["state"] != "succeeded"
        }
        backend_ids = [(j["cluster"], j["backend_id"]) for j in done]
        assert len(set(backend_ids)) == len(done), "a job ran twice on a cluster"
        usage = httpx.get(f"{url}/v1/tenants", headers=headers, timeout=10).json()
        held = {t["name"]: t["gpu_used"] for t in (usage["tenants"] if isinstance(usage, dict) else usage)}
        assert all(value == 0 for value in held.values()), f"the ledger holds GPUs for jobs that ended: {held}"
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)


def test_a_server_killed_mid_submission_loses_and_doubles_nothing(database_url, tmp_path, monkeypatch):
    """SIGKILL of the only server while clients submit with idempotency keys, then a
    restart: every key is one job, on PostgreSQL and on SQLite (the embedded default)."""
    monkeypatch.setenv("GPUSH_DATA_DIR", str(tmp_path / "data"))
    for url in (database_url, f"sqlite:///{tmp_path / 'gpush.db'}"):
        if url.startswith("sqlite"):
            gpush("--database-url", url, "db", "upgrade")
        token = gpush(
            "--database-url", url, "admin", "token", "create", "--user", "bob", "--tenant", "ml"
        ).stdout.strip()
        server, server_url = start_server(url, "--workers", "1", "--no-scheduler")
        keys = [f"kill-{n}" for n in range(300)]
        errors: list[str] = []
        urls = [server_url]
        clients = [threading.Thread(target=submit_all, args=(urls, token, keys[n::3], errors)) for n in range(3)]
        for client in clients:
            client.start()
        try:
            wait_for(lambda url=url: stored_jobs(url) >= 30, timeout=60, what="the clients to store some jobs")
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
            # The kill came mid-submission: some keys stored, others still to send.
            assert stored_jobs(url) < len(keys), f"{url.split(':')[0]}: every job was in before the kill"
            # The same port again, so the clients' retries reach the new process.
            port = int(server_url.rsplit(":", 1)[1])
            server, _ = start_server(url, "--workers", "1", "--no-scheduler", port=port)
            for client in clients:
                client.join(120)
            assert not errors, errors
            headers = {"Authorization": f"Bearer {token}"}
            page = httpx.get(f"{server_url}/v1/jobs", params={"limit": 1000}, headers=headers, timeout=10).json()
            stored = sorted(j["spec"]["idempotency_key"] for j in page["jobs"])
            assert stored == sorted(keys), f"{url.split(':')[0]}: {len(stored)} jobs for {len(keys)} keys"
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(10)


def stored_jobs(database_url: str) -> int:
    """How many jobs the database holds, read from it directly (no server needed)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM jobs")).scalar()
    finally:
        engine.dispose()


def restart_postgresql() -> None:
    """Restart this machine's PostgreSQL cluster (the one make test starts), as an
    operator's restart or a failover of the database would look to the broker."""
    dsn = os.environ.get("GPUSH_TEST_PG_DSN")
    if dsn and "127.0.0.1" not in dsn and "localhost" not in dsn:
        pytest.skip(f"GPUSH_TEST_PG_DSN names another server ({dsn}): this drill restarts the local one")
    version = sorted(os.listdir("/etc/postgresql"), key=lambda v: [int(x) for x in v.split(".") if x.isdigit()])[-1]
    ctl = shutil.which("pg_ctlcluster")
    assert ctl, "pg_ctlcluster not found: integration/scripts/ensure-postgres.sh installs PostgreSQL"
    subprocess.run([ctl, "--skip-systemctl-redirect", version, "main", "restart"], check=True, timeout=120)
    wait_for(
        lambda: subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1"], check=False).returncode == 0,
        timeout=60,
        what="PostgreSQL to answer after its restart",
    )


@pytest.mark.may_skip("GPUSH_TEST_PG_DSN names a server other than this machine's, which the drill cannot restart")
def test_postgresql_restarted_under_a_running_broker(database_url, monkeypatch, tmp_path):
    """The broker reconnects (API and scheduler, leadership taken again) and nothing is lost."""
    monkeypatch.setenv("GPUSH_DATA_DIR", str(tmp_path / "data"))
    admin = ["--database-url", database_url]
    gpush(*admin, "cluster", "add", "slurm-a", "--kind", "sim", "--fleet", str(ROOT / "examples" / "fleet.yaml"))
    gpush(*admin, "cluster", "add", "k8s-a", "--kind", "sim", "--fleet", str(ROOT / "examples" / "fleet.yaml"))
    gpush(*admin, "policy", "apply", str(ROOT / "policies" / "default.yaml"), "-m", "drill")
    token = gpush(*admin, "admin", "token", "create", "--user", "carol", "--tenant", "ml").stdout.strip()
    server, url = start_server(database_url, "--workers", "1", "--cycle-interval", "0.2")
    headers = {"Authorization": f"Bearer {token}"}
    keys = [f"pg-{n}" for n in range(90)]
    errors: list[str] = []
    try:
        traffic = threading.Thread(target=submit_all, args=([url], token, keys, errors))
        traffic.start()
        wait_for(lambda: stored_jobs(database_url) >= 10, timeout=60, what="the client to store some jobs")
        # The restart comes mid-traffic: requests meet the broker's reconnection.
        assert stored_jobs(database_url) < len(keys), "every job was in before the restart"
        restart_postgresql()
        traffic.join(120)
        assert not errors, errors
        assert server.poll() is None, "the broker exited when PostgreSQL restarted"

        def jobs() -> list[dict]:
            try:
                answer = httpx.get(f"{url}/v1/jobs", params={"limit": 1000}, headers=headers, timeout=10)
            except httpx.TransportError:
                return []
            return answer.json()["jobs"] if answer.status_code == 200 else []

        wait_for(
            lambda: len(jobs()) == len(keys) and {j["state"] for j in jobs()} == {"succeeded"},
            timeout=120,
            what="every job to run and end after PostgreSQL restarted",
        )
        assert sorted(j["spec"]["idempotency_key"] for j in jobs()) == sorted(keys)
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    finally:
        stop(server)


def stop(server) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
