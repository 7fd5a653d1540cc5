"""The broker's RBAC as shipped (deploy/k8s/gpush-broker-rbac.yaml) is exactly what the Kubernetes adapter needs:
the adapter runs everything it does (each kind of job in tenant namespaces it creates, statuses by watch, a
restart, cancel, scale, logs, inventory, a multi-node job's Indexed Job and Service, time-slicing, tenants'
ResourceQuotas, fencing a node, a MIG layout) as the file's ServiceAccount against the API test server with
the file's rules enforced (integration/k8s/apiserver_rbac.py plays the RBAC authorizer), and the server
records every request as kube-apiserver authorizes it. Every request must be allowed, and every grant of the
file must have been needed by one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from adapters.k8s import KubernetesAdapter
from broker.core.adapter import BackendState, Owner, Rejected, Sharing
from integration.k8s import apiserver
from integration.k8s.apiserver_rbac import (
    RbacPolicy,
    RequestAttributes,
    forbidden,
    request_attributes,
    wildcards,
)
from integration.test_k8s_adapter import (
    TAG,
    Follower,
    _install_gpu_operator_api,
    job_spec,
    placed,
    simulated_durations,  # noqa: F401  (autouse: job labels sim-duration, sim-exit reach the simulator)
    simulated_nodes,
    wait_for,
)
from tests.inventory.test_agent_deploy import unknown_fields

RBAC_FILE = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "gpush-broker-rbac.yaml"
BROKER = "system:serviceaccount:gpush:gpush-broker"
BROKER_TOKEN = "gpush-broker-token"
VISION, NLP = Owner("alice", "vision"), Owner("bob", "nlp")


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d]


@pytest.fixture
def audited(tmp_path) -> Iterator[tuple[Any, list[RequestAttributes], RbacPolicy]]:
    """The API test server enforcing the shipped RBAC for the broker's token, recording its requests."""
    policy = RbacPolicy.from_documents(documents())
    audit: list[RequestAttributes] = []
    server = apiserver.start(users={BROKER_TOKEN: BROKER}, authorizer=policy.allows, audit=audit)
    yield server, audit, policy
    server.stop()


@pytest.fixture
def admin_api(audited, tmp_path) -> Iterator[Any]:
    server = audited[0]
    api = config.new_client_from_config(config_file=str(server.write_kubeconfig(tmp_path / "admin")))
    yield api
    api.close()


@pytest.fixture
def nodes(admin_api) -> Iterator[Any]:
    yield from simulated_nodes(admin_api)


def broker_adapter(server: Any, tmp_path: Path) -> KubernetesAdapter:
    kubeconfig = server.write_kubeconfig(tmp_path / "broker", token=BROKER_TOKEN)
    settings = {
        "kubeconfig": str(kubeconfig),
        "namespace": "gpush",
        "create_namespace": True,
        "namespace_mode": "per-tenant",
        "tenant_namespaces": "vision=cv-jobs",
        "namespace_pattern": "team-{tenant}",
        "tag": TAG,
        "image": "python:3.11-slim",
        "watch_seconds": 0.5,
    }
    return KubernetesAdapter("k8s-rbac", settings)


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/apis/batch/v1/jobs", {}, ("list", "batch", "jobs", "", "", "")),
        ("GET", "/apis/batch/v1/jobs", {"watch": "true"}, ("watch", "batch", "jobs", "", "", "")),
        ("GET", "/apis/batch/v1/watch/namespaces/a/jobs", {}, ("watch", "batch", "jobs", "", "a", "")),
        ("GET", "/api/v1/namespaces/a/pods/p/log", {}, ("get", "", "pods", "log", "a", "p")),
        (
            "PATCH",
            "/apis/apps/v1/namespaces/a/deployments/d/scale",
            {},
            ("patch", "apps", "deployments", "scale", "a", "d"),
        ),
        ("GET", "/api/v1/namespaces/a", {}, ("get", "", "namespaces", "", "a", "a")),
        ("POST", "/api/v1/namespaces", {}, ("create", "", "namespaces", "", "", "")),
        ("PUT", "/api/v1/namespaces/a/resourcequotas/q", {}, ("update", "", "resourcequotas", "", "a", "q")),
        ("DELETE", "/api/v1/namespaces/a/pods", {}, ("deletecollection", "", "pods", "", "a", "")),
        ("GET", "/api/v1/nodes", {"fieldSelector": "metadata.name=n1"}, ("list", "", "nodes", "", "", "n1")),
        ("GET", "/apis/nvidia.com/v1/clusterpolicies", {}, ("list", "nvidia.com", "clusterpolicies", "", "", "")),
    ],
)
def test_requests_are_authorized_by_the_attributes_kube_apiserver_reads_off_them(method, path, query, expected):
    seen = request_attributes(BROKER, method, path, query)
    assert (seen.verb, seen.api_group, seen.resource, seen.subresource, seen.namespace, seen.name) == expected
    assert seen.resource_request
    assert not request_attributes(BROKER, "GET", "/apis/batch/v1", {}).resource_request  # discovery


def test_rbac_is_played_by_binding_scope_resource_names_and_subresources():
    policy = RbacPolicy.from_documents(documents())
    allowed = [
        ("GET", "/apis/batch/v1/jobs", {"watch": "true"}),  # every namespace: ClusterRoleBinding
        ("GET", "/api/v1/namespaces/team-a/pods/p/log", {}),
        ("PATCH", "/apis/apps/v1/namespaces/team-a/deployments/d/scale", {}),
        ("GET", "/api/v1/namespaces/gpu-operator/configmaps/time-slicing-config", {}),
        ("POST", "/api/v1/namespaces/gpu-operator/configmaps", {}),
    ]
    refused = [
        ("PUT", "/apis/apps/v1/namespaces/team-a/deployments/d/scale", {}),  # patch only
        ("GET", "/api/v1/namespaces/team-a/configmaps/time-slicing-config", {}),  # the Role is gpu-operator's
        ("GET", "/api/v1/namespaces/gpu-operator/configmaps/other", {}),  # resourceNames
        ("GET", "/api/v1/namespaces/team-a/secrets/s", {}),
        ("DELETE", "/api/v1/nodes/n1", {}),
    ]
    for method, path, query in allowed:
        assert policy.allows(request_attributes(BROKER, method, path, query)), path
    for method, path, query in refused:
        assert not policy.allows(request_attributes(BROKER, method, path, query)), path
    assert not policy.allows(request_attributes("system:serviceaccount:other:x", "GET", "/apis/batch/v1/jobs", {}))
    denied = forbidden(request_attributes(BROKER, "GET", "/api/v1/namespaces/team-a/secrets/s", {}))
    assert (denied.code, denied.reason) == (403, "Forbidden")
    assert denied.message == (
        f'secrets "s" is forbidden: User "{BROKER}" cannot get resource "secrets" in API group "" '
        'in the namespace "team-a"'
    )


def test_the_shipped_rbac_has_no_wildcards_and_binds_what_it_defines():
    assert wildcards(documents()) == []
    kinds = [d["kind"] for d in documents()]
    assert kinds == ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRole"] + ["ClusterRoleBinding"] * 2 + [
        "Role",
        "RoleBinding",
    ]
    for document in documents():  # every field one Kubernetes knows, as kubectl apply would check
        assert unknown_fields(document, f"V1{document['kind']}") == [], document["metadata"]["name"]
    policy = RbacPolicy.from_documents(documents())  # every binding's role is in the file
    assert {g.user for g in policy.grants} == {BROKER}


def test_a_broker_without_the_rbac_is_refused_and_told_what_grants_it(tmp_path):
    """The authorizer refuses as kube-apiserver does, and the adapter says which file grants it."""
    server = apiserver.start(users={BROKER_TOKEN: BROKER}, authorizer=RbacPolicy([]).allows)
    try:
        adapter = broker_adapter(server, tmp_path)
        health = adapter.health()
        assert not health.ok and "deploy/k8s/gpush-broker-rbac.yaml" in health.detail
        refused = 'cannot list resource "pods" in API group "" at the cluster scope .*deploy/k8s/gpush-broker-rbac.yaml'
        with pytest.raises(Rejected, match=refused):
            adapter.statuses()
        adapter.close()
    finally:
        server.stop()


def test_every_request_of_the_adapter_is_allowed_and_every_grant_is_used(audited, admin_api, nodes, tmp_path):
    server, audit, policy = audited
    _install_gpu_operator_api(admin_api)
    adapter = broker_adapter(server, tmp_path)
    try:
        assert adapter.health().ok
        assert any(u.node == "t4-0" for u in adapter.inventory())  # Nodes, Pods, the time-slicing config
        wait_for(lambda: any(a.verb == "watch" and a.resource == "nodes" for a in audit), what="the node watch")
        quotas = {"vision": 2.0, "nlp": 1.0}
        assert adapter.apply_tenant_quotas(adapter.tenant_quotas(quotas)) == []  # no tenant namespace yet

        # Each kind of job, in namespaces gpush creates, each with its ResourceQuota.
        printed = adapter.submit(
            1, job_spec(command="echo hi", labels={"sim-duration": "0.3"}), placed(Sharing.K8S_EXCLUSIVE), VISION
        )
        elastic = job_spec(
            kind="inference",
            isolation="none",
            gpu_memory_gb=2,
            elastic={"min_replicas": 1, "max_replicas": 2},
            command=["python", "-m", "http.server"],
        )
        served = adapter.submit(2, elastic, placed(Sharing.K8S_TIMESLICE, gpu_model="T4"), NLP)
        batch = [
            (3 + i, job_spec(labels={"sim-duration": "60"}), placed(Sharing.K8S_EXCLUSIVE), VISION) for i in (0, 1)
        ]
        assert adapter.submit_many(batch) == [f"cv-jobs/job/{TAG}-3", f"cv-jobs/job/{TAG}-4"]
        # A multi-node job: an Indexed Job and its headless Service (on nodes not there: its ranks
        # wait, taking no GPU from the jobs above).
        two_nodes = placed(Sharing.K8S_EXCLUSIVE, units=2, node="h100-8", nodes=("h100-8", "h100-9"))
        assert adapter.submit(5, job_spec(nodes=2, gpus=2), two_nodes, VISION) == f"cv-jobs/job/{TAG}-5"
        # Submitted again (a broker killed before its database write): found by name, not created twice.
        assert adapter.submit(*batch[0]) == f"cv-jobs/job/{TAG}-3"
        assert adapter.submit(2, elastic, placed(Sharing.K8S_TIMESLICE, gpu_model="T4"), NLP) == served
        core = client.CoreV1Api(admin_api)
        assert {q.metadata.namespace for q in core.list_resource_quota_for_all_namespaces().items} == {
            "cv-jobs",
            "team-nlp",
        }

        follow = Follower(adapter)
        follow.until(1, BackendState.SUCCEEDED)
        follow.until(2, BackendState.RUNNING)
        follow.until(3, BackendState.RUNNING)
        assert adapter.logs(1, printed).text == "hi\n"
        assert adapter.scale(2, 2) == 2
        assert adapter.scale(2, 0) == 0
        wait_for(lambda: not core.list_namespaced_pod("team-nlp").items, what="no replica left")
        with pytest.raises(Rejected, match="its Deployment .* has no pod"):  # read to say why there is no output
            adapter.logs(2, served)

        adapter.cancel(3)
        follow.until(3, BackendState.CANCELLED)
        gone = adapter.logs(3, f"cv-jobs/job/{TAG}-3")  # its Pod went with its log: the Job's events name it
        assert not gone.readable and gone.location.startswith("pod ")
        assert adapter.find(4).state == BackendState.RUNNING

        # Time-slicing: the ConfigMap created, then changed; the ClusterPolicy patched; nodes labelled.
        adapter.apply_timeslice(adapter.timeslice(4, node_label="sim.gpush.io/pool=t4"))
        adapter.apply_timeslice(adapter.timeslice(2, node_label="sim.gpush.io/pool=t4"))
        assert adapter.timeslice_state() is not None

        # A MIG layout change: the node fenced (cordoned) and unfenced; the A100's new layout
        # in the MIG manager's ConfigMap and the node's labels, then read back once applied.
        adapter.fence("a100-0", "MIG change 1")
        assert adapter.fenced() == {"a100-0": "MIG change 1"}
        adapter.unfence("a100-0")
        seven = [f"1g.5gb@{i}" for i in range(7)]
        adapter.publish_mig("a100-0", 0, seven)
        wait_for(lambda: adapter.mig_published("a100-0", 0) == tuple(seven), what="the new MIG layout")

        # Quotas changed and removed: the ResourceQuotas replaced and deleted.
        changed = adapter.apply_tenant_quotas(adapter.tenant_quotas({"vision": 1.0}))
        assert [line.split(" ResourceQuota")[0] for line in changed] == ["updated", "deleted"]

        # Cancels: the elastic job's Deployment; and the Pods of a Job someone deleted leaving
        # them behind (kubectl delete --cascade=orphan), which hold their GPUs until deleted.
        cursor = follow.cursor
        adapter.cancel(2)
        client.BatchV1Api(admin_api).delete_namespaced_job(f"{TAG}-4", "cv-jobs", propagation_policy="Orphan")
        adapter.cancel(4)
        wait_for(lambda: not core.list_namespaced_pod("cv-jobs", label_selector="gpush.io/job-id=4").items)
        adapter.cancel(5)  # the gang's Job and Service, found by label
        assert not core.list_namespaced_service("cv-jobs", label_selector="gpush.io/job-id=5").items
        # A restarted broker: everything listed again, and the old cursor's deletions watched for.
        restarted = broker_adapter(server, tmp_path)
        try:
            page = restarted.statuses(cursor)
            assert {j.job_id for j in page.jobs} >= {1, 2}
        finally:
            restarted.close()
    finally:
        adapter.close()

    asked = [a for a in audit if a.user == BROKER]
    assert asked and all(a.resource_request for a in asked), [a.describe() for a in asked if not a.resource_request]
    refused = sorted({a.describe() for a in asked if not policy.allows(a)})
    assert refused == [], "requests the shipped RBAC does not allow:\n" + "\n".join(refused)
    unused = [g.describe() for g in policy.unused(asked)]
    assert unused == [], "grants of the shipped RBAC no request needed:\n" + "\n".join(unused)
