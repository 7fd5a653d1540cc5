"""Tenants on Kubernetes without a server: which namespace a tenant's jobs go to, the settings
that say so (and their refusals), and the ResourceQuota rendered from a tenant's GPU quota for
whole GPUs, time-sliced GPUs and MIG slices. Node objects come from tests/data/k8s.
integration/test_k8s_tenants.py runs the same against the test API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from adapters.k8s.context import parse_backend_id
from adapters.k8s.inventory import node_units
from adapters.k8s.settings import KubernetesSettings
from adapters.k8s.tenancy import (
    QUOTA_NAME,
    TenantNamespaces,
    claimed_by,
    dns_label,
    gpu_resources,
    namespace_manifest,
    plan_quotas,
    quota_counts,
)
from adapters.settings import load_settings
from broker.core.adapter import Owner, Rejected
from broker.core.errors import InvalidRequest

NODES = json.loads((Path(__file__).resolve().parents[1] / "data" / "k8s" / "nodes.json").read_text())
CLUSTER = "Kubernetes cluster k8s-a"


def namespaces(**fields: Any) -> TenantNamespaces:
    return TenantNamespaces(**{"cluster": CLUSTER, "default": "gpush", "mode": "per-tenant", **fields})


def units(*nodes: str) -> list:
    return [unit for node in nodes for unit in node_units("k8s-a", NODES[node], {})]


# -- which namespace ---------------------------------------------------------------------


def test_shared_mode_and_jobs_without_an_owner_go_to_the_default_namespace():
    shared = TenantNamespaces(cluster=CLUSTER, default="gpush")
    assert shared.namespace_for(Owner("alice", "vision")) == ("gpush", None)
    assert namespaces(pattern="gpush-{tenant}").namespace_for(None) == ("gpush", None)


def test_a_tenant_goes_to_its_mapped_namespace_else_to_the_pattern():
    where = namespaces(mapping={"vision": "cv-jobs"}, pattern="gpush-{tenant}")
    assert where.namespace_for(Owner("alice", "vision")) == ("cv-jobs", "vision")
    assert where.namespace_for(Owner("bob", "nlp")) == ("gpush-nlp", "nlp")


@pytest.mark.parametrize(
    ("tenant", "label"),
    [("Vision", "vision"), ("team_a", "team-a"), ("alice@lab.example", "alice-lab-example"), ("nlp.", "nlp")],
)
def test_a_tenant_name_is_made_a_dns_label(tenant, label):
    assert dns_label(tenant) == label
    assert namespaces(pattern="gpush-{tenant}").tenant_namespace(tenant) == f"gpush-{label}"


@pytest.mark.parametrize(
    ("tenant", "fields", "words"),
    [
        ("nlp", {"mapping": {"vision": "cv-jobs"}}, "tenant nlp has no namespace on Kubernetes cluster k8s-a"),
        ("x" * 60, {"pattern": "gpush-{tenant}"}, "which is not a namespace name"),
        ("___", {"pattern": "gpush-{tenant}"}, "has no letter or digit"),
        ("kube-system", {"pattern": "{tenant}"}, "one of Kubernetes' own namespaces"),
        ("default", {"pattern": "{tenant}"}, "one of Kubernetes' own namespaces"),
        ("gpush", {"pattern": "{tenant}"}, "the namespace of jobs without an owner"),
    ],
)
def test_a_tenant_without_a_valid_namespace_is_refused_saying_how_to_map_it(tenant, fields, words):
    with pytest.raises(Rejected, match=words) as refused:
        namespaces(**fields).namespace_for(Owner("alice", tenant))
    assert f"tenant_namespaces={tenant}=NAMESPACE" in str(refused.value)


def test_namespaces_gpush_creates_say_whose_they_are():
    body = namespace_manifest("gpush-team-a", tag="gpush", tenant="team_a")
    assert body["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "gpush",
        "gpush.io/broker": "gpush",
        "gpush.io/tenant": "team_a",
    }
    assert claimed_by(body, "gpush") == "team_a"
    assert claimed_by(body, "other-broker") is None  # another broker's marks are not this one's
    assert claimed_by({"metadata": {"name": "made-by-an-admin"}}, "gpush") is None
    assert "annotations" not in namespace_manifest("gpush", tag="gpush", tenant=None)["metadata"]


@pytest.mark.parametrize(
    ("backend_id", "expected"),
    [
        ("cv-jobs/job/gpush-7", ("cv-jobs", "jobs", "gpush-7")),
        ("cv-jobs/deployment/gpush-8", ("cv-jobs", "deployments", "gpush-8")),
        ("job/gpush-7", ("gpush", "jobs", "gpush-7")),  # written by earlier versions: the default namespace
        ("deployment/gpush-8", ("gpush", "deployments", "gpush-8")),
        ("gpush-9", ("gpush", "jobs", "gpush-9")),
    ],
)
def test_backend_ids_say_their_namespace_and_old_ones_mean_the_default(backend_id, expected):
    assert parse_backend_id(backend_id, "gpush") == expected


# -- settings ------------------------------------------------------------------------------


def settings(**config: Any) -> KubernetesSettings:
    return load_settings(KubernetesSettings, config, cluster=CLUSTER)


def test_settings_as_the_command_line_gives_them():
    made = settings(
        namespace_mode="per-tenant",
        tenant_namespaces="vision=cv-jobs, nlp=nlp-jobs",
        namespace_pattern="gpush-{tenant}",
    )
    assert made.tenant_namespaces == {"vision": "cv-jobs", "nlp": "nlp-jobs"}
    assert settings().namespace_mode == "shared"  # the default: one namespace, as before tenants


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"tenant_namespaces": "vision=cv-jobs"}, "take effect with namespace_mode=per-tenant"),
        ({"namespace_mode": "per-tenant"}, "needs tenant_namespaces (TENANT=NAMESPACE,...), namespace_pattern"),
        ({"namespace_mode": "per-namespace"}, "namespace_mode: Input should be 'shared' or 'per-tenant'"),
        ({"namespace_mode": "per-tenant", "tenant_namespaces": "vision"}, "tenant_namespaces is TENANT=NAMESPACE"),
        ({"namespace_mode": "per-tenant", "tenant_namespaces": "vision=CV_Jobs"}, "is not a namespace name"),
        ({"namespace_mode": "per-tenant", "tenant_namespaces": "vision=kube-system"}, "Kubernetes' own"),
        ({"namespace_mode": "per-tenant", "tenant_namespaces": "a=shared,b=shared"}, "a and b both map to"),
        ({"namespace_mode": "per-tenant", "tenant_namespaces": "vision=gpush"}, "jobs without an owner"),
        ({"namespace_mode": "per-tenant", "namespace_pattern": "gpush"}, "must hold {tenant} once"),
        ({"namespace_mode": "per-tenant", "namespace_pattern": "{tenant}-{tenant}"}, "must hold {tenant} once"),
        ({"namespace_mode": "per-tenant", "namespace_pattern": "{team}-{tenant}"}, "no other braces"),
        ({"namespace_mode": "per-tenant", "namespace_pattern": "GPUSH_{tenant}"}, "does not make namespace names"),
    ],
)
def test_bad_tenancy_settings_are_refused_as_invalid_with_what_to_do(config, words):
    with pytest.raises(InvalidRequest) as refused:
        settings(**config)
    assert refused.value.http_status == 422
    message = refused.value.message
    assert message.startswith(f"{CLUSTER}: ") and words in message
    assert "Value error" not in message  # pydantic's wrapping is not the admin's business


# -- quotas --------------------------------------------------------------------------------


def test_each_gpu_resource_is_worth_what_the_ledger_counts():
    offered = gpu_resources(units("t4-timeslice", "a100-mig-mixed", "h100-whole", "single-mig"))
    assert set(offered) == {"nvidia.com/gpu", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb"}
    assert offered["nvidia.com/mig-3g.20gb"] == pytest.approx((3 / 7,))
    assert offered["nvidia.com/mig-1g.5gb"] == pytest.approx((1 / 7,))
    # whole H100s, T4 replicas (1/4), and slices the single strategy advertises as nvidia.com/gpu (1/7)
    assert offered["nvidia.com/gpu"] == pytest.approx((1 / 7, 1 / 4, 1.0))


@pytest.mark.parametrize(
    ("node", "gpu_quota", "expected"),
    [
        ("h100-whole", 2.0, {"nvidia.com/gpu": 2}),
        ("h100-whole", 2.5, {"nvidia.com/gpu": 2}),  # a third GPU would take it past 2.5
        ("h100-whole", 0.5, {"nvidia.com/gpu": 0}),
        ("t4-timeslice", 2.0, {"nvidia.com/gpu": 8}),  # replicas of T4s split 4 ways: 1/4 each
        ("t4-timeslice", 0.5, {"nvidia.com/gpu": 2}),
        ("old-gfd-timeslice", 1.5, {"nvidia.com/gpu": 3}),  # split 2 ways
        ("a100-mig-mixed", 1.0, {"nvidia.com/mig-1g.5gb": 7, "nvidia.com/mig-3g.20gb": 2}),
        ("a100-mig-mixed", 3 / 7, {"nvidia.com/mig-1g.5gb": 3, "nvidia.com/mig-3g.20gb": 1}),  # exactly one slice
        ("a100-mig-mixed", 0.0, {"nvidia.com/mig-1g.5gb": 0, "nvidia.com/mig-3g.20gb": 0}),
    ],
)
def test_the_quota_of_each_resource_is_the_largest_count_that_alone_stays_within_it(node, gpu_quota, expected):
    assert quota_counts(gpu_quota, gpu_resources(units(node))) == expected


def test_a_resource_that_means_more_than_one_amount_is_counted_by_its_smallest():
    """nvidia.com/gpu is a whole H100 on one node and a quarter of a T4 on another: counted by
    the quarter, the quota never refuses a replica the ledger admitted."""
    mixed = gpu_resources(units("t4-timeslice", "h100-whole"))
    assert quota_counts(1.0, mixed) == {"nvidia.com/gpu": 4}
    plan = plan_quotas({"vision": 1.0}, namespaces(pattern="gpush-{tenant}"), mixed, tag="gpush")
    text = plan.to_yaml()
    assert "nvidia.com/gpu is 1/4 or 1 GPU-equivalents on different nodes: counted by the smallest" in text
    assert "up to 4x the quota in the larger units" in text


def test_the_quota_yaml_is_a_namespace_and_a_resource_quota_per_tenant_with_a_quota():
    offered = gpu_resources(units("t4-timeslice", "a100-mig-mixed"))
    where = namespaces(mapping={"vision": "cv-jobs"}, pattern="gpush-{tenant}")
    quotas = {"vision": 2.0, "nlp": 0.5, "ops": None, "x" * 60: 1.0}
    plan = plan_quotas(quotas, where, offered, tag="gpush")
    text = plan.to_yaml()
    documents = [d for d in yaml.safe_load_all(text) if d]
    assert [(d["kind"], d["metadata"]["name"]) for d in documents] == [
        ("Namespace", "gpush-nlp"),
        ("ResourceQuota", QUOTA_NAME),
        ("Namespace", "cv-jobs"),
        ("ResourceQuota", QUOTA_NAME),
    ]
    nlp, vision = documents[1], documents[3]
    assert vision["metadata"]["namespace"] == "cv-jobs"
    assert vision["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "8",
        "requests.nvidia.com/mig-1g.5gb": "14",
        "requests.nvidia.com/mig-3g.20gb": "4",
    }
    assert nlp["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "2",
        "requests.nvidia.com/mig-1g.5gb": "3",
        "requests.nvidia.com/mig-3g.20gb": "1",
    }
    assert vision["metadata"]["labels"]["gpush.io/tenant"] == "vision"
    assert vision["metadata"]["annotations"]["gpush.io/gpu-quota"] == "2"
    # What the numbers mean, and the tenant that has no namespace here, are said in comments.
    assert "the broker's own ledger holds each tenant to its combined budget" in text.lower()
    assert "cluster-side backstop" in text
    assert f"# no ResourceQuota: tenant {'x' * 60} makes 'gpush-{'x' * 60}'" in text
    assert "ops" not in text  # no quota: nothing to say


def test_no_quota_yaml_with_one_shared_namespace_or_no_gpus_known():
    offered = gpu_resources(units("h100-whole"))
    off = plan_quotas({"vision": 2.0}, TenantNamespaces(cluster=CLUSTER, default="gpush"), offered, tag="gpush")
    assert off.off and not off.entries
    assert [d for d in yaml.safe_load_all(off.to_yaml()) if d] == []
    assert "namespace_mode=per-tenant gives each tenant a namespace" in off.to_yaml()
    blind = plan_quotas({"vision": 2.0}, namespaces(pattern="gpush-{tenant}"), {}, tag="gpush")
    assert [d for d in yaml.safe_load_all(blind.to_yaml()) if d] == []
    assert "No GPU resource is known" in blind.to_yaml()


def test_a_namespace_two_tenants_would_share_gets_the_quota_of_one_and_says_so():
    where = namespaces(mapping={"vision": "gpush-nlp"}, pattern="gpush-{tenant}")  # nlp's pattern makes it too
    plan = plan_quotas({"vision": 1.0, "nlp": 3.0}, where, gpu_resources(units("h100-whole")), tag="gpush")
    assert [(e.tenant, e.namespace, dict(e.hard)) for e in plan.entries] == [
        ("nlp", "gpush-nlp", {"requests.nvidia.com/gpu": "3"})
    ]
    assert "# no ResourceQuota: tenant vision's namespace gpush-nlp is tenant nlp's" in plan.to_yaml()
