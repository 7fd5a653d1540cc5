"""Network topology on the project's Kubernetes API test server and GPU node simulator.

A cluster whose nodes carry block and rack labels (integration/k8s/gpu_nodes.py, a pool's
``topology``), registered with ``topology_levels`` block and rack: the adapter's inventory
reports each node's position (None where a node lacks the rack label), a gang placed within one
block by broker.core.topology's choice runs its Pods on exactly those nodes, and a one-node job
runs on the node gpush chose, although the simulator's scheduler (LeastAllocated, as
kube-scheduler scores by default) would rather put it elsewhere.

Four H100 nodes of two GPUs in blocks b1 (h100-0, h100-1) and b2 (h100-2, h100-3), racks r1..r3
and none for h100-3; one more H100 node (h100s-0, block b2, rack r4) with 8 CPUs where the others
have 64, so that a scheduler left to choose never picks it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from adapters.k8s import KubernetesAdapter
from adapters.k8s.render import ANNOTATION_GPUS
from broker.core.adapter import BackendState, Placement, Sharing
from broker.core.topology import choose_nodes
from integration.k8s import simulator
from integration.k8s.gpu_nodes import GpuPool, node_manifest
from integration.test_k8s_adapter import (  # noqa: F401  (fixtures: the API server and its client)
    NAMESPACE,
    Follower,
    api,
    job_spec,
    kubeconfig,
    make_adapter,
    server,
    simulated_durations,
    wait_for,
)

BLOCK, RACK = "cloud.provider.com/topology-block", "cloud.provider.com/topology-rack"
H100 = GpuPool(
    "h100",
    count=4,
    product="NVIDIA-H100-80GB-HBM3",
    gpus_per_node=2,
    topology={BLOCK: ("b1", "b1", "b2", "b2"), RACK: ("r1", "r2", "r3", None)},
)
SMALL = GpuPool(
    "h100s",
    product="NVIDIA-H100-80GB-HBM3",
    gpus_per_node=2,
    cpu="8",
    memory="64Gi",
    topology={BLOCK: "b2", RACK: "r4"},
)
POOLS = (H100, SMALL)
LEVELS = f"block={BLOCK},rack={RACK}"


@pytest.fixture
def cluster(api) -> Iterator[Any]:  # noqa: F811
    sim = simulator.Simulator(api, list(POOLS)).start()
    sim.create_nodes()
    wait_for(lambda: {n for p in POOLS for n in p.node_names()} <= sim.c.managed, what="simulated nodes")
    yield sim
    sim.stop()


@pytest.fixture
def adapter(kubeconfig, cluster) -> Iterator[KubernetesAdapter]:  # noqa: F811
    made = make_adapter(kubeconfig, topology_levels=LEVELS)
    yield made
    made.close()


def pods_of(api, job_id: int) -> list[Any]:  # noqa: F811
    return client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=f"gpush.io/job-id={job_id}").items


def test_simulated_nodes_carry_their_pool_s_topology_labels():
    labels = [node_manifest(H100, i)["metadata"]["labels"] for i in range(4)]
    assert [(n.get(BLOCK), n.get(RACK)) for n in labels] == [("b1", "r1"), ("b1", "r2"), ("b2", "r3"), ("b2", None)]
    assert RACK not in labels[3] and labels[3]["kubernetes.io/hostname"] == "h100-3"
    assert node_manifest(SMALL, 0)["metadata"]["labels"][BLOCK] == "b2"
    with pytest.raises(ValueError, match="2 domains for 4 nodes"):
        GpuPool("bad", count=4, topology={BLOCK: ("b1", "b2")})


def test_the_inventory_reports_each_node_s_position_and_none_where_a_label_is_missing(adapter):
    positions = {u.node: u.topology for u in adapter.inventory()}
    assert positions == {
        "h100-0": (("block", "b1"), ("rack", "r1")),
        "h100-1": (("block", "b1"), ("rack", "r2")),
        "h100-2": (("block", "b2"), ("rack", "r3")),
        "h100-3": (("block", "b2"), ("rack", None)),
        "h100s-0": (("block", "b2"), ("rack", "r4")),
    }
    # Which device indexes are free, Kubernetes does not say through its API.
    assert all(u.free_gpus is None for u in adapter.inventory())


def test_a_gang_placed_in_one_block_runs_its_pods_on_exactly_those_nodes(adapter, api):  # noqa: F811
    position = {u.node: u.topology for u in adapter.inventory()}
    # In this order the first two span both blocks; the choice keeps to one (b1: the one with fewest).
    candidates = ["h100-1", "h100-2", "h100-3", "h100-0"]
    choice = choose_nodes(candidates, 2, position, level="block", required=True)
    assert choice is not None and choice.nodes == ("h100-1", "h100-0") and choice.domains == 1
    where = Placement(
        "k8s-test",
        Sharing.K8S_EXCLUSIVE,
        units=2,
        gpu_equivalents=4.0,
        node=choice.nodes[0],
        gpu_model="H100-SXM5-80GB",
        nodes=choice.nodes,
    )
    adapter.submit(40, job_spec(nodes=2, gpus=2, labels={"sim-duration": "1"}), where)
    assert Follower(adapter).until(40, BackendState.SUCCEEDED, timeout=20).exit_code == 0
    pods = pods_of(api, 40)
    assert sorted(p.spec.node_name for p in pods) == sorted(choice.nodes)
    nodes = {n.metadata.name: n.metadata.labels for n in client.CoreV1Api(api).list_node().items}
    assert {nodes[p.spec.node_name][BLOCK] for p in pods} == {"b1"}
    adapter.cancel(40)


def test_a_one_node_job_runs_on_the_node_gpush_chose_not_the_one_the_scheduler_would(adapter, api):  # noqa: F811
    where = Placement(
        "k8s-test",
        Sharing.K8S_EXCLUSIVE,
        units=1,
        gpu_equivalents=1.0,
        node="h100s-0",
        gpu_model="H100-SXM5-80GB",
        gpus=(1,),
    )
    adapter.submit(41, job_spec(gpus=1, cpus=2, labels={"sim-duration": "1"}), where)
    assert Follower(adapter).until(41, BackendState.SUCCEEDED, timeout=20).exit_code == 0
    (pod,) = pods_of(api, 41)
    assert pod.spec.node_name == "h100s-0"
    # gpush's GPU choice is for people to read; the device plugin chose the device.
    assert pod.metadata.annotations[ANNOTATION_GPUS] == "1"
    assert all(e.name != "CUDA_VISIBLE_DEVICES" for e in pod.spec.containers[0].env)
    adapter.cancel(41)
