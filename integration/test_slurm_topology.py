"""Topology on the real Slurm test cluster (issue 35): the adapter reads the network and a
node's NVLink islands, a gang gpush places in one switch or block runs there with sbatch
asked to keep it so, and Slurm gives a multi-GPU job the NVLink island gpush would choose.

Clusters (start.sh --topology, each on ports of its own, started fresh and stopped after):
Slurm 22.05 on the host with topology/tree (leaf1 over gpu01, gpu02, nvl01; leaf2 over
mig01, mps01; spine over both), and each Debian suite's Slurm (SLURM_SUITES: 24.11, 26.05)
with topology/block (b1: gpu01, gpu02, nvl01; b2: mig01, mps01). nvl01 has four H100s
whose gres.conf Links= make two NVLink pairs, GPUs 0+2 and 1+3. Both backends each.

Measured here: Slurm 24.11 and 26.05 do not pick GPUs by Links= for a per-node request
(``--gres=gpu:h100:2`` got IDX 0-1 on an idle nvl01, 1-2 with GPU 0 busy), but do for
``--gpus=h100:2`` (0,2 and 1,3), while 22.05 follows Links= for both; so on 24.11 on the
adapter asks such a job's GPUs with --gpus (adapters.slurm.render).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.slurm.adapter import SlurmAdapter
from adapters.slurm.records import Submission, held_indexes
from broker.core.adapter import Placement, Sharing
from broker.core.schemas import JobSpec
from broker.core.topology import choose_gpus, choose_nodes
from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import SLURM_SUITES, chroot_cluster, own_cluster

TOKEN_ENV = "GPUSH_TEST_SLURM_JWT"
HOST = "22.05-tree"
# Ports apart from every other test cluster (68xx-99xx in use elsewhere).
PORTS = {
    HOST: 9700,
    **{suite: base for suite, base in (("trixie", 9730), ("sid", 9760), ("forky", 9790))},
}


def _ports(base: int) -> dict[str, str]:
    return {
        "GPUSH_SLURMCTLD_PORT": str(base + 1),
        "GPUSH_SLURMDBD_PORT": str(base + 2),
        "GPUSH_SLURMRESTD_PORT": str(base + 3),
        "GPUSH_SLURMD_PORT": str(base + 10),  # six nodes: base+10 .. base+15
    }


@pytest.fixture(scope="module", params=[HOST, *SLURM_SUITES])
def slurm_cluster(request, slurm_chroots: dict[str, Path]) -> Iterator[SlurmTestCluster]:
    if request.param == HOST:
        yield from own_cluster(
            "gpush-slurm-topology-", _ports(PORTS[HOST]), "with topology/tree", whole_nodes=2, topology="tree"
        )
    else:
        suite = request.param
        yield from chroot_cluster(
            slurm_chroots, suite, accounting=False, whole_nodes=2, topology="block", ports=_ports(PORTS[suite])
        )


@pytest.fixture(params=["cli", "rest"])
def backend(request) -> str:
    return request.param


# gpush job ids per backend: a fresh adapter takes a tagged job Slurm still lists for its
# own (restart recovery), so the second backend's jobs must not reuse the first's ids.
FIRST_ID = {"cli": 100, "rest": 200}


def topology_adapter(cluster: SlurmTestCluster, backend: str, workdir: Path) -> tuple[SlurmAdapter, list[Submission]]:
    """The adapter on ``cluster`` reading its gres.conf, and the submissions it sends."""
    workdir.chmod(0o755)
    config = {"workdir": str(workdir), "cache_seconds": 0, "gres_conf": str(cluster.conf.parent / "gres.conf")}
    if backend == "rest":
        os.environ[TOKEN_ENV] = cluster.token()
        config |= {"rest_url": cluster.rest_url, "token_env": TOKEN_ENV, "user": "root"}
    # scontrol for the network, in REST mode too (slurmrestd has no topology endpoint)
    config |= {"slurm_conf": str(cluster.conf)}
    if cluster.command_prefix:
        config["command_prefix"] = shlex.join(cluster.command_prefix)
    adapter = SlurmAdapter("topo", config)
    sent: list[Submission] = []
    submit = adapter.client.submit

    def spy(job: Submission) -> str:
        sent.append(job)
        return submit(job)

    adapter.client.submit = spy  # type: ignore[method-assign]
    return adapter, sent


def expected_domains(cluster: SlurmTestCluster) -> dict[str, tuple]:
    if cluster.chroot is None:
        leaf1, leaf2 = (("switch2", "spine"), ("switch", "leaf1")), (("switch2", "spine"), ("switch", "leaf2"))
        return {"gpu01": leaf1, "gpu02": leaf1, "nvl01": leaf1, "mig01": leaf2, "mps01": leaf2}
    b1, b2 = (("block", "b1"),), (("block", "b2"),)
    return {"gpu01": b1, "gpu02": b1, "nvl01": b1, "mig01": b2, "mps01": b2}


def spec(command: list[str], **fields) -> JobSpec:
    return JobSpec(kind="batch", command=command, tenant="ml", user="alice", **fields)


def test_the_inventory_reports_each_nodes_domains_and_the_islands_of_gres_conf(
    slurm_cluster: SlurmTestCluster, backend: str, tmp_path: Path
):
    adapter, _sent = topology_adapter(slurm_cluster, backend, tmp_path)
    units = adapter.inventory()
    assert {u.node: u.topology for u in units} == expected_domains(slurm_cluster)
    (nvl,) = [u for u in units if u.node == "nvl01"]
    assert nvl.sharing == Sharing.SLURM_EXCLUSIVE and nvl.capacity == 4
    assert nvl.gpu_topology is not None and nvl.gpu_topology.islands() == [(0, 2), (1, 3)]
    assert nvl.free_gpus == (0, 1, 2, 3)


def test_a_gang_placed_in_one_switch_or_block_runs_on_exactly_those_nodes(
    slurm_cluster: SlurmTestCluster, backend: str, tmp_path: Path
):
    adapter, sent = topology_adapter(slurm_cluster, backend, tmp_path)
    whole = [u for u in adapter.inventory() if u.sharing == Sharing.SLURM_EXCLUSIVE and u.node.startswith("gpu")]
    # Placed as gpush places a gang (broker.core.topology.choose_nodes): mig01 and mps01
    # first, so that the order alone would not put the gang in one domain.
    candidates = ["mps01", *sorted(u.node for u in whole)]
    positions = {u.node: u.topology for u in adapter.inventory()}
    choice = choose_nodes(candidates, 2, positions)
    assert choice is not None and choice.domains == 1 and sorted(choice.nodes) == ["gpu01", "gpu02"], choice
    placement = Placement(
        "topo", Sharing.SLURM_EXCLUSIVE, 1, 2.0, node=choice.nodes[0], gpu_model=whole[0].gpu_model, nodes=choice.nodes
    )
    job_id = FIRST_ID[backend]
    backend_id = adapter.submit(job_id, spec(["sleep", "30"], nodes=2, isolation="exclusive"), placement)
    try:
        record = slurm_cluster.wait_for(int(backend_id), "RUNNING", timeout=20)
        assert record["nodes"] == "gpu[01-02]"
        args = sent[-1].sbatch_args()
        assert "--nodelist=" + ",".join(choice.nodes) in args
        shown = slurm_cluster.run("scontrol", "show", "job", backend_id).stdout
        if slurm_cluster.chroot is None:
            assert "--switches=1" in args
            if backend == "cli":  # slurmrestd v0.0.38 takes no switches ("Disabled key")
                assert re.search(r"\bSwitches=1@", shown), shown
        else:
            assert "--segment=2" in args
            if slurm_cluster.version_info >= (26, 5):  # 24.11 shows the segment nowhere (squeue, scontrol)
                assert record.get("segment_size") == 2, record
                assert "SegmentSize=2" in shown, shown
    finally:
        adapter.cancel(job_id)
        slurm_cluster.wait_for(int(backend_id), "CANCELLED", timeout=20)


def test_slurm_gives_a_two_gpu_job_the_nvlink_island_gpush_chooses(
    slurm_cluster: SlurmTestCluster, backend: str, tmp_path: Path
):
    adapter, sent = topology_adapter(slurm_cluster, backend, tmp_path)

    def nvl01():
        return next(u for u in adapter.inventory() if u.node == "nvl01")

    one = Placement("topo", Sharing.SLURM_EXCLUSIVE, 1, 1.0, node="nvl01", gpu_model=nvl01().gpu_model)
    ids = (FIRST_ID[backend] + 1, FIRST_ID[backend] + 2)
    first = adapter.submit(ids[0], spec(["sleep", "30"], isolation="exclusive"), one)
    jobs = [first]
    try:
        held = held_indexes(slurm_cluster.wait_for(int(first), "RUNNING")["gres_detail"], "gpu", "h100")
        assert held is not None and len(held) == 1
        unit = nvl01()
        assert unit.free_gpus == tuple(i for i in range(4) if i not in held)
        wanted = choose_gpus(unit.gpu_topology, unit.free_gpus, 2)
        assert wanted is not None and wanted in unit.gpu_topology.islands()  # the island left whole
        two = Placement("topo", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="nvl01", gpu_model=unit.gpu_model, gpus=wanted)
        second = adapter.submit(ids[1], spec(["sleep", "30"], isolation="exclusive"), two)
        jobs.append(second)
        asked = "--gpus=h100:2" if slurm_cluster.version_info >= (24, 11) else "--gres=gpu:h100:2"
        assert asked in sent[-1].sbatch_args()
        got = held_indexes(slurm_cluster.wait_for(int(second), "RUNNING")["gres_detail"], "gpu", "h100")
        assert got == set(wanted)
    finally:
        for job_id in ids[: len(jobs)]:
            adapter.cancel(job_id)
        for backend_id in jobs:
            slurm_cluster.wait_for(int(backend_id), "CANCELLED", timeout=20)
