"""Gang reservations in ``gpush simulate``: on a synthetic workload where a stream of small
jobs starves a multi-node job without them, the gang starts within a bound with them,
short work is backfilled onto its nodes, and the report gives gang waits per size class."""

from __future__ import annotations

from pathlib import Path

import yaml

from broker.routing.policy import load_policy
from broker.simulation.fleet import load_fleet
from broker.simulation.replay import replay
from broker.simulation.report import run_simulation
from broker.simulation.report_text import summary_lines
from broker.simulation.results import ReplayResult
from broker.simulation.workload import read_workload

FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - name: gpu
        count: 4
        cpus: 128
        memory: 1T
        gpus:
          - {model: A100-SXM4-80GB, count: 8}
"""
POLICY = """
rules:
  - name: everything
    match: {}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""
HOURS = 12


def starving_workload() -> str:
    """A 4-node gang at one minute, among 1-GPU jobs of 50 minutes (limit 1 h) every 3
    minutes and 1-GPU jobs of 10 minutes (limit 15 m) every 7 minutes, for 12 hours: some
    small job always runs on every node the gang needs, unless its nodes are reserved."""
    jobs = [
        {"name": "long", "kind": "batch", "gpus": 1, "time_limit": 60, "at": 0, "duration": 3000,
         "count": HOURS * 20, "every": 180},
        {"name": "short", "kind": "batch", "gpus": 1, "time_limit": 15, "at": 30, "duration": 600,
         "count": HOURS * 60 // 7, "every": 420},
        {"name": "gang", "kind": "training", "nodes": 4, "gpus": 8, "time_limit": 120, "at": 60,
         "duration": 3600},
    ]  # fmt: skip
    return yaml.safe_dump({"jobs": jobs}, sort_keys=False)


def run(reservations: bool) -> ReplayResult:
    workload = read_workload(starving_workload(), "starving.yaml")
    return replay(load_fleet(FLEET, "fleet.yaml"), load_policy(POLICY), workload.arrivals, reservations=reservations)


def gang_of(result: ReplayResult):
    return next(j for j in result.jobs if j.name == "gang")


def test_without_reservations_the_gang_starves_and_with_them_it_starts_within_the_bound():
    starved = gang_of(run(False))
    # it starts only once the stream of small jobs has dried up, if at all
    assert starved.start is None or starved.start > (HOURS - 1) * 3600
    reserved = run(True)
    gang = gang_of(reserved)
    # the bound: the policy's wait (10 minutes) plus the longest time limit on its nodes (1 hour)
    assert gang.start is not None and gang.wait <= 600 + 3600
    assert gang.nodes == 4
    # the short jobs that ended before it could start ran on its nodes meanwhile
    backfilled = [j for j in reserved.jobs if j.backfilled]
    assert backfilled and {j.name.split("-")[0] for j in backfilled} == {"short"}
    assert reserved.backfilled_gpu_hours() > 0
    waits = reserved.summary()["gang_waits"]
    assert list(waits) == ["3-4 nodes"] and waits["3-4 nodes"]["jobs"] == 1
    assert waits["3-4 nodes"]["p95"] == gang.wait


def test_simulate_reports_gang_waits_with_and_without_reservations(tmp_path: Path):
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "workload.yaml").write_text(starving_workload())
    result = run_simulation(
        str(tmp_path / "fleet.yaml"),
        str(tmp_path / "workload.yaml"),
        None,
        str(tmp_path / "policy.yaml"),
        None,
        str(tmp_path / "r"),
        plots=False,
        reservations=True,
    )
    assert result["comparison"]["label"] == "without reservations"
    assert result["primary"]["reservations"] == {"after_seconds": 600.0, "gangs_reserved": 1}
    assert result["comparison"]["reservations"] is None
    lines = summary_lines(result)
    row = next(line for line in lines if "gangs of 3-4 nodes: wait p50/p95" in line)
    assert "shorter" in row
    assert any("GPU-hours backfilled on reserved nodes" in line for line in lines)
    report = (tmp_path / "r" / "report.md").read_text()
    assert "## Multi-node jobs" in report and "| gangs of 3-4 nodes: wait p50/p95 |" in report
