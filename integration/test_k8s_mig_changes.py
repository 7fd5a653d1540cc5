"""Fencing nodes and changing MIG layouts through the Kubernetes adapter, against the project's
Kubernetes API test server and node simulator, whose MIG manager applies the mig-parted configs
the nodes' ``nvidia.com/mig.config`` labels name (integration/k8s/simulator.py, ``MigManager``).

The pools: one A100-40GB node with two GPUs, each split into two 3g.20gb instances (mixed
strategy; labelled ``all-3g.20gb`` as the GPU Operator would), and one time-sliced T4 node.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from adapters.k8s import KubernetesAdapter
from broker.core.adapter import BackendState, Rejected, Sharing
from integration.k8s import apiserver, simulator
from integration.k8s.gpu_nodes import (
    CLUSTER_POLICY_CRD,
    GpuPool,
    mig_parted_layouts,
    node_devices,
    reconfigured,
)
from integration.test_k8s_adapter import (
    Follower,
    job_spec,
    make_adapter,
    placed,
    wait_for,
)

A100 = GpuPool(
    "a100",
    count=1,
    product="NVIDIA-A100-SXM4-40GB",
    gpus_per_node=2,
    mig_strategy="mixed",
    mig_layout=("3g.20gb", "3g.20gb"),
)
T4 = GpuPool("t4", count=1, product="Tesla-T4", gpus_per_node=1, replicas=2, cpu="16", memory="64Gi")
NODE = "a100-0"
OPERATOR = "gpu-operator"
MIG_CONFIG_MAP = "default-mig-parted-config"
# What the GPU Operator ships (abridged), comments and all: gpush must leave it as it is.
OPERATOR_CONFIG = """\
version: v1
mig-configs:
  # MIG off everywhere
  all-disabled:
    - devices: all
      mig-enabled: false

  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7

  all-3g.20gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.20gb": 2
"""
SEVEN_SMALL = tuple(f"1g.5gb@{i}" for i in range(7))


@pytest.fixture
def server() -> Iterator[Any]:
    srv = apiserver.start()
    yield srv
    srv.stop()


@pytest.fixture
def kubeconfig(server, tmp_path) -> str:
    return str(server.write_kubeconfig(tmp_path / "kubeconfig"))


@pytest.fixture
def api(kubeconfig) -> Iterator[Any]:
    api_client = config.new_client_from_config(config_file=kubeconfig)
    yield api_client
    api_client.close()


@pytest.fixture
def core(api) -> Any:
    return client.CoreV1Api(api)


@pytest.fixture
def sim(api) -> Iterator[Any]:
    # A MIG change takes 0.5 s, long enough to read the pending state before it ends.
    started = simulator.Simulator(api, [A100, T4], timings=simulator.Timings(mig_reconfigure=0.5)).start()
    started.create_nodes()
    yield started
    started.stop()


@pytest.fixture
def adapter(kubeconfig, sim) -> Iterator[KubernetesAdapter]:
    made = make_adapter(kubeconfig)
    yield made
    made.close()


@pytest.fixture
def operator(api, core) -> None:
    """The GPU Operator's API as the MIG manager needs it: its namespace, a ClusterPolicy, and
    the mig-parted ConfigMap it ships."""
    client.ApiextensionsV1Api(api).create_custom_resource_definition(CLUSTER_POLICY_CRD)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR}})
    client.CustomObjectsApi(api).create_cluster_custom_object(
        "nvidia.com",
        "v1",
        "clusterpolicies",
        {
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "cluster-policy"},
            "spec": {"migManager": {"config": {"name": MIG_CONFIG_MAP}}},
        },
    )
    core.create_namespaced_config_map(
        OPERATOR,
        {"metadata": {"name": MIG_CONFIG_MAP}, "data": {"config.yaml": OPERATOR_CONFIG}},
    )


def node(core, name: str = NODE) -> Any:
    return core.read_node(name)


def mig_allocatable(core, name: str = NODE) -> dict[str, str]:
    allocatable = node(core, name).status.allocatable or {}
    return {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/mig-")}


def mig_config_text(core) -> str:
    return core.read_namespaced_config_map(MIG_CONFIG_MAP, OPERATOR).data["config.yaml"]


def run_mig_job(adapter: KubernetesAdapter, job_id: int) -> None:
    spec = job_spec(isolation="hardware", gpu_memory_gb=20)
    adapter.submit(job_id, spec, placed(Sharing.K8S_MIG, mig_profile="3g.20gb"))


# -- fencing -------------------------------------------------------------------------------


def test_a_fenced_node_takes_no_new_pod_while_the_running_one_goes_on(adapter, core):
    follow = Follower(adapter)
    run_mig_job(adapter, 1)
    follow.until(1, BackendState.RUNNING)

    adapter.fence(NODE, "MIG change of GPU 0")
    adapter.fence(NODE, "MIG change of GPU 0")  # again: no error, nothing changes
    assert node(core).spec.unschedulable is True
    assert adapter.fenced() == {NODE: "MIG change of GPU 0"}

    run_mig_job(adapter, 2)

    def unschedulable() -> str | None:
        follow.read()
        reason = follow.last[2].reason if 2 in follow.last else None
        return reason if reason and reason.startswith("Unschedulable") else None

    # The scheduler's reason names the T4 node's lack of the resource; the A100 is cordoned.
    wait_for(unschedulable, what="job 2 unschedulable")
    assert follow.last[2].state == BackendState.PENDING and follow.last[2].node is None
    assert follow.last[1].state == BackendState.RUNNING

    adapter.unfence(NODE)
    assert not node(core).spec.unschedulable
    assert adapter.fenced() == {}
    follow.until(2, BackendState.RUNNING)
    assert follow.last[1].state == BackendState.RUNNING


def test_fenced_lists_only_gpushs_fences_and_unfence_leaves_someone_elses_cordon(adapter, core):
    core.patch_node("t4-0", {"spec": {"unschedulable": True}})  # an admin's cordon
    assert adapter.fenced() == {}
    adapter.unfence("t4-0")  # not gpush's: stays cordoned
    assert node(core, "t4-0").spec.unschedulable is True

    adapter.fence("t4-0", "draining for a MIG change")
    adapter.fence(NODE, "another")
    assert adapter.fenced() == {"t4-0": "draining for a MIG change", NODE: "another"}
    adapter.unfence("t4-0")
    adapter.unfence("t4-0")  # unfencing an unfenced node is no error
    assert node(core, "t4-0").spec.unschedulable is True  # the admin's cordon stays
    assert adapter.fenced() == {NODE: "another"}

    with pytest.raises(Rejected, match="no node gpu-9"):
        adapter.fence("gpu-9", "x")
    with pytest.raises(Rejected, match="no node gpu-9"):
        adapter.unfence("gpu-9")


# -- MIG layouts -----------------------------------------------------------------------------


def test_publish_mig_moves_one_gpu_to_the_new_layout_and_keeps_the_other(adapter, core, operator):
    assert mig_allocatable(core) == {"nvidia.com/mig-3g.20gb": "4"}
    assert adapter.mig_published(NODE, 0) == ("3g.20gb@0", "3g.20gb@4")  # from the operator's all-3g.20gb

    adapter.publish_mig(NODE, 0, list(SEVEN_SMALL))
    labels = node(core).metadata.labels
    assert labels["nvidia.com/mig.config"] == "gpush-a100-0"
    assert adapter.mig_published(NODE, 0) is None  # pending: the MIG manager is at it

    published = wait_for(lambda: adapter.mig_published(NODE, 0), what="the new layout offered")
    assert published == SEVEN_SMALL
    assert adapter.mig_published(NODE, 1) == ("3g.20gb@0", "3g.20gb@4")  # GPU 1 kept its layout
    labels = node(core).metadata.labels
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert mig_allocatable(core) == {"nvidia.com/mig-1g.5gb": "7", "nvidia.com/mig-3g.20gb": "2"}
    assert (labels["nvidia.com/mig-1g.5gb.count"], labels["nvidia.com/mig-3g.20gb.count"]) == ("7", "2")
    text = mig_config_text(core)
    assert text.startswith(OPERATOR_CONFIG)  # the operator's configs, byte for byte
    units = {u.mig_profile: u.capacity for u in adapter.inventory() if u.node == NODE}
    assert units == {"1g.5gb": 7, "3g.20gb": 2}

    # The next change goes under the node's other name, so the MIG manager sees the label move.
    adapter.publish_mig(NODE, 1, ["7g.40gb@0"])
    assert node(core).metadata.labels["nvidia.com/mig.config"] == "gpush-a100-0_2"
    assert wait_for(lambda: adapter.mig_published(NODE, 1), what="GPU 1 whole-size instance") == ("7g.40gb@0",)
    assert adapter.mig_published(NODE, 0) == SEVEN_SMALL
    assert mig_allocatable(core) == {"nvidia.com/mig-1g.5gb": "7", "nvidia.com/mig-7g.40gb": "1"}
    text = mig_config_text(core)
    assert text.startswith(OPERATOR_CONFIG) and "gpush-a100-0:" not in text  # one config per node

    # Publishing what is offered already changes nothing.
    adapter.publish_mig(NODE, 1, ["7g.40gb@0"])
    assert node(core).metadata.labels["nvidia.com/mig.config"] == "gpush-a100-0_2"
    assert adapter.mig_published(NODE, 1) == ("7g.40gb@0",)


def test_a_profile_the_gpu_does_not_offer_fails_and_mig_published_says_so(kubeconfig, sim, core, operator):
    # A cluster whose gpu_types take this A100-40GB for an 80GB one: gpush lets 2g.20gb through,
    # the GPU (the simulator's MIG manager) has no such profile.
    wrong = make_adapter(kubeconfig, gpu_types="NVIDIA-A100-SXM4-40GB=A100-SXM4-80GB")
    try:
        wrong.publish_mig(NODE, 0, ["2g.20gb@0"])
        wait_for(lambda: node(core).metadata.labels["nvidia.com/mig.config.state"] == "failed", what="failed")
        with pytest.raises(Rejected, match="mig.config.state=failed"):
            wrong.mig_published(NODE, 0)
        assert mig_allocatable(core) == {"nvidia.com/mig-3g.20gb": "4"}  # the node kept its layout
    finally:
        wrong.close()


def test_a_layout_that_takes_instances_from_running_pods_is_refused(adapter, core, operator, sim):
    follow = Follower(adapter)
    for job_id in (1, 2, 3, 4):
        run_mig_job(adapter, job_id)
    for job_id in (1, 2, 3, 4):
        follow.until(job_id, BackendState.RUNNING)
    with pytest.raises(Rejected, match="drain node a100-0 first"):
        adapter.publish_mig(NODE, 0, list(SEVEN_SMALL))
    assert "gpush-a100-0" not in mig_config_text(core)

    # Labelled by hand past gpush: the MIG manager refuses too, with GPU clients on the node.
    core.patch_node(NODE, {"metadata": {"labels": {"nvidia.com/mig.config": "all-1g.5gb"}}})
    wait_for(lambda: node(core).metadata.labels["nvidia.com/mig.config.state"] == "failed", what="failed")
    assert mig_allocatable(core) == {"nvidia.com/mig-3g.20gb": "4"}


def test_the_mig_managers_config_reads_as_per_gpu_layouts():
    assert mig_parted_layouts(OPERATOR_CONFIG, "all-3g.20gb", 2) == {0: ("3g.20gb",) * 2, 1: ("3g.20gb",) * 2}
    assert mig_parted_layouts(OPERATOR_CONFIG, "all-disabled", 1) == {0: ()}
    with pytest.raises(ValueError, match="not in the MIG manager's ConfigMap"):
        mig_parted_layouts(OPERATOR_CONFIG, "gpush-x", 1)
    changed = reconfigured(A100, A100.layouts(), {1: ("1g.5gb",) * 7}, "gpush-a100-0")
    devices = node_devices(changed)
    assert devices.resources == {"nvidia.com/mig-3g.20gb": 2, "nvidia.com/mig-1g.5gb": 7, "nvidia.com/gpu": 0}
    assert devices.labels["nvidia.com/mig.config"] == "gpush-a100-0"
    with pytest.raises(ValueError, match="has no MIG profile 2g.20gb"):
        reconfigured(A100, A100.layouts(), {0: ("2g.20gb",)}, "x")
    with pytest.raises(ValueError, match="compute slices"):
        reconfigured(A100, A100.layouts(), {0: ("4g.20gb", "4g.20gb")}, "x")
