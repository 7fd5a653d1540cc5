"""`gpush k8s timeslice`: the time-slicing config an admin can read, apply with kubectl, or have gpush apply."""

from __future__ import annotations

from pathlib import Path

import yaml

FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"


def test_render_prints_a_configmap_a_clusterpolicy_patch_and_node_labels(gpush):
    result = gpush("k8s", "timeslice", "render", "--replicas", "4", "--node-label", "nvidia.com/gpu.product=Tesla-T4")
    assert result.code == 0, result.err
    config_map, patch, nodes = list(yaml.safe_load_all(result.out))
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["namespace"] == "gpu-operator"
    plugin = yaml.safe_load(config_map["data"]["replicas-4"])
    assert plugin["sharing"]["timeSlicing"]["resources"] == [{"name": "nvidia.com/gpu", "replicas": 4}]
    assert patch == {"spec": {"devicePlugin": {"config": {"name": "time-slicing-config"}}}}
    assert nodes["labels"] == {"nvidia.com/device-plugin.config": "replicas-4"}


def test_without_a_node_label_the_config_is_the_default_for_every_node(gpush):
    config_map, patch = list(yaml.safe_load_all(gpush("k8s", "timeslice", "render", "--replicas", "2").out))
    assert list(config_map["data"]) == ["any"]
    assert patch["spec"]["devicePlugin"]["config"]["default"] == "any"


def test_bad_input_is_refused_with_what_to_do(gpush):
    zero = gpush("k8s", "timeslice", "render", "--replicas", "0")
    assert zero.code == 2 and "1<=x<=64" in zero.err
    label = gpush("k8s", "timeslice", "render", "--replicas", "2", "--node-label", "no-equals-sign")
    assert label.code == 2 and "KEY=VALUE" in label.err


def test_apply_needs_a_kubernetes_cluster(gpush):
    assert gpush("cluster", "add", "slurm-a", "--kind", "sim", "--fleet", FLEET).code == 0
    result = gpush("k8s", "timeslice", "apply", "slurm-a", "--replicas", "4")
    assert result.code == 2 and "time-slicing is configured on Kubernetes" in result.err
    missing = gpush("k8s", "timeslice", "apply", "nowhere", "--replicas", "4")
    assert missing.code == 3 and "no cluster nowhere" in missing.err


def test_cluster_add_takes_kubernetes_options_only_for_kubernetes(gpush, tmp_path):
    result = gpush("cluster", "add", "x", "--kind", "sim", "--fleet", FLEET, "--kubeconfig", tmp_path / "k")
    assert result.code == 2 and "--kubeconfig is a Kubernetes setting" in result.err
