"""Gang reservations in the live cycle: stored from cycle to cycle, said in the waiting
job's reason (what ``gpush status`` shows), kept off by longer work, taken by shorter work,
shown in the inventory (API field and the CLI's node table), and ended when the gang starts."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import pytest
from rich.console import Console
from sqlalchemy import select

from broker.cli.clusters import inventory
from broker.cli.console import Output
from broker.cli.inventory_tables import inventory_nodes_table
from broker.core.models import GangReservation
from tests.scheduling.test_cycle import job, scheduler, submit


def reservations(sessions) -> dict[int, tuple]:
    with sessions() as session:
        return {r.job_id: (tuple(r.nodes), r.start_by) for r in session.execute(select(GangReservation)).scalars()}


def shown_inventory(sdk, columns: int, *args) -> str:
    """What `gpush inventory` prints in a terminal ``columns`` wide."""
    stdout = io.StringIO()
    out = Output(stdout=stdout, width=columns)
    assert inventory(sdk(user="root", tenant="ops", role="admin"), out, cluster=None, gpus="--gpus" in args) == 0
    return stdout.getvalue()


def test_a_gang_that_waited_gets_its_nodes_reserved_until_it_starts(
    engine, sessions, clock, fleet, http, sdk, monkeypatch
):
    start = clock()
    # slurm-a's whole-GPU nodes gpu-01 and gpu-02 (4 A100s each) are both busy
    full = submit(sessions, clock, kind="training", gpus=4, time_limit="1h", labels={"sim-duration": "3000"})
    part = submit(sessions, clock, kind="training", gpus=1, time_limit="2h", labels={"sim-duration": "3000"})
    cycle = scheduler(engine, fleet, clock)
    cycle.run_cycle()
    assert {job(sessions, full).placement["node"], job(sessions, part).placement["node"]} == {"gpu-01", "gpu-02"}
    gang = submit(sessions, clock, kind="training", nodes=2, gpus=4, time_limit="1h", labels={"sim-duration": "600"})
    cycle.run_cycle()
    assert "reserved" not in job(sessions, gang).state_reason and reservations(sessions) == {}

    clock.advance(11 * 60)  # past the default wait of 10 minutes
    cycle.run_cycle()
    waiting = job(sessions, gang)
    assert waiting.state == "queued"
    assert waiting.state_reason.endswith(
        "; reserved gpu-01, gpu-02 on slurm-a; starts by ~11:00 UTC when their jobs end"
    )
    assert reservations(sessions) == {gang: (("gpu-01", "gpu-02"), start + timedelta(hours=2))}

    # the next cycle keeps them: a job that would end after 11:00 waits, a shorter one is backfilled
    long_job = submit(sessions, clock, kind="training", gpus=1, time_limit="3h")
    short_job = submit(sessions, clock, kind="training", gpus=1, time_limit="30m", labels={"sim-duration": "600"})
    cycle.run_cycle()
    assert job(sessions, long_job).state == "queued"
    assert job(sessions, short_job).placement["node"] in ("gpu-01", "gpu-02")
    assert list(reservations(sessions)) == [gang]

    # the inventory shows the reserved nodes, in the API and in the CLI's node table
    body = http(user="root", tenant="ops", role="admin").get("/v1/inventory").json()
    nodes = {n["name"]: n for c in body["clusters"] for n in c["nodes"]}
    assert nodes["gpu-01"]["reserved_for"] == {"job_id": gang, "start_by": (start + timedelta(hours=2)).isoformat()}
    assert nodes["mig-01"]["reserved_for"] is None
    assert f"reserved for job {gang} until ~11:00: gpu-01, gpu-02 on slurm-a" in shown_inventory(sdk, 200)
    # in the reader's time zone, as every time the CLI shows (the reason says UTC)
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert f"reserved for job {gang} until ~20:00: gpu-01, gpu-02 on slurm-a" in shown_inventory(sdk, 200)
    finally:
        monkeypatch.undo()
        time.tzset()

    # once the jobs on its nodes have ended the gang starts there, and its reservation ends
    clock.advance(2 * 3600)
    cycle.run_cycle()
    cycle.run_cycle()
    placed = job(sessions, gang)
    assert placed.placement is not None and tuple(placed.placement["nodes"]) == ("gpu-01", "gpu-02")
    assert reservations(sessions) == {}


def test_a_running_gang_says_the_nodes_it_runs_on(engine, sessions, clock, fleet):
    gang = submit(sessions, clock, kind="training", nodes=2, gpus=4, time_limit="1h")
    cycle = scheduler(engine, fleet, clock)
    for _ in range(3):
        cycle.run_cycle()
    running = job(sessions, gang)
    assert running.state == "running"
    assert running.state_reason == "running on slurm-a nodes gpu-01,gpu-02"


def reserve_gpu_01_and_02(engine, sessions, clock, fleet) -> int:
    """A gang that waited past the policy's 10 minutes for slurm-a's busy gpu-01 and gpu-02:
    they are reserved for it until ~11:00."""
    for limit in ("1h", "2h"):
        submit(sessions, clock, kind="training", gpus=4, time_limit=limit, labels={"sim-duration": "3000"})
    gang = submit(sessions, clock, kind="training", nodes=2, gpus=4, time_limit="1h")
    cycle = scheduler(engine, fleet, clock)
    cycle.run_cycle()
    clock.advance(11 * 60)
    cycle.run_cycle()
    assert reservations(sessions)[gang][0] == ("gpu-01", "gpu-02")
    return gang


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("gpus", [(), ("--gpus",)])
def test_the_inventory_marks_reserved_nodes_readably_and_keeps_node_names_whole(
    engine, sessions, clock, fleet, sdk, columns, gpus
):
    gang = reserve_gpu_01_and_02(engine, sessions, clock, fleet)
    lines = shown_inventory(sdk, columns, *gpus).splitlines()
    assert max(len(line) for line in lines) <= columns
    rows = {line.split()[1]: line for line in lines if line.startswith(("slurm-a ", "k8s-a "))}
    assert {"gpu-01", "gpu-02", "mig-01", "mps-01", "t4-01", "t4-02", "a100-mig", "h100"} <= set(rows)
    for node in ("gpu-01", "gpu-02"):  # the mark fits its column, and the line below says for whom
        assert rows[node].rstrip().endswith("reserved"), rows[node]
    assert f"reserved for job {gang} until ~11:00: gpu-01, gpu-02 on slurm-a" in " ".join(lines)


@pytest.mark.parametrize("gpus", [False, True])
def test_node_names_stay_whole_at_80_columns(engine, sessions, clock, fleet, http, gpus):
    """Node names as long as a site's (``a100-sxm4-node-017``) are never cut: other columns
    give way."""
    reserve_gpu_01_and_02(engine, sessions, clock, fleet)
    body = http(user="root", tenant="ops", role="admin").get("/v1/inventory").json()
    names = []
    for c in body["clusters"]:
        for i, node in enumerate(c["nodes"]):
            node["name"] = f"a100-sxm4-node-{i:03}"
            names.append(node["name"])
    console = Console(record=True, width=80)
    console.print(inventory_nodes_table(body, gpus=gpus, width=80))
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    shown = [line.split()[1] for line in lines if line.startswith(("slurm-a ", "k8s-a "))]
    assert sorted(shown) == sorted(names)


def test_a_job_in_the_queue_before_the_gang_is_not_held_back_by_its_stored_reservation(engine, sessions, clock, fleet):
    """The reservation read back from the database knows the gang's place in the queue: a
    later cycle lets a job that came before the gang onto its nodes, and not one after it."""
    # gpu-01 full until 10:50 (its job's limit 11:00), gpu-02 one GPU taken until 11:40 (12:00)
    full = submit(sessions, clock, kind="training", gpus=4, time_limit="1h", labels={"sim-duration": "3000"})
    submit(sessions, clock, kind="training", gpus=1, time_limit="2h", labels={"sim-duration": "6000"})
    cycle = scheduler(engine, fleet, clock)
    cycle.run_cycle()
    clock.advance(1)
    earlier = submit(sessions, clock, kind="training", gpus=4, time_limit="3h")  # waits for a whole node
    clock.advance(1)
    gang = submit(sessions, clock, kind="training", nodes=2, gpus=4, time_limit="1h")
    clock.advance(1)
    later = submit(sessions, clock, kind="training", gpus=3, time_limit="4h")  # gpu-02 has 3 free
    clock.advance(11 * 60)
    cycle.run_cycle()
    assert list(reservations(sessions)) == [gang] and job(sessions, earlier).state == "queued"
    assert "gpu-02 held for a multi-node job until ~11:00 UTC" in job(sessions, later).state_reason

    clock.advance(40 * 60)  # full's job has ended: gpu-01 is free
    cycle.run_cycle()
    clock.advance(1)
    cycle.run_cycle()
    assert job(sessions, full).state == "succeeded"
    assert job(sessions, earlier).placement["node"] == "gpu-01"
    assert list(reservations(sessions)) == [gang]
    waiting = job(sessions, later)
    assert waiting.state == "queued" and "gpu-02 held for a multi-node job" in waiting.state_reason
