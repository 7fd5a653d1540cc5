"""A simulated cluster runs a multi-node job (a gang): its units on every node at once
or on none, ended together, reported as one job, with output per rank."""

from __future__ import annotations

import pytest

from broker.core.adapter import BackendState, Placement, Rejected, Sharing
from broker.simulation.cluster import SimulatedCluster
from tests.simulation.test_fleet import DEMO_FLEET, VirtualClock, placement, spec, units


def gang(units_per_node: int = 4, nodes: tuple[str, ...] = ("gpu-01", "gpu-02")) -> Placement:
    return Placement(
        "slurm-a",
        Sharing.SLURM_EXCLUSIVE,
        units_per_node,
        float(units_per_node * len(nodes)),
        node=nodes[0],
        gpu_model="A100-SXM4-80GB",
        nodes=nodes,
    )


def free(cluster: SimulatedCluster, node: str) -> int:
    return units(cluster, node, Sharing.SLURM_EXCLUSIVE).free


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def slurm(clock: VirtualClock) -> SimulatedCluster:
    return SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET)}, clock=clock)


def test_a_gang_takes_its_units_on_every_node_and_ends_on_all_together(slurm, clock) -> None:
    slurm.submit(1, spec(duration=600, nodes=2, gpus=4, tasks_per_node=4), gang())
    job = slurm.find(1)
    assert (job.state, job.node) == (BackendState.RUNNING, "gpu-01,gpu-02")
    assert (free(slurm, "gpu-01"), free(slurm, "gpu-02")) == (0, 0)
    clock.at(601)
    assert slurm.find(1).state is BackendState.SUCCEEDED
    assert (free(slurm, "gpu-01"), free(slurm, "gpu-02")) == (4, 4)


def test_a_gang_never_starts_on_part_of_its_nodes(slurm, clock) -> None:
    one = placement(Sharing.SLURM_EXCLUSIVE, 2, node="gpu-02", gpu_model="A100-SXM4-80GB")
    slurm.submit(1, spec(duration=300, gpus=2), one)
    slurm.submit(2, spec(duration=600, nodes=2, gpus=4), gang())
    waiting = slurm.find(2)
    assert waiting.state is BackendState.PENDING
    assert "waiting for all 2 nodes at once (1 have room now)" in waiting.reason
    assert (free(slurm, "gpu-01"), free(slurm, "gpu-02")) == (4, 2)  # nothing taken on gpu-01
    clock.at(301)  # the one-node job ends: the gang starts on both at its end time
    started = slurm.find(2)
    assert started.state is BackendState.RUNNING
    assert (free(slurm, "gpu-01"), free(slurm, "gpu-02")) == (0, 0)
    slurm.cancel(2)
    assert (free(slurm, "gpu-01"), free(slurm, "gpu-02")) == (4, 4)


def test_status_shows_the_gang_as_one_job_and_each_rank_has_its_output(slurm) -> None:
    slurm.submit(1, spec(duration=600, nodes=2, gpus=4, tasks_per_node=2), gang())
    statuses = [j for j in slurm.statuses().jobs if j.job_id == 1]
    assert [j.node for j in statuses] == ["gpu-01,gpu-02"]
    rank3 = slurm.logs(1, "sim-slurm-a-1", replica=3)
    assert "rank 3 of 4 (node rank 1 of 2) started on gpu-02, rendezvous at gpu-01" in rank3.text
    assert "node gpu-02" in rank3.location
    with pytest.raises(Rejected, match="no rank 4"):
        slurm.logs(1, "sim-slurm-a-1", replica=4)


def test_a_gang_outlives_a_restart_of_its_simulated_cluster(tmp_path, clock) -> None:
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}
    first = SimulatedCluster("slurm-a", config, clock=clock)
    first.submit(1, spec(duration=600, nodes=2, gpus=4), gang())
    again = SimulatedCluster("slurm-a", config, clock=clock)
    assert (free(again, "gpu-01"), free(again, "gpu-02")) == (0, 0)
    clock.at(601)
    assert again.find(1).state is BackendState.SUCCEEDED
    assert (free(again, "gpu-01"), free(again, "gpu-02")) == (4, 4)


def test_a_gang_on_a_node_twice_or_too_small_is_rejected(slurm) -> None:
    with pytest.raises(Rejected, match="names a node twice"):
        slurm.submit(1, spec(nodes=2, gpus=4), gang(nodes=("gpu-01", "gpu-01")))
    with pytest.raises(Rejected, match="can never hold"):
        slurm.submit(2, spec(nodes=2, gpus=8), gang(8))
