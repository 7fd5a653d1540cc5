"""Preemption in a replay (``gpush simulate --preemption``): protected work preempts the
preemptible jobs that lose the least, they lose only the work since their last
checkpoint and run the rest later, and nothing that is not preemptible is touched."""

from __future__ import annotations

import json

import pytest

from broker.placement.preemption import Terms
from broker.routing.policy import load_policy
from broker.simulation.fleet import load_fleet
from broker.simulation.replay import replay
from broker.simulation.workload import read_workload
from tests.simulation.test_replay import POOL_FLEET, POOL_POLICY

FLEET, POLICY = POOL_FLEET, POOL_POLICY  # 8 whole A100s, every job sent there

# Eight batch jobs fill the 8 GPUs for 2 h; at 30 min four urgent 1-GPU jobs arrive.
WORKLOAD = """
jobs:
  - {name: sweep, at: 0, duration: 2h, count: 4, kind: batch, gpus: 1, tenant: ml, preemptible: true,
     checkpoint_every: 10m}
  - {name: fresh, at: 600, duration: 2h, count: 2, kind: batch, gpus: 1, tenant: ml, preemptible: true}
  - {name: pinned, at: 0, duration: 2h, count: 2, kind: training, gpus: 1, tenant: ml}
  - {name: urgent, at: 1800, duration: 1h, count: 3, kind: training, gpus: 1, priority: 10, tenant: ops}
"""


def run(preemption):
    workload = read_workload(WORKLOAD, "w.yaml")
    fleet = load_fleet(FLEET, "fleet")
    return replay(fleet, load_policy(POLICY, "p"), workload.arrivals, preemption=preemption)


def test_protected_work_starts_at_once_and_the_victims_lose_the_least():
    without, with_ = run(None), run(Terms())
    urgent = [j for j in with_.jobs if (j.name or "").startswith("urgent")]
    assert [j.start for j in urgent] == [1800, 1800, 1800]  # not after the 2 h the batch jobs hold
    assert all(j.start >= 7200 for j in without.jobs if (j.name or "").startswith("urgent"))
    stopped = [j for j in with_.jobs if j.preempted]
    # The two fresh jobs (no checkpoint: 20 min at risk each) are spared while the
    # checkpointed sweep jobs lose nothing (they checkpointed at 30 min): those go first.
    assert sorted(j.name for j in stopped) == ["sweep-1", "sweep-2", "sweep-3"]
    assert all(j.state == "requeued" and "preempted by job" in j.reason for j in stopped)
    assert with_.preemption == {"requeues": 3, "gpu_hours_lost": pytest.approx(0.0)}
    # Nothing that is not preemptible was touched, and every job's work got done.
    assert not any(j.preempted for j in with_.jobs if (j.name or "").startswith("pinned"))
    continued = [j for j in with_.jobs if j.requeue_of is not None]
    assert len(continued) == 3 and all(j.state == "succeeded" for j in continued)
    # They resume with the work left: 2 h less the 30 min done before the preemption.
    assert all(j.end - j.start == pytest.approx(5400) for j in continued)
    summary = with_.summary()
    assert summary["protected_waits"]["p99"] == 0
    assert without.summary()["protected_waits"]["p50"] >= 5400


def test_work_since_the_last_checkpoint_is_lost(tmp_path):
    text = WORKLOAD.replace("checkpoint_every: 10m", "checkpoint_every: 25m")
    workload = read_workload(text, "w.yaml")
    result = replay(load_fleet(FLEET, "fleet"), load_policy(POLICY, "p"), workload.arrivals, preemption=Terms())
    # Checkpointed at 25 min, preempted at 30: 5 min of one GPU lost per victim, or the
    # fresh jobs' 20 min each: the sweep jobs lose less and go first.
    assert result.preemption["gpu_hours_lost"] == pytest.approx(3 * 5 / 60)


def test_simulate_reports_what_preemption_cost_and_bought(tmp_path, gpush):
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "w.yaml").write_text(WORKLOAD)
    (tmp_path / "p.yaml").write_text(POLICY)
    args = [
        "simulate",
        "--fleet",
        tmp_path / "fleet.yaml",
        "--workload",
        tmp_path / "w.yaml",
        "--policy",
        tmp_path / "p.yaml",
        "--report",
        tmp_path / "out",
        "--preemption",
    ]
    result = gpush(*args)
    assert result.code == 0, result.err
    assert "protected work (priority > 0) wait p50/p99" in result.out
    assert "GPU-hours of work lost to preemption" in result.out
    assert "without preemption" in result.out
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["primary"]["summary"]["preemption"]["requeues"] == 3
    bad = gpush("simulate", "--trace", "openb", tmp_path, "--report", tmp_path / "o2", "--preemption")
    assert bad.code == 2 and "--preemption" in bad.err


def test_a_gang_preempts_the_nodes_whose_jobs_lose_least_in_a_replay_too():
    # Three nodes of 4 A100s. At 1 h a 2-node gang arrives: gpu-01's one job loses 21 min
    # (84 GPU-min), gpu-02's 3-GPU job 1 min and its 1-GPU job 22 min (25 GPU-min),
    # gpu-03's four 1-GPU jobs 20 min each (80 GPU-min): it preempts on gpu-02 and gpu-03,
    # as the live scheduler does (tests/scheduling/test_preemption.py).
    fleet = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - {name: gpu, count: 3, gpus: [{model: A100-SXM4-80GB, count: 4}]}
"""
    workload = read_workload(
        """
jobs:
  - {name: whole, at: 0, duration: 10h, kind: training, gpus: 4, tenant: ml, preemptible: true, checkpoint_every: 39m}
  - {name: three, at: 0, duration: 10h, kind: training, gpus: 3, tenant: ml, preemptible: true, checkpoint_every: 59m}
  - {name: one, at: 0, duration: 10h, kind: training, gpus: 1, tenant: ml, preemptible: true, checkpoint_every: 38m}
  - {name: small, at: 0, duration: 10h, count: 4, kind: training, gpus: 1, tenant: ml, preemptible: true,
     checkpoint_every: 40m}
  - {name: gang, at: 3600, duration: 1h, kind: training, nodes: 2, gpus: 4, priority: 10, tenant: ops}
""",
        "w.yaml",
    )
    result = replay(load_fleet(fleet, "fleet"), load_policy(POLICY, "p"), workload.arrivals, preemption=Terms())
    by_name = {j.name: j for j in result.jobs if j.requeue_of is None}
    assert by_name["whole"].placement["node"] == "gpu-01" and by_name["three"].placement["node"] == "gpu-02"
    assert sorted(j.name for j in result.jobs if j.preempted) == [
        "one",
        "small-1",
        "small-2",
        "small-3",
        "small-4",
        "three",
    ]
    gang = by_name["gang"]
    assert gang.start == 3600 and gang.placement["nodes"] == ["gpu-02", "gpu-03"]
    assert result.preemption["gpu_hours_lost"] == pytest.approx((3 * 1 + 22 + 4 * 20) / 60)


def test_a_running_gang_preempted_in_a_replay_frees_every_node_and_runs_again_whole():
    workload = read_workload(
        """
jobs:
  - {name: gang, at: 0, duration: 2h, kind: training, nodes: 2, gpus: 4, tenant: ml, preemptible: true}
  - {name: urgent, at: 1800, duration: 1h, kind: training, gpus: 4, priority: 10, tenant: ops}
  - {name: after, at: 1800, duration: 1h, kind: training, gpus: 4, priority: 10, tenant: ops}
""",
        "w.yaml",
    )
    result = replay(load_fleet(FLEET, "fleet"), load_policy(POLICY, "p"), workload.arrivals, preemption=Terms())
    jobs = {j.name: j for j in result.jobs if j.requeue_of is None}
    # one victim made room for both 4-GPU jobs: the gang held gpu-01 and gpu-02
    assert [j.name for j in result.jobs if j.preempted] == ["gang"]
    assert jobs["urgent"].start == jobs["after"].start == 1800
    (again,) = [j for j in result.jobs if j.requeue_of is not None]
    assert again.start == 5400 and again.placement["nodes"] == ["gpu-01", "gpu-02"]
