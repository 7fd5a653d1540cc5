"""The Kubernetes API test server, driven through the official client and a kubeconfig.

Every test down to the "test server only" section uses public API behaviour alone, in a namespace of
its own and with unique names for cluster-scoped objects, and waits for what a real cluster does
asynchronously (garbage collection, namespace deletion), so the same assertions can hold against a
real cluster. The last tests restart the server, compact its history or run it by hand, which only
the test server allows.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient

from integration.k8s.apiserver import TestApiServer, start

ROOT = Path(__file__).resolve().parents[1]
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


# --- fixtures and helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def apiserver() -> Iterator[TestApiServer]:
    server = start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def kubeconfig(apiserver, tmp_path_factory) -> Path:
    return apiserver.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config")


@pytest.fixture(scope="module")
def api(kubeconfig) -> Iterator[client.ApiClient]:
    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    yield api_client
    api_client.close()


@pytest.fixture
def core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def apps(api) -> client.AppsV1Api:
    return client.AppsV1Api(api)


@pytest.fixture
def batch(api) -> client.BatchV1Api:
    return client.BatchV1Api(api)


@pytest.fixture
def namespace(core) -> Iterator[str]:
    name = unique("t")
    core.create_namespace({"metadata": {"name": name}})
    yield name
    try:
        core.delete_namespace(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def api_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the Status body of a call that must fail."""
    with pytest.raises(ApiException) as info:
        call(*args, **kwargs)
    return info.value.status, json.loads(info.value.body)


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """What a real cluster does asynchronously (garbage collection, namespace deletion) may take a while."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def pod(name: str | None = None, labels: dict[str, str] | None = None, **container: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": labels or {}}
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = "pod-"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "main", "image": "busybox:1.36", **container}]},
    }


def deployment(name: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "a",
                            "image": "a:1",
                            "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "1"}],
                        },
                        {"name": "b", "image": "b:1"},
                    ]
                },
            },
        },
    }


def job(name: str, restart_policy: str | None = "Never") -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox:1.36"}]}
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": {"template": {"spec": spec}}}


def owned_pod(owner: Any, kind: str, api_version: str) -> dict[str, Any]:
    body = pod()
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": api_version,
            "kind": kind,
            "name": owner.metadata.name,
            "uid": owner.metadata.uid,
            "controller": True,
        }
    ]
    return body


def names(listing: Any) -> list[str]:
    return [item.metadata.name for item in listing.items]


def configmap(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


# --- connection, discovery ----------------------------------------------------------------------------


def test_a_kubeconfig_with_the_token_reaches_the_server_and_a_wrong_token_does_not(apiserver, kubeconfig):
    config.load_kube_config(config_file=str(kubeconfig))
    assert "default" in names(client.CoreV1Api().list_namespace())
    assert client.VersionApi().get_code().major == "1"

    wrong = client.Configuration()
    wrong.host = apiserver.url
    wrong.api_key = {"authorization": "Bearer not-the-token"}
    status, body = api_error(client.CoreV1Api(client.ApiClient(wrong)).list_namespace)
    assert status == 401
    assert (body["kind"], body["status"], body["reason"]) == ("Status", "Failure", "Unauthorized")


def test_discovery_is_enough_for_the_dynamic_client(api, namespace):
    dynamic = DynamicClient(api)
    pods = dynamic.resources.get(api_version="v1", kind="Pod")
    assert pods.namespaced and pods.name == "pods"
    deployments = dynamic.resources.get(api_version="apps/v1", kind="Deployment")
    assert "scale" in deployments.subresources and "status" in deployments.subresources
    jobs = dynamic.resources.get(api_version="batch/v1", kind="Job")
    created = jobs.create(body=job("dyn"), namespace=namespace)
    assert jobs.get(name="dyn", namespace=namespace).metadata.uid == created.metadata.uid


# --- CRUD and error bodies ------------------------------------------------------------------------------


def test_a_pod_is_created_read_listed_replaced_and_deleted(core, namespace):
    created = core.create_namespaced_pod(namespace, pod(labels={"app": "x"}, resources={"limits": {"memory": "1Gi"}}))
    assert created.metadata.name.startswith("pod-") and len(created.metadata.name) == len("pod-") + 5
    assert created.metadata.uid and created.metadata.creation_timestamp and int(created.metadata.resource_version) > 0
    assert created.status.phase == "Pending"
    # The server defaults a request the container leaves out to its limit.
    assert created.spec.containers[0].resources.requests == {"memory": "1Gi"}

    name = created.metadata.name
    assert core.read_namespaced_pod(name, namespace).metadata.uid == created.metadata.uid
    assert names(core.list_namespaced_pod(namespace)) == [name]

    created.metadata.labels["app"] = "y"
    replaced = core.replace_namespaced_pod(name, namespace, created)
    assert replaced.metadata.labels == {"app": "y"}
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)

    core.delete_namespaced_pod(name, namespace)
    assert eventually(lambda: not core.list_namespaced_pod(namespace).items)
    status, body = api_error(core.read_namespaced_pod, name, namespace)
    assert status == 404


def test_errors_come_as_status_bodies(core, namespace):
    status, body = api_error(core.read_namespaced_pod, "missing", namespace)
    assert status == 404
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'pods "missing" not found',
        "reason": "NotFound",
        "details": {"name": "missing", "kind": "pods"},
        "code": 404,
    }

    core.create_namespaced_config_map(namespace, configmap("twice"))
    status, body = api_error(core.create_namespaced_config_map, namespace, configmap("twice"))
    assert (status, body["reason"], body["details"]["kind"]) == (409, "AlreadyExists", "configmaps")
    assert body["message"] == 'configmaps "twice" already exists'

    status, body = api_error(core.create_namespaced_config_map, unique("no-such-ns"), configmap("x"))
    assert (status, body["reason"], body["details"]["kind"]) == (404, "NotFound", "namespaces")


def test_invalid_objects_are_refused_as_the_real_server_refuses_them(core, apps, batch, namespace):
    status, body = api_error(core.create_namespaced_pod, namespace, pod("Bad_Name"))
    assert (status, body["reason"], body["details"]["kind"]) == (422, "Invalid", "Pod")
    assert body["message"].startswith('Pod "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name"')
    assert body["details"]["causes"][0]["field"] == "metadata.name"

    nameless = pod()
    del nameless["metadata"]["generateName"]
    status, body = api_error(core.create_namespaced_pod, namespace, nameless)
    assert status == 422 and "name or generateName is required" in body["message"]

    status, body = api_error(core.create_namespace, {"metadata": {"name": "has.dots"}})
    assert (status, body["reason"]) == (422, "Invalid")

    status, body = api_error(core.create_namespaced_config_map, namespace, configmap("cm", tenant="not ok"))
    assert status == 422 and "metadata.labels" in body["message"]

    # An extended resource needs a limit (equal to the request); a quantity must parse.
    status, body = api_error(
        core.create_namespaced_pod, namespace, pod(resources={"requests": {"nvidia.com/gpu": "1"}})
    )
    assert status == 422 and "Limit must be set for non overcommitable resources" in body["message"]
    status, body = api_error(core.create_namespaced_pod, namespace, pod(resources={"limits": {"memory": "16GB"}}))
    assert (status, body["reason"]) == (400, "BadRequest")

    status, body = api_error(batch.create_namespaced_job, namespace, job("restarts", restart_policy=None))
    assert (status, body["details"]["kind"], body["details"]["group"]) == (422, "Job", "batch")
    assert "spec.template.spec.restartPolicy" in body["message"]

    mismatched = deployment("mismatched")
    mismatched["spec"]["template"]["metadata"]["labels"] = {"app": "other"}
    status, body = api_error(apps.create_namespaced_deployment, namespace, mismatched)
    assert status == 422 and "`selector` does not match template `labels`" in body["message"]


def test_a_stale_write_conflicts(core, namespace):
    core.create_namespaced_config_map(namespace, configmap("cm"))
    first = core.read_namespaced_config_map("cm", namespace)
    second = core.read_namespaced_config_map("cm", namespace)

    first.data = {"k": "first"}
    core.replace_namespaced_config_map("cm", namespace, first)
    second.data = {"k": "second"}
    status, body = api_error(core.replace_namespaced_config_map, "cm", namespace, second)
    assert (status, body["reason"]) == (409, "Conflict")
    assert body["message"].startswith('Operation cannot be fulfilled on configmaps "cm": the object has been modified')

    stale = {"metadata": {"resourceVersion": second.metadata.resource_version}, "data": {"k": "patched"}}
    status, body = api_error(core.patch_namespaced_config_map, "cm", namespace, stale)
    assert (status, body["reason"]) == (409, "Conflict")

    # Without a resourceVersion a write is unconditional.
    second.metadata.resource_version = None
    assert core.replace_namespaced_config_map("cm", namespace, second).data == {"k": "second"}


def test_configmaps_and_events(core, namespace):
    core.create_namespaced_config_map(namespace, configmap("settings"))
    updated = core.patch_namespaced_config_map("settings", namespace, {"data": {"extra": "1"}})
    assert updated.data == {"k": "v", "extra": "1"}
    for reason, obj in (("Scheduled", "p1"), ("Pulled", "p1"), ("Scheduled", "p2")):
        core.create_namespaced_event(
            namespace,
            {
                "metadata": {"generateName": f"{obj}."},
                "involvedObject": {"kind": "Pod", "name": obj, "namespace": namespace},
                "reason": reason,
                "message": f"{reason} {obj}",
                "type": "Normal",
            },
        )
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=p1")
    assert sorted(e.reason for e in events.items) == ["Pulled", "Scheduled"]
    assert len(core.list_namespaced_event(namespace, field_selector="reason=Scheduled").items) == 2


# --- patches ----------------------------------------------------------------------------------------------


def test_strategic_merge_merges_containers_and_env_by_name_and_merge_patch_replaces_lists(apps, namespace):
    apps.create_namespaced_deployment(namespace, deployment("web"))
    patched = apps.patch_namespaced_deployment(
        "web",
        namespace,
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "$patch": "delete"}]},
                            {"name": "c", "image": "c:1"},
                        ]
                    }
                }
            }
        },
    )
    containers = patched.spec.template.spec.containers
    assert [(c.name, c.image) for c in containers] == [("a", "a:1"), ("b", "b:1"), ("c", "c:1")]
    assert [(e.name, e.value) for e in containers[0].env] == [("X", "2")]
    assert patched.metadata.generation == 2

    replaced = apps.patch_namespaced_deployment(
        "web",
        namespace,
        {"spec": {"template": {"spec": {"containers": [{"name": "only", "image": "o:1"}]}}}},
        _content_type=MERGE_PATCH,
    )
    assert [c.name for c in replaced.spec.template.spec.containers] == ["only"]
    assert replaced.metadata.generation == 3


def test_json_patch_applies_operations_in_order_and_a_failed_test_changes_nothing(core, namespace):
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cm"}, "data": {"k": "v", "gone": "x"}})
    patched = core.patch_namespaced_config_map(
        "cm",
        namespace,
        [
            {"op": "add", "path": "/metadata/labels", "value": {"a/b": "c"}},
            {"op": "replace", "path": "/data/k", "value": "v2"},
            {"op": "remove", "path": "/data/gone"},
            {"op": "copy", "from": "/data/k", "path": "/data/copied"},
        ],
    )
    assert patched.metadata.labels == {"a/b": "c"}
    assert patched.data == {"k": "v2", "copied": "v2"}

    status, body = api_error(
        core.patch_namespaced_config_map,
        "cm",
        namespace,
        [{"op": "replace", "path": "/data/k", "value": "v3"}, {"op": "test", "path": "/data/k", "value": "nope"}],
    )
    assert status == 422
    assert core.read_namespaced_config_map("cm", namespace).data["k"] == "v2"


# --- selectors and pagination -------------------------------------------------------------------------------


def test_label_selectors(core, namespace):
    for name, labels in {
        "web-prod": {"app": "web", "env": "prod"},
        "web-dev": {"app": "web", "env": "dev"},
        "db-prod": {"app": "db", "env": "prod", "tier": "backend"},
        "bare": {},
    }.items():
        core.create_namespaced_config_map(namespace, configmap(name, **labels))

    def selected(selector: str) -> list[str]:
        return sorted(names(core.list_namespaced_config_map(namespace, label_selector=selector)))

    assert selected("app=web") == ["web-dev", "web-prod"]
    assert selected("app==web,env=prod") == ["web-prod"]
    assert selected("env!=prod") == ["bare", "web-dev"]
    assert selected("env in (dev, prod),app notin (web)") == ["db-prod"]
    assert selected("tier") == ["db-prod"]
    assert selected("!tier,app") == ["web-dev", "web-prod"]
    status, body = api_error(core.list_namespaced_config_map, namespace, label_selector="app in (")
    assert (status, body["reason"]) == (400, "BadRequest")


def test_field_selectors_on_name_node_and_phase(core, namespace):
    node = unique("node")
    for name in ("a", "b", "c"):
        core.create_namespaced_pod(namespace, pod(name))
    # A scheduler binds a Pod through pods/binding; the response is a Status, so read it raw.
    core.create_namespaced_pod_binding(
        "a", namespace, {"metadata": {"name": "a"}, "target": {"kind": "Node", "name": node}}, _preload_content=False
    )
    core.patch_namespaced_pod_status("a", namespace, {"status": {"phase": "Running"}})

    def selected(selector: str) -> list[str]:
        return sorted(names(core.list_namespaced_pod(namespace, field_selector=selector)))

    assert selected(f"spec.nodeName={node}") == ["a"]
    assert selected("spec.nodeName=") == ["b", "c"]
    assert selected("status.phase=Running") == ["a"]
    assert selected("status.phase!=Running,metadata.name!=b") == ["c"]
    assert selected("metadata.name=b") == ["b"]
    assert names(core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}")) == ["a"]
    status, body = api_error(core.list_namespaced_pod, namespace, field_selector="spec.no.such.field=x")
    assert (status, body["reason"]) == (400, "BadRequest")


def test_pagination_lists_one_consistent_snapshot(core, namespace):
    for i in range(25):
        core.create_namespaced_config_map(namespace, configmap(f"cm-{i:03d}"))
    first = core.list_namespaced_config_map(namespace, limit=10)
    assert names(first) == [f"cm-{i:03d}" for i in range(10)]
    assert first.metadata._continue and first.metadata.remaining_item_count == 15

    # Changes between pages do not show: every page is the list as of the first page's resourceVersion.
    core.delete_namespaced_config_map("cm-020", namespace)
    core.create_namespaced_config_map(namespace, configmap("cm-015a"))
    seen, page = names(first), first
    while page.metadata._continue:
        page = core.list_namespaced_config_map(namespace, limit=10, _continue=page.metadata._continue)
        assert page.metadata.resource_version == first.metadata.resource_version
        seen += names(page)
    assert seen == [f"cm-{i:03d}" for i in range(25)]

    fresh = names(core.list_namespaced_config_map(namespace))
    assert "cm-015a" in fresh and "cm-020" not in fresh and len(fresh) == 25


# --- subresources -----------------------------------------------------------------------------------------


def test_the_scale_subresource_reads_and_writes_deployment_replicas(apps, namespace):
    apps.create_namespaced_deployment(namespace, deployment("svc", replicas=1))
    scale = apps.read_namespaced_deployment_scale("svc", namespace)
    assert (scale.kind, scale.api_version, scale.spec.replicas, scale.status.selector) == (
        "Scale",
        "autoscaling/v1",
        1,
        "app=svc",
    )

    scale.spec.replicas = 3
    assert apps.replace_namespaced_deployment_scale("svc", namespace, scale).spec.replicas == 3
    current = apps.read_namespaced_deployment("svc", namespace)
    assert (current.spec.replicas, current.metadata.generation) == (3, 2)

    status, body = api_error(apps.replace_namespaced_deployment_scale, "svc", namespace, scale)
    assert (status, body["reason"]) == (409, "Conflict")  # scale still carries the old resourceVersion

    assert apps.patch_namespaced_deployment_scale("svc", namespace, {"spec": {"replicas": 0}}).spec.replicas == 0
    status, body = api_error(apps.patch_namespaced_deployment_scale, "svc", namespace, {"spec": {"replicas": -1}})
    assert (status, body["reason"]) == (422, "Invalid")


def test_status_is_written_only_through_the_status_subresource(core, apps, namespace):
    core.create_namespaced_pod(namespace, pod("p"))
    running = core.patch_namespaced_pod_status(
        "p", namespace, {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    )
    assert running.status.phase == "Running"

    # On the main resource, status changes are ignored and the rest applies.
    patched = core.patch_namespaced_pod(
        "p", namespace, {"metadata": {"labels": {"x": "y"}}, "status": {"phase": "Failed"}}
    )
    assert (patched.status.phase, patched.metadata.labels) == ("Running", {"x": "y"})
    # On the status subresource, everything but status is ignored.
    patched = core.patch_namespaced_pod_status(
        "p", namespace, {"spec": {"activeDeadlineSeconds": 5}, "status": {"phase": "Succeeded"}}
    )
    assert (patched.status.phase, patched.spec.active_deadline_seconds) == ("Succeeded", None)

    created = apps.create_namespaced_deployment(namespace, deployment("d"))
    assert created.metadata.generation == 1
    body = apps.read_namespaced_deployment("d", namespace)
    body.status.replicas = body.status.ready_replicas = 1
    body.status.observed_generation = 1
    updated = apps.replace_namespaced_deployment_status("d", namespace, body)
    assert (updated.status.ready_replicas, updated.metadata.generation) == (1, 1)


def test_a_pod_is_placed_by_binding_and_its_spec_is_otherwise_immutable(core, namespace):
    node = unique("node")
    core.create_namespaced_pod(namespace, pod("p"))
    status, body = api_error(core.patch_namespaced_pod, "p", namespace, {"spec": {"nodeName": node}})
    assert (status, body["reason"]) == (422, "Invalid") and "spec: Forbidden" in body["message"]

    binding = {"metadata": {"name": "p"}, "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    core.create_namespaced_pod_binding("p", namespace, binding, _preload_content=False)
    bound = core.read_namespaced_pod("p", namespace)
    assert bound.spec.node_name == node
    assert [(c.type, c.status) for c in bound.status.conditions] == [("PodScheduled", "True")]
    status, body = api_error(core.create_namespaced_pod_binding, "p", namespace, binding, _preload_content=False)
    assert (status, body["reason"]) == (409, "Conflict")

    image_only = {"spec": {"containers": [{"name": "main", "image": "busybox:1.37"}]}}
    assert core.patch_namespaced_pod("p", namespace, image_only).spec.containers[0].image == "busybox:1.37"


# --- workloads and garbage collection -------------------------------------------------------------------------


def test_a_job_gets_a_generated_selector_and_deleting_it_handles_its_pods_by_policy(core, batch, namespace):
    created = batch.create_namespaced_job(namespace, job("train"))
    uid = created.metadata.uid
    assert created.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": uid}
    assert created.spec.template.metadata.labels["job-name"] == "train"
    assert (created.spec.backoff_limit, created.spec.completions, created.spec.parallelism) == (6, 1, 1)

    pods = [
        core.create_namespaced_pod(namespace, owned_pod(created, "Job", "batch/v1")).metadata.name for _ in range(2)
    ]
    batch.delete_namespaced_job("train", namespace, propagation_policy="Foreground")
    assert eventually(lambda: not core.list_namespaced_pod(namespace).items)

    kept = batch.create_namespaced_job(namespace, job("kept"))
    orphan = core.create_namespaced_pod(namespace, owned_pod(kept, "Job", "batch/v1")).metadata.name
    batch.delete_namespaced_job("kept", namespace, propagation_policy="Orphan")
    assert eventually(lambda: not core.read_namespaced_pod(orphan, namespace).metadata.owner_references)
    assert pods and names(core.list_namespaced_pod(namespace)) == [orphan]


def test_deleting_a_deployment_deletes_what_it_owns_by_default(core, apps, namespace):
    created = apps.create_namespaced_deployment(namespace, deployment("web"))
    core.create_namespaced_pod(namespace, owned_pod(created, "Deployment", "apps/v1"))
    apps.delete_namespaced_deployment("web", namespace)
    assert eventually(lambda: not core.list_namespaced_pod(namespace).items)


def test_delete_collection_deletes_what_the_selector_selects(core, namespace):
    for name, labels in (("a", {"batch": "1"}), ("b", {"batch": "1"}), ("c", {"batch": "2"}), ("d", {})):
        core.create_namespaced_config_map(namespace, configmap(name, **labels))
    core.delete_collection_namespaced_config_map(namespace, label_selector="batch=1")
    assert eventually(lambda: names(core.list_namespaced_config_map(namespace)) == ["c", "d"])


def test_deleting_a_namespace_deletes_its_objects(core):
    name = unique("doomed")
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_config_map(name, configmap("cm"))
    core.delete_namespace(name)

    def gone() -> bool:
        try:
            core.read_namespace(name)
        except ApiException as exc:
            return exc.status == 404
        return False

    assert eventually(gone, timeout=30)
    assert api_error(core.read_namespaced_config_map, "cm", name)[0] == 404


def test_nodes_are_cluster_scoped_and_carry_status(core):
    name = unique("gpu-node")
    node = {
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "gpush-test": name}},
        "status": {
            "capacity": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"},
            "allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"},
        },
    }
    try:
        created = core.create_node(node)
        assert created.status.allocatable["nvidia.com/gpu"] == "8" and created.metadata.namespace is None
        updated = core.patch_node_status(name, {"status": {"allocatable": {"nvidia.com/gpu": "32"}}})
        assert updated.status.allocatable == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "32"}
        assert names(core.list_node(label_selector=f"gpush-test={name}")) == [name]
        assert names(core.list_node(field_selector=f"metadata.name={name},spec.unschedulable=false")) == [name]
    finally:
        core.delete_node(name)
    assert api_error(core.read_node, name)[0] == 404


def test_quantities_are_stored_in_their_canonical_form(core, apps, namespace):
    """The real server decodes each Quantity and writes it back canonical, whatever was sent."""
    resources = {
        "requests": {"cpu": "0.5", "memory": "1024Mi", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "1000m", "memory": "1.5Gi", "nvidia.com/gpu": "1", "ephemeral-storage": "1e3"},
    }
    created = core.create_namespaced_pod(namespace, pod("quantities", resources=resources))
    stored = created.spec.containers[0].resources
    assert stored.requests == {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "1", "ephemeral-storage": "1e3"}
    assert stored.limits == {"cpu": "1", "memory": "1536Mi", "nvidia.com/gpu": "1", "ephemeral-storage": "1e3"}
    assert core.read_namespaced_pod("quantities", namespace).spec.containers[0].resources == stored

    body = deployment("quantities")
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"memory": "0.1Gi"}}
    template = apps.create_namespaced_deployment(namespace, body).spec.template.spec.containers[0].resources
    # (Requests default to limits on Pods only, not in templates.)
    assert template.limits == {"memory": "107374182400m"} and template.requests is None

    quota = core.create_namespaced_resource_quota(
        namespace, {"metadata": {"name": "gpus"}, "spec": {"hard": {"requests.nvidia.com/gpu": "8000m", "pods": "1k"}}}
    )
    assert quota.spec.hard == {"requests.nvidia.com/gpu": "8", "pods": "1k"}
    limits = core.create_namespaced_limit_range(
        namespace,
        {
            "metadata": {"name": "defaults"},
            "spec": {"limits": [{"type": "Container", "default": {"memory": "2048Mi"}, "max": {"cpu": "2000m"}}]},
        },
    )
    assert (limits.spec.limits[0].default, limits.spec.limits[0].max) == ({"memory": "2Gi"}, {"cpu": "2"})
    status, body = api_error(
        core.create_namespaced_resource_quota,
        namespace,
        {"metadata": {"name": "bad"}, "spec": {"hard": {"memory": "512mi"}}},
    )
    assert (status, body["reason"]) == (400, "BadRequest") and "quantity's suffix" in body["message"]


def test_node_capacity_is_stored_in_its_canonical_form(core):
    name = unique("qty-node")
    quantities = {"cpu": "4000m", "memory": "16384Mi", "nvidia.com/gpu": "8", "pods": "110"}
    try:
        created = core.create_node({"metadata": {"name": name}, "status": {"capacity": quantities}})
        assert created.status.capacity == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "8", "pods": "110"}
        patched = core.patch_node_status(name, {"status": {"allocatable": {"memory": "15.5Gi", "cpu": "3.5"}}})
        assert patched.status.allocatable == {"memory": "15872Mi", "cpu": "3500m"}
    finally:
        core.delete_node(name)


def test_a_pod_gets_the_defaults_a_real_server_gives_it(core, apps, batch, namespace):
    bare = pod("defaults")
    bare["spec"]["containers"].append({"name": "pinned", "image": "busybox:latest@sha256:" + "0" * 64})
    bare["spec"]["containers"].append({"name": "tagged", "image": "registry.example:5000/team/app:1.2"})
    spec = core.create_namespaced_pod(namespace, bare).spec
    assert spec.enable_service_links is True
    assert (spec.restart_policy, spec.dns_policy) == ("Always", "ClusterFirst")
    assert spec.scheduler_name == "default-scheduler"
    assert spec.termination_grace_period_seconds == 30 and spec.security_context == client.V1PodSecurityContext()
    # The Priority admission plugin: no class, so the default priority and preemption policy.
    assert (spec.priority, spec.preemption_policy) == (0, "PreemptLowerPriority")
    main, pinned, tagged = spec.containers
    assert (main.termination_message_path, main.termination_message_policy) == ("/dev/termination-log", "File")
    assert [c.image_pull_policy for c in spec.containers] == ["IfNotPresent", "Always", "IfNotPresent"]
    untagged = core.create_namespaced_pod(namespace, pod("untagged", image="busybox")).spec
    assert untagged.containers[0].image_pull_policy == "Always"
    explicit = pod("explicit")
    explicit["spec"].update(enableServiceLinks=False, priority=0, preemptionPolicy="PreemptLowerPriority")
    spec = core.create_namespaced_pod(namespace, explicit).spec
    assert (spec.enable_service_links, spec.priority, spec.preemption_policy) == (False, 0, "PreemptLowerPriority")
    critical = pod("critical")
    critical["spec"]["priorityClassName"] = "system-node-critical"
    assert core.create_namespaced_pod(namespace, critical).spec.priority == 2000001000
    # A priority the Pod's class does not give it is the admission plugin's 403.
    status, body = api_error(
        core.create_namespaced_pod, namespace, {**pod("own"), "spec": {**pod()["spec"], "priority": 7}}
    )
    assert (status, body["reason"]) == (403, "Forbidden")
    assert body["message"].startswith('pods "own" is forbidden: the integer value of priority (7) must not be provided')

    # Templates get the Pod spec defaults (not admission's priority: that is set on the Pods).
    template = apps.create_namespaced_deployment(namespace, deployment("tmpl")).spec.template.spec
    assert template.enable_service_links is True and template.priority is None
    assert template.containers[0].image_pull_policy == "IfNotPresent"
    job_template = batch.create_namespaced_job(namespace, job("tmpl")).spec.template.spec
    assert job_template.enable_service_links is True and job_template.scheduler_name == "default-scheduler"


# --- custom resources -----------------------------------------------------------------------------------------


def cluster_policy_crd(group: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"clusterpolicies.{group}"},
        "spec": {
            "group": group,
            "scope": "Cluster",
            "names": {"plural": "clusterpolicies", "singular": "clusterpolicy", "kind": "ClusterPolicy"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }


def test_custom_resources_are_served_once_their_definition_exists(api):
    extensions = client.ApiextensionsV1Api(api)
    custom = client.CustomObjectsApi(api)
    group = f"{unique('t')}.gpush.example"
    policy = {
        "apiVersion": f"{group}/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"},
        "spec": {"devicePlugin": {"config": {"name": "time-slicing-config", "default": "any"}}},
    }
    args = (group, "v1", "clusterpolicies")
    assert api_error(custom.create_cluster_custom_object, *args, policy)[0] == 404

    schemaless = cluster_policy_crd(group)
    del schemaless["spec"]["versions"][0]["schema"]
    status, body = api_error(extensions.create_custom_resource_definition, schemaless)
    assert status == 422 and "schemas are required" in body["message"]

    extensions.create_custom_resource_definition(cluster_policy_crd(group))
    try:

        def established() -> bool:
            crd = extensions.read_custom_resource_definition(f"clusterpolicies.{group}")
            return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or ())

        assert eventually(established)
        created = eventually(lambda: _create_when_served(custom, args, policy))
        assert created["metadata"]["uid"] and created["metadata"]["generation"] == 1
        assert custom.get_cluster_custom_object(*args, "cluster-policy")["spec"] == policy["spec"]
        assert [o["metadata"]["name"] for o in custom.list_cluster_custom_object(*args)["items"]] == ["cluster-policy"]

        # CustomObjectsApi patches with merge patch; strategic merge is refused for custom resources.
        patch = {"spec": {"devicePlugin": {"config": {"default": "tesla-t4"}}}, "status": {"state": "ignored"}}
        patched = custom.patch_cluster_custom_object(*args, "cluster-policy", patch)
        assert patched["spec"]["devicePlugin"]["config"] == {"name": "time-slicing-config", "default": "tesla-t4"}
        assert "status" not in patched and patched["metadata"]["generation"] == 2
        status, _ = api_error(
            custom.patch_cluster_custom_object, *args, "cluster-policy", patch, _content_type=STRATEGIC_MERGE_PATCH
        )
        assert status == 415

        ready = custom.patch_cluster_custom_object_status(*args, "cluster-policy", {"status": {"state": "ready"}})
        assert ready["status"] == {"state": "ready"} and ready["metadata"]["generation"] == 2

        stale = dict(created)
        status, body = api_error(custom.replace_cluster_custom_object, *args, "cluster-policy", stale)
        assert (status, body["reason"]) == (409, "Conflict")
        custom.delete_cluster_custom_object(*args, "cluster-policy")
        assert api_error(custom.get_cluster_custom_object, *args, "cluster-policy")[0] == 404
    finally:
        extensions.delete_custom_resource_definition(f"clusterpolicies.{group}")
    assert eventually(lambda: _not_served(custom, args))


def structural_crd(group: str) -> dict[str, Any]:
    """A ClusterPolicy-like CRD with a structural schema: what the GPU Operator installs."""
    string = {"type": "string"}
    spec = {
        "type": "object",
        "properties": {
            "devicePlugin": {
                "type": "object",
                "properties": {"config": {"type": "object", "properties": {"name": string, "default": string}}},
            },
            "driver": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "nodes": {"type": "array", "items": {"type": "object", "properties": {"name": string}}},
            "labels": {"type": "object", "additionalProperties": string},
        },
    }
    crd = cluster_policy_crd(group)
    crd["spec"]["versions"][0]["schema"] = {
        "openAPIV3Schema": {
            "type": "object",
            "properties": {"spec": spec, "status": {"type": "object", "properties": {"state": string}}},
        }
    }
    return crd


def test_fields_a_custom_resources_schema_does_not_know_are_pruned_with_a_warning(api):
    extensions = client.ApiextensionsV1Api(api)
    custom = client.CustomObjectsApi(api)
    group = f"{unique('t')}.gpush.example"
    args = (group, "v1", "clusterpolicies")
    extensions.create_custom_resource_definition(structural_crd(group))
    policy = {
        "apiVersion": f"{group}/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy", "labels": {"a": "b"}, "clusterName": "gone"},
        "spec": {
            "devicePlugin": {"config": {"name": "time-slicing-config", "defualt": "any"}},
            "devicePlugn": {"enabled": True},
            "driver": {"anything": {"goes": 1}},
            "nodes": [{"name": "n1", "gpus": 2}],
            "labels": {"x": "y"},
        },
        "status": {"state": "ready"},
        "extra": True,
    }
    try:
        assert eventually(lambda: not _not_served(custom, args))
        status, body = api_error(custom.create_cluster_custom_object, *args, policy, field_validation="Strict")
        assert (status, body["reason"]) == (400, "BadRequest")
        assert body["message"] == (
            'ClusterPolicy in version "v1" cannot be handled as a ClusterPolicy: strict decoding error: '
            'unknown field "extra", unknown field "spec.devicePlugin.config.defualt", '
            'unknown field "spec.devicePlugn", unknown field "spec.nodes[0].gpus", unknown field "metadata.clusterName"'
        )

        created, code, headers = custom.create_cluster_custom_object_with_http_info(*args, policy)
        assert code == 201
        assert created["spec"] == {
            "devicePlugin": {"config": {"name": "time-slicing-config"}},
            "driver": {"anything": {"goes": 1}},
            "nodes": [{"name": "n1"}],
            "labels": {"x": "y"},
        }
        assert "extra" not in created and "clusterName" not in created["metadata"]
        assert created["metadata"]["labels"] == {"a": "b"} and created["apiVersion"] == f"{group}/v1"
        warnings = headers.get("Warning", "")
        for path in ("extra", "metadata.clusterName", "spec.devicePlugin.config.defualt", "spec.devicePlugn"):
            assert f'299 - "unknown field \\"{path}\\""' in warnings, warnings
        assert custom.get_cluster_custom_object(*args, "cluster-policy")["spec"] == created["spec"]

        patch = {"spec": {"devicePlugin": {"config": {"default": "tesla-t4"}}, "migManager": {}}}
        status, body = api_error(
            custom.patch_cluster_custom_object, *args, "cluster-policy", patch, field_validation="Strict"
        )
        assert (status, body["reason"]) == (422, "Invalid")
        assert body["message"].startswith(' "" is invalid: patch: Invalid value: "{')
        assert body["message"].endswith('strict decoding error: unknown field "spec.migManager"')
        patched, _, headers = custom.patch_cluster_custom_object_with_http_info(
            *args, "cluster-policy", patch, field_validation="Ignore"
        )
        assert patched["spec"]["devicePlugin"]["config"] == {"name": "time-slicing-config", "default": "tesla-t4"}
        assert "migManager" not in patched["spec"] and "Warning" not in headers
    finally:
        extensions.delete_custom_resource_definition(f"clusterpolicies.{group}")


def _create_when_served(custom: client.CustomObjectsApi, args: tuple[str, str, str], body: dict) -> dict | None:
    try:
        return custom.create_cluster_custom_object(*args, body)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _not_served(custom: client.CustomObjectsApi, args: tuple[str, str, str]) -> bool:
    try:
        custom.list_cluster_custom_object(*args)
    except ApiException as exc:
        return exc.status == 404
    return False


# --- watch ----------------------------------------------------------------------------------------------------


def _watch_in_thread(func: Callable[..., Any], *args: Any, count: int, **kwargs: Any) -> tuple[queue.Queue, Any]:
    """Collects ``count`` events of a watch in a thread, so the test can make changes meanwhile."""
    events: queue.Queue = queue.Queue()
    w = watch.Watch()

    def run() -> None:
        try:
            for seen, event in enumerate(w.stream(func, *args, timeout_seconds=20, **kwargs), start=1):
                events.put(event)
                if seen == count:
                    w.stop()
        except Exception as exc:  # handed to the test thread
            events.put(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return events, thread


def _take(events: queue.Queue, count: int) -> list[dict[str, Any]]:
    taken = []
    for _ in range(count):
        event = events.get(timeout=10)
        if isinstance(event, Exception):
            raise event
        taken.append(event)
    return taken


def test_a_watch_streams_added_modified_and_deleted_as_they_happen(core, namespace):
    since = core.list_namespaced_config_map(namespace).metadata.resource_version
    events, thread = _watch_in_thread(core.list_namespaced_config_map, namespace, resource_version=since, count=3)
    # Lets the watch open first, so the changes below stream live; a watch that opened
    # late still gets them all, replayed from ``since``: the sleep orders nothing the test relies on.
    time.sleep(0.2)
    core.create_namespaced_config_map(namespace, configmap("live"))
    core.patch_namespaced_config_map("live", namespace, {"data": {"k": "v2"}})
    core.delete_namespaced_config_map("live", namespace)
    got = _take(events, 3)
    thread.join(10)
    assert [(e["type"], e["object"].metadata.name) for e in got] == [
        ("ADDED", "live"),
        ("MODIFIED", "live"),
        ("DELETED", "live"),
    ]
    assert isinstance(got[1]["object"], client.V1ConfigMap) and got[1]["object"].data == {"k": "v2"}
    versions = [int(e["object"].metadata.resource_version) for e in got]
    assert versions == sorted(versions) and versions[0] > int(since)


def test_a_watch_resumes_after_the_resource_version_it_saw_last(core, namespace):
    first = core.create_namespaced_config_map(namespace, configmap("a"))
    core.create_namespaced_config_map(namespace, configmap("b"))
    core.create_namespaced_config_map(namespace, configmap("c"))

    w = watch.Watch()
    seen = []
    for event in w.stream(
        core.list_namespaced_config_map, namespace, resource_version=first.metadata.resource_version, timeout_seconds=2
    ):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 2:
            w.stop()
    assert seen == [("ADDED", "b"), ("ADDED", "c")]

    core.patch_namespaced_config_map("c", namespace, {"data": {"k": "v2"}})
    resumed = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_config_map, namespace, resource_version=w.resource_version, timeout_seconds=1
        )
    ]
    assert resumed == [("MODIFIED", "c")]


def test_a_watch_without_a_resource_version_starts_with_the_current_objects(core, namespace):
    core.create_namespaced_config_map(namespace, configmap("present"))
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(core.list_namespaced_config_map, namespace, timeout_seconds=1)
    ]
    assert seen == [("ADDED", "present")]


def test_a_selective_watch_reports_objects_entering_and_leaving_its_selection(core, namespace):
    since = core.list_namespaced_config_map(namespace).metadata.resource_version
    events, thread = _watch_in_thread(
        core.list_namespaced_config_map, namespace, resource_version=since, label_selector="app=x", count=3
    )
    # Lets the watch open first, so the changes below stream live; a watch that opened
    # late still gets them all, replayed from ``since``: the sleep orders nothing the test relies on.
    time.sleep(0.2)
    core.create_namespaced_config_map(namespace, configmap("cm", app="x"))
    core.patch_namespaced_config_map("cm", namespace, {"metadata": {"labels": {"app": "y"}}})
    core.patch_namespaced_config_map("cm", namespace, {"data": {"unseen": "change"}})
    core.patch_namespaced_config_map("cm", namespace, {"metadata": {"labels": {"app": "x"}}})
    got = _take(events, 3)
    thread.join(10)
    assert [e["type"] for e in got] == ["ADDED", "DELETED", "ADDED"]


# --- test server only: history, bookmarks, restarts, running by hand ------------------------------------------


@pytest.fixture
def private_server(tmp_path) -> Iterator[TestApiServer]:
    server = start(state_file=tmp_path / "state.json", bookmark_interval=0.2)
    yield server
    server.stop()


def _core(server: TestApiServer, tmp_path: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(server.write_kubeconfig(tmp_path / "kc"))))


def test_a_resource_version_older_than_the_kept_history_is_gone(private_server, tmp_path):
    core = _core(private_server, tmp_path)
    for i in range(3):
        core.create_namespaced_config_map("default", configmap(f"cm-{i}"))
    first = core.list_namespaced_config_map("default", limit=2)
    old = first.metadata.resource_version
    core.patch_namespaced_config_map("cm-0", "default", {"data": {"k": "v2"}})
    private_server.store.compact()  # what etcd compaction does to old revisions

    with pytest.raises(ApiException) as info:
        # Watch retries once after a 410 and then raises it.
        for _ in watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=old, _request_timeout=10
        ):
            pass
    assert info.value.status == 410

    status, body = api_error(core.list_namespaced_config_map, "default", limit=2, _continue=first.metadata._continue)
    assert (status, body["reason"]) == (410, "Expired")
    status, body = api_error(
        core.list_namespaced_config_map, "default", resource_version=old, resource_version_match="Exact"
    )
    assert status == 410


def test_history_older_than_the_compaction_window_is_gone_without_forcing_it(tmp_path):
    """As kube-apiserver compacts etcd every 5 minutes (here every 0.2 s), to the revision it saw
    at the tick before: an old resourceVersion is 410 for a new watch and a list, while an open
    watch goes on."""
    server = start(compaction_interval=0.2)
    try:
        core = _core(server, tmp_path)
        for i in range(3):
            core.create_namespaced_config_map("default", configmap(f"cm-{i}"))
        first = core.list_namespaced_config_map("default", limit=2)
        old = first.metadata.resource_version
        core.patch_namespaced_config_map("cm-0", "default", {"data": {"k": "v2"}})
        events, thread = _watch_in_thread(
            core.list_namespaced_config_map, "default", resource_version=old, count=2, _request_timeout=30
        )
        _take(events, 1)  # the watch is open and has the patch

        def gone() -> bool:
            try:
                core.list_namespaced_config_map("default", resource_version=old, resource_version_match="Exact")
            except ApiException as exc:
                return exc.status == 410
            return False

        assert eventually(gone, timeout=5)
        token = first.metadata._continue
        status, body = api_error(core.list_namespaced_config_map, "default", limit=2, _continue=token)
        assert (status, body["reason"]) == (410, "Expired")
        with pytest.raises(ApiException) as info:
            list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=old))
        assert info.value.status == 410
        # The watch opened before the compaction still sees what comes after it.
        core.create_namespaced_config_map("default", configmap("later"))
        (event,) = _take(events, 1)
        assert (event["type"], event["object"].metadata.name) == ("ADDED", "later")
        thread.join(10)
    finally:
        server.stop()


def test_a_watch_from_before_the_server_started_is_gone_at_once(tmp_path):
    """kube-apiserver's watch cache starts at the resourceVersion it listed when it started:
    a new watch from an older one is 410 at once, before any compaction; from the listed one on,
    a watch streams the changes."""
    server = start(compaction_interval=None)
    try:
        core = _core(server, tmp_path)
        listed = core.list_namespace().metadata.resource_version
        assert int(listed) > 1  # the bootstrap namespaces came at 1, 2, ...
        with pytest.raises(ApiException) as info:
            list(watch.Watch().stream(core.list_namespace, resource_version="1", _request_timeout=10))
        assert info.value.status == 410
        events, thread = _watch_in_thread(core.list_namespace, resource_version=listed, count=1, _request_timeout=30)
        core.create_namespace({"metadata": {"name": "after-start"}})
        (event,) = _take(events, 1)
        assert (event["type"], event["object"].metadata.name) == ("ADDED", "after-start")
        thread.join(10)
    finally:
        server.stop()


def test_the_default_compaction_window_is_kube_apiservers():
    server = TestApiServer()
    assert server.compaction_interval == 300.0  # --etcd-compaction-interval


def test_bookmarks_carry_the_current_resource_version(private_server, tmp_path):
    core = _core(private_server, tmp_path)
    core.create_namespace({"metadata": {"name": "elsewhere"}})
    revision = private_server.store.resource_version
    w = watch.Watch()
    bookmark = None
    for event in w.stream(core.list_namespaced_pod, "default", allow_watch_bookmarks=True, timeout_seconds=3):
        if event["type"] == "BOOKMARK":
            bookmark = event
            w.stop()
    assert bookmark is not None
    assert int(bookmark["raw_object"]["metadata"]["resourceVersion"]) >= revision
    assert w.resource_version == bookmark["raw_object"]["metadata"]["resourceVersion"]


class Informer:
    """List, then watch from the list's resourceVersion; re-list after 410; retry a dropped connection.

    The loop a Kubernetes client must run; here it keeps a cache of ConfigMap data by name.
    """

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.cache: dict[str, dict[str, str]] = {}
        self.relists = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _list(self) -> str:
        listing = self.core.list_namespaced_config_map(self.namespace)
        self.cache = {item.metadata.name: item.data for item in listing.items}
        self.relists += 1
        return listing.metadata.resource_version

    def _run(self) -> None:
        rv = None
        while not self.stopped.is_set():
            try:
                if rv is None:
                    rv = self._list()
                w = watch.Watch()
                for event in w.stream(
                    self.core.list_namespaced_config_map, self.namespace, resource_version=rv, timeout_seconds=1
                ):
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        self.cache.pop(obj.metadata.name, None)
                    else:
                        self.cache[obj.metadata.name] = obj.data
                    rv = obj.metadata.resource_version
                rv = w.resource_version or rv
            except ApiException as exc:
                if exc.status == 410:
                    rv = None  # history is gone: re-list
                else:
                    time.sleep(0.1)
            except Exception:  # the server is restarting: connection refused or reset
                time.sleep(0.1)


def test_after_a_restart_objects_and_resource_versions_survive_and_stale_watchers_relist(private_server, tmp_path):
    core = _core(private_server, tmp_path)
    informer = Informer(core, "default")
    informer.thread.start()
    try:
        core.create_namespaced_config_map("default", configmap("before"))
        assert eventually(lambda: "before" in informer.cache)
        listed = core.list_namespaced_config_map("default").metadata.resource_version
        before = core.read_namespaced_config_map("before", "default")
        core.create_namespaced_config_map("default", configmap("missed"))  # a watcher from `listed` has not seen it
        revision = private_server.store.resource_version

        private_server.restart()
        assert json.loads(Path(private_server.state_file).read_text())["resourceVersion"] == revision
        assert core.read_namespaced_config_map("before", "default").metadata.uid == before.metadata.uid

        with pytest.raises(ApiException) as info:  # a watch reports 410 as an event, not a body
            list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=listed))
        assert info.value.status == 410
        after = core.create_namespaced_config_map("default", configmap("after"))
        assert int(after.metadata.resource_version) > revision
        assert eventually(lambda: set(informer.cache) == {"before", "missed", "after"})
        relists = informer.relists
        core.patch_namespaced_config_map("after", "default", {"data": {"k": "v2"}})
        assert eventually(lambda: informer.cache.get("after") == {"k": "v2"})
        assert informer.relists == relists  # resumed, not re-listed
    finally:
        informer.stopped.set()
        informer.thread.join(10)


def test_the_server_runs_by_hand_with_a_kubeconfig(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    state = tmp_path / "state.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "integration.k8s.apiserver", "--kubeconfig", str(kubeconfig), "--state", str(state)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "Kubernetes API test server on http://127.0.0.1:" in line, line
        core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        core.create_namespaced_config_map("default", configmap("by-hand"))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    assert "by-hand" in state.read_text()
