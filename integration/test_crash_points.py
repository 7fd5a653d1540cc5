"""A broker killed by SIGKILL between a cluster's answer and its database write loses no
job and submits none twice: real processes (``gpush scheduler run``), killed at the
point ``GPUSH_FAULT`` arms (broker/core/faults.py), on a simulated cluster whose state
file outlives them as a real cluster would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHOLE = "rules:\n  - name: whole\n    match: {}\n    route: {cluster: slurm-a, sharing: slurm/exclusive}\n"
GPUSH = [sys.executable, "-c", "import sys; from broker.cli.main import main; main(sys.argv[1:])"]


@pytest.fixture
def env(tmp_path):
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUSH_")} | {
        "HOME": str(tmp_path / "home"),
        "GPUSH_DATA_DIR": str(tmp_path / "data"),
        "GPUSH_CONFIG_DIR": str(tmp_path / "config"),
        "GPUSH_LOCAL_SERVER": "0",
        "PYTHONPATH": str(ROOT),
    }


def gpush(env, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    run_env = env | ({"GPUSH_FAULT": fault} if fault else {})
    return subprocess.run([*GPUSH, *args], env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture
def fleet(env, tmp_path):
    """slurm-a of the demo's fleet, in real time, with a policy that sends every job there."""
    ok(gpush(env, "cluster", "add", "slurm-a", "--kind", "sim", "--fleet", "examples/fleet.yaml", "--speed", "1"))
    policy = tmp_path / "whole.yaml"
    policy.write_text(WHOLE)
    ok(gpush(env, "policy", "apply", str(policy), "-m", "crash test"))
    return env


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_scheduler_killed_after_the_clusters_answer_finds_the_job_there_and_runs_it_once(fleet, tmp_path):
    env = fleet
    job = ok(gpush(env, "submit", "-k", "training", "-G", "1", "-t", "1h", "--", "python", "train.py")).strip()

    killed = gpush(env, "scheduler", "run", "--cycles", "1", fault="submitted-before-record")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    status = json.loads(ok(gpush(env, "status", job, "--json")))
    assert status["state"] == "submitting"  # the answer was never written
    state_file = next((tmp_path / "data" / "sim").glob("slurm-a*.json"))
    assert [j["job_id"] for j in json.loads(state_file.read_text())["jobs"]] == [int(job)]  # the cluster has it

    ok(gpush(env, "scheduler", "run", "--cycles", "2"))  # a new broker process, unarmed: it lives
    status = json.loads(ok(gpush(env, "status", job, "--json")))
    assert status["state"] in ("submitted", "running"), status  # the simulated job starts as the cycle reads it
    events = json.loads(ok(gpush(env, "events", job, "--json")))
    found = [e for e in events if e["to_state"] == "submitted"]
    assert len(found) == 1 and found[0]["reason"] == f"found on slurm-a as sim-slurm-a-{job} after a broker restart"
    assert [j["job_id"] for j in json.loads(state_file.read_text())["jobs"]] == [int(job)]  # not submitted twice
