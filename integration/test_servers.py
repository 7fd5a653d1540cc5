"""Real `gpush server` processes over HTTP, several sharing one PostgreSQL, driven by the CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

GPUSH = str(Path(sys.executable).with_name("gpush"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpush(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [GPUSH, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60
    )
    if check and result.returncode != 0:
        raise AssertionError(f"gpush {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


def start_server(database_url: str, *options: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    proc = subprocess.Popen(
        [GPUSH, "--database-url", database_url, "server", "--port", str(port), "--log-level", "warning", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gpush server exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("gpush server did not become ready in 30 s")


@pytest.fixture
def servers(database_url):
    procs = []
    urls = []
    for _ in range(2):
        proc, url = start_server(database_url, "--no-scheduler", "--workers", "1")
        procs.append(proc)
        urls.append(url)
    yield urls
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_servers_share_one_queue(servers, database_url):
    a, b = servers
    token = gpush(
        "--database-url", database_url, "admin", "token", "create", "--user", "alice", "--tenant", "ml"
    ).stdout.strip()
    env = {"GPUSH_TOKEN": token}
    submit = ["submit", "--kind", "training", "--gpus", "2", "--idempotency-key", "k1"]
    command = ["--", "python", "train.py", "--note", "it's $(here); ok"]
    job_id = gpush("--url", a, *submit, *command, env=env).stdout.strip()
    # A retry that lands on the other server finds the same job.
    again = gpush("--url", b, *submit, *command, env=env).stdout.strip()
    assert again == job_id
    job = json.loads(gpush("--url", b, "status", job_id, "--json", env=env).stdout)
    assert job["spec"]["command"] == ["python", "train.py", "--note", "it's $(here); ok"]
    assert json.loads(gpush("--url", b, "cancel", job_id, "--json", env=env).stdout)[0]["outcome"] == "cancelled"
    events = json.loads(gpush("--url", a, "events", job_id, "--json", env=env).stdout)
    assert [e["to_state"] for e in events] == ["queued", "cancelled"]
    listed = json.loads(gpush("--url", a, "list", "--all", "--json", env=env).stdout)  # finished ones too
    assert [j["id"] for j in listed["jobs"]] == [int(job_id)]


def test_cli_exit_codes_over_http(servers, database_url):
    url = servers[0]
    token = gpush(
        "--database-url", database_url, "admin", "token", "create", "--user", "bob", "--tenant", "vision"
    ).stdout.strip()
    assert gpush("--url", url, "--token", token, "status", "999", check=False).returncode == 3
    assert gpush("--url", url, "--token", "gpush_wrong", "list", check=False).returncode == 4
    assert gpush("--url", url, "list", check=False).returncode == 4  # no token at all
    bad = gpush("--url", url, "--token", token, "submit", "--kind", "training", "--gpus", "0", "--", "x", check=False)
    assert bad.returncode == 2 and "gpus" in bad.stderr
    assert gpush("--url", url, "--token", token, "admin", "token", "list", check=False).returncode == 4


def test_server_refuses_an_unmigrated_postgresql(empty_pg_url):
    result = gpush("--database-url", empty_pg_url, "server", "--port", str(free_port()), check=False)
    assert result.returncode == 1
    assert "gpush db upgrade" in result.stderr
    upgraded = json.loads(gpush("--database-url", empty_pg_url, "db", "upgrade", "--json").stdout)
    assert upgraded["from"] is None and upgraded["to"] == upgraded["head"]
    assert json.loads(gpush("--database-url", empty_pg_url, "db", "current", "--json").stdout)["up_to_date"]


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def cycles_run(url: str) -> float:
    """How many scheduling cycles the server at ``url`` has finished (its /metrics; 0 for
    one that never led)."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("gpush_scheduler_cycle_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_scheduling_moves_to_the_other_server_when_the_leader_dies(database_url, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    admin = ["--database-url", database_url]
    for name in ("slurm-a", "k8s-a"):
        gpush(*admin, "cluster", "add", name, "--kind", "sim", "--fleet", str(root / "examples" / "fleet.yaml"))
    gpush(*admin, "policy", "apply", str(root / "policies" / "default.yaml"), "-m", "test")
    token = gpush(*admin, "admin", "token", "create", "--user", "alice", "--tenant", "ml").stdout.strip()
    monkeypatch.setenv("GPUSH_TOKEN", token)  # for this test's gpush calls
    options = ("--workers", "1", "--cycle-interval", "0.2")
    leader, leader_url = start_server(database_url, *options)
    procs = [leader]
    try:

        def state(url: str, job_id: str) -> str:
            return json.loads(gpush("--url", url, "status", job_id, "--json").stdout)["state"]

        first = gpush("--url", leader_url, "submit", "--kind", "training", "--", "python", "a.py").stdout.strip()
        wait_for(lambda: state(leader_url, first) in ("submitted", "running"), what="the only server to place a job")
        standby, standby_url = start_server(database_url, *options)
        procs.append(standby)
        os.killpg(leader.pid, signal.SIGKILL)  # the leader dies without a word
        leader.wait(10)
        second = gpush("--url", standby_url, "submit", "--kind", "training", "--", "python", "b.py").stdout.strip()
        wait_for(lambda: state(standby_url, second) in ("submitted", "running"), what="the standby to take over")
        placed = json.loads(gpush("--url", standby_url, "list", "--all", "--json").stdout)["jobs"]
        assert {j["cluster"] for j in placed} == {"slurm-a"}
        assert len({j["backend_id"] for j in placed}) == 2
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)


def test_a_submission_to_any_server_wakes_the_leader_at_once(database_url, monkeypatch):
    """The leader's cycle interval is 120 s here: a job placed within seconds was placed
    because the API that took it woke the leader (in-process, or by PostgreSQL NOTIFY
    from the other server process), not by the next tick."""
    root = Path(__file__).resolve().parents[1]
    admin = ["--database-url", database_url]
    for name in ("slurm-a", "k8s-a"):
        gpush(*admin, "cluster", "add", name, "--kind", "sim", "--fleet", str(root / "examples" / "fleet.yaml"))
    gpush(*admin, "policy", "apply", str(root / "policies" / "default.yaml"), "-m", "test")
    monkeypatch.setenv(
        "GPUSH_TOKEN", gpush(*admin, "admin", "token", "create", "--user", "a", "--tenant", "ml").stdout.strip()
    )
    leader, leader_url = start_server(database_url, "--workers", "1", "--cycle-interval", "120")
    api_only, api_url = start_server(database_url, "--workers", "1", "--no-scheduler")
    try:
        # The leader's first cycle (at start) is over: from now on it sleeps 120 s.
        wait_for(lambda: cycles_run(leader_url) >= 1, what="the leader's first cycle")

        def state(job_id: str) -> str:
            return json.loads(gpush("--url", api_url, "status", job_id, "--json").stdout)["state"]

        for url in (api_url, leader_url):  # through the other process (NOTIFY), then in-process
            job = gpush("--url", url, "submit", "--kind", "training", "--", "python", "a.py").stdout.strip()
            wait_for(lambda job=job: state(job) in ("submitted", "running"), what=f"job {job} placed", timeout=20)
    finally:
        for proc in (leader, api_only):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
