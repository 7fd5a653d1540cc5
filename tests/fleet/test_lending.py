"""Lending a node two clusters share, in the live cycle (broker/fleet/lending.py), on
simulated clusters that both list the node ``lend``: offered by one side at a time, moved
when the other side's work waits, never offered by both."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.core.models import NodeMove, NodeMoveEvent
from broker.inventory.reconcile import reconcile
from broker.inventory.view import ClusterInventory
from tests.scheduling.test_cycle import DEFAULT_POLICY, apply_policy, job, scheduler, submit

FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - name: mig-01
        gpus: [{model: A100-SXM4-40GB, count: 2, mig: [3g.20gb, 3g.20gb]}]
      - name: mps-01
        gpus: [{model: A100-SXM4-40GB, mps: true}]
      - name: gpu-01
        gpus: [{model: A100-SXM4-80GB, count: 1}]
      - name: lend
        gpus: [{model: A100-SXM4-40GB, count: 2, mig: [3g.20gb, 3g.20gb]}]
  k8s-a:
    flavor: k8s
    pools:
      - {name: infer, nodes: 1, gpus_per_node: 2, model: A100-SXM4-40GB, timeslice_replicas: 4}
      - {name: kmig, nodes: 1, gpus_per_node: 1, model: A100-SXM4-40GB, mig: [3g.20gb, 3g.20gb]}
      - {name: lend, nodes: 1, gpus_per_node: 2, model: A100-SXM4-40GB, timeslice_replicas: 4}
"""
LENDING = (
    DEFAULT_POLICY
    + """
lending:
  - nodes: [lend]
    clusters: [slurm-a, k8s-a]
    hold: 0
    threshold: 1
"""
)


def lending_pool(sessions, clock, fleet_yaml: str) -> AdapterPool:
    """slurm-a and k8s-a of ``fleet_yaml`` registered, simulated, under the LENDING policy."""
    made = AdapterPool(clock)
    with sessions() as session, session.begin():
        for name in ("slurm-a", "k8s-a"):
            add_cluster(session, name=name, kind="sim", config={"fleet_yaml": fleet_yaml}, actor="root", now=clock())
    apply_policy(sessions, made, clock, LENDING)
    return made


@pytest.fixture
def pool(sessions, clock):
    return lending_pool(sessions, clock, FLEET)


def adapter(pool, sessions, name):
    with sessions() as session:
        (info,) = [c for c in list_clusters(session) if c.name == name]
    return pool.get(info)


def offered_twice(pool, sessions, clock) -> list:
    inventories = {
        name: ClusterInventory(name=name, kind="sim", units=adapter(pool, sessions, name).inventory())
        for name in ("slurm-a", "k8s-a")
    }
    return [f for f in reconcile(inventories, {}, now=clock()).findings if f.kind == "gpu_claimed_twice"]


def test_a_shared_node_is_offered_by_its_home_and_lent_when_the_other_side_waits(engine, sessions, clock, pool, sdk):
    cycle = scheduler(engine, pool, clock)
    cycle.run_cycle()  # settles: both offer lend, k8s-a fences it, slurm-a (its home) keeps it
    assert adapter(pool, sessions, "k8s-a").fenced() == {"lend": "lent to slurm-a (gpush lending pool)"}
    assert offered_twice(pool, sessions, clock) == []
    fields = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 4, "labels": {"sim-duration": "36000"}}
    jobs = [submit(sessions, clock, **fields) for _ in range(12)]  # 8 replicas on infer-01: 4 wait
    cycle.run_cycle()  # 8 placed, 4 wait for time-slices: lend moves to k8s-a
    for _ in range(3):
        clock.advance(5)
        cycle.run_cycle()
    assert [job(sessions, j).state for j in jobs] == ["running"] * 12
    assert adapter(pool, sessions, "slurm-a").fenced() == {"lend": "lent to k8s-a (gpush lending pool)"}
    assert adapter(pool, sessions, "k8s-a").fenced() == {}
    assert offered_twice(pool, sessions, clock) == []
    with sessions() as session:
        (move,) = session.scalars(select(NodeMove)).all()
        steps = session.scalars(select(NodeMoveEvent.step).order_by(NodeMoveEvent.id)).all()
    assert (move.node, move.source, move.target, move.step) == ("lend", "slurm-a", "k8s-a", "done")
    assert steps == ["draining", "joining", "done"]
    assert "1 GPU-eq wait for k8s-a against 0 for slurm-a; lend idle" == move.reason
    admin = sdk(user="root", tenant="ops", role="admin")
    assert admin.lending_moves() == []  # none under way
    # gpush events (no job): the fleet's events, each step of the move in order
    events = admin.fleet_events()
    assert [(e["kind"], e["node"], e["where"], e["step"]) for e in events] == [
        ("node-move", "lend", "slurm-a -> k8s-a", step) for step in ("draining", "joining", "done")
    ]
    assert admin.fleet_events(node="elsewhere") == [] and len(admin.fleet_events(limit=1)) == 1
    from rich.console import Console

    from broker.cli.console import fleet_events_table

    screen = Console(width=80, record=True, color_system=None)
    screen.print(fleet_events_table(events))
    shown = screen.export_text()
    assert "move 1  lend  draining  slurm-a -> k8s-a: fenced on" in shown, shown
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    with pytest.raises(Exception, match="403|admin"):
        sdk(user="bob", tenant="ml").fleet_events()
    (shown,) = admin.lending_moves(all=True)
    assert (shown["node"], shown["step"], [e["step"] for e in shown["events"]]) == (
        "lend",
        "done",
        ["draining", "joining", "done"],
    )


def test_a_node_busy_at_home_drains_first_and_the_move_is_called_off_when_the_reason_goes(
    engine, sessions, clock, pool
):
    cycle = scheduler(engine, pool, clock)
    training = {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 20, "labels": {"sim-duration": "36000"}}
    held = [submit(sessions, clock, **training) for _ in range(8)]  # mig-01's 4 slices and lend's 4
    cycle.run_cycle()
    cycle.run_cycle()
    assert [job(sessions, j).state for j in held] == ["running"] * 8
    serve = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 4, "labels": {"sim-duration": "36000"}}
    waiting = [submit(sessions, clock, **serve) for _ in range(12)]
    cycle.run_cycle()
    with sessions() as session:
        (move,) = session.scalars(select(NodeMove)).all()
    assert move.step == "draining" and "lend runs 1.71 GPU-eq of work, to drain" in move.reason  # its 4 slices of 3/7
    assert adapter(pool, sessions, "slurm-a").fenced() == {"lend": "lent to k8s-a (gpush lending pool)"}
    # The waiting inference is cancelled: nothing waits for k8s-a any more.
    from broker.intake import queue
    from tests.scheduling.test_cycle import ADMIN

    queued = [j for j in waiting if job(sessions, j).state == "queued"]
    with sessions() as session, session.begin():
        for j in queued:
            queue.cancel_job(session, j, ADMIN, now=clock())
    cycle.run_cycle()
    with sessions() as session:
        move = session.get(NodeMove, move.id)
    assert move.step == "called-off"
    assert adapter(pool, sessions, "slurm-a").fenced() == {}
    assert [job(sessions, j).state for j in held] == ["running"] * 8  # nothing was stopped


@pytest.fixture(params=["as-they-come", "claim-after-sync-writes", "sync-writes-late"])
def interleaving(request, monkeypatch):
    """A cycle's threads held to one order (issue 33: the outcome of a cycle hung on which
    came first): the claim's read after the status sync's writes, or those writes held
    until the cycle waits for them or its lending step is over."""
    from broker.fleet.lending import NodeLending
    from broker.scheduling.claim import Claim
    from broker.scheduling.sync import StatusChanges, StatusSync

    read, write, start, wait, lend = (
        Claim._read,
        StatusSync.write_statuses,
        StatusChanges.start,
        StatusChanges.wait,
        NodeLending.step,
    )
    gate = threading.Event()

    def held(work):
        def run(*args, **kwargs):
            assert gate.wait(30), "the other side never came"
            gate.clear()
            return work(*args, **kwargs)

        return run

    def then_open(work):
        def run(*args, **kwargs):
            try:
                return work(*args, **kwargs)
            finally:
                gate.set()

        return run

    if request.param == "claim-after-sync-writes":
        monkeypatch.setattr(Claim, "_read", held(read))
        monkeypatch.setattr(StatusSync, "write_statuses", then_open(write))

        def start_or_open(changes, sync):
            start(changes, sync)
            if not changes.pages:  # nothing to write this cycle
                gate.set()

        monkeypatch.setattr(StatusChanges, "start", start_or_open)
    elif request.param == "sync-writes-late":
        monkeypatch.setattr(StatusSync, "write_statuses", held(write))

        def start_closed(changes, sync):
            gate.clear()
            start(changes, sync)

        monkeypatch.setattr(StatusChanges, "start", start_closed)
        monkeypatch.setattr(StatusChanges, "wait", lambda *a, **kw: (gate.set(), wait(*a, **kw))[1])
        monkeypatch.setattr(NodeLending, "step", then_open(lend))
    return request.param


def test_preemptible_work_on_a_draining_node_is_preempted_for_the_move(engine, sessions, clock, pool, interleaving):
    """Whichever of a cycle's threads comes first, the jobs preempted for the move are
    claimed from the next cycle on and the node is seen empty once they are requeued: the
    move is done, never called off by its own victims and planned again (issue 33)."""
    from broker.core.models import Preemption

    apply_policy(sessions, pool, clock, LENDING + "\npreemption:\n  grace: 10s\n")
    cycle = scheduler(engine, pool, clock)
    training = {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 20, "labels": {"sim-duration": "36000"}}
    held = [submit(sessions, clock, preemptible=True, **training) for _ in range(8)]  # mig-01's 4 and lend's 4
    cycle.run_cycle()
    cycle.run_cycle()
    serve = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 4, "labels": {"sim-duration": "36000"}}
    waiting = [submit(sessions, clock, **serve) for _ in range(12)]
    for _ in range(6):
        clock.advance(15)
        cycle.run_cycle()
    with sessions() as session:
        kinds = {p.why for p in session.scalars(select(Preemption))}
        (move,) = session.scalars(select(NodeMove)).all()
    assert kinds == {"lending"}  # the jobs on lend were told, then requeued
    assert move.step == "done"
    assert [job(sessions, j).state for j in waiting] == ["running"] * 12
    # mig-01 and k8s-a's MIG node run 6 of them again; 2 wait for a slice
    assert sorted(job(sessions, j).state for j in held) == ["queued"] * 2 + ["running"] * 6


def test_a_broker_that_restarts_mid_move_carries_the_move_on_from_its_row(engine, sessions, clock, tmp_path):
    """The move is a row: a new broker (new adapters, new scheduler) finds it draining and
    carries it on; it plans no second move of the node, and the node is never offered by both."""

    with sessions() as session, session.begin():  # the clusters' state in files, as servers keep it
        for name in ("slurm-a", "k8s-a"):
            config = {"fleet_yaml": FLEET, "state_file": str(tmp_path / f"{name}.json")}
            add_cluster(session, name=name, kind="sim", config=config, actor="root", now=clock())
    first = AdapterPool(clock)
    apply_policy(sessions, first, clock, LENDING + "\npreemption:\n  grace: 10s\n")
    cycle = scheduler(engine, first, clock)
    training = {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 20, "labels": {"sim-duration": "36000"}}
    held = [submit(sessions, clock, preemptible=True, **training) for _ in range(8)]
    cycle.run_cycle()
    cycle.run_cycle()
    serve = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 4, "labels": {"sim-duration": "36000"}}
    waiting = [submit(sessions, clock, **serve) for _ in range(12)]
    cycle.run_cycle()
    with sessions() as session:
        (move,) = session.scalars(select(NodeMove)).all()
    assert move.step == "draining"

    second = AdapterPool(clock)  # the broker restarts: only the database and the clusters' state stay
    cycle = scheduler(engine, second, clock)
    for _ in range(6):
        clock.advance(15)
        cycle.run_cycle()
        assert offered_twice(second, sessions, clock) == []
    with sessions() as session:
        moves = session.scalars(select(NodeMove)).all()
    assert [(m.id, m.step) for m in moves] == [(move.id, "done")]
    assert [job(sessions, j).state for j in waiting] == ["running"] * 12
    # As without the restart: mig-01 and k8s-a's MIG node run 6 of them again; 2 wait for a slice.
    assert sorted(job(sessions, j).state for j in held) == ["queued"] * 2 + ["running"] * 6


# -- nodes multi-node jobs keep (issue 34 item 6) -----------------------------------------

# slurm-a's whole-GPU nodes gpu-01 and lend take a two-node gang; lend is also k8s-a's,
# time-sliced, when it is lent.
GANG_FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - name: mig-01
        gpus: [{model: A100-SXM4-40GB, count: 1, mig: [3g.20gb, 3g.20gb]}]
      - name: mps-01
        gpus: [{model: A100-SXM4-40GB, mps: true}]
      - name: gpu-01
        gpus: [{model: A100-SXM4-80GB, count: 2}]
      - name: lend
        gpus: [{model: A100-SXM4-80GB, count: 2}]
  k8s-a:
    flavor: k8s
    pools:
      - {name: infer, nodes: 1, gpus_per_node: 2, model: A100-SXM4-80GB, timeslice_replicas: 4}
      - {name: kmig, nodes: 1, gpus_per_node: 1, model: A100-SXM4-40GB, mig: [3g.20gb, 3g.20gb]}
      - {name: lend, nodes: 1, gpus_per_node: 2, model: A100-SXM4-80GB, timeslice_replicas: 4}
"""
SERVE = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 4, "labels": {"sim-duration": "36000"}}


@pytest.fixture
def gang_pool(sessions, clock):
    return lending_pool(sessions, clock, GANG_FLEET)


def test_a_node_a_running_gang_has_a_rank_on_is_not_lent(engine, sessions, clock, gang_pool):
    cycle = scheduler(engine, gang_pool, clock)
    cycle.run_cycle()  # settles: slurm-a keeps lend
    gang = submit(sessions, clock, kind="training", nodes=2, gpus=2, labels={"sim-duration": "600"})
    cycle.run_cycle()
    cycle.run_cycle()
    placed = job(sessions, gang)
    assert (placed.state, placed.placement["nodes"]) == ("running", ["gpu-01", "lend"])  # rank 1 on lend
    waiting = [submit(sessions, clock, **SERVE) for _ in range(12)]  # 8 fit on infer-01: 4 wait for k8s-a
    for _ in range(3):
        clock.advance(5)
        cycle.run_cycle()
    with sessions() as session:
        assert session.scalars(select(NodeMove)).all() == []
    assert adapter(gang_pool, sessions, "slurm-a").fenced() == {}
    assert job(sessions, gang).state == "running"
    assert sorted(job(sessions, j).state for j in waiting) == ["queued"] * 4 + ["running"] * 8
    # once the gang has ended, lend is lent as before
    clock.advance(600)
    for _ in range(4):
        clock.advance(5)
        cycle.run_cycle()
    with sessions() as session:
        (move,) = session.scalars(select(NodeMove)).all()
    assert (move.node, move.target, move.step) == ("lend", "k8s-a", "done")


def test_a_node_a_gang_reservation_holds_is_not_lent(engine, sessions, clock, gang_pool):
    cycle = scheduler(engine, gang_pool, clock)
    cycle.run_cycle()
    busy = {"kind": "training", "gpus": 2, "time_limit": "2h", "labels": {"sim-duration": "7000"}}
    ones = [submit(sessions, clock, **busy) for _ in range(2)]
    cycle.run_cycle()
    assert {job(sessions, j).placement["node"] for j in ones} == {"gpu-01", "lend"}
    gang = submit(sessions, clock, kind="training", nodes=2, gpus=2, time_limit="1h")
    clock.advance(11 * 60)  # past the default wait before a reservation
    cycle.run_cycle()
    assert "reserved gpu-01, lend on slurm-a" in job(sessions, gang).state_reason
    # k8s-a waits for more than slurm-a (the gang's 4 GPUs): 3 of 4 services of 8 replicas (6 GPU-eq)
    wide = {**SERVE, "elastic": {"min_replicas": 8, "max_replicas": 8}}
    served = [submit(sessions, clock, **wide) for _ in range(4)]
    for _ in range(3):
        clock.advance(5)
        cycle.run_cycle()
    assert sorted(job(sessions, j).state for j in served) == ["queued"] * 3 + ["running"]
    with sessions() as session:
        assert session.scalars(select(NodeMove)).all() == []
    assert adapter(gang_pool, sessions, "slurm-a").fenced() == {}
    assert "reserved gpu-01, lend on slurm-a" in job(sessions, gang).state_reason
