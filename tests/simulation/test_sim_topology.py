"""Topology in the simulator (issue 35): the fleet file gives node pools a GPU topology and
network blocks, simulated clusters report them with each node's free GPUs and take the
GPUs a placement names, and ``gpush simulate`` places through the topology-aware decision."""

from __future__ import annotations

import pytest
import yaml

from broker.core.adapter import Placement, Sharing
from broker.core.errors import InvalidRequest
from broker.routing.policy import load_policy
from broker.simulation.cluster import SimulatedCluster
from broker.simulation.fleet import gpu_topology_of, load_fleet
from broker.simulation.replay import replay
from broker.simulation.workload import parse_workload
from tests.simulation.test_fleet import VirtualClock, spec

A100 = "A100-SXM4-80GB"
FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - {name: n, count: 4, gpu_topology: nvlink-pairs, blocks: 2, gpus: [{model: A100-SXM4-80GB, count: 8}]}
      - {name: s, gpu_topology: nvswitch, block: b9, gpus: [{model: A100-SXM4-80GB, count: 8}]}
  k8s-a:
    flavor: k8s
    pools:
      - {name: p, nodes: 2, gpus_per_node: 4, model: H100-SXM5-80GB, gpu_topology: pcie, blocks: 1}
"""
POLICY = load_policy("rules:\n  - {name: all, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}\n")


def whole_units(cluster: SimulatedCluster) -> dict[str, object]:
    return {u.node: u for u in cluster.inventory() if u.sharing in (Sharing.SLURM_EXCLUSIVE, Sharing.K8S_EXCLUSIVE)}


def test_the_fleet_file_gives_nodes_a_gpu_topology_and_a_block_the_units_report():
    fleet = load_fleet(FLEET, "fleet.yaml")
    slurm = SimulatedCluster.from_fleet(fleet, "slurm-a", clock=VirtualClock())
    units = whole_units(slurm)
    assert {n: u.topology for n, u in units.items()} == {
        "n-01": (("block", "b1"),),
        "n-02": (("block", "b1"),),
        "n-03": (("block", "b2"),),
        "n-04": (("block", "b2"),),
        "s": (("block", "b9"),),
    }
    assert units["n-01"].gpu_topology.nvlink == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert units["s"].gpu_topology.nvlink == (tuple(range(8)),)
    assert units["n-01"].free_gpus == tuple(range(8))
    k8s = SimulatedCluster.from_fleet(fleet, "k8s-a", clock=VirtualClock())
    pcie = whole_units(k8s)["p-01"]
    assert pcie.gpu_topology.islands() == [] and pcie.gpu_topology.pcie == ((0, 1, 2, 3),)


def test_a_simulated_node_takes_the_gpus_a_placement_names_else_the_closest_and_gives_them_back():
    clock = VirtualClock()
    slurm = SimulatedCluster.from_fleet(load_fleet(FLEET, "fleet.yaml"), "slurm-a", clock=clock)
    named = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="n-01", gpu_model=A100, gpus=(4, 5))
    slurm.submit(1, spec(duration=600, gpus=2), named)
    assert whole_units(slurm)["n-01"].free_gpus == (0, 1, 2, 3, 6, 7)
    # Named GPUs not all free: the node picks as choose_gpus does (a whole pair, on the
    # PCIe switch with the fewest free).
    clash = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="n-01", gpu_model=A100, gpus=(5, 6))
    slurm.submit(2, spec(duration=300, gpus=2), clash)
    assert whole_units(slurm)["n-01"].free_gpus == (0, 1, 2, 3)
    clock.at(301)
    assert whole_units(slurm)["n-01"].free_gpus == (0, 1, 2, 3, 6, 7)
    clock.at(601)
    assert whole_units(slurm)["n-01"].free_gpus == tuple(range(8))


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("{name: n, block: b1, blocks: 2, gpus: [{model: A100-SXM4-80GB}]}", "give block (all nodes in one) or blocks"),
        ("{name: n, gpu_topology: torus, gpus: [{model: A100-SXM4-80GB}]}", "nvswitch"),
    ],
)
def test_a_bad_topology_in_the_fleet_file_is_refused_saying_what_to_write(entry, words):
    with pytest.raises(InvalidRequest) as caught:
        load_fleet(f"clusters:\n  slurm-a:\n    flavor: slurm\n    nodes:\n      - {entry}\n", "fleet.yaml")
    assert words in str(caught.value) and "node n" in str(caught.value)


def test_gpu_topology_kinds_group_a_nodes_gpus():
    pairs = gpu_topology_of("nvlink-pairs", 8)
    # A pair on NVLink, a PCIe switch (and socket) of four, nothing across the halves.
    assert [pairs.closeness(gpus) for gpus in ((0, 1), (0, 2), (0, 4))] == [0, 1, 3]
    switch = gpu_topology_of("nvswitch", 8)
    assert [switch.closeness(gpus) for gpus in (range(8), (0, 1))] == [0, 0]
    assert switch.pcie[0] == (0, 1) and switch.socket == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert gpu_topology_of(None, 8) is None


def test_gpush_simulate_places_a_gang_in_one_block_and_blind_to_topology_it_spreads():
    fleet = load_fleet(FLEET, "fleet.yaml")
    workload = parse_workload(
        yaml.safe_dump(
            [
                {"at": 0, "duration": 3600, "kind": "batch", "command": ["x"], "gpus": 2, "name": "one"},
                {"at": 10, "duration": 600, "kind": "training", "command": ["x"], "gpus": 8, "nodes": 2, "name": "g"},
            ]
        ),
        "workload.yaml",
    )
    nodes = {}
    for aware in (True, False):
        result = replay(fleet, POLICY, workload, topology=aware)
        gang = next(j for j in result.jobs if j.name == "g")
        nodes[aware] = tuple(gang.placement["nodes"])
    assert nodes == {True: ("n-03", "n-04"), False: ("n-02", "n-03")}


def test_a_reloaded_simulated_cluster_keeps_the_gpus_its_running_jobs_were_named(tmp_path):
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(FLEET)
    config = {"fleet": str(fleet_file), "state_file": str(tmp_path / "slurm-a.json")}
    clock = VirtualClock()
    first = SimulatedCluster("slurm-a", config, clock=clock)
    named = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="n-02", gpu_model=A100, gpus=(6, 7))
    first.submit(1, spec(duration=600, gpus=2), named)
    again = SimulatedCluster("slurm-a", config, clock=clock)
    assert whole_units(again)["n-02"].free_gpus == (0, 1, 2, 3, 4, 5)


def test_a_node_without_a_block_in_a_fleet_with_blocks_has_no_domain_there():
    # As a Kubernetes node without the level's label, or a Slurm node that topology.conf
    # leaves out: the level is the cluster's, the node has no domain at it (a drift finding).
    fleet = load_fleet(
        "clusters:\n  slurm-a:\n    flavor: slurm\n    nodes:\n"
        "      - {name: a, count: 2, block: b1, gpus: [{model: A100-SXM4-80GB, count: 8}]}\n"
        "      - {name: loose, gpus: [{model: A100-SXM4-80GB, count: 8}]}\n",
        "fleet.yaml",
    )
    units = whole_units(SimulatedCluster.from_fleet(fleet, "slurm-a", clock=VirtualClock()))
    assert units["loose"].topology == (("block", None),)
    assert units["a-01"].topology == (("block", "b1"),)
