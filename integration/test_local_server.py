"""The embedded default runs jobs with no extra step: the first command that needs the
broker starts a local server with its scheduler in the background, later commands find
it, and `gpush server status|logs|stop` look after it. Real processes, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPUSH = [sys.executable, "-c", "import sys; from broker.cli.main import main; main(sys.argv[1:])"]


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSH_")} | {
        "HOME": str(tmp_path / "home"),
        "GPUSH_DATA_DIR": str(tmp_path / "data"),
        "GPUSH_CONFIG_DIR": str(tmp_path / "config"),
        "GPUSH_LOCAL_SERVER": "1",
        "PYTHONPATH": str(ROOT),
    }
    yield env
    subprocess.run([*GPUSH, "server", "stop"], env=env, cwd=ROOT, capture_output=True, timeout=60)


def gpush(env, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*GPUSH, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"gpush {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def test_a_submitted_job_runs_with_no_server_started_by_hand_and_its_output_shows(user_env):
    assert gpush(user_env, "server", "status", check=False).returncode == 1  # none yet

    first = gpush(
        user_env, "cluster", "add", "slurm-a", "--kind", "sim", "--fleet", "examples/fleet.yaml", "--speed", "60"
    )
    assert "started a local gpush server" in first.stderr
    gpush(user_env, "cluster", "add", "k8s-a", "--kind", "sim", "--fleet", "examples/fleet.yaml", "--speed", "60")
    gpush(user_env, "policy", "apply", "policies/default.yaml", "-m", "first")
    job = gpush(
        user_env,
        "submit",
        "--kind",
        "training",
        "--isolation",
        "hardware",
        "--gpu-memory-gb",
        "4",
        "--time-limit",
        "1",
        "--",
        "python",
        "train.py",
    ).stdout.strip()
    assert "started a local gpush server" not in gpush(user_env, "whoami").stderr  # found, not started again

    deadline = time.monotonic() + 60
    while (state := json.loads(gpush(user_env, "status", job, "--json").stdout)["state"]) != "succeeded":
        assert time.monotonic() < deadline, f"job {job} still {state} after 60 s"
        time.sleep(0.5)

    out = gpush(user_env, "logs", job).stdout
    assert f"job {job} replica 0 started on" in out and "succeeded (exit 0)" in out
    assert gpush(user_env, "logs", job, "--tail", "1").stdout.count("\n") == 1
    assert "gpush logs" in gpush(user_env, "status", job).stdout  # the status page says where the output is

    status = json.loads(gpush(user_env, "server", "status", "--json").stdout)
    assert status["running"] and status["url"].startswith("http://127.0.0.1:") and "token" not in status
    log = gpush(user_env, "server", "logs", "--tail", "200").stdout
    assert "POST /v1/jobs" in log  # requests are logged at info level
    assert oct(Path(status["log"]).stat().st_mode & 0o777) == "0o600"

    stopped = gpush(user_env, "server", "stop")
    assert "stopped the local server" in stopped.stdout
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(status["pid"], 0)
            time.sleep(0.1)
    # The queue outlives the server: the next command starts a new one and sees the job.
    assert json.loads(gpush(user_env, "status", job, "--json").stdout)["state"] == "succeeded"


def test_a_server_that_cannot_start_says_why_and_where_its_log_is(user_env):
    user_env["GPUSH_MAX_BODY_BYTES"] = "lots"  # the server refuses to start on it
    done = gpush(user_env, "whoami", check=False)
    assert done.returncode != 0
    assert "gpush: error: the local gpush server did not start (see " in done.stderr
    assert "GPUSH_MAX_BODY_BYTES" in done.stderr  # its log's last lines say why


def _a_free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_local_servers_port_is_chosen_with_port_or_gpush_port(user_env):
    port = _a_free_port()
    started = gpush(user_env, "server", "start", "--port", str(port), "--json")
    assert json.loads(started.stdout)["url"] == f"http://127.0.0.1:{port}"
    again = gpush(user_env, "server", "start", "--port", str(port + 1 if port < 65535 else port - 1), check=False)
    assert again.returncode == 2 and f"already runs at http://127.0.0.1:{port}" in again.stderr
    gpush(user_env, "server", "stop")

    other = _a_free_port()
    env = user_env | {"GPUSH_PORT": str(other)}
    assert "started a local gpush server" in gpush(env, "whoami").stderr  # on first need, on GPUSH_PORT
    assert json.loads(gpush(env, "server", "status", "--json").stdout)["url"] == f"http://127.0.0.1:{other}"


def test_a_taken_or_invalid_port_is_a_clear_error_and_starts_nothing(user_env):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = gpush(user_env, "server", "start", "--port", str(port), check=False)
        assert done.returncode == 2, done.stderr
        assert f"port {port} of 127.0.0.1 is taken" in done.stderr and "--port or GPUSH_PORT" in done.stderr
        first_need = gpush(user_env | {"GPUSH_PORT": str(port)}, "whoami", check=False)
        assert first_need.returncode == 2 and f"port {port} of 127.0.0.1 is taken" in first_need.stderr

    bad = gpush(user_env | {"GPUSH_PORT": "http"}, "whoami", check=False)
    assert bad.returncode == 2 and "GPUSH_PORT='http' is not a port" in bad.stderr
    usage = gpush(user_env, "server", "start", "--port", "70000", check=False)
    assert usage.returncode == 2 and "70000" in usage.stderr
    assert gpush(user_env, "server", "status", check=False).returncode == 1  # none started


def test_top_level_help_says_the_first_command_starts_a_local_server(user_env):
    text = " ".join(gpush(user_env, "--help").stdout.split())
    assert "starts a local server with its scheduler in the background" in text
    assert "so a first look needs no server" not in text
