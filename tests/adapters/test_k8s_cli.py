"""`gpush k8s timeslice`: the time-slicing config an admin can read, apply with kubectl, or have gpush apply."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"


def test_render_prints_a_configmap_and_a_clusterpolicy_and_the_node_label_command(gpush):
    result = gpush("k8s", "timeslice", "render", "--replicas", "4", "--node-label", "nvidia.com/gpu.product=Tesla-T4")
    assert result.code == 0, result.err
    config_map, cluster_policy = list(yaml.safe_load_all(result.out))
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["namespace"] == "gpu-operator"
    plugin = yaml.safe_load(config_map["data"]["replicas-4"])
    assert plugin["sharing"]["timeSlicing"]["resources"] == [{"name": "nvidia.com/gpu", "replicas": 4}]
    assert cluster_policy["spec"] == {"devicePlugin": {"config": {"name": "time-slicing-config"}}}
    # Labels are no object kubectl applies: the command is in a comment.
    label = "kubectl label nodes -l nvidia.com/gpu.product=Tesla-T4 nvidia.com/device-plugin.config=replicas-4"
    assert f"#   {label} --overwrite" in result.out


@pytest.mark.parametrize("options", [[], ["--node-label", "nvidia.com/gpu.product=Tesla-T4"], ["--replicas", "1"]])
def test_every_document_render_prints_is_an_object_kubectl_apply_takes(gpush, options):
    replicas = [] if "--replicas" in options else ["--replicas", "4"]
    result = gpush("k8s", "timeslice", "render", *replicas, *options)
    assert result.code == 0, result.err
    documents = list(yaml.safe_load_all(result.out))
    assert [d["kind"] for d in documents] == ["ConfigMap", "ClusterPolicy"]
    for document in documents:
        assert set(document) >= {"apiVersion", "kind", "metadata"}, document
        assert re.fullmatch(r"([a-z0-9.-]+/)?v[0-9]+\w*", document["apiVersion"]), document["apiVersion"]
        assert document["metadata"]["name"]
    assert documents[1]["apiVersion"] == "nvidia.com/v1"


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


def test_quota_yaml_needs_a_kubernetes_cluster_and_an_admin(gpush):
    assert gpush("cluster", "add", "slurm-a", "--kind", "sim", "--fleet", FLEET).code == 0
    result = gpush("tenant", "quota-yaml", "slurm-a")
    assert result.code == 2 and "per-tenant quotas on the cluster's side are Kubernetes ResourceQuotas" in result.err
    missing = gpush("tenant", "quota-yaml", "nowhere")
    assert missing.code == 3 and "no cluster nowhere" in missing.err
