"""What a job asked, in words (``gpu_request``: `gpush list`'s GPUS column), and a
multi-node job's nodes with their ranks (``gang``: `gpush status`'s node rows), sent by
the API in every job it returns, the same for the CLI and the dashboard."""

from __future__ import annotations

import pytest

from broker.core.models import Job

GANG = {"kind": "training", "nodes": 2, "gpus": 8, "tasks_per_node": 4, "command": ["torchrun", "t.py"]}


def every_answer(client, job_id: int) -> list[dict]:
    """The job as each endpoint that returns jobs has it: one job, and the list."""
    listed = [j for j in client.get("/v1/jobs").json()["jobs"] if j["id"] == job_id]
    return [client.get(f"/v1/jobs/{job_id}").json(), *listed]


def test_a_queued_gang_shows_its_shape_and_the_ranks_of_each_node_not_placed_yet(http):
    client = http()
    submitted = client.post("/v1/jobs", json=GANG)
    assert submitted.status_code == 201, submitted.text
    answers = [submitted.json(), *every_answer(client, submitted.json()["id"])]
    assert len(answers) == 3
    for job in answers:
        assert job["gpu_request"] == "2x8"
        assert job["gang"] == {
            "tasks_per_node": 4,
            "ranks": 8,
            "nodes": [
                {"index": 0, "node": None, "first_rank": 0, "last_rank": 3, "rendezvous": False},
                {"index": 1, "node": None, "first_rank": 4, "last_rank": 7, "rendezvous": False},
            ],
        }


def test_a_placed_gang_names_its_nodes_rank_0_first_and_its_gpu_model(http, sessions):
    client = http()
    job_id = client.post("/v1/jobs", json={**GANG, "tasks_per_node": 1}).json()["id"]
    with sessions() as session, session.begin():
        job = session.get(Job, job_id)
        job.cluster = "slurm-a"
        job.placement = {
            "cluster": "slurm-a",
            "sharing": "slurm/exclusive",
            "units": 8,
            "gpu_equivalents": 16.0,
            "node": "gpu-02",
            "gpu_model": "A100-SXM4-80GB",
            "nodes": ["gpu-02", "gpu-01"],
        }
    for job in every_answer(client, job_id):
        assert job["gpu_request"] == "2x8 A100"
        assert job["gang"]["nodes"] == [
            {"index": 0, "node": "gpu-02", "first_rank": 0, "last_rank": 0, "rendezvous": True},
            {"index": 1, "node": "gpu-01", "first_rank": 1, "last_rank": 1, "rendezvous": False},
        ]
        assert job["gang"]["ranks"] == 2


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        pytest.param({"kind": "training", "gpus": 2}, "2", id="whole-gpus"),
        pytest.param({"kind": "training", "isolation": "hardware", "gpu_memory_gb": 10}, "1 × 10GB", id="a-slice"),
        pytest.param(
            {"kind": "inference", "gpu_memory_gb": 8, "elastic": {"min_replicas": 1, "max_replicas": 4}},
            "1 × 8GB (1-4 replicas)",
            id="elastic",
        ),
    ],
)
def test_a_one_node_job_has_its_request_in_words_and_no_gang(http, spec, words):
    client = http()
    job_id = client.post("/v1/jobs", json={**spec, "command": ["x"], "image": "i:1"}).json()["id"]
    for job in every_answer(client, job_id):
        assert job["gpu_request"] == words
        assert job["gang"] is None


def test_the_cli_shows_the_apis_figures(gpush):
    job_id = gpush("submit", "-k", "training", "-N", "2", "-G", "8", "--ntasks-per-node", "4", "--", "t").out.strip()
    shown = gpush("status", job_id, "--json").json
    listed = next(line for line in gpush("list").out.splitlines() if line.startswith(job_id))
    assert shown["gpu_request"] in listed.split()
    words = " ".join(gpush("status", job_id).out.split())
    for node in shown["gang"]["nodes"]:
        assert f"node {node['index']} (not placed yet): ranks {node['first_rank']}-{node['last_rank']}" in words
