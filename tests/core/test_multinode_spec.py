"""A multi-node job's spec: what it holds, and what is refused before anything is stored."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.intake.jobfile import validate_spec


def job(**fields: Any) -> JobSpec:
    return validate_spec({"kind": "training", "command": ["torchrun", "train.py"], **fields})


def test_a_job_is_one_node_with_one_task_unless_it_says_more():
    spec = job(gpus=8)
    assert (spec.nodes, spec.tasks_per_node) == (1, 1)


def test_nodes_and_tasks_per_node_are_kept_with_the_per_node_request():
    spec = job(nodes=4, gpus=8, tasks_per_node=8, cpus=64, memory="512G")
    assert (spec.nodes, spec.gpus, spec.tasks_per_node, spec.cpus, spec.memory) == (4, 8, 8, 64, "512G")


def test_a_multi_node_job_may_ask_mig_slices_on_each_node():
    spec = job(nodes=2, isolation="hardware", gpu_memory_gb=10, gpus=2)
    assert (spec.nodes, spec.isolation.value) == (2, "hardware")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        pytest.param({"nodes": 0}, "greater than or equal to 1", id="zero"),
        pytest.param({"nodes": 257}, "less than or equal to 256", id="too-many"),
        pytest.param({"tasks_per_node": 0}, "greater than or equal to 1", id="no-tasks"),
        pytest.param(
            {"nodes": 2, "isolation": "process", "gpu_memory_gb": 8},
            "MPS shares a GPU on one node and cannot span nodes; use isolation exclusive",
            id="mps",
        ),
        pytest.param(
            {"nodes": 2, "isolation": "none", "gpu_memory_gb": 8},
            "time-slicing shares a GPU on one node and cannot span nodes",
            id="time-slicing",
        ),
        pytest.param(
            {"nodes": 3, "kind": "inference", "isolation": "exclusive", "elastic": {"max_replicas": 4}},
            "nodes 3 with elastic replicas",
            id="elastic",
        ),
    ],
)
def test_what_cannot_run_on_several_nodes_is_refused_naming_the_field(fields, words):
    field = "tasks_per_node" if "tasks_per_node" in fields else "nodes"
    with pytest.raises(InvalidRequest) as info:
        job(**fields)
    assert words in str(info.value)
    assert info.value.details[0]["field"] == field


def test_a_one_node_job_hashes_as_before_multi_node_jobs_existed():
    spec = job(gpus=2)
    body = spec.model_dump(mode="json")
    old = {k: v for k, v in body.items() if k not in ("nodes", "tasks_per_node")}
    assert JobSpec.fingerprint_of(body) == JobSpec.fingerprint_of(old)
    assert job(gpus=2, nodes=2).fingerprint() != spec.fingerprint()


def test_the_api_refuses_mps_across_nodes_with_a_422_naming_nodes(http):
    answer = http().post(
        "/v1/jobs",
        json={"kind": "training", "nodes": 2, "isolation": "process", "gpu_memory_gb": 8, "command": ["x"]},
    )
    assert answer.status_code == 422, answer.text
    detail = answer.json()["error"]["details"][0]
    assert detail["field"] == "nodes" and "cannot span nodes" in answer.text


def test_the_cli_takes_sbatchs_letters_and_refuses_time_slicing_across_nodes_with_exit_2(gpush):
    placed = gpush("submit", "-k", "training", "-N", "2", "-G", "8", "--ntasks-per-node", "8", "--", "torchrun", "t.py")
    assert placed.code == 0, placed.err
    spec = gpush("status", placed.out.strip(), "--json").json["spec"]
    assert (spec["nodes"], spec["gpus"], spec["tasks_per_node"]) == (2, 8, 8)
    refused = gpush("submit", "-k", "inference", "-N", "2", "--gpu-memory-gb", "8", "--", "serve")
    assert refused.code == 2
    assert "nodes" in refused.err and "time-slicing" in refused.err


def test_a_job_file_takes_nodes(gpush, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("kind: training\nnodes: 3\ngpus: 4\ntasks_per_node: 4\ncommand: [torchrun, t.py]\n")
    placed = gpush("submit", "-f", str(path))
    assert placed.code == 0, placed.err
    spec = gpush("status", placed.out.strip(), "--json").json["spec"]
    assert (spec["nodes"], spec["gpus"], spec["tasks_per_node"]) == (3, 4, 4)


def test_list_shows_the_shape_and_status_every_node_with_its_ranks(gpush):
    job_id = gpush("submit", "-k", "training", "-N", "2", "-G", "8", "--ntasks-per-node", "4", "--", "t").out.strip()
    listed = gpush("list").out
    row = next(line for line in listed.splitlines() if line.startswith(job_id))
    assert "2x8" in row.split()
    shown = gpush("status", job_id).out
    assert "2, 4 tasks (ranks) per node, 8 ranks in all" in shown
    assert "node 1 (not placed yet): ranks 4-7" in " ".join(shown.split())


def test_one_task_per_node_reads_as_one_rank_and_the_placement_event_names_every_node():
    from broker.cli.job_detail import nodes_rows
    from broker.core.adapter import Placement, Sharing
    from broker.core.job_shape import GangOut, gang
    from broker.scheduling.submission import describe

    rows = dict(nodes_rows(GangOut(**gang({"nodes": 2, "tasks_per_node": 1}, {"nodes": ["gpu-01", "gpu-02"]}))))
    assert rows["Nodes"] == "2, 1 task (rank) per node, 2 ranks in all"
    gang = Placement(
        cluster="slurm-a",
        sharing=Sharing.SLURM_EXCLUSIVE,
        node="gpu-01",
        units=8,
        gpu_equivalents=16,
        nodes=("gpu-01", "gpu-02"),
    )
    assert describe(gang) == "slurm/exclusive: 8 whole GPUs on each of gpu-01, gpu-02"
    one = Placement(cluster="slurm-a", sharing=Sharing.SLURM_EXCLUSIVE, node="gpu-01", units=1, gpu_equivalents=1)
    assert describe(one) == "slurm/exclusive: 1 whole GPU on gpu-01"


def test_status_says_a_gangs_cpus_and_memory_are_per_node(gpush):
    gang = gpush("submit", "-k", "training", "-N", "2", "-G", "8", "-c", "16", "--mem", "64G", "--", "t").out.strip()
    one = gpush("submit", "-k", "training", "-G", "1", "-c", "16", "--mem", "64G", "--", "t").out.strip()
    assert "CPUs / memory     16 / 64G per node\n" in gpush("status", gang).out
    assert "CPUs / memory     16 / 64G\n" in gpush("status", one).out


def test_a_one_node_job_with_several_tasks_shows_them_and_both_tiers_start_them():
    """--ntasks-per-node without -N: Slurm's srun starts the tasks on the one node, and a
    Kubernetes Pod gets the launcher's variables for them; gpush status says how many."""
    from adapters.k8s.render import RenderOptions
    from adapters.k8s.render import render as k8s_render
    from adapters.slurm.render import render as slurm_render
    from broker.core.adapter import Placement, Sharing
    from broker.core.schemas import JobSpec

    spec = JobSpec.model_validate({"kind": "training", "gpus": 4, "tasks_per_node": 4, "command": ["python", "t.py"]})
    slurm = slurm_render(
        7, spec, Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 4, 4.0, node="gpu01"), tag="gpush", gres_type="a100"
    )
    assert {"--nodes=1", "--ntasks-per-node=4"} <= set(slurm.sbatch_args()) and "srun" in slurm.script
    assert (slurm.environment["WORLD_SIZE"], slurm.environment["LOCAL_WORLD_SIZE"]) == ("4", "4")
    pod = k8s_render(
        8,
        spec,
        Placement("k8s-a", Sharing.K8S_EXCLUSIVE, 4, 4.0, node="h1"),
        RenderOptions(tag="gpush", namespace="gpush", image="python:3.11-slim"),
    )
    env = {e["name"]: e.get("value") for e in pod.body["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {k: env.get(k) for k in ("MASTER_ADDR", "NNODES", "NPROC_PER_NODE", "WORLD_SIZE", "NODE_RANK")} == {
        "MASTER_ADDR": "127.0.0.1",
        "NNODES": "1",
        "NPROC_PER_NODE": "4",
        "WORLD_SIZE": "4",
        "NODE_RANK": "0",
    }


def test_status_shows_the_tasks_of_a_one_node_job(gpush):
    job_id = gpush("submit", "-k", "training", "-G", "4", "--ntasks-per-node", "4", "--", "t").out.strip()
    rows = {line[:18].strip(): line[18:].strip() for line in gpush("status", job_id).out.splitlines()}
    assert rows["Tasks"] == "4 (ranks) on 1 node"
    one = gpush("submit", "-k", "training", "-G", "4", "--", "t").out.strip()
    assert "Tasks" not in gpush("status", one).out
