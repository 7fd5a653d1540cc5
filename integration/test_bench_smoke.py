"""Each benchmark of integration/bench/ that needs a service runs: its ``--smoke`` mode
(tiny sizes, seconds) as a subprocess, exits 0 and writes JSON with the figures it reports.

PostgreSQL (submissions, scheduling, Kubernetes, the dashboard on PostgreSQL), the
embedded default with its local server (the CLI), chromium (the dashboard), the
Kubernetes test server (started by the bench), and the single-machine Slurm test cluster
(the Slurm, Slurm gang and Ray benches start one of their own, on ports of their own). The benches
that need none of these are in tests/test_bench_smoke.py.
"""

from __future__ import annotations

import pytest

from integration.conftest import ADMIN_DSN
from tests.test_bench_smoke import run_bench

# The benches make and drop their own scratch databases on this server.
PG = {"GPUSH_BENCH_PG_URL": ADMIN_DSN.replace("postgresql://", "postgresql+psycopg://", 1)}


def test_the_submit_bench_runs_on_both_databases(tmp_path):
    result = run_bench("submit", tmp_path / "submit.json", timeout=400, env=PG)
    assert result["errors"] == [] and result["smoke"] is True
    rows = {(r["backend"], r["scenario"], r["clients"]) for r in result["results"]}
    for backend in ("sqlite", "postgres"):
        assert {(backend, "baseline", 1), (backend, "single", 1), (backend, "single", 4)} <= rows
        assert any(b == backend and s.startswith("batch") for b, s, _ in rows)
    for row in result["results"]:
        assert row["errors"] == 0 and row["jobs"] > 0 and row["jobs_per_s"] > 0, row


def test_the_schedule_bench_runs_a_fill_and_the_million_run(tmp_path):
    result = run_bench("schedule", tmp_path / "schedule.json", timeout=400, env=PG)
    assert result["errors"] == [] and result["settings"]["smoke"] is True
    placed = {r["scenario"]: r["placed"] for r in result["results"]}
    assert placed["fill: cycles with room"] > 0
    assert placed["1M queued: first cycle"] > 0
    assert result["peak_rss_mb"] > 0
    # The cycle's steps, as the scheduler reports them, reach the figures.
    first = result["details"]["fill"]["cycles"][0]
    assert {"sync", "claim", "decide"} <= set(first["steps"])


def test_the_kubernetes_bench_runs(tmp_path):
    result = run_bench("k8s", tmp_path / "k8s.json", timeout=400, env=PG)
    assert result["smoke"] is True and result["nodes"] == 8
    (one,) = result["rounds"]
    assert one["direct"]["pods"] == one["gpush"]["pods"] == 16
    assert one["gpush"]["cycle_errors"] == 0 and result["ratio"] > 0
    assert result["latency"]["jobs"] == 2 and result["latency"]["gpush"]["p50_s"] > 0
    assert result["inventory"]["nodes"] == 40 and result["inventory"]["median_s"] > 0


def test_the_cli_bench_runs(tmp_path):
    result = run_bench("cli", tmp_path / "cli.json", timeout=300)
    commands = [row["command"] for row in result["rows"]]
    assert commands[:3] == ["python -c pass (floor)", "gpush --help", "gpush list"]
    assert any(c.startswith("submit -> running") for c in commands)
    assert all(row["rounds"] == 1 and 0 < row["median_s"] <= row["max_s"] for row in result["rows"])


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_dashboard_bench_runs(tmp_path, database):
    args = ("--postgres",) if database == "postgres" else ()
    result = run_bench("dashboard", tmp_path / "dashboard.json", *args, timeout=400, env=PG)
    assert result["postgres"] is (database == "postgres")
    assert result["large"]["jobs"] == 300 and result["baseline"]["jobs"] == 100
    for page in ("queue_s", "inventory_s"):
        assert result["large"][page] > 0 and result["baseline"][page] > 0


@pytest.mark.slurm  # the bench starts a Slurm test cluster of its own
def test_the_slurm_bench_runs(tmp_path):
    result = run_bench("slurm", tmp_path / "slurm.json", timeout=600, env=PG)
    assert result["smoke"] is True
    (one,) = result["rounds"]
    assert one["sbatch"]["jobs"] == one["gpush"]["jobs"] == 20
    assert one["gpush"]["cycles"] > 0 and one["gpush"]["status_read_s"] > 0  # timed through on_phase
    assert result["ratio"] > 0
    assert len(result["latency"]["gpush"]["runs_s"]) == 2
    # The status read of the latency breakdown comes from the scheduler's timing hook.
    assert result["latency"]["gpush"]["stage_medians_s"]["status_read"] is not None


@pytest.mark.slurm  # the bench starts a Slurm test cluster of its own
def test_the_ray_bench_runs(tmp_path):
    result = run_bench("ray", tmp_path / "ray.json", timeout=600, env=PG)
    assert result["smoke"] is True
    (row,) = result["rows"]
    assert row["workers"] == 1 and row["gpush_all_joined_s"] > 0 and row["by_hand_all_joined_s"] > 0


def test_the_slurm_gang_bench_runs_both_sides_and_checks_every_gang(tmp_path):
    result = run_bench("gangs_slurm", tmp_path / "gangs_slurm.json", timeout=600, env=PG)
    assert result["smoke"] is True and result["nodes"] == 2
    for side in ("sbatch", "gpush"):
        figures = result[side]
        assert figures["jobs"] == result["jobs"] and figures["gangs"] == result["classes"]["gangs"] > 0
        assert figures["makespan_s"] > 0 and 0 < figures["utilisation"] <= 1
        assert figures["gangs_started_partly"] == []  # every gang one Slurm job, its ranks together
        assert figures["waits"]["gangs"]["jobs"] == figures["gangs"]
    assert {v["figure"] for v in result["verdicts"]} >= {"makespan (s)", "GPU utilisation"}
