"""Topology on Kubernetes without a server: the ``topology_levels`` setting and its refusals, each
node's position in the inventory, and where a placed job's Pods may run (its node pinned by name;
gpush's GPU choice only as an annotation). integration/test_k8s_topology.py runs the same against
the project's Kubernetes test API server and node simulator.

Node objects come from tests/data/k8s/nodes.json (written in the API's shape, not recorded).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from adapters.k8s.inventory import node_units
from adapters.k8s.render import ANNOTATION_GPUS, RenderOptions, render
from adapters.k8s.settings import KubernetesSettings
from adapters.k8s.topology import MAX_LEVELS
from adapters.settings import load_settings
from broker.core.adapter import Placement, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec

NODES = json.loads((Path(__file__).resolve().parents[1] / "data" / "k8s" / "nodes.json").read_text())
OPTIONS = RenderOptions(tag="gpush", namespace="gpush", image="python:3.11-slim")
BLOCK, RACK = "cloud.provider.com/topology-block", "cloud.provider.com/topology-rack"


def settings(levels: Any) -> KubernetesSettings:
    return load_settings(KubernetesSettings, {"topology_levels": levels}, cluster="Kubernetes cluster k8s-a")


def refusal(levels: Any) -> str:
    with pytest.raises(InvalidRequest) as caught:
        settings(levels)
    return str(caught.value)


# -- the setting ---------------------------------------------------------------------------


def test_levels_from_the_command_line_keep_their_order_widest_first():
    levels = settings(f"block={BLOCK}, rack={RACK}").topology_levels
    assert [(t.level, t.node_label) for t in levels] == [("block", BLOCK), ("rack", RACK)]
    # Kueue's words (nodeLabel) and the short one (label) alike, as a list from the API or a file.
    listed = settings([{"level": "block", "nodeLabel": BLOCK}, {"level": "rack", "label": RACK}]).topology_levels
    assert listed == levels
    assert settings("").topology_levels == [] and KubernetesSettings().topology_levels == []


def test_hostname_is_allowed_as_the_last_level_only_as_in_kueue():
    last = settings(f"rack={RACK},host=kubernetes.io/hostname").topology_levels
    assert [t.node_label for t in last] == [RACK, "kubernetes.io/hostname"]
    message = refusal(f"host=kubernetes.io/hostname,rack={RACK}")
    assert "kubernetes.io/hostname can only be the last" in message and "adds nothing" in message


@pytest.mark.parametrize(
    ("levels", "words"),
    [
        ("block=Cloud.Provider.com/block", "its prefix 'Cloud.Provider.com' must be a DNS subdomain"),
        ("block=cloud..provider.com/block", "must be a DNS subdomain"),
        ("block=/block", "empty prefix"),
        ("block=cloud.provider.com/-block", "its name '-block' must be 1 to 63"),
        ("block=cloud.provider.com/" + "b" * 64, "must be 1 to 63"),
        ("block=" + "a" * 250 + ".example.com/block", "at most 253 characters"),
        (f"block={BLOCK},block={RACK}", "level name block given twice"),
        (f"block={BLOCK},rack={BLOCK}", f"node label {BLOCK} given twice"),
        (",".join(f"l{i}=example.com/l{i}" for i in range(MAX_LEVELS + 1)), f"name at most {MAX_LEVELS}"),
        (f"nvlink={BLOCK}", "names a level inside a node"),
        (f"-block={BLOCK}", "level name '-block'"),
        ("block", "write LEVEL=NODE_LABEL"),
        (42, "write LEVEL=NODE_LABEL"),
        ([{"level": "block"}], "nodeLabel missing"),
        ([{"level": "block", "nodeLabel": BLOCK, "weight": 2}], "weight is not a key of it"),
    ],
)
def test_levels_kubernetes_or_kueue_would_refuse_are_refused_saying_what_to_write(levels, words):
    message = refusal(levels)
    assert message.startswith("Kubernetes cluster k8s-a: topology_levels")
    assert words in message


def test_as_many_levels_as_allowed_are_taken():
    levels = settings(",".join(f"l{i}=example.com/l{i}" for i in range(MAX_LEVELS))).topology_levels
    assert len(levels) == MAX_LEVELS


# -- the inventory -------------------------------------------------------------------------


def labelled(node: str, **labels: str) -> dict[str, Any]:
    out = copy.deepcopy(NODES[node])
    out["metadata"]["labels"] = {**out["metadata"].get("labels", {}), **labels}
    return out


def test_every_record_of_a_node_carries_its_domain_at_each_level_widest_first():
    levels = settings(f"block={BLOCK},rack={RACK}").topology_levels
    for node in ("t4-timeslice", "a100-mig-mixed", "h100-whole"):
        units = node_units("k8s-a", labelled(node, **{BLOCK: "b1", RACK: "r7"}), {}, levels=levels)
        assert units and all(u.topology == (("block", "b1"), ("rack", "r7")) for u in units), node
        # Kubernetes does not say which device indexes are free, nor how NVLink joins them.
        assert all(u.free_gpus is None and u.gpu_topology is None for u in units)


def test_a_node_without_a_level_s_label_has_no_domain_there():
    levels = settings(f"block={BLOCK},rack={RACK}").topology_levels
    (missing,) = node_units("k8s-a", labelled("h100-whole", **{BLOCK: "b2"}), {}, levels=levels)
    assert missing.topology == (("block", "b2"), ("rack", None))
    (empty,) = node_units("k8s-a", labelled("h100-whole", **{BLOCK: "", RACK: "r1"}), {}, levels=levels)
    assert empty.topology == (("block", None), ("rack", "r1"))


def test_without_levels_no_record_has_a_position():
    (whole,) = node_units("k8s-a", labelled("h100-whole", **{BLOCK: "b1"}), {})
    assert whole.topology == ()


# -- where a job's Pods run ----------------------------------------------------------------


def spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"kind": "training", "command": ["python", "train.py"], **fields})


def placement(sharing: Sharing, **fields: Any) -> Placement:
    return Placement(**{"cluster": "k8s-a", "sharing": sharing, "units": 1, "gpu_equivalents": 1.0, **fields})


def pod_of(manifest) -> dict[str, Any]:
    return manifest.body["spec"]["template"]


def required_terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]


BY_NAME = {"key": "metadata.name", "operator": "In", "values": ["h100-3"]}


@pytest.mark.parametrize(
    "where",
    [
        placement(Sharing.K8S_EXCLUSIVE, units=2, node="h100-3", gpu_model="H100-SXM5-80GB"),
        placement(Sharing.K8S_MIG, node="h100-3", mig_profile="3g.40gb", gpu_model="H100-SXM5-80GB"),
        placement(Sharing.K8S_TIMESLICE, node="h100-3", replicas=2, gpu_model="H100-SXM5-80GB"),
    ],
    ids=["whole-gpus", "mig", "timeslice-replicas"],
)
def test_a_one_node_job_runs_only_on_the_node_gpush_chose(where):
    pod = pod_of(render(7, spec(), where, OPTIONS))
    terms = required_terms(pod)
    assert terms and all(t["matchFields"] == [BY_NAME] for t in terms)
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in pod["spec"]["affinity"]["nodeAffinity"]
    # The GPU model and sharing terms still hold, beside the name.
    if where.sharing != Sharing.K8S_MIG:
        assert all(any(e["key"] == "nvidia.com/gpu.product" for e in t["matchExpressions"]) for t in terms)


def test_a_job_without_a_node_is_left_to_the_scheduler():
    pod = pod_of(render(8, spec(), placement(Sharing.K8S_MIG, mig_profile="3g.40gb"), OPTIONS))
    assert "affinity" not in pod["spec"]


def test_an_elastic_deployment_only_prefers_its_node_so_that_scaling_may_use_others():
    job = spec(kind="inference", isolation="none", gpu_memory_gb=4, elastic={"min_replicas": 1, "max_replicas": 4})
    where = placement(Sharing.K8S_TIMESLICE, node="h100-3", gpu_model="H100-SXM5-80GB", gpu_memory_gb=4)
    manifest = render(9, job, where, OPTIONS)
    assert manifest.kind == "deployments"
    affinity = pod_of(manifest)["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms and all("matchFields" not in t for t in terms)
    (preferred,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["preference"]["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["h100-3"]}
    ]


def test_gpush_s_gpu_choice_is_an_annotation_never_the_devices_the_container_sees():
    where = placement(Sharing.K8S_EXCLUSIVE, units=2, node="h100-3", gpus=(4, 5), gpu_model="H100-SXM5-80GB")
    manifest = render(10, spec(), where, OPTIONS)
    assert pod_of(manifest)["metadata"]["annotations"][ANNOTATION_GPUS] == "4,5"
    assert manifest.body["metadata"]["annotations"][ANNOTATION_GPUS] == "4,5"
    text = json.dumps(manifest.body)
    assert "CUDA_VISIBLE_DEVICES" not in text and "NVIDIA_VISIBLE_DEVICES" not in text
    # None chosen: no annotation.
    plain = render(10, spec(), placement(Sharing.K8S_EXCLUSIVE, node="h100-3"), OPTIONS)
    assert ANNOTATION_GPUS not in pod_of(plain)["metadata"]["annotations"]


def test_a_gang_s_ranks_share_one_template_so_it_names_no_one_node_s_gpus():
    where = placement(
        Sharing.K8S_EXCLUSIVE, units=2, node="h100-0", nodes=("h100-0", "h100-1"), gpus=(0, 1), gpu_equivalents=4.0
    )
    pod = pod_of(render(11, spec(nodes=2, gpus=2), where, OPTIONS))
    assert ANNOTATION_GPUS not in pod["metadata"]["annotations"]
    by_name = {"key": "metadata.name", "operator": "In", "values": ["h100-0", "h100-1"]}
    assert all(t["matchFields"] == [by_name] for t in required_terms(pod))
