"""``gpush simulate`` says how it places: a fleet replay as the broker does, a trace by
the placement asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path

from broker.simulation.traces import DEFAULT_NODES, DEFAULT_PODS

ROOT = Path(__file__).resolve().parents[2]
FLEET = str(ROOT / "examples" / "fleet.yaml")
WORKLOAD = str(ROOT / "examples" / "workload.yaml")


def test_a_fleet_replay_reports_the_brokers_own_placement(gpush, tmp_path) -> None:
    result = gpush("simulate", "--fleet", FLEET, "--workload", WORKLOAD, "--report", str(tmp_path), "--json")
    assert result.code == 0, result.err
    placement = json.loads(result.out)["inputs"]["placement"]
    assert "best-fit for whole GPUs and MIG" in placement and "fgd per GPU" in placement
    report = (tmp_path / "report.md").read_text()
    assert "best-fit for whole GPUs and MIG" in report


def test_placement_is_refused_for_a_fleet_saying_why(gpush, tmp_path) -> None:
    result = gpush(
        "simulate", "--fleet", FLEET, "--workload", WORKLOAD, "--placement", "fgd", "--report", str(tmp_path)
    )
    assert result.code == 2
    assert "--placement is for --trace" in result.err and "leave it out" in result.err


def test_help_says_which_placement_applies_where(gpush) -> None:
    result = gpush("simulate", "--help")
    assert result.code == 0
    text = " ".join(result.out.split())
    assert "With --trace: placement on its GPU-sharing nodes" in text
    assert "A --fleet replay places as the broker does" in text


def test_progress_goes_to_stderr_and_json_stays_clean(gpush, tmp_path, monkeypatch) -> None:
    # As if the run were slow: progress from the first step.
    monkeypatch.setattr("broker.simulation.progress.QUIET_SECONDS", 0.0)
    result = gpush("simulate", "--fleet", FLEET, "--workload", WORKLOAD, "--report", str(tmp_path), "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["primary"]["label"] == "gpush (default.yaml)"  # nothing else on stdout
    assert "gpush simulate: replaying gpush (default.yaml)" in result.err
    assert "gpush simulate: done in" in result.err


def test_the_summary_on_stdout_says_which_way_is_good_without_progress_lines(gpush, tmp_path) -> None:
    result = gpush("simulate", "--fleet", FLEET, "--workload", WORKLOAD, "--report", str(tmp_path))
    assert result.code == 0, result.err
    assert "good when" in result.out and "lower, for the same need" in result.out
    assert "gpush simulate:" not in result.out


def test_the_trace_examples_of_help_and_readme_name_the_trace_in_the_repository(gpush) -> None:
    # A clone anywhere runs them from its root: the trace directory they name is in the
    # repository and holds the lists `--trace openb` reads.
    result = gpush("simulate", "--help")
    assert result.code == 0
    readme = (ROOT / "README.md").read_text()
    examples = re.findall(r"--trace openb (\S+)", result.out) + re.findall(
        r"gpush simulate --trace openb (\S+)", readme
    )
    assert examples
    for directory in examples:
        path = (ROOT / directory).resolve()
        assert path.is_relative_to(ROOT), f"{directory} is outside the repository"
        assert (path / DEFAULT_NODES).is_file() and (path / DEFAULT_PODS).is_file(), directory
        assert (path / "README.md").is_file(), f"{directory} has no README saying where the trace comes from"


def test_reservations_compare_a_fleet_replay_and_are_refused_beside_another_comparison(gpush, tmp_path) -> None:
    result = gpush(
        "simulate", "--fleet", FLEET, "--workload", WORKLOAD, "--reservations", "--report", str(tmp_path), "--json"
    )
    assert result.code == 0, result.err
    body = json.loads(result.out)
    assert body["comparison"]["label"] == "without reservations"
    assert body["primary"]["reservations"]["after_seconds"] == 600
    refused = gpush(
        "simulate",
        "--fleet",
        FLEET,
        "--workload",
        WORKLOAD,
        "--reservations",
        "--preemption",
        "--report",
        str(tmp_path),
    )
    assert refused.code == 2 and "leave out --trace, --compare and --preemption" in refused.err
