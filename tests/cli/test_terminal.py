"""What a person sees in a terminal: `gpush list` at 80 and 120 columns, -o formats,
bulk cancel, --cluster, completion. Jobs are placed on the demo's simulated fleet by
scheduler cycles run in the test's process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleet.yaml"
POLICY = ROOT / "policies" / "default.yaml"
LONG = "a-rather-long-job-name-that-goes-on-and-on"


@pytest.fixture
def fleet(gpush):
    """The demo's clusters and policy, and a mix: placed, held, queued and finished."""
    for name in ("slurm-a", "k8s-a"):
        assert gpush("cluster", "add", name, "--kind", "sim", "--fleet", FLEET, "--speed", 600).code == 0
    assert gpush("policy", "apply", POLICY, "-m", "test").code == 0

    def submit(*args) -> int:
        result = gpush("submit", *args)
        assert result.code == 0, result.err
        return int(result.out)

    jobs = {
        "mig": submit(
            "-n",
            LONG,
            "-k",
            "training",
            "-i",
            "hardware",
            "--gpu-memory-gb",
            10,
            "-l",
            "sim-duration=86400",
            "--",
            "python",
            "t.py",
        ),
        "held": submit("-n", "too-big", "-k", "training", "-G", 16, "--", "python", "huge.py"),
        "done": submit("-k", "training", "-i", "hardware", "--gpu-memory-gb", 4, "-l", "sim-duration=1", "--", "x"),
        "serve": submit(
            "-k",
            "inference",
            "--gpu-memory-gb",
            3,
            "--min-replicas",
            2,
            "--max-replicas",
            4,
            "--image",
            "vllm",
            "-l",
            "sweep=a",
        ),
    }
    assert gpush("scheduler", "run", "--cycles", 3, "--interval", 0.2).code == 0  # the 1 s job ends
    jobs["queued"] = submit("-k", "batch", "-l", "sweep=a", "--", "echo", "hi")
    return jobs


def rendered(gpush, monkeypatch, columns: int, *args) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    result = gpush("list", *args)
    assert result.code == 0, result.err
    return result.out.splitlines()


@pytest.mark.parametrize("columns", [80, 120])
def test_list_fits_the_terminal_with_id_name_state_and_reason(gpush, fleet, monkeypatch, columns):
    lines = rendered(gpush, monkeypatch, columns)
    assert max(len(line.rstrip()) for line in lines) <= columns
    assert lines[0].split() == ["ID", "NAME", "STATE", "GPUS", "AGE", "WHERE/REASON"]
    rows = {int(line.split()[0]): line for line in lines[1:]}
    assert set(rows) == {fleet["mig"], fleet["held"], fleet["serve"], fleet["queued"]}  # active only
    for line in rows.values():
        assert re.match(r"^\d+\s+\S+\s+(queued|held|running|submitted)\s", line), line  # states whole
    assert "held: can never fit" in rows[fleet["held"]]
    assert "slurm-a/mig-01 3g.20gb" in rows[fleet["mig"]]  # where a placed job runs, not a reason
    # A cut word ends in an ellipsis; at 120 columns nothing of the name is cut.
    if columns == 80:
        assert LONG not in rows[fleet["mig"]] and "…" in rows[fleet["mig"]]
        assert rows[fleet["held"]].rstrip().endswith("…")
    else:
        assert LONG[:20] in rows[fleet["mig"]]


def test_all_adds_finished_jobs_and_wide_shows_every_column(gpush, fleet, monkeypatch):
    ids = [int(line.split()[0]) for line in rendered(gpush, monkeypatch, 80, "-A")[1:]]
    assert fleet["done"] in ids and len(ids) == 5
    wide = rendered(gpush, monkeypatch, 200, "-A", "-o", "wide")
    assert wide[0].split() == [
        "ID",
        "NAME",
        "STATE",
        "KIND",
        "ISOLATION",
        "GPUS",
        "TENANT",
        "USER",
        "AGE",
        "WHERE",
        "REASON",
    ]
    assert any(LONG in line for line in wide)


def test_output_formats_for_scripts(gpush, fleet):
    names = gpush("list", "-o", "name").out.split()
    assert names == [
        str(i) for i in sorted((fleet["mig"], fleet["held"], fleet["serve"], fleet["queued"]), reverse=True)
    ]
    as_json = json.loads(gpush("list", "-o", "json").out)
    as_yaml = yaml.safe_load(gpush("list", "-o", "yaml").out)
    assert [j["id"] for j in as_json["jobs"]] == [j["id"] for j in as_yaml["jobs"]] == [int(n) for n in names]
    assert gpush("list", "--json").out == gpush("list", "-o", "json").out


def test_me_shows_only_the_callers_jobs(gpush, fleet):
    theirs = gpush("submit", "-k", "batch", "--user", "bob", "--tenant", "vision", "--", "x")
    assert theirs.code == 0
    mine = gpush("list", "--me", "-o", "name").out.split()
    assert theirs.out.strip() not in mine and str(fleet["mig"]) in mine
    assert theirs.out.strip() in gpush("list", "-o", "name").out.split()


def test_status_says_where_the_job_runs_and_where_its_output_is(gpush, fleet):
    page = gpush("status", fleet["mig"]).out
    assert re.search(r"Where\s+slurm-a mig 3g.20gb mig-01", page)
    assert re.search(rf"Output\s+simulated cluster slurm-a, node mig-01 .*\(gpush logs {fleet['mig']}\)", page)
    assert "none yet" in gpush("status", fleet["queued"]).out
    logs = gpush("logs", fleet["mig"])
    assert logs.code == 0 and f"job {fleet['mig']} replica 0 started on mig-01" in logs.out
    never = gpush("logs", fleet["held"])
    assert never.code == 1 and "never reached a cluster" in never.err


def test_bulk_cancel_asks_first_and_cancels_only_what_the_filters_select(gpush, fleet, monkeypatch):
    monkeypatch.setattr("click.confirm", lambda *a, **k: False)
    refused = gpush("cancel", "--label", "sweep=a")
    assert refused.code == 1 and "nothing cancelled" in refused.err
    assert gpush("status", fleet["queued"], "--json").json["state"] == "queued"

    done = gpush("cancel", "--label", "sweep=a", "--yes")
    assert done.code == 0
    assert f"job {fleet['queued']} cancelled" in done.out
    assert gpush("status", fleet["queued"], "--json").json["state"] == "cancelled"  # queued: at once
    assert gpush("status", fleet["serve"], "--json").json["cancel_requested_at"]  # running: asked of k8s-a
    assert not gpush("status", fleet["mig"], "--json").json["cancel_requested_at"]

    assert gpush("cancel", "1", "--mine").code == 2  # ids or filters, not both
    assert gpush("cancel").code == 2
    assert "finished jobs cannot be cancelled" in gpush("cancel", "--state", "succeeded", "--yes").err


def test_cluster_pins_a_job_within_what_the_policy_allows(gpush, fleet):
    pinned = gpush("submit", "-M", "k8s-a", "-k", "training", "-i", "hardware", "--gpu-memory-gb", 4, "--", "x")
    refused = gpush("submit", "-M", "k8s-a", "-k", "training", "-G", 1, "--", "x")  # whole-GPU training: slurm-a
    assert gpush("scheduler", "run", "--cycles", 1).code == 0
    placed = gpush("status", pinned.out.strip(), "--json").json
    assert placed["cluster"] == "k8s-a" and placed["placement"]["sharing"] == "k8s/mig"
    held = gpush("status", refused.out.strip(), "--json").json
    assert held["state"] == "held"
    assert "not to cluster k8s-a that it asks for" in held["state_reason"]


def test_completion_scripts_for_three_shells(gpush):
    for shell in ("bash", "zsh", "fish"):
        result = gpush("completion", shell)
        assert result.code == 0 and "_GPUSH_COMPLETE" in result.out
    assert gpush("completion", "tcsh").code == 2


@pytest.mark.parametrize("columns", [80, 120])
def test_inventory_and_cluster_list_fit_the_terminal(gpush, fleet, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    inventory = gpush("inventory", "--gpus")
    clusters = gpush("cluster", "list")
    assert inventory.code == clusters.code == 0
    for result in (inventory, clusters):
        assert max(len(line.rstrip()) for line in result.out.splitlines()) <= columns
    lines = inventory.out.splitlines()
    assert lines[0].split() == ["CLUSTER", "KIND", "SHARING", "VERIFIED", "FREE", "ALLOC", "TOTAL", "BROKEN"]
    assert any(line.startswith("slurm-a  ") and "mig-01" in line for line in lines)
    assert clusters.out.split()[:2] == ["NAME", "KIND"]
    assert gpush("cluster", "list", "-o", "name").out.split() == ["k8s-a", "slurm-a"]
    assert "slurm-a/mig-01" in gpush("inventory", "-o", "name").out.split()
    assert "clusters" in yaml.safe_load(gpush("inventory", "-o", "yaml").out)


def test_watch_redraws_on_change_and_stops_when_the_job_ends(gpush, fleet, monkeypatch):
    """Piped, each change prints one copy under a time stamp; status --watch ends with
    the job, list --watch with Ctrl-C (exit 0)."""
    from broker.client.embedded import embedded_client

    looks = []
    other_terminal = embedded_client()

    def sleep(seconds):
        looks.append(seconds)
        if len(looks) == 1:
            other_terminal.cancel(fleet["queued"])  # a change between two looks
        elif len(looks) >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("time.sleep", sleep)
    monkeypatch.setattr("broker.cli.console.age", lambda *a: "1m")  # no change but the one made here
    watched = gpush("list", "--watch", "--interval", 0.5)
    assert watched.code == 0
    copies = watched.out.split("--- ")[1:]
    assert len(copies) == 2  # the first look, and the one after the cancel; no copy for no change
    assert str(fleet["queued"]) in copies[0].split() and str(fleet["queued"]) not in copies[1].split()

    done = gpush("status", fleet["done"], "--watch")
    assert done.code == 0 and done.out.count("--- ") == 1 and "succeeded" in done.out
    assert gpush("list", "--watch", "-o", "json").code == 2  # tables only


@pytest.mark.parametrize("columns", [60, 80])
def test_events_and_status_read_whole_at_60_and_80_columns(gpush, fleet, monkeypatch, columns):
    """Headers stay whole and a reason wraps at words: as a column while it has 30
    columns, else under its row, indented (they were split, a few letters a line)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    reason = gpush("status", fleet["held"], "--json").json["state_reason"]
    for args in (("events", fleet["held"]), ("status", fleet["held"]), ("status", fleet["done"], "--watch")):
        result = gpush(*args)
        assert result.code == 0, result.err
        lines = result.out.splitlines()
        assert max(len(line.rstrip()) for line in lines) <= columns, result.out
        header = next(i for i, line in enumerate(lines) if line.startswith("TIME"))
        stacked = lines[header].split() == ["TIME", "FROM", "TO", "BY"]
        assert stacked or lines[header].split() == ["TIME", "FROM", "TO", "BY", "REASON"], result.out
        assert stacked or columns > 60  # at 60 a reason column would be too narrow to read
        rows = lines[header + 1 :]
        for row in rows:  # each event a row of its fields whole; a stacked reason indented under it
            fields = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(  \S+\s*){3}"
            assert (stacked and row.startswith("    ")) or re.match(fields, row) or row.startswith(" " * 40), row
        if args[1] == fleet["held"]:
            words = {w for line in rows for w in line.split()}
            assert set(reason.split()) <= words, result.out  # no word of the reason cut
            if stacked:
                under = " ".join(line.strip() for line in rows if line.startswith("    "))
                assert " ".join(reason.split()) in under
    # Wide enough, the reason is a column of its own and a short one stays on its row.
    monkeypatch.setenv("COLUMNS", "160")
    wide = gpush("events", fleet["held"]).out.splitlines()
    assert wide[0].split() == ["TIME", "FROM", "TO", "BY", "REASON"]
    assert wide[1].split()[2:] == ["-", "queued", "root", "submitted"]
