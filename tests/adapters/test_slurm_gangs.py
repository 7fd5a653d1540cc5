"""Multi-node jobs (gangs) on Slurm (issue 34): one batch job on the nodes gpush chose,
its command run through srun on every node with the launchers' environment, counted
and cancelled as one job. Recorded answers; the rendered scripts run for real, with a
stand-in srun. integration/test_slurm_gangs.py runs them on the real test cluster."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from adapters.slurm.records import Gres, SlurmJob, SlurmNode
from adapters.slurm.render import render
from broker.core.adapter import BackendState, Placement, Sharing
from broker.core.schemas import JobSpec
from tests.adapters.test_slurm_adapter import (
    V2205,
    V2411,
    V2605,
    RecordedRestd,
    RecordedSlurm,
    _workdir,  # noqa: F401 (the jobs' log directory in the test's own directory)
    adapter,
    recorded_2205,
    rest,
    spec,
)


def gang(gpus: int = 1, nodes: tuple[str, ...] = ("gpu01", "gpu02")) -> Placement:
    return Placement(
        "slurm-a",
        Sharing.SLURM_EXCLUSIVE,
        gpus,
        float(gpus * len(nodes)),
        node=nodes[0],
        gpu_model="A100-SXM4-40GB",
        nodes=nodes,
    )


def two_nodes(**fields: Any) -> JobSpec:
    return spec(["python", "train.py"], nodes=2, isolation="exclusive", **fields)


def test_a_gang_is_one_batch_job_with_its_per_node_request_on_the_nodes_gpush_chose():
    job = render(7, two_nodes(cpus=4, memory="8G"), gang(), tag="gpush", gres_type="a100")
    args = job.sbatch_args()
    for arg in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--nodelist=gpu01,gpu02",
        "--gres=gpu:a100:1",  # per node, as Slurm reads --gres
        "--cpus-per-task=4",
        "--mem=8192M",  # per node
    ):
        assert arg in args
    assert "srun" in job.script
    assert job.environment["WORLD_SIZE"] == "2" and job.environment["NNODES"] == "2"

    # cpus is per node: four tasks on each share its 8 CPUs
    four = render(7, two_nodes(cpus=8, tasks_per_node=4), gang(), tag="gpush", gres_type="a100")
    assert {"--ntasks-per-node=4", "--cpus-per-task=2"} <= set(four.sbatch_args())
    assert four.environment["WORLD_SIZE"] == "8" and four.environment["LOCAL_WORLD_SIZE"] == "4"


def test_a_one_node_job_is_one_task_on_the_node_gpush_chose():
    job = render(7, spec(), replace(gang(nodes=("gpu01",)), nodes=()), tag="gpush", gres_type="a100")
    assert not [a for a in job.sbatch_args() if a.startswith(("--nodes", "--ntasks"))]
    # Pinned, so that Slurm does not run it on a node gpush reserved for a gang.
    assert "--nodelist=gpu01" in job.sbatch_args()
    assert "srun" not in job.script and "WORLD_SIZE" not in job.environment


FAKE_SRUN = """#!/bin/sh
# Stands in for srun: records its options, then runs the command as Slurm would run
# task $FAKE_TASK of node $FAKE_NODE.
while [ "${1#--}" != "$1" ]; do echo "$1" >> "$FAKE_DIR/srun-args"; shift; done
SLURM_NODEID=$FAKE_NODE SLURM_PROCID=$FAKE_TASK SLURM_LOCALID=0 exec "$@"
"""


def printing_env(script: str) -> str:
    """The script with the job's program replaced by one that prints its environment."""
    assert script.count(" gpush-task python train.py\n") == 1
    return script.replace(" gpush-task python train.py\n", " gpush-task /usr/bin/env -0\n")


def run_task(script: str, tmp_path: Path, *, batch_node: str, node: int, task: int) -> dict[str, str]:
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    env = {"SLURMD_NODENAME": batch_node, "FAKE_DIR": str(tmp_path), "FAKE_NODE": str(node), "FAKE_TASK": str(task)}
    out = subprocess.run(["/bin/sh", str(tmp_path / "job.sh")], capture_output=True, env=env, timeout=10, check=True)
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if item)


def test_every_task_of_a_gang_gets_the_rendezvous_and_its_own_ranks(tmp_path):
    path = f"{tmp_path}:/usr/bin:/bin"
    job = render(
        9,
        two_nodes(env={"PATH": path, "NCCL_DEBUG": "INFO"}, tasks_per_node=2, cpus=2),
        gang(),
        tag="gpush",
        gres_type="a100",
        node_addresses={"gpu01": "10.0.0.1", "gpu02": "10.0.0.2", "mig01": "10.0.0.9"},
    )
    script = printing_env(job.script)
    seen = run_task(script, tmp_path, batch_node="gpu01", node=1, task=3)

    assert seen["MASTER_ADDR"] == "10.0.0.1"  # the node that runs the batch script: Slurm's node 0
    assert seen["MASTER_PORT"] == "20009"
    assert (seen["WORLD_SIZE"], seen["NNODES"], seen["LOCAL_WORLD_SIZE"]) == ("4", "2", "2")
    assert (seen["NODE_RANK"], seen["RANK"], seen["LOCAL_RANK"]) == ("1", "3", "0")
    assert (seen["GPUSH_JOB_ID"], seen["NCCL_DEBUG"]) == ("9", "INFO")
    srun = (tmp_path / "srun-args").read_text().split()
    assert srun == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--cpus-per-task=1"]

    # the batch script on a node gpush has no address for: its name is the rendezvous
    assert run_task(script, tmp_path, batch_node="gpu07", node=0, task=0)["MASTER_ADDR"] == "gpu07"


def test_a_job_that_sets_the_rendezvous_itself_keeps_its_values(tmp_path):
    job = render(
        9,
        two_nodes(env={"PATH": f"{tmp_path}:/usr/bin:/bin", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}),
        gang(),
        tag="gpush",
        gres_type="a100",
        node_addresses={"gpu01": "10.0.0.1"},
    )
    seen = run_task(printing_env(job.script), tmp_path, batch_node="gpu01", node=0, task=0)
    assert (seen["MASTER_ADDR"], seen["MASTER_PORT"], seen["NODE_RANK"]) == ("head", "1234", "0")


def test_rest_on_22_05_sends_the_gang_as_sbatch_options():
    restd = RecordedRestd(V2205)
    job = render(7, two_nodes(), gang(), tag="gpush", gres_type="a100")
    rest(restd).submit(job)
    sent = json.loads(restd.requests[-1].content)["job"]
    # v0.0.38 refuses "required_nodes" ("Disabled key") and takes sbatch's -w as "nodelist"
    assert (sent["nodes"], sent["tasks_per_node"], sent["nodelist"]) == ("2", 1, "gpu01,gpu02")
    assert "required_nodes" not in sent and sent["gres"] == "gpu:a100:1"


@pytest.mark.parametrize("folder", [V2411, V2605])
def test_rest_on_24_11_and_26_05_sends_the_gang_in_the_job_description(folder):
    restd = RecordedRestd(folder)
    job = render(7, two_nodes(tasks_per_node=2, cpus=2), gang(), tag="gpush", gres_type="a100")
    rest(restd).submit(job)
    sent = json.loads(restd.requests[-1].content)["job"]
    assert (sent["nodes"], sent["tasks_per_node"], sent["required_nodes"]) == ("2", 2, ["gpu01", "gpu02"])
    assert "nodelist" not in sent and sent["tres_per_node"] == "gres/gpu:a100=1"


def test_the_adapter_submits_a_gang_whole_with_the_address_of_each_node():
    slurm = recorded_2205()
    slurm.node_list.append(
        replace(next(n for n in slurm.node_list if n.name == "gpu01"), name="gpu02", address="10.0.0.2")
    )

    assert adapter(slurm).submit(20, two_nodes(), gang()) == "1001"

    sent = slurm.submitted[0]
    assert (sent.nodes, sent.nodelist, sent.gres) == (2, ("gpu01", "gpu02"), "gpu:a100:1")
    assert "gpu01) MASTER_ADDR=127.0.0.1 ;;" in sent.script  # the recorded node's NodeAddr
    assert "gpu02) MASTER_ADDR=10.0.0.2 ;;" in sent.script


def running_gang(slurm: RecordedSlurm) -> SlurmJob:
    """gpush-30 running on gpu01 and gpu02 with one A100 of each."""
    template = slurm.job_list[0]
    job = replace(
        template,
        job_id="77",
        name="gpush-30",
        comment="gpush:job-30 tenant=ml user=alice",
        states=("RUNNING",),
        reason="None",
        nodes="gpu[01-02]",
        tres_per_node=(Gres("gpu", "a100", 1),),
        exit_code=None,
        end_time=None,
    )
    slurm.job_list.append(job)
    return job


def two_whole_gpu_nodes() -> RecordedSlurm:
    slurm = recorded_2205()
    base = next(n for n in slurm.node_list if n.name == "gpu01")
    used = (Gres("gpu", "a100", 1),)
    slurm.node_list = [n for n in slurm.node_list if n.name != "gpu01"] + [
        replace(base, name=name, gres_used=used, states=("MIXED",)) for name in ("gpu01", "gpu02")
    ]
    return slurm


def test_the_inventory_counts_the_gpus_a_gang_holds_on_every_node_and_status_reports_one_job():
    slurm = two_whole_gpu_nodes()
    running_gang(slurm)
    gpush = adapter(slurm)

    units = {u.node: u for u in gpush.inventory() if u.sharing == Sharing.SLURM_EXCLUSIVE}
    assert {n: (u.capacity, u.allocated) for n, u in units.items()} == {"gpu01": (2, 1), "gpu02": (2, 1)}

    found = gpush.find(30)
    assert found is not None and (found.backend_id, found.state) == ("77", BackendState.RUNNING)
    assert found.node == "gpu[01-02]"
    reported = [j for j in gpush.statuses(None).jobs if j.job_id == 30]
    assert [(j.backend_id, j.state) for j in reported] == [("77", BackendState.RUNNING)]

    gpush.cancel(30)
    assert slurm.cancelled == ["77"]  # the one Slurm job: every node's tasks end with it


def test_nodes_read_their_address():
    node = SlurmNode.of({"name": "gpu01", "address": "10.1.2.3", "state": "IDLE"})
    assert node.address == "10.1.2.3"
