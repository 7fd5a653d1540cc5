"""Tenants on Kubernetes against the project's API test server and GPU node simulator: each
tenant's jobs in its own namespace (taken from the job's owner, never its spec), found,
followed, scaled, cancelled and read across namespaces by this process and by a restarted
one, and each tenant namespace's ResourceQuota following the tenant's GPU quota, from the
adapter alone and from the broker's scheduling cycle (PostgreSQL) with `gpush tenant
quota-yaml`'s route. The cluster is integration/test_k8s_adapter.py's: time-sliced T4s (2 GPUs
x 4 replicas), an A100 in two 3g.20gb MIG slices, two whole H100s."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from adapters.k8s import KubernetesAdapter
from broker.core.adapter import BackendState, Owner, Rejected, Sharing
from integration.k8s import apiserver
from integration.test_k8s_adapter import (
    NAMESPACE,
    TAG,
    Follower,
    job_spec,
    placed,
    simulated_durations,  # noqa: F401  (autouse: job labels sim-duration, sim-exit reach the simulator)
    simulated_nodes,
    wait_for,
)

VISION = Owner("alice", "vision")
NLP = Owner("bob", "nlp")
TENANCY = {"namespace_mode": "per-tenant", "tenant_namespaces": "vision=cv-jobs", "namespace_pattern": "team-{tenant}"}


def make_adapter(kubeconfig: str, **config: Any) -> KubernetesAdapter:
    settings = {
        "kubeconfig": kubeconfig,
        "namespace": NAMESPACE,
        "create_namespace": True,
        "tag": TAG,
        "image": "python:3.11-slim",
        "watch_seconds": 0.5,
        **TENANCY,
        **config,
    }
    return KubernetesAdapter("k8s-test", settings)


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
def cluster(api) -> Iterator[Any]:
    yield from simulated_nodes(api)


@pytest.fixture
def tenants(kubeconfig, cluster) -> Iterator[KubernetesAdapter]:
    made = make_adapter(kubeconfig)
    yield made
    made.close()


def objects(api, kind: str, job_id: int) -> list[Any]:
    """Job ``job_id``'s objects of ``kind`` in every namespace, as the API lists them."""
    selector = f"gpush.io/job-id={job_id}"
    if kind == "jobs":
        return client.BatchV1Api(api).list_job_for_all_namespaces(label_selector=selector).items
    if kind == "deployments":
        return client.AppsV1Api(api).list_deployment_for_all_namespaces(label_selector=selector).items
    return client.CoreV1Api(api).list_pod_for_all_namespaces(label_selector=selector).items


def quotas_in(api) -> dict[str, dict[str, str]]:
    """namespace -> spec.hard of every ResourceQuota gpush-gpu-quota in the cluster."""
    found = client.CoreV1Api(api).list_resource_quota_for_all_namespaces().items
    return {q.metadata.namespace: dict(q.spec.hard) for q in found if q.metadata.name == "gpush-gpu-quota"}


# -- where jobs go ---------------------------------------------------------------------------


def test_each_tenants_job_lands_in_its_own_namespace_whatever_its_spec_says(tenants, api):
    # Alice's job names another tenant and a namespace of its own: neither counts.
    sneaky = job_spec(tenant="nlp", user="mallory", labels={"sim-duration": "0.5", "namespace": "team-nlp"})
    assert tenants.submit(1, sneaky, placed(Sharing.K8S_EXCLUSIVE), VISION) == f"cv-jobs/job/{TAG}-1"
    assert tenants.submit(2, job_spec(labels={"sim-duration": "0.5"}), placed(Sharing.K8S_EXCLUSIVE), NLP) == (
        f"team-nlp/job/{TAG}-2"
    )
    # No owner (an old caller): the cluster's own namespace.
    assert tenants.submit(3, job_spec(), placed(Sharing.K8S_EXCLUSIVE)) == f"{NAMESPACE}/job/{TAG}-3"
    (job,) = objects(api, "jobs", 1)
    assert job.metadata.namespace == "cv-jobs"
    assert job.metadata.labels["gpush.io/tenant"] == "vision" and job.metadata.labels["gpush.io/user"] == "alice"
    env = {e.name: e.value for e in job.spec.template.spec.containers[0].env}
    assert env["GPUSH_TENANT"] == "vision"
    assert [j.metadata.namespace for j in objects(api, "jobs", 2)] == ["team-nlp"]
    assert [j.metadata.namespace for j in objects(api, "jobs", 3)] == [NAMESPACE]
    core = client.CoreV1Api(api)
    for namespace, tenant in (("cv-jobs", "vision"), ("team-nlp", "nlp")):
        made = core.read_namespace(namespace).metadata
        assert made.labels["app.kubernetes.io/managed-by"] == "gpush" and made.labels["gpush.io/broker"] == TAG
        assert made.annotations["gpush.io/tenant"] == tenant
    # The watches follow every namespace.
    follow = Follower(tenants)
    assert follow.until(1, BackendState.SUCCEEDED).backend_id == f"cv-jobs/job/{TAG}-1"
    assert follow.until(2, BackendState.SUCCEEDED).backend_id == f"team-nlp/job/{TAG}-2"


def test_status_cancel_scale_and_logs_across_namespaces_also_after_a_restart(tenants, kubeconfig, api):
    printed = tenants.submit(
        10, job_spec(command="echo from vision", labels={"sim-duration": "0.3"}), placed(Sharing.K8S_EXCLUSIVE), VISION
    )
    elastic = job_spec(
        kind="inference",
        isolation="none",
        gpu_memory_gb=2,
        elastic={"min_replicas": 1, "max_replicas": 3},
        command=["python", "-m", "http.server"],
    )
    served = tenants.submit(11, elastic, placed(Sharing.K8S_TIMESLICE, gpu_model="T4"), NLP)
    assert served == f"team-nlp/deployment/{TAG}-11"
    long = tenants.submit(12, job_spec(labels={"sim-duration": "60"}), placed(Sharing.K8S_EXCLUSIVE), VISION)
    follow = Follower(tenants)
    follow.until(10, BackendState.SUCCEEDED)
    follow.until(11, BackendState.RUNNING)
    follow.until(12, BackendState.RUNNING)
    assert tenants.logs(10, printed).text == "from vision\n"
    assert tenants.logs(10, printed).location.endswith("(namespace cv-jobs)")

    restarted = make_adapter(kubeconfig)  # a new broker process: nothing in memory
    try:
        again = Follower(restarted)
        again.read()  # the first read lists every namespace and reports every job
        assert {j: again.last[j].backend_id for j in (10, 11, 12)} == {10: printed, 11: served, 12: long}
        assert restarted.find(12).state == BackendState.RUNNING
        assert restarted.logs(10, printed).text == "from vision\n"
        assert restarted.scale(11, 2) == 2
        wait_for(lambda: len(objects(api, "pods", 11)) == 2, what="2 replicas in team-nlp")
        assert {p.metadata.namespace for p in objects(api, "pods", 11)} == {"team-nlp"}
        restarted.cancel(12)
        assert again.until(12, BackendState.CANCELLED).reason == "cancelled by gpush"
        assert objects(api, "jobs", 12) == []
        # and the old process hears of it too, through its own watch
        assert follow.until(12, BackendState.CANCELLED).backend_id == long
    finally:
        restarted.close()


def test_ids_from_before_namespaces_were_said_still_reach_the_default_namespace(kubeconfig, cluster, api):
    """A job submitted while every tenant shared one namespace keeps its id (``job/<name>``):
    with a namespace per tenant that id still means the cluster's namespace."""
    shared = make_adapter(kubeconfig, namespace_mode="shared", tenant_namespaces={}, namespace_pattern=None)
    try:
        before = job_spec(command="echo before", labels={"sim-duration": "0.3"})
        old_id = shared.submit(20, before, placed(Sharing.K8S_EXCLUSIVE), VISION)
        assert old_id == f"job/{TAG}-20"
        Follower(shared).until(20, BackendState.SUCCEEDED)
    finally:
        shared.close()
    per_tenant = make_adapter(kubeconfig)
    try:
        assert per_tenant.logs(20, old_id).text == "before\n"
        assert per_tenant.find(20).backend_id == f"{NAMESPACE}/job/{TAG}-20"
        assert Follower(per_tenant).until(20, BackendState.SUCCEEDED).exit_code == 0
    finally:
        per_tenant.close()


def test_crash_safety_holds_in_each_tenants_namespace(tenants, kubeconfig, api):
    spec = job_spec(labels={"sim-duration": "30"})
    first = tenants.submit(30, spec, placed(Sharing.K8S_EXCLUSIVE), NLP)
    restarted = make_adapter(kubeconfig)
    try:
        assert restarted.submit(30, spec, placed(Sharing.K8S_EXCLUSIVE), NLP) == first  # not created twice
        assert len(objects(api, "jobs", 30)) == 1
        # An object of that name in the tenant's namespace that is not this job's is never taken for it.
        client.BatchV1Api(api).create_namespaced_job(
            "team-nlp",
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": f"{TAG}-31"},
                "spec": {
                    "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "x", "image": "busybox"}]}}
                },
            },
        )
        with pytest.raises(Rejected, match="exists in namespace team-nlp .* is not gpush job 31"):
            restarted.submit(31, spec, placed(Sharing.K8S_EXCLUSIVE), NLP)
        # The same name in another tenant's namespace is no obstacle there.
        assert restarted.submit(31, spec, placed(Sharing.K8S_EXCLUSIVE), VISION) == f"cv-jobs/job/{TAG}-31"
    finally:
        restarted.close()


def test_without_create_namespace_a_tenants_namespace_must_exist(kubeconfig, cluster, api):
    strict = make_adapter(kubeconfig, create_namespace=False)
    try:
        missing = "namespace team-nlp (tenant nlp's) does not exist in k8s-test: create it (kubectl create namespace"
        with pytest.raises(Rejected, match=re.escape(missing)):
            strict.submit(40, job_spec(), placed(Sharing.K8S_EXCLUSIVE), NLP)
        client.CoreV1Api(api).create_namespace({"metadata": {"name": "team-nlp"}})
        assert strict.submit(40, job_spec(), placed(Sharing.K8S_EXCLUSIVE), NLP) == f"team-nlp/job/{TAG}-40"
        mapped_only = make_adapter(kubeconfig, namespace_pattern=None)
        try:
            with pytest.raises(Rejected, match="tenant ops has no namespace .* tenant_namespaces=ops=NAMESPACE"):
                mapped_only.submit(41, job_spec(), placed(Sharing.K8S_EXCLUSIVE), Owner("c", "ops"))
        finally:
            mapped_only.close()
    finally:
        strict.close()


def test_two_tenants_whose_names_make_one_namespace_are_told_apart(tenants, api):
    tenants.submit(50, job_spec(), placed(Sharing.K8S_EXCLUSIVE), Owner("a", "Ops"))
    with pytest.raises(Rejected, match="namespace team-ops holds tenant Ops's jobs .* tenant ops maps to it too"):
        tenants.submit(51, job_spec(), placed(Sharing.K8S_EXCLUSIVE), Owner("b", "ops"))
    assert objects(api, "jobs", 51) == []
    # In a batch too: the namespace is checked once, and refuses only the other tenant's items.
    batch = [
        (52, job_spec(), placed(Sharing.K8S_EXCLUSIVE), Owner("b", "ops")),
        (53, job_spec(), placed(Sharing.K8S_EXCLUSIVE), Owner("a", "Ops")),
    ]
    refused, accepted = tenants.submit_many(batch)
    assert isinstance(refused, Rejected) and "holds tenant Ops's jobs" in str(refused)
    assert accepted == f"team-ops/job/{TAG}-53"


# -- quotas ------------------------------------------------------------------------------------


def test_resource_quotas_follow_the_tenants_gpu_quotas(tenants, kubeconfig, api):
    """T4s split 4 ways and whole H100s both offer nvidia.com/gpu: counted by the quarter; the
    A100's 3g.20gb slices are 3/7 each."""
    tenants.submit(60, job_spec(), placed(Sharing.K8S_EXCLUSIVE), VISION)  # cv-jobs exists now; team-nlp not yet
    plan = tenants.tenant_quotas({"vision": 2.0, "nlp": 0.5})
    done = tenants.apply_tenant_quotas(plan)
    assert done == [
        "created ResourceQuota cv-jobs/gpush-gpu-quota of tenant vision (2 GPU-equivalents): "
        "nvidia.com/gpu 8, nvidia.com/mig-3g.20gb 4"
    ]
    assert quotas_in(api) == {"cv-jobs": {"requests.nvidia.com/gpu": "8", "requests.nvidia.com/mig-3g.20gb": "4"}}
    # nlp's namespace gets its quota when gpush creates it, with the job that needs it
    tenants.submit(61, job_spec(), placed(Sharing.K8S_EXCLUSIVE), NLP)
    assert quotas_in(api)["team-nlp"] == {"requests.nvidia.com/gpu": "2", "requests.nvidia.com/mig-3g.20gb": "1"}
    quota = client.CoreV1Api(api).read_namespaced_resource_quota("gpush-gpu-quota", "team-nlp")
    assert quota.metadata.labels["gpush.io/broker"] == TAG and quota.metadata.annotations["gpush.io/tenant"] == "nlp"
    assert tenants.apply_tenant_quotas(plan) == []  # nothing changed: nothing written

    changed = tenants.apply_tenant_quotas(tenants.tenant_quotas({"vision": 1.0, "nlp": 0.5}))
    assert changed == [
        "updated ResourceQuota cv-jobs/gpush-gpu-quota of tenant vision (1 GPU-equivalents): "
        "nvidia.com/gpu 4, nvidia.com/mig-3g.20gb 2"
    ]
    assert quotas_in(api)["cv-jobs"] == {"requests.nvidia.com/gpu": "4", "requests.nvidia.com/mig-3g.20gb": "2"}

    # A restarted broker reads what is there: the same quotas write nothing, and a quota
    # removed while it was away removes its ResourceQuota.
    restarted = make_adapter(kubeconfig)
    try:
        assert restarted.apply_tenant_quotas(restarted.tenant_quotas({"vision": 1.0, "nlp": 0.5})) == []
        assert restarted.apply_tenant_quotas(restarted.tenant_quotas({"vision": 1.0})) == [
            "deleted ResourceQuota team-nlp/gpush-gpu-quota: its tenant has no GPU quota here now"
        ]
    finally:
        restarted.close()
    assert set(quotas_in(api)) == {"cv-jobs"}


def test_the_quota_yaml_is_what_the_cluster_gets(tenants, api):
    tenants.submit(70, job_spec(), placed(Sharing.K8S_EXCLUSIVE), VISION)
    plan = tenants.tenant_quotas({"vision": 1.5})
    tenants.apply_tenant_quotas(plan)
    documents = [d for d in yaml.safe_load_all(plan.to_yaml()) if d]
    assert [d["kind"] for d in documents] == ["Namespace", "ResourceQuota"]
    assert documents[1]["spec"]["hard"] == quotas_in(api)["cv-jobs"]
    assert documents[1]["spec"]["hard"] == {"requests.nvidia.com/gpu": "6", "requests.nvidia.com/mig-3g.20gb": "3"}


# -- through the broker ------------------------------------------------------------------------


def now() -> datetime:
    return datetime.now(UTC)


def test_the_scheduler_places_each_tenants_jobs_in_its_namespace_and_keeps_their_quotas(
    kubeconfig, cluster, api, sessions, engine, app, sdk
):
    from broker.core.clusters import AdapterPool, add_cluster
    from broker.core.errors import NotAllowed
    from broker.placement.tenants import set_tenant
    from broker.routing import versions as policystore
    from broker.routing.versions import cluster_views
    from broker.scheduling.cycle import Scheduler
    from integration.test_k8s_broker import POLICY

    config = {
        "kubeconfig": kubeconfig,
        "namespace": "gpush",
        "create_namespace": True,
        "image": "python:3.11",
        **TENANCY,
    }
    pool = AdapterPool(now)
    with sessions() as session, session.begin():
        add_cluster(session, name="k8s-a", kind="k8s", config=config, actor="root", now=now())
        set_tenant(session, "vision", weight=None, gpu_quota=2.0, clear_quota=False, now=now())
        views = cluster_views(session, pool)
        policystore.apply(session, POLICY, comment="t", author="root", now=now(), views=views, base_version=None)
    scheduler = Scheduler(engine, pool, clock=now)
    try:
        alice = sdk(user="alice", tenant="vision")
        bob = sdk(user="bob", tenant="nlp")
        seen = alice.submit({"kind": "training", "isolation": "exclusive", "gpus": 1, "command": ["train"]})
        # Bob's token is nlp's: a job that names tenant vision is refused at the door.
        with pytest.raises(NotAllowed, match="only an admin submits for tenant 'vision'"):
            bob.submit({"kind": "training", "gpus": 1, "command": ["train"], "tenant": "vision"})
        heard = bob.submit({"kind": "training", "isolation": "exclusive", "gpus": 1, "command": ["train"]})

        def submitted() -> bool:
            scheduler.run_cycle()
            return all(c.get(j.id).backend_id for c, j in ((alice, seen), (bob, heard)))

        wait_for(submitted, timeout=20, what="both jobs submitted")
        assert re.fullmatch(rf"cv-jobs/job/[a-z0-9-]+-{seen.id}", alice.get(seen.id).backend_id)
        assert re.fullmatch(rf"team-nlp/job/[a-z0-9-]+-{heard.id}", bob.get(heard.id).backend_id)
        assert quotas_in(api) == {"cv-jobs": {"requests.nvidia.com/gpu": "8", "requests.nvidia.com/mig-3g.20gb": "4"}}

        # An admin changes vision's quota: the next cycle writes it.
        admin = sdk(user="root", tenant="ops", role="admin")
        admin.set_tenant("vision", gpu_quota=1.0)
        admin.set_tenant("nlp", gpu_quota=0.25)
        scheduler.run_cycle()
        assert quotas_in(api) == {
            "cv-jobs": {"requests.nvidia.com/gpu": "4", "requests.nvidia.com/mig-3g.20gb": "2"},
            "team-nlp": {"requests.nvidia.com/gpu": "1", "requests.nvidia.com/mig-3g.20gb": "0"},
        }
        # `gpush tenant quota-yaml k8s-a` shows what the cycle applied.
        rendered = admin.tenant_quotas("k8s-a")["rendered"]
        documents = [d for d in yaml.safe_load_all(rendered) if d]
        shown = {d["metadata"]["namespace"]: d["spec"]["hard"] for d in documents if d["kind"] == "ResourceQuota"}
        assert shown == quotas_in(api)
    finally:
        pool.close()
        app.state.adapters.close()
