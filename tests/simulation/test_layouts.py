"""MIG layouts and lending in a replay (broker/simulation/layouts.py): a GPU re-cut for the
queue, a node lent to the tier whose work waits and back, never offered by both tiers, and
the comparison's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.routing.policy import load_policy  # noqa: I001
from broker.simulation import layouts
from broker.simulation.fleet import load_fleet
from broker.simulation.workload import read_workload
from tests.scheduling.test_cycle import DEFAULT_POLICY

FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - name: mig-01
        gpus:
          - {model: A100-SXM4-40GB, count: 2, mig: [1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb]}
      - name: lend        # k8s-a lists it too (a pool of one node is named as the pool)
        gpus:
          - {model: A100-SXM4-40GB, count: 2, mig: [3g.20gb, 3g.20gb]}
  k8s-a:
    flavor: k8s
    pools:
      - {name: infer, nodes: 1, gpus_per_node: 2, model: A100-SXM4-40GB, timeslice_replicas: 4}
      - {name: lend, nodes: 1, gpus_per_node: 2, model: A100-SXM4-40GB, timeslice_replicas: 4}
"""
# Training on 3g.20gb slices (more than lend-01's four; mig-01 is cut in 1g.5gb), then
# inference (more replicas than k8s-a's own node has), then training again.
WORKLOAD = """
jobs:
  - {name: mid, at: 0, duration: 30m, count: 12, every: 30, kind: training, isolation: hardware, gpu_memory_gb: 20}
  - {name: serve, at: 2h, duration: 30m, count: 30, every: 30, kind: inference, isolation: none, gpu_memory_gb: 4}
  - {name: again, at: 4h, duration: 30m, count: 12, every: 30, kind: training, isolation: hardware, gpu_memory_gb: 20}
"""


@pytest.fixture(scope="module")
def runs():
    fleet = load_fleet(FLEET, "test fleet")
    loaded = read_workload(WORKLOAD, "test workload")
    policy = load_policy(DEFAULT_POLICY, "default.yaml")
    return layouts.replay_layouts(fleet, policy, loaded.arrivals, terms=layouts.LayoutTerms(every=60, hold=600))


def test_dynamic_mig_recuts_idle_gpus_for_the_waiting_slices(runs):
    static, dynamic, _ = (r.summary() for r in runs)
    assert static["recuts"] == 0 and dynamic["recuts"] >= 1
    assert dynamic["waits"]["training"]["p95"] < static["waits"]["training"]["p95"]
    assert dynamic["fenced_gpu_hours"] > 0  # each re-cut fences its node a while


def test_lending_moves_a_node_to_the_inference_and_back(runs):
    lending = runs[2]
    assert [(node, source, target) for _, node, source, target in lending.moved][:1] == [("lend", "slurm-a", "k8s-a")]
    summary = lending.summary()
    assert summary["moves"] >= 1
    assert summary["waits"]["inference"]["p95"] < runs[0].summary()["waits"]["inference"]["p95"]
    assert summary["placed"] == runs[0].summary()["placed"]  # no job lost


def test_a_lent_node_is_never_offered_by_both_tiers(monkeypatch):
    seen = []
    real = layouts._LayoutReplay._on_time

    def checked(self, t):
        real(self, t)
        for node, names in self.lendable.items():
            open_on = [name for name in names if not self.fences[(name, node)]]
            seen.append(len(open_on))
            assert len(open_on) <= 1, f"{node} offered by {open_on} at {t}"

    monkeypatch.setattr(layouts._LayoutReplay, "_on_time", checked)
    fleet = load_fleet(FLEET, "test fleet")
    loaded = read_workload(WORKLOAD, "test workload")
    layouts.replay_layouts(
        fleet,
        load_policy(DEFAULT_POLICY, "default.yaml"),
        loaded.arrivals,
        modes=["lending"],
        terms=layouts.LayoutTerms(every=60, hold=600),
    )
    assert seen and 0 in seen  # it was fenced on both sides while it drained


def test_the_report_compares_the_runs_within_80_columns(runs, tmp_path: Path):
    files = layouts.write_report(tmp_path, runs, {"fleet": "f", "workload": "w", "policy": "p", "jobs": 54})
    assert files == ["report.md", "results.json", "layouts-held.png", "layouts-queue.png"]
    assert all(len(line) <= 80 for line in layouts.table(runs))
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in results["runs"]] == ["static", "dynamic", "lending"]
    assert "of the fleet idle at the peak hours against" in (tmp_path / "report.md").read_text()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown layout mode"):
        layouts.replay_layouts(load_fleet(FLEET, "f"), load_policy(DEFAULT_POLICY, "p"), [], modes=["magic"])


# -- multi-node jobs keep their nodes (issue 34 item 6) --------------------------------------

GANG_FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - name: mig-01
        gpus: [{model: A100-SXM4-80GB, count: 1, mig: [3g.40gb, 3g.40gb]}]
      - name: gpu-01
        gpus: [{model: A100-SXM4-80GB, count: 2}]
      - name: lend
        gpus: [{model: A100-SXM4-80GB, count: 2}]
  k8s-a:
    flavor: k8s
    pools:
      - {name: infer, nodes: 1, gpus_per_node: 2, model: A100-SXM4-80GB, timeslice_replicas: 4}
      - {name: lend, nodes: 1, gpus_per_node: 2, model: A100-SXM4-80GB, timeslice_replicas: 4}
"""
# A two-node gang on gpu-01 and lend for 3 hours, then more inference than k8s-a's own node holds.
GANG_WORKLOAD = """
jobs:
  - {name: gang, at: 0, duration: 3h, kind: training, gpus: 2, nodes: 2}
  - {name: serve, at: 10m, duration: 4h, count: 16, every: 10, kind: inference, isolation: none, gpu_memory_gb: 4}
"""


def test_a_node_a_running_gang_has_a_rank_on_is_not_lent_in_a_replay():
    fleet = load_fleet(GANG_FLEET, "test fleet")
    loaded = read_workload(GANG_WORKLOAD, "test workload")
    policy = load_policy(DEFAULT_POLICY, "default.yaml")
    (run,) = layouts.replay_layouts(
        fleet, policy, loaded.arrivals, modes=("lending",), terms=layouts.LayoutTerms(every=60, hold=600)
    )
    gang = next(r for r in run.result.jobs if r.name == "gang")
    assert (gang.start, gang.end) == (0.0, 3 * 3600.0)
    moved = [(t, node, source, target) for t, node, source, target in run.moved]
    assert moved and all(t >= gang.end for t, *_ in moved), moved  # lend goes once the gang has ended
