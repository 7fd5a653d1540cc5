"""Fencing nodes and changing MIG layouts on a simulated cluster: a fenced node takes no
new job and lets its running ones go on; a published MIG layout changes the node's
pools at once, is refused when it would take instances from jobs, and outlives a
restart through the state file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.core.adapter import BackendState, MigPublisher, NodeFencer, Rejected, Sharing, undeclared_or_missing
from broker.simulation.cluster import SimulatedCluster
from tests.simulation.test_fleet import DEMO_FLEET, VirtualClock, placement, slice_1g, spec, units

# mig-01 of slurm-a: GPU 0 holds seven 1g.5gb instances, GPU 1 two 3g.20gb.
SPLIT = ["3g.20gb@0", "2g.10gb@4", "1g.5gb@6"]


def whole(count: int = 1, node: str | None = None):
    return placement(Sharing.SLURM_EXCLUSIVE, count, node=node)


def slice_3g(node: str | None = "mig-01"):
    return placement(Sharing.SLURM_MIG, mig_profile="3g.20gb", node=node)


def state(cluster: SimulatedCluster, job_id: int) -> BackendState:
    return cluster.find(job_id).state


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def slurm(clock: VirtualClock, tmp_path: Path) -> SimulatedCluster:
    return SimulatedCluster(
        "slurm-a", {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}, clock=clock
    )


def test_the_simulator_declares_both_capabilities_truly() -> None:
    assert undeclared_or_missing(SimulatedCluster) == []
    assert {NodeFencer, MigPublisher} <= SimulatedCluster.capabilities
    assert SimulatedCluster.changes_gpus is False  # a node agent changes the GPU first


# -- fencing -----------------------------------------------------------------------------


def test_a_fenced_node_starts_nothing_new_and_its_running_jobs_go_on(slurm, clock) -> None:
    slurm.submit(1, spec(duration=600), whole(node="gpu-01"))
    slurm.fence("gpu-01", "draining for a MIG change")
    assert slurm.fenced() == {"gpu-01": "draining for a MIG change"}
    # An unpinned job passes the fenced node by (it has three GPUs free) ...
    slurm.submit(2, spec(duration=3600), whole(4))
    assert slurm.find(2).node == "gpu-02"
    # ... and one with nowhere else to go waits, even when the fenced node empties.
    slurm.submit(3, spec(duration=60), whole(4))
    assert state(slurm, 3) is BackendState.PENDING
    clock.at(601)
    assert state(slurm, 1) is BackendState.SUCCEEDED
    assert state(slurm, 3) is BackendState.PENDING
    assert units(slurm, "gpu-01", Sharing.SLURM_EXCLUSIVE).capacity == 4  # the inventory still lists it

    slurm.unfence("gpu-01")
    job = slurm.find(3)
    assert (job.state, job.node) == (BackendState.RUNNING, "gpu-01")
    assert slurm.fenced() == {}


def test_a_job_pinned_to_a_fenced_node_waits_saying_why(slurm) -> None:
    slurm.fence("mig-01", "maintenance")
    slurm.fence("mig-01", "maintenance")  # again: no error
    slurm.submit(1, spec(duration=60), slice_1g())
    job = slurm.find(1)
    assert job.state is BackendState.PENDING
    assert "fenced" in job.reason and "maintenance" in job.reason
    slurm.unfence("mig-01")
    slurm.unfence("mig-01")  # not fenced: no error
    assert state(slurm, 1) is BackendState.RUNNING


def test_fencing_an_unknown_node_is_refused_naming_it(slurm) -> None:
    with pytest.raises(Rejected, match="no node gpu-99"):
        slurm.fence("gpu-99", "maintenance")


def test_a_job_on_a_fenced_node_may_shrink_but_not_grow(slurm) -> None:
    slurm.submit(1, spec(duration=600), placement(Sharing.SLURM_EXCLUSIVE, 1, node="gpu-01", replicas=2))
    slurm.fence("gpu-01", "maintenance")
    with pytest.raises(Rejected, match="fenced"):
        slurm.scale(1, 3)
    assert slurm.scale(1, 1) == 1


# -- MIG layouts -------------------------------------------------------------------------


def test_a_published_layout_changes_the_inventory_and_starts_a_waiting_job(slurm) -> None:
    assert slurm.mig_published("mig-01", 1) == ("3g.20gb@0", "3g.20gb@4")
    for job_id in range(1, 9):  # seven 1g.5gb instances: the eighth job waits
        slurm.submit(job_id, spec(duration=600), slice_1g())
    assert state(slurm, 8) is BackendState.PENDING
    cursor = slurm.statuses().cursor

    slurm.publish_mig("mig-01", 1, list(reversed(SPLIT)))
    assert slurm.mig_published("mig-01", 1) == tuple(SPLIT)
    counts = {u.mig_profile: u.capacity for u in slurm.inventory() if u.node == "mig-01"}
    assert counts == {"1g.5gb": 8, "3g.20gb": 1, "2g.10gb": 1}
    # The waiting job took the new instance; the running ones went on, and so did the cursor.
    assert [(job.job_id, job.state) for job in slurm.statuses(cursor).jobs] == [(8, BackendState.RUNNING)]
    assert all(state(slurm, job_id) is BackendState.RUNNING for job_id in range(1, 9))


def test_publishing_the_layout_the_gpu_has_changes_nothing(slurm) -> None:
    slurm.publish_mig("mig-01", 1, ["3g.20gb@4", "3g.20gb@0"])
    assert units(slurm, "mig-01", Sharing.SLURM_MIG, "3g.20gb").capacity == 2
    slurm.publish_mig("mig-01", 1, [])  # MIG mode on, no instance
    assert slurm.mig_published("mig-01", 1) == ()
    assert {u.mig_profile for u in slurm.inventory() if u.node == "mig-01"} == {"1g.5gb"}


@pytest.mark.parametrize(
    ("node", "gpu", "instances", "words"),
    [
        pytest.param("mig-01", 1, ["3g.20gb@0", "3g.20gb@2"], "cannot start at memory slot 2", id="bad-start"),
        pytest.param("mig-01", 1, ["3g.20gb@0", "2g.10gb@2"], "overlap", id="overlap"),
        pytest.param("mig-01", 1, ["3g.20gb"], "such as 3g.20gb@0", id="no-start"),
        pytest.param("mig-01", 1, ["9g.90gb@0"], "no MIG profile", id="unknown-profile"),
        pytest.param("gpu-01", 0, ["3g.20gb@0"], "not in MIG mode", id="whole-gpu"),
        pytest.param("mig-01", 5, ["3g.20gb@0"], "no GPU 5", id="no-such-gpu"),
        pytest.param("mig-99", 0, ["3g.20gb@0"], "no node mig-99", id="unknown-node"),
    ],
)
def test_publishing_refuses_what_the_gpu_cannot_take(slurm, node, gpu, instances, words) -> None:
    with pytest.raises(Rejected, match=words):
        slurm.publish_mig(node, gpu, instances)
    assert slurm.mig_published("mig-01", 1) == ("3g.20gb@0", "3g.20gb@4")


def test_publishing_refuses_to_take_an_instance_a_running_job_holds(slurm) -> None:
    slurm.submit(1, spec(duration=600), slice_3g())
    slurm.submit(2, spec(duration=600), slice_3g())
    with pytest.raises(Rejected, match="running jobs hold 2 3g.20gb"):
        slurm.publish_mig("mig-01", 1, SPLIT)
    assert units(slurm, "mig-01", Sharing.SLURM_MIG, "3g.20gb").capacity == 2
    slurm.cancel(2)
    slurm.publish_mig("mig-01", 1, SPLIT)  # one 3g.20gb is left for the job still running
    assert state(slurm, 1) is BackendState.RUNNING
    assert units(slurm, "mig-01", Sharing.SLURM_MIG, "3g.20gb").allocated == 1


def test_publishing_refuses_to_take_the_last_instances_jobs_wait_for(slurm) -> None:
    slurm.fence("mig-01", "MIG change")  # drained first, as a layout change is made
    slurm.submit(1, spec(duration=600), slice_3g())  # pinned to the node
    with pytest.raises(Rejected, match="1 job.* wait there for 3g.20gb"):
        slurm.publish_mig("mig-01", 1, [])
    slurm.cancel(1)
    slurm.submit(2, spec(duration=600), slice_3g(node=None))  # only mig-01 has 3g.20gb
    with pytest.raises(Rejected, match="no node would have any"):
        slurm.publish_mig("mig-01", 1, [])
    slurm.cancel(2)
    slurm.publish_mig("mig-01", 1, [])
    assert slurm.mig_published("mig-01", 1) == ()
    assert slurm.fenced() == {"mig-01": "MIG change"}  # the change keeps the fence


def test_layouts_and_fences_outlive_a_restart(slurm, clock, tmp_path) -> None:
    other = SimulatedCluster(
        "slurm-a", {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}, clock=clock
    )
    other.health()  # an instance with its own view, from before the change
    slurm.submit(1, spec(duration=600), slice_3g())
    slurm.publish_mig("mig-01", 1, SPLIT)
    slurm.fence("gpu-02", "bad fan")
    restarted = SimulatedCluster(
        "slurm-a", {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}, clock=clock
    )
    for cluster in (other, restarted):
        assert cluster.mig_published("mig-01", 1) == tuple(SPLIT)
        assert cluster.fenced() == {"gpu-02": "bad fan"}
        assert units(cluster, "mig-01", Sharing.SLURM_MIG, "2g.10gb").capacity == 1
        assert units(cluster, "mig-01", Sharing.SLURM_MIG, "3g.20gb").allocated == 1
    clock.at(601)
    assert state(restarted, 1) is BackendState.SUCCEEDED


def test_a_state_file_from_before_fences_and_layouts_still_loads(slurm, clock, tmp_path) -> None:
    slurm.submit(1, spec(duration=600), slice_1g())
    path = tmp_path / "slurm-a.json"
    saved = json.loads(path.read_text())
    del saved["fenced"], saved["mig"]
    path.write_text(json.dumps(saved))
    restarted = SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET), "state_file": str(path)}, clock=clock)
    assert state(restarted, 1) is BackendState.RUNNING
    assert restarted.fenced() == {}
    assert restarted.mig_published("mig-01", 1) == ("3g.20gb@0", "3g.20gb@4")
