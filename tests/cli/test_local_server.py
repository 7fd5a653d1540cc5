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

ROOT = Path(__file__).resolve().parents[2]
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
