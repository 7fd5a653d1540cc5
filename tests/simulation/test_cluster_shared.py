"""A simulated cluster shared by several broker processes through its state file: each
instance acts on the file's state, never on a stale view of its own (issue 14, finding 6:
a new leader never learnt of the jobs its predecessor submitted)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from broker.core.adapter import BackendState
from broker.simulation.cluster import SimulatedCluster
from tests.simulation.test_fleet import DEMO_FLEET, VirtualClock, at, slice_1g, spec


def pair(tmp_path: Path, clock: VirtualClock) -> tuple[SimulatedCluster, SimulatedCluster]:
    """Two instances of one cluster, as two broker processes on one database have."""
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}
    return SimulatedCluster("slurm-a", config, clock=clock), SimulatedCluster("slurm-a", config, clock=clock)


def test_an_instance_that_did_not_submit_sees_the_jobs_the_other_did(tmp_path) -> None:
    clock = VirtualClock()
    leader, replica = pair(tmp_path, clock)
    replica.health()  # the replica has its own (empty) view loaded
    for job_id in (1, 2, 3):
        leader.submit(job_id, spec(duration=600), slice_1g())
    # The leader dies; the replica takes over: it knows every job and when each ends.
    assert {job.job_id for job in replica.statuses().jobs} == {1, 2, 3}
    assert replica.find(2) is not None
    clock.at(601)
    ended = {job.job_id: job.state for job in replica.statuses().jobs}
    assert ended == dict.fromkeys((1, 2, 3), BackendState.SUCCEEDED)


def test_a_stale_instance_never_writes_its_view_over_the_others_jobs(tmp_path) -> None:
    clock = VirtualClock()
    leader, replica = pair(tmp_path, clock)
    leader.submit(1, spec(duration=600), slice_1g())
    clock.at(10)
    replica.health()  # an API replica's health check: it used to save its empty view
    replica.inventory()
    again = SimulatedCluster(
        "slurm-a", {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}, clock=clock
    )
    assert again.find(1) is not None and again.find(1).state is BackendState.RUNNING


def test_cursors_stay_valid_across_instances(tmp_path) -> None:
    clock = VirtualClock()
    leader, replica = pair(tmp_path, clock)
    leader.submit(1, spec(duration=60), slice_1g())
    cursor = leader.statuses().cursor
    clock.at(61)
    page = replica.statuses(cursor)  # the new leader reads on from the old leader's cursor
    assert [(job.job_id, job.state) for job in page.jobs] == [(1, BackendState.SUCCEEDED)]
    assert page.jobs[0].at == at(60)


def _submit_many(state_file: str, first: int, count: int) -> None:
    clock = VirtualClock()
    cluster = SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET), "state_file": state_file}, clock=clock)
    for job_id in range(first, first + count):
        cluster.submit(job_id, spec(duration=3600), slice_1g(node=None))


def test_processes_submitting_side_by_side_lose_no_job(tmp_path) -> None:
    state_file = str(tmp_path / "slurm-a.json")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_submit_many, args=(state_file, 1 + 40 * n, 40)) for n in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    reader = SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET), "state_file": state_file}, clock=VirtualClock())
    assert {job.job_id for job in reader.statuses().jobs} == set(range(1, 121))
