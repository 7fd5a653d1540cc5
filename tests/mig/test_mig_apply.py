"""`gpush mig apply` end to end on the simulated fleet: the API records the plan's changes,
the scheduling cycle moves them on, the node agent (a stateful fake NVML behind it) re-cuts
the GPU, the simulated Slurm cluster offers the new instances, and the work that waited for
them runs."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from broker.core.clusters import AdapterPool, add_cluster
from broker.core.models import MigChange
from broker.nodeagent.agent import run_agent
from tests.doubles.fake_nvml import FakeNvml
from tests.scheduling.test_cycle import DEFAULT_POLICY, FLEET, apply_policy, job, scheduler, submit

ONES = [f"1g.5gb@{i}" for i in range(7)]
THREES = ["3g.20gb@0", "3g.20gb@4"]


@pytest.fixture
def slurm(sessions, clock, tmp_path):
    """slurm-a and k8s-a of examples/fleet.yaml (slurm-a's state in a file, as a server keeps it)."""
    pool = AdapterPool(clock)
    config = {"fleet_yaml": FLEET, "state_file": str(tmp_path / "slurm-a.json")}
    with sessions() as session, session.begin():
        add_cluster(session, name="slurm-a", kind="sim", config=config, actor="root", now=clock())
        add_cluster(session, name="k8s-a", kind="sim", config={"fleet_yaml": FLEET}, actor="root", now=clock())
    apply_policy(sessions, pool, clock, DEFAULT_POLICY)
    return pool


@pytest.fixture
def gpus():
    """mig-01's two A100s as examples/fleet.yaml lays them out: seven 1g.5gb, two 3g.20gb,
    with a process on each 3g.20gb (the two jobs the simulated cluster runs there)."""
    nvml = FakeNvml.with_layouts("A100-SXM4-40GB", [ONES, THREES])
    nvml.gpus[1].processes = [(4101, 1, 9000), (4102, 2, 9000)]
    return nvml


@pytest.fixture
def agent(http, make_token, gpus):
    """mig-01's agent, one round at a time (an admin's token may report for any node)."""
    token = make_token(user="root", tenant="ops", role="admin")
    client = http(token=None)

    def report(allow: bool = True) -> int:
        return run_agent(
            "http://gpush.test", token, "mig-01", 30, gpus, once=True, client=client, allow_mig_changes=allow
        )

    return report


def twenty_gb_jobs(sessions, clock, n=12):
    fields = {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 20, "labels": {"sim-duration": "36000"}}
    return [submit(sessions, clock, **fields) for _ in range(n)]


def layout(gpus, index):
    from broker.nodeagent.agent import collect

    gpu = collect(gpus, "mig-01").gpus[index]
    return sorted(f"{m.profile}@{m.placement_start}" for m in gpu.mig_instances)


def test_mig_apply_recuts_a_gpu_and_the_work_that_waited_runs(engine, sessions, clock, slurm, gpus, agent, sdk):
    cycle = scheduler(engine, slurm, clock)
    # Twelve jobs of 20 GB: two run on mig-01 GPU 1's 3g.20gb instances, eight on k8s-a's,
    # two wait; mig-01 GPU 0's seven 1g.5gb instances are idle.
    jobs = twenty_gb_jobs(sessions, clock)
    cycle.run_cycle()
    cycle.run_cycle()
    assert sorted(job(sessions, j).state for j in jobs) == ["queued"] * 2 + ["running"] * 10
    assert agent() == 1
    admin = sdk(user="root", tenant="ops", role="admin")

    dry = admin.mig_apply(cluster="slurm-a", dry_run=True)
    (gpu0,) = dry["gpus"]
    assert (gpu0["node"], gpu0["gpu"], gpu0["change"], gpu0["refused"]) == ("mig-01", 0, None, None)
    assert gpu0["planned"] == THREES
    with sessions() as session:
        assert session.scalar(select(MigChange)) is None

    applied = admin.mig_apply(cluster="slurm-a")
    assert [g["change"] for g in applied["gpus"]] == [1]
    cycle.run_cycle()  # fenced, empty: the agent's turn
    assert admin.mig_change(1)["step"] == "changing"
    waiting = [job(sessions, j) for j in jobs if job(sessions, j).state == "queued"]
    assert waiting and all("mig-01 offers none: fenced for MIG change 1" in j.state_reason for j in waiting), [
        j.state_reason for j in waiting
    ]
    assert slurm_adapter(slurm, sessions).fenced() == {"mig-01": "gpush MIG change 1"}
    clock.advance(5)
    assert agent() == 2  # the report, then the one after the change
    assert layout(gpus, 0) == THREES and layout(gpus, 1) == THREES
    cycle.run_cycle()  # published, confirmed, admitted
    change = admin.mig_change(1)
    assert change["step"] == "done", change["events"]
    assert [e["step"] for e in change["events"]] == [
        "planned",
        "draining",
        "emptying",
        "changing",
        "publishing",
        "confirming",
        "done",
    ]
    assert slurm_adapter(slurm, sessions).fenced() == {}
    cycle.run_cycle()
    cycle.run_cycle()
    assert [job(sessions, j).state for j in jobs] == ["running"] * 12
    units = [u for u in slurm_adapter(slurm, sessions).inventory() if u.node == "mig-01"]
    assert {u.mig_profile: u.capacity for u in units} == {"3g.20gb": 4}
    assert admin.mig_changes() == []  # none under way
    assert [c["id"] for c in admin.mig_changes(all=True)] == [1]


def test_an_agent_without_allow_mig_changes_leaves_the_gpu_and_the_change_rolls_back(
    engine, sessions, clock, slurm, gpus, agent, sdk
):
    cycle = scheduler(engine, slurm, clock)
    twenty_gb_jobs(sessions, clock)
    cycle.run_cycle()
    cycle.run_cycle()
    agent(allow=False)
    admin = sdk(user="root", tenant="ops", role="admin")
    admin.mig_apply(cluster="slurm-a")
    cycle.run_cycle()
    clock.advance(11 * 60)
    agent(allow=False)
    assert layout(gpus, 0) == ONES
    cycle.run_cycle()  # out of time: rolling back to the layout it has
    clock.advance(30)
    agent(allow=False)
    cycle.run_cycle()
    change = admin.mig_change(1)
    assert change["step"] == "rolled-back"
    steps = [(e["step"], e["note"]) for e in change["events"]]
    assert (
        steps[3][0] == "changing" and "did not report the new layout in 10 min; rolling back to 1g.5gb@0" in steps[3][1]
    )
    assert steps[4:] == [
        ("changing", "the agent of mig-01 reports the old layout back"),
        ("publishing", "slurm-a offers that layout already"),
        ("confirming", "confirmed: slurm-a and the agent agree, no critical finding"),
        ("rolled-back", "back on its last good layout; new work may land"),
    ]
    assert slurm_adapter(slurm, sessions).fenced() == {}
    drift = admin.drift("slurm-a")
    assert any(f["kind"] == "mig_change_rolled_back" and f["gpu"] == 0 for f in drift)


def test_mig_apply_is_for_admins_and_names_a_node_no_agent_reports(sdk, slurm):
    from broker.core.errors import NotAllowed, NotFound

    with pytest.raises(NotAllowed):
        sdk(user="alice", tenant="ml").mig_apply()
    with pytest.raises(NotFound, match="no agent reports node 'gpu-01'"):
        sdk(user="root", tenant="ops", role="admin").mig_apply(node="gpu-01")


def slurm_adapter(pool, sessions):
    from broker.core.clusters import list_clusters

    with sessions() as session:
        (info,) = [c for c in list_clusters(session) if c.name == "slurm-a"]
    return pool.get(info)


AUTOMATIC = DEFAULT_POLICY + "\nmig:\n  automatic: true\n  every: 5m\n  quiet_hours: [QUIET]\n"


@pytest.mark.parametrize("quiet", ["", '"08:00-10:00"'])
def test_the_policys_automatic_mode_recuts_the_gpu_itself_outside_quiet_hours(
    engine, sessions, clock, slurm, gpus, agent, sdk, quiet
):
    apply_policy(sessions, slurm, clock, AUTOMATIC.replace("QUIET", quiet))  # the clock reads 09:00 UTC
    cycle = scheduler(engine, slurm, clock)
    jobs = twenty_gb_jobs(sessions, clock)
    agent()
    for _ in range(3):
        clock.advance(5)
        cycle.run_cycle()
        agent()
    admin = sdk(user="root", tenant="ops", role="admin")
    if quiet:
        assert admin.mig_changes(all=True) == [] and layout(gpus, 0) == ONES
        return
    (change,) = admin.mig_changes(all=True)
    assert (change["requested_by"], change["node"], change["gpu"], change["step"]) == ("scheduler", "mig-01", 0, "done")
    assert layout(gpus, 0) == THREES
    cycle.run_cycle()
    cycle.run_cycle()
    assert [job(sessions, j).state for j in jobs] == ["running"] * 12
    clock.advance(600)  # the next plan: nothing left to gain, nothing asked
    cycle.run_cycle()
    assert len(admin.mig_changes(all=True)) == 1


def test_an_agent_that_refuses_says_why_in_its_report_and_the_change_rolls_back_at_once(
    engine, sessions, clock, slurm, gpus, agent, sdk
):
    cycle = scheduler(engine, slurm, clock)
    twenty_gb_jobs(sessions, clock)
    cycle.run_cycle()
    cycle.run_cycle()
    agent()
    admin = sdk(user="root", tenant="ops", role="admin")
    admin.mig_apply(cluster="slurm-a")
    cycle.run_cycle()  # fenced and empty: the agent's turn
    gpus.gpus[0].processes.append((4242, 7, 512))  # a process on 1g.5gb@6 started meanwhile
    clock.advance(5)
    assert agent() == 2  # the report, then the one that says it refused
    assert layout(gpus, 0) == ONES  # nothing destroyed under the process
    cycle.run_cycle()
    change = admin.mig_change(1)
    notes = [e["note"] for e in change["events"]]
    assert change["target"] == ONES and any(
        "the agent of mig-01 did not make it: refused:" in n and "rolling back" in n for n in notes
    ), notes
