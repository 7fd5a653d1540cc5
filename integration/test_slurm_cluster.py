"""The Slurm test cluster is what the Slurm adapter's tests need (issue 5).

Real slurmctld, slurmd and slurmrestd: nodes carry the GRES the adapter places on
(MIG slices, MPS shares, whole GPUs), typed requests land on the right node, and
slurmrestd answers with a JWT.
"""

from __future__ import annotations

import re

import httpx
import pytest

from integration.slurm.cluster import SlurmTestCluster, node_states


def _asked_gres(job: dict) -> str:
    """The GRES a job asked for: tres_per_node is "gres:gpu:..." in 22.05, "gres/gpu:..." later."""
    return re.sub(r"^gres[:/]", "", job["tres_per_node"])


@pytest.fixture
def cluster(slurm_cluster: SlurmTestCluster):
    """The session's cluster, with no job of this test left behind."""
    yield slurm_cluster
    slurm_cluster.cancel_all()


def test_nodes_are_up_with_their_gres(cluster):
    nodes = cluster.nodes()

    assert sorted(nodes) == ["gpu01", "mig01", "mps01"]
    for name, node in nodes.items():
        assert node_states(node) & {"IDLE", "MIXED", "ALLOCATED"}, f"{name}: {node.get('state')}"
    assert nodes["mig01"]["gres"] == "gpu:1g.5gb:7,gpu:3g.20gb:2"
    assert nodes["gpu01"]["gres"] == "gpu:a100:2"
    # MPS takes the type of the GPU it shares: mps:a100:100
    assert re.fullmatch(r"gpu:a100:1,mps(:a100)?:100", nodes["mps01"]["gres"])
    assert cluster.partitions() == {
        "gpu": "gpu01,mig01,mps01",
        "mig": "mig01",
        "mps": "mps01",
        "exclusive": "gpu01",
    }


def test_a_mig_slice_job_completes_on_mig01(cluster, tmp_path):
    out = tmp_path / "mig.out"
    job_id = cluster.submit("--gres=gpu:1g.5gb:1", "-o", str(out), "--wrap", "echo $CUDA_VISIBLE_DEVICES")

    job = cluster.wait_for(job_id, "COMPLETED")

    assert job["nodes"] == "mig01"
    assert _asked_gres(job) == "gpu:1g.5gb:1"
    # AutoDetect=off: no MIG UUIDs, the slice is device 0 of the job
    assert out.read_text().strip() == "0"


def test_an_mps_share_runs_on_mps01(cluster, tmp_path):
    out = tmp_path / "mps.out"
    job_id = cluster.submit(
        "--gres=mps:25", "-o", str(out), "--wrap", "echo $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; sleep 1"
    )

    running = cluster.wait_for(job_id, "RUNNING")
    assert running["nodes"] == "mps01"
    assert _asked_gres(running) == "mps:25"

    cluster.wait_for(job_id, "COMPLETED")
    assert out.read_text().strip() == "25"


def test_a_typed_whole_gpu_job_runs_on_gpu01(cluster, tmp_path):
    out = tmp_path / "gpu.out"
    job_id = cluster.submit("--gres=gpu:a100:2", "-o", str(out), "--wrap", "echo $CUDA_VISIBLE_DEVICES")

    job = cluster.wait_for(job_id, "COMPLETED")

    assert job["nodes"] == "gpu01"  # the only node with two A100s
    assert out.read_text().strip() == "0,1"


def test_slurmrestd_answers_with_a_jwt(cluster):
    job_id = cluster.submit("-J", "gpush-rest-check", "-o", "/dev/null", "--wrap", "sleep 30")
    headers = cluster.rest_headers()

    with httpx.Client(base_url=cluster.rest_url, timeout=10) as tcp:
        assert tcp.get(cluster.rest_path("ping")).status_code == 401  # no token
        ping = tcp.get(cluster.rest_path("ping"), headers=headers)
        jobs = tcp.get(cluster.rest_path("jobs"), headers=headers)
    transport = httpx.HTTPTransport(uds=str(cluster.rest_socket))
    with httpx.Client(base_url="http://slurmrestd", transport=transport, timeout=10) as unix:
        over_socket = unix.get(cluster.rest_path("ping"), headers=headers)

    assert ping.status_code == 200, ping.text
    (pinged,) = ping.json()["pings"]
    # "ping": "UP" in v0.0.38 (22.05); "pinged": "UP" from v0.0.40 on (24.11)
    assert pinged.get("ping", pinged.get("pinged")) == "UP"
    assert over_socket.status_code == 200, over_socket.text
    assert jobs.status_code == 200, jobs.text
    listed = {job["job_id"]: job for job in jobs.json()["jobs"]}
    assert listed[job_id]["name"] == "gpush-rest-check"
