"""The Kubernetes adapter without a server: manifests, names and labels, what object
states mean to gpush, inventory from Node objects, the time-slicing config, and the
status cursor over a stand-in client.

Objects come from tests/data/k8s (see its README: written in the API's shape, not
recorded). integration/test_k8s_adapter.py runs the adapter against the test API server.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from adapters.k8s import KubernetesAdapter
from adapters.k8s.client import AlreadyExists, Gone, KubeClient, NotFound, WatchBatch, WatchEvent, _status_error
from adapters.k8s.inventory import gpu_requests_by_node, node_units
from adapters.k8s.render import (
    COMPLETION_INDEX,
    LABEL_BROKER,
    LABEL_JOB_ID,
    LABEL_TENANT,
    LABEL_USER,
    RenderOptions,
    check_tag,
    label_value,
    model_of_product,
    product_names,
    render,
)
from adapters.k8s.states import OOM_REASON, Observed, backend_job, shorten_unschedulable
from adapters.k8s.status import format_cursor, parse_cursor
from adapters.k8s.timeslice import TimesliceState, render_timeslice, replicas_in
from broker.core.adapter import BackendState, ClusterAdapter, Placement, Rejected, Sharing, Unreachable
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
PODS = json.loads((DATA / "pods.json").read_text())
JOBS = json.loads((DATA / "jobs.json").read_text())
DEPLOYMENTS = json.loads((DATA / "deployments.json").read_text())
NODES = json.loads((DATA / "nodes.json").read_text())
OPTIONS = RenderOptions(tag="gpush", namespace="gpush", image="python:3.11-slim")


def spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {"kind": "training", "command": ["python", "train.py", "--lr", "0.1"]}
    return JobSpec.model_validate({**base, **fields})


def placement(sharing: Sharing, **fields: Any) -> Placement:
    base: dict[str, Any] = {"cluster": "k8s-a", "sharing": sharing, "units": 1, "gpu_equivalents": 1.0}
    return Placement(**{**base, **fields})


def pod_spec(manifest) -> dict[str, Any]:
    return manifest.body["spec"]["template"]["spec"]


def env_of(manifest) -> dict[str, Any]:
    """Each variable's value, or its ``valueFrom`` source."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec(manifest)["containers"][0]["env"]}


# -- rendering ---------------------------------------------------------------------------


def test_training_becomes_a_job_that_runs_once_and_stays_for_find():
    job = spec(time_limit="2h", memory="16G", cpus=4, tenant="vision", user="alice")
    manifest = render(42, job, placement(Sharing.K8S_EXCLUSIVE, units=2, gpu_model="H100-SXM5-80GB"), OPTIONS)
    body = manifest.body
    assert (body["apiVersion"], body["kind"], manifest.kind) == ("batch/v1", "Job", "jobs")
    assert body["metadata"]["name"] == "gpush-42" and manifest.backend_id == "job/gpush-42"
    assert body["spec"]["backoffLimit"] == 0
    assert body["spec"]["activeDeadlineSeconds"] == 7200
    assert "ttlSecondsAfterFinished" not in body["spec"]
    pod = pod_spec(manifest)
    assert pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    # argv as given, no shell in between
    assert container["command"] == ["python", "train.py", "--lr", "0.1"]
    assert container["resources"]["requests"] == {"cpu": "4", "nvidia.com/gpu": "2", "memory": "16384Mi"}
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2", "memory": "16384Mi"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False
    for labels in (body["metadata"]["labels"], manifest.body["spec"]["template"]["metadata"]["labels"]):
        assert labels[LABEL_BROKER] == "gpush" and labels[LABEL_JOB_ID] == "42"
        assert labels[LABEL_TENANT] == "vision" and labels[LABEL_USER] == "alice"


def gang(sharing: Sharing = Sharing.K8S_EXCLUSIVE, nodes: tuple[str, ...] = ("h1", "h2"), **fields: Any) -> Placement:
    """A multi-node placement: ``units`` on each of ``nodes``, rank 0 first."""
    return placement(sharing, **{"units": 8, "node": nodes[0], "nodes": nodes, "gpu_equivalents": 16.0, **fields})


def test_a_gang_becomes_an_indexed_job_whose_ranks_hold_the_chosen_nodes_one_each():
    job = spec(nodes=2, tasks_per_node=4, gpus=8, time_limit="1h")
    manifest = render(42, job, gang(gpu_model="H100-SXM5-80GB"), OPTIONS)
    body = manifest.body["spec"]
    assert (body["completionMode"], body["completions"], body["parallelism"], body["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    # A rank disrupted (its node gone) fails the Job saying so, which the adapter reads as a loss.
    assert body["podFailurePolicy"] == {
        "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    }
    pod = pod_spec(manifest)
    assert pod["subdomain"] == "gpush-42" and "hostname" not in pod  # the Job controller names <job>-<index>
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}  # per node, not the gang's 16
    # Only the chosen nodes (by name), each still one that does not share its GPUs, and no two ranks on one.
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms and all(
        t["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["h1", "h2"]}] for t in terms
    )
    assert all(any(e["key"] == "nvidia.com/gpu.product" for e in t["matchExpressions"]) for t in terms)
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["nodeAffinity"]
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == {
        "labelSelector": {"matchLabels": {LABEL_BROKER: "gpush", LABEL_JOB_ID: "42"}},
        "topologyKey": "kubernetes.io/hostname",
    }
    rank = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    env = env_of(manifest)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE", "WORLD_SIZE")} == {
        "MASTER_ADDR": "gpush-42-0.gpush-42",
        "MASTER_PORT": "29500",
        "NNODES": "2",
        "NPROC_PER_NODE": "4",
        "WORLD_SIZE": "8",
    }
    assert env["NODE_RANK"] == rank and env["JOB_COMPLETION_INDEX"] == rank
    # The headless Service that makes <job>-<rank>.<job> resolve, with the job's labels.
    service = manifest.service
    assert service is not None and service["metadata"]["name"] == "gpush-42"
    assert service["metadata"]["labels"][LABEL_JOB_ID] == "42"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {LABEL_BROKER: "gpush", LABEL_JOB_ID: "42"}


def test_a_gang_of_mig_slices_is_pinned_to_its_nodes_alone():
    manifest = render(3, spec(nodes=2), gang(Sharing.K8S_MIG, units=2, mig_profile="3g.20gb"), OPTIONS)
    pod = pod_spec(manifest)
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.20gb": "2"}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["h1", "h2"]}]}]


def test_a_one_node_job_has_no_service_and_no_rank_variables():
    manifest = render(4, spec(), placement(Sharing.K8S_EXCLUSIVE, node="h1"), OPTIONS)
    assert manifest.service is None and "completionMode" not in manifest.body["spec"]
    assert "podAntiAffinity" not in pod_spec(manifest)["affinity"] and "subdomain" not in pod_spec(manifest)
    assert not {"MASTER_ADDR", "NODE_RANK", "WORLD_SIZE"} & set(env_of(manifest))


def test_a_gang_says_what_it_cannot_run_as():
    with pytest.raises(Rejected, match="nodes 1"):
        render(5, spec(), gang(Sharing.K8S_TIMESLICE, units=1), OPTIONS)


def test_a_gang_keeps_the_rendezvous_variables_the_job_sets_itself_as_on_slurm():
    own = {"MASTER_PORT": "1234", "WORLD_SIZE": "99", "NODE_RANK": "7"}
    manifest = render(6, spec(nodes=2, env=own), gang(), OPTIONS)
    names = [e["name"] for e in pod_spec(manifest)["containers"][0]["env"]]
    assert len(names) == len(set(names))  # each once: the job's value, not gpush's beside it
    env = env_of(manifest)
    assert {k: env[k] for k in own} == own
    # the others are still gpush's
    assert (env["MASTER_ADDR"], env["NNODES"]) == ("gpush-6-0.gpush-6", "2")


def test_no_device_ids_anywhere():
    manifest = render(1, spec(), placement(Sharing.K8S_EXCLUSIVE), OPTIONS)
    text = json.dumps(manifest.body)
    assert "CUDA_VISIBLE_DEVICES" not in text and "NVIDIA_VISIBLE_DEVICES" not in text
    with pytest.raises(Rejected, match="the cluster chooses the GPUs"):
        render(1, spec(env={"CUDA_VISIBLE_DEVICES": "0"}), placement(Sharing.K8S_EXCLUSIVE), OPTIONS)


def test_exclusive_gpus_only_on_nodes_that_do_not_share():
    manifest = render(1, spec(), placement(Sharing.K8S_EXCLUSIVE, gpu_model="H100-SXM5-80GB"), OPTIONS)
    terms = pod_spec(manifest)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = [
        {e["key"]: (e["operator"], e.get("values")) for e in t["matchExpressions"]} for t in terms["nodeSelectorTerms"]
    ]
    strategies = [t["nvidia.com/gpu.sharing-strategy"] for t in exprs]
    assert ("In", ["none"]) in strategies and ("DoesNotExist", None) in strategies
    assert all(t["nvidia.com/gpu.product"][0] == "In" for t in exprs)
    assert "NVIDIA-H100-80GB-HBM3" in exprs[0]["nvidia.com/gpu.product"][1]
    assert "nvidia.com/gpu.replicas" in exprs[2] and exprs[2]["nvidia.com/gpu.replicas"] == ("Lt", ["2"])


def test_timeslice_asks_one_replica_on_time_slicing_nodes_with_a_memory_budget():
    job = spec(kind="inference", isolation="none", gpu_memory_gb=4, memory="8G", image="vllm/vllm-openai:v0.6")
    where = placement(Sharing.K8S_TIMESLICE, gpu_model="T4", gpu_memory_gb=4, node="t4-1")
    manifest = render(5, job, where, OPTIONS, gpu_memory_gb=16, products=product_names("T4"))
    container = pod_spec(manifest)["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", "memory": "8192Mi"}
    assert container["image"] == "vllm/vllm-openai:v0.6"
    env = env_of(manifest)
    assert env["GPUSH_GPU_MEMORY_FRACTION"] == "0.25" and env["GPUSH_GPU_MEMORY_GB"] == "4"
    assert env["GPUSH_JOB_ID"] == "5"
    affinity = pod_spec(manifest)["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    first = {e["key"]: e for e in terms[0]["matchExpressions"]}
    assert first["nvidia.com/gpu.sharing-strategy"]["values"] == ["time-slicing"]
    assert {"Tesla-T4", "Tesla-T4-SHARED"} <= set(first["nvidia.com/gpu.product"]["values"])
    # GFD before v0.15 has no strategy label: replicas > 1 means time-slicing there.
    second = {e["key"]: e for e in terms[1]["matchExpressions"]}
    assert second["nvidia.com/gpu.replicas"] == {"key": "nvidia.com/gpu.replicas", "operator": "Gt", "values": ["1"]}
    # The node gpush placed it on, by name, in every term (adapters/k8s/render.py "Where it runs").
    assert all(t["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["t4-1"]}] for t in terms)
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in affinity


def test_mig_asks_for_the_profile_resource():
    job = spec(isolation="hardware", gpu_memory_gb=20)
    where = placement(Sharing.K8S_MIG, mig_profile="3g.20gb", gpu_model="A100-SXM4-40GB")
    manifest = render(6, job, where, OPTIONS)
    limits = pod_spec(manifest)["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/mig-3g.20gb": "1"}
    env = env_of(manifest)
    assert env["GPUSH_GPU_MEMORY_FRACTION"] == "1" and env["GPUSH_GPU_MEMORY_GB"] == "20"
    whole = env_of(render(6, spec(), placement(Sharing.K8S_EXCLUSIVE, gpu_model="H100-SXM5-80GB"), OPTIONS))
    # the nominal 80 GB is more than the device has: a whole GPU without a budget gets only the fraction
    assert whole["GPUSH_GPU_MEMORY_FRACTION"] == "1" and "GPUSH_GPU_MEMORY_GB" not in whole
    assert "affinity" not in pod_spec(manifest)  # the profile names the model; no node preferred
    with pytest.raises(Rejected, match="MIG profile"):
        render(6, job, placement(Sharing.K8S_MIG), OPTIONS)


def test_elastic_inference_becomes_a_deployment_of_the_placed_replicas():
    job = spec(kind="inference", isolation="none", gpu_memory_gb=4, elastic={"min_replicas": 2, "max_replicas": 6})
    manifest = render(9, job, placement(Sharing.K8S_TIMESLICE, replicas=2, gpu_model="T4"), OPTIONS)
    body = manifest.body
    assert (body["apiVersion"], body["kind"], manifest.backend_id) == ("apps/v1", "Deployment", "deployment/gpush-9")
    assert body["spec"]["replicas"] == 2
    assert body["spec"]["selector"]["matchLabels"] == {LABEL_BROKER: "gpush", LABEL_JOB_ID: "9"}
    assert body["spec"]["strategy"] == {"type": "Recreate"}
    assert pod_spec(manifest)["restartPolicy"] == "Always"


def test_cluster_settings_reach_the_pod():
    options = RenderOptions(
        tag="team-a",
        namespace="ml",
        image="base:1",
        service_account="trainer",
        run_as_user=4242,
        priority_class="batch-low",
        node_selector={"pool": "gpu"},
    )
    manifest = render(3, spec(), placement(Sharing.K8S_EXCLUSIVE), options)
    pod = pod_spec(manifest)
    assert manifest.body["metadata"] == {
        **manifest.body["metadata"],
        "name": "team-a-3",
        "namespace": "ml",
    }
    assert pod["serviceAccountName"] == "trainer" and pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsUser"] == 4242 and pod["priorityClassName"] == "batch-low"
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["containers"][0]["image"] == "base:1"


def test_user_input_made_valid_or_refused_clearly():
    assert label_value("alice@example.com", "user") == "alice_example.com"
    assert label_value("x" * 70, "user") == "x" * 63
    with pytest.raises(Rejected, match="cannot be a Kubernetes label value"):
        label_value("@@@", "tenant")
    job = spec(user="alice@example.com", tenant="vision", name="resnet@v2")
    manifest = render(1, job, placement(Sharing.K8S_EXCLUSIVE), OPTIONS)
    annotations = manifest.body["metadata"]["annotations"]
    assert annotations["gpush.io/user"] == "alice@example.com" and annotations["gpush.io/name"] == "resnet@v2"
    with pytest.raises(Rejected, match="reserves"):
        render(1, spec(labels={"gpush.io/job-id": "99"}), placement(Sharing.K8S_EXCLUSIVE), OPTIONS)
    with pytest.raises(Rejected, match="reserves"):
        render(1, spec(labels={"node.kubernetes.io/x": "1"}), placement(Sharing.K8S_EXCLUSIVE), OPTIONS)
    manifest = render(1, spec(labels={"team": "cv", "sim-duration": "30"}), placement(Sharing.K8S_EXCLUSIVE), OPTIONS)
    assert manifest.body["spec"]["template"]["metadata"]["labels"]["team"] == "cv"
    with pytest.raises(ValueError, match="lowercase"):
        check_tag("My_Tag")


def test_refusals_name_what_to_do():
    with pytest.raises(Rejected, match="set the cluster's image"):
        render(1, spec(), placement(Sharing.K8S_EXCLUSIVE), RenderOptions(tag="gpush", namespace="gpush"))
    with pytest.raises(Rejected, match="not a Kubernetes sharing mode"):
        render(1, spec(), placement(Sharing.SLURM_MIG, mig_profile="1g.5gb"), OPTIONS)


def test_gfd_products_map_to_gpush_models():
    assert model_of_product("Tesla-T4-SHARED") == "T4"
    assert model_of_product("NVIDIA-A100-SXM4-40GB") == "A100-SXM4-40GB"
    assert model_of_product("NVIDIA-H100-80GB-HBM3") == "H100-SXM5-80GB"
    assert model_of_product("NVIDIA-A100-80GB-PCIe") == "A100-SXM4-80GB"
    assert model_of_product("NVIDIA-RTX-PRO-6000") is None
    assert model_of_product("Custom-GPU", {"Custom-GPU": "L4"}) == "L4"


# -- settings ----------------------------------------------------------------------------


class NoServer(KubeClient):
    def _client(self):
        raise AssertionError("this test must not reach a server")


def test_settings_refuse_unknown_keys_with_a_suggestion():
    with pytest.raises(InvalidRequest, match="did you mean namespace"):
        KubernetesAdapter("k8s-a", {"namepsace": "ml"}, client=NoServer())
    with pytest.raises(InvalidRequest, match="tag"):
        KubernetesAdapter("k8s-a", {"tag": "Bad_Tag"}, client=NoServer())
    with pytest.raises(InvalidRequest, match="unknown GPU model"):
        KubernetesAdapter("k8s-a", {"gpu_types": "Tesla-T4=T5"}, client=NoServer())
    adapter = KubernetesAdapter(
        "k8s-a",
        {"node_selector": "pool=gpu,zone=a", "gpu_types": "Custom-GPU=L4", "create_namespace": "true"},
        client=NoServer(),
    )
    assert adapter.settings.node_selector == {"pool": "gpu", "zone": "a"}
    assert adapter.gpu_types["Custom-GPU"] == "L4" and adapter.gpu_types["Tesla-T4"] == "T4"
    assert adapter.settings.create_namespace is True
    assert isinstance(adapter, ClusterAdapter)


# -- states ------------------------------------------------------------------------------


def observed(job: str | None = None, pods: tuple[str, ...] = (), deployment: str | None = None) -> Observed:
    seen = Observed(
        job=copy.deepcopy(JOBS[job]) if job else None,
        deployment=copy.deepcopy(DEPLOYMENTS[deployment]) if deployment else None,
        pods={PODS[p]["metadata"]["name"]: copy.deepcopy(PODS[p]) for p in pods},
    )
    seen.note_started()
    return seen


@pytest.mark.parametrize(
    ("job", "pods", "state", "reason", "exit_code"),
    [
        ("new", (), BackendState.PENDING, "waiting for k8s-a to create its Pod", None),
        (
            "new",
            ("unschedulable-mig",),
            BackendState.PENDING,
            "Unschedulable: Insufficient nvidia.com/mig-3g.20gb",
            None,
        ),
        (
            "new",
            ("image-pull",),
            BackendState.PENDING,
            (
                "ImagePullBackOff: cannot pull the image (backing off) "
                '(Back-off pulling image "registry.example/none:1")'
            ),
            None,
        ),
        ("new", ("creating",), BackendState.PENDING, "starting on t4-1", None),
        ("active", ("running",), BackendState.RUNNING, None, None),
        ("complete", ("succeeded",), BackendState.SUCCEEDED, None, 0),
        ("failed-backoff", ("oomkilled",), BackendState.FAILED, OOM_REASON, 137),
        # the Pod failed; the Job controller has not written its condition yet
        ("active", ("oomkilled",), BackendState.FAILED, OOM_REASON, 137),
        ("failed-backoff", ("exit-3",), BackendState.FAILED, "exited with code 3: ValueError: bad input", 3),
        ("deadline", (), BackendState.FAILED, "reached its time limit (3600 s)", None),
        ("failed-backoff", ("evicted",), BackendState.FAILED, None, None),
        (
            "failed-backoff",
            (),
            BackendState.FAILED,
            "failed in k8s-a: Job has reached the specified backoff limit",
            None,
        ),
    ],
)
def test_job_states(job, pods, state, reason, exit_code):
    result = backend_job(11, "job/gpush-11", observed(job, pods), "k8s-a")
    assert result.state == state
    if reason is not None:
        assert result.reason == reason
    assert result.exit_code == exit_code
    if state == BackendState.RUNNING:
        assert result.node == "t4-1" and result.at is not None


def test_evicted_says_why():
    result = backend_job(14, "job/gpush-14", observed("failed-backoff", ("evicted",)))
    assert result.reason.startswith("evicted by Kubernetes: The node was low on resource: memory")


@pytest.mark.parametrize(
    ("message", "short"),
    [
        (
            PODS["unschedulable-mig"]["status"]["conditions"][0]["message"],
            "Unschedulable: Insufficient nvidia.com/mig-3g.20gb",
        ),
        (
            "0/5 nodes are available: 3 Insufficient nvidia.com/gpu, 2 Insufficient memory.",
            "Unschedulable: Insufficient nvidia.com/gpu, Insufficient memory",
        ),
        (
            PODS["unschedulable-affinity"]["status"]["conditions"][0]["message"],
            "Unschedulable: node(s) didn't match Pod's node affinity/selector",
        ),
        ("", "Unschedulable: no node fits"),
    ],
)
def test_scheduler_messages_shortened_for_users(message, short):
    assert shorten_unschedulable(message) == short


def test_deployment_states():
    ready = backend_job(
        16, "deployment/gpush-16", observed(deployment="partly-ready", pods=("running", "unschedulable-mig"))
    )
    assert ready.state == BackendState.RUNNING
    assert ready.reason == "2 of 3 replicas ready; Unschedulable: Insufficient nvidia.com/mig-3g.20gb"
    waiting = backend_job(16, "deployment/gpush-16", observed(deployment="none-ready", pods=("unschedulable-mig",)))
    assert (waiting.state, waiting.reason) == (
        BackendState.PENDING,
        "Unschedulable: Insufficient nvidia.com/mig-3g.20gb",
    )
    zero = backend_job(16, "deployment/gpush-16", observed(deployment="scaled-to-zero"))
    assert (zero.state, zero.reason) == (BackendState.RUNNING, "scaled to 0 replicas")
    crashing = backend_job(16, "deployment/gpush-16", observed(deployment="none-ready", pods=("crashloop-oom",)))
    assert crashing.reason == f"{OOM_REASON} (Kubernetes restarted it 3 times)"


def test_deleted_objects():
    never_ran = observed("new", ("unschedulable-mig",))
    never_ran.deleted = True
    assert backend_job(7, "job/gpush-7", never_ran).state == BackendState.LOST
    ran = observed("active", ("running",))
    ran.deleted = True
    result = backend_job(11, "job/gpush-11", ran, "k8s-a")
    assert (result.state, result.reason) == (BackendState.CANCELLED, "deleted in k8s-a, not by gpush")
    ran.cancelled = True
    assert backend_job(11, "job/gpush-11", ran).reason == "cancelled by gpush"


# -- inventory ---------------------------------------------------------------------------


def units_of(node: str, held: dict[str, int] | None = None, **kw: Any):
    return node_units("k8s-a", NODES[node], held or {}, **kw)


def test_time_slicing_counts_physical_gpus():
    units = units_of("t4-timeslice", {"nvidia.com/gpu": 5})
    assert [u.sharing for u in units] == [Sharing.K8S_TIMESLICE] * 2  # 8 replicas on 2 GPUs
    assert [u.gpus for u in units] == [(0,), (1,)]
    assert [(u.capacity, u.allocated) for u in units] == [(4, 4), (4, 1)]  # dealt in index order
    assert all(u.gpu_equivalent == 0.25 and u.gpu_model == "T4" and u.gpu_memory_gb == 16 for u in units)
    assert sum(u.capacity * u.gpu_equivalent for u in units) == 2.0
    assert units[0].memory_allocated_gb is None and "drift" not in units[0].labels


def test_mig_profiles_are_worth_their_share_of_the_gpu():
    units = {u.mig_profile: u for u in units_of("a100-mig-mixed", {"nvidia.com/mig-1g.5gb": 3})}
    assert set(units) == {"3g.20gb", "1g.5gb"}
    big, small = units["3g.20gb"], units["1g.5gb"]
    assert (big.sharing, big.capacity, big.allocated, big.unit_memory_gb) == (Sharing.K8S_MIG, 2, 0, 20)
    assert big.gpu_equivalent == pytest.approx(3 / 7) and big.gpu_model == "A100-SXM4-40GB" and big.in_mig_mode
    assert (small.capacity, small.allocated, small.gpu_equivalent) == (4, 3, pytest.approx(1 / 7))


def test_whole_gpus_and_unavailable_nodes():
    (whole,) = units_of("h100-whole", {"nvidia.com/gpu": 3})
    assert (whole.sharing, whole.capacity, whole.allocated, whole.gpu_model) == (
        Sharing.K8S_EXCLUSIVE,
        8,
        3,
        "H100-SXM5-80GB",
    )
    (down,) = units_of("t4-not-ready")
    assert down.allocated == down.capacity == 4 and down.labels["unavailable"].startswith("not Ready")
    (cordoned,) = units_of("h100-cordoned")
    assert cordoned.free == 0 and cordoned.labels["unavailable"] == "cordoned (unschedulable)"
    assert units_of("cpu-only") == []


def test_old_gfd_without_strategy_label_and_single_mig():
    units = units_of("old-gfd-timeslice")
    assert len(units) == 4 and all(u.capacity == 2 and u.gpu_equivalent == 0.5 for u in units)
    assert units[0].gpu_model == "V100-SXM2-32GB"
    (single,) = units_of("single-mig")
    assert single.broken and "mixed strategy" in single.broken and single.mig_profile == "1g.5gb"


def test_drift_against_the_time_slicing_config():
    (first, _second) = units_of("t4-timeslice", expected_replicas=8, expected_from="ConfigMap gpu-operator/ts key any")
    assert first.labels["drift"] == (
        "advertises 4 time-slicing replicas per GPU; ConfigMap gpu-operator/ts key any says 8"
    )
    (whole,) = units_of("h100-whole", expected_replicas=4, expected_from="ConfigMap x key any")
    assert "does not time-slice" in whole.labels["drift"]
    node = copy.deepcopy(NODES["t4-timeslice"])
    node["status"]["allocatable"]["nvidia.com/gpu"] = "16"  # plugin restarted with 8, labels still say 4
    units = node_units("k8s-a", node, {})
    assert "advertises 16 nvidia.com/gpu on 2 GPUs" in units[0].labels["drift"]


def test_gpu_requests_count_bound_unfinished_pods():
    pods = [PODS["running"], PODS["succeeded"], PODS["unschedulable-mig"], PODS["oomkilled"]]
    held = gpu_requests_by_node(pods)
    assert dict(held) == {"t4-1": {"nvidia.com/gpu": 1}}


# -- time-slicing config -----------------------------------------------------------------


def test_render_timeslice_default_for_every_node():
    plan = render_timeslice(4)
    config = yaml.safe_load(plan.config_map["data"]["any"])
    assert config == {
        "version": "v1",
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}},
    }
    assert "flags" not in config  # the ClusterPolicy's MIG strategy stays in force
    assert plan.config_map["metadata"] == {
        "name": "time-slicing-config",
        "namespace": "gpu-operator",
        "labels": {"app.kubernetes.io/managed-by": "gpush"},
    }
    assert plan.cluster_policy_patch == {
        "spec": {"devicePlugin": {"config": {"name": "time-slicing-config", "default": "any"}}}
    }
    assert plan.node_selector is None
    config_map, cluster_policy = yaml.safe_load_all(plan.to_yaml())
    assert config_map == plan.config_map
    assert cluster_policy["kind"] == "ClusterPolicy" and cluster_policy["spec"] == plan.cluster_policy_patch["spec"]


def test_render_timeslice_for_labelled_nodes():
    plan = render_timeslice(8, node_label="nvidia.com/gpu.product=Tesla-T4", config_map="ops/ts")
    assert (plan.namespace, plan.name, plan.key) == ("ops", "ts", "replicas-8")
    assert plan.cluster_policy_patch == {"spec": {"devicePlugin": {"config": {"name": "ts"}}}}
    assert plan.node_selector == "nvidia.com/gpu.product=Tesla-T4"
    assert (
        "kubectl label nodes -l nvidia.com/gpu.product=Tesla-T4 nvidia.com/device-plugin.config=replicas-8"
        in plan.to_yaml()
    )
    with pytest.raises(ValueError, match="KEY=VALUE"):
        render_timeslice(8, node_label="Tesla-T4")
    off = render_timeslice(1)
    assert replicas_in(off.config_map["data"]["any"]) == 1


def test_replicas_in_nvidia_example_and_node_keys():
    nvidia_example = (
        "version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    assert replicas_in(nvidia_example) == 4
    assert replicas_in(": not yaml [") is None
    state = TimesliceState(
        "gpu-operator", "ts", {"any": nvidia_example, "t4": render_timeslice(8).config_map["data"]["any"]}, "any"
    )
    assert state.replicas_for({}) == (4, "ConfigMap gpu-operator/ts key any")
    assert state.replicas_for({"nvidia.com/device-plugin.config": "t4"})[0] == 8
    assert state.replicas_for({"nvidia.com/device-plugin.config": "missing"})[0] is None
    assert TimesliceState("gpu-operator", "ts", {}, None).replicas_for({})[0] == 1


# -- the client's error mapping ----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "kind"),
    [
        (422, "Invalid", Rejected),
        (403, "Forbidden", Rejected),
        (400, "BadRequest", Rejected),
        (404, "NotFound", NotFound),
        (409, "AlreadyExists", AlreadyExists),
        (409, "Conflict", Unreachable),
        (410, "Expired", Gone),
        (401, "Unauthorized", Unreachable),
        (429, "TooManyRequests", Unreachable),
        (500, "InternalError", Unreachable),
        (503, "ServiceUnavailable", Unreachable),
    ],
)
def test_api_errors_are_typed(status, reason, kind):
    body = json.dumps(
        {"kind": "Status", "status": "Failure", "message": f"it said {reason}", "reason": reason, "code": status}
    )
    error = _status_error(status, body.encode(), "create jobs/gpush-1")
    assert isinstance(error, kind)
    assert f"it said {reason}" in str(error) and f"HTTP {status}" in str(error)
    if kind is Rejected:
        assert not isinstance(error, Unreachable)


# -- statuses over a stand-in client -----------------------------------------------------


class FakeKube:
    """Answers list and watch from a script: enough to follow the cursor logic."""

    def __init__(self):
        self.objects: dict[str, dict[str, dict]] = {"pods": {}, "jobs": {}, "deployments": {}, "services": {}}
        self.version = 100
        self.pending: dict[str, list[WatchEvent]] = {"pods": [], "jobs": [], "deployments": [], "services": []}
        self.gone = False
        self.lists = 0
        self.watched_from: list[tuple[str, str]] = []

    def put(self, kind: str, obj: dict, event: str = "ADDED") -> None:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        if event == "DELETED":
            self.objects[kind].pop(name, None)
        else:
            self.objects[kind][name] = obj
        self.pending[kind].append(WatchEvent(event, obj))

    def list(self, kind, namespace=None, *, label_selector=None, field_selector=None, limit=500):
        self.lists += 1
        return [copy.deepcopy(o) for o in self.objects[kind].values()], str(self.version)

    def get(self, kind, namespace, name):
        found = self.objects[kind].get(name)
        return copy.deepcopy(found) if found is not None else None

    def delete(self, kind, namespace, name, *, propagation="Background", grace=None):
        if name not in self.objects[kind]:
            return False
        self.put(kind, self.objects[kind][name], event="DELETED")
        return True

    def watch(self, kind, namespace, *, resource_version, label_selector=None, seconds=1.0):
        self.watched_from.append((kind, resource_version))
        if self.gone:
            raise Gone("too old")
        events = [e for e in self.pending[kind] if int(e.object["metadata"]["resourceVersion"]) > int(resource_version)]
        version = events[-1].object["metadata"]["resourceVersion"] if events else resource_version
        return WatchBatch(events, version)


def test_statuses_follow_the_watch_and_relist_on_gone():
    fake = FakeKube()
    adapter = KubernetesAdapter("k8s-a", {}, client=fake)  # type: ignore[arg-type]
    fake.put("jobs", JOBS["new"])
    fake.put(
        "pods",
        PODS["unschedulable-mig"]
        | {
            "metadata": {**PODS["unschedulable-mig"]["metadata"], "labels": {LABEL_BROKER: "gpush", LABEL_JOB_ID: "18"}}
        },
    )
    first = adapter.statuses(None)
    assert [(j.job_id, j.state) for j in first.jobs] == [(18, BackendState.PENDING)]
    assert first.jobs[0].reason == "Unschedulable: Insufficient nvidia.com/mig-3g.20gb"
    assert parse_cursor(first.cursor) == {"pods": "102", "jobs": "102", "deployments": "102"}
    # Nothing new: an empty page, the cursor unchanged, no re-list.
    lists = fake.lists
    quiet = adapter.statuses(first.cursor)
    assert quiet.jobs == [] and quiet.cursor == first.cursor and fake.lists == lists
    # The Pod runs, then the Job completes.
    running = copy.deepcopy(PODS["running"])
    running["metadata"]["labels"][LABEL_JOB_ID] = "18"
    fake.put("pods", running)
    page = adapter.statuses(quiet.cursor)
    assert [(j.job_id, j.state, j.node) for j in page.jobs] == [(18, BackendState.RUNNING, "t4-1")]
    assert ("pods", "102") in fake.watched_from
    done = copy.deepcopy(JOBS["complete"])
    done["metadata"] = JOBS["new"]["metadata"]
    fake.put("jobs", done)
    page = adapter.statuses(page.cursor)
    assert [(j.job_id, j.state, j.exit_code) for j in page.jobs] == [(18, BackendState.SUCCEEDED, 0)]
    # 410 Gone: re-list, every job's current state.
    fake.gone = True
    lists = fake.lists
    relisted = adapter.statuses(page.cursor)
    assert fake.lists == lists + 3 and [(j.job_id, j.state) for j in relisted.jobs] == [(18, BackendState.SUCCEEDED)]
    fake.gone = False


def test_statuses_after_a_restart_report_all_and_find_deletions():
    fake = FakeKube()
    first = KubernetesAdapter("k8s-a", {}, client=fake)  # type: ignore[arg-type]
    fake.put("jobs", JOBS["new"])
    fake.put("jobs", JOBS["active"])
    cursor = first.statuses(None).cursor
    # While no broker watched: job 18 (never started) deleted by someone; job 11 runs on.
    fake.put("jobs", JOBS["new"], event="DELETED")
    running = copy.deepcopy(PODS["running"])
    fake.put("pods", running)
    restarted = KubernetesAdapter("k8s-a", {}, client=fake)  # type: ignore[arg-type]
    page = restarted.statuses(cursor)
    states = {j.job_id: j.state for j in page.jobs}
    assert states == {11: BackendState.RUNNING, 18: BackendState.LOST}


def gang_job(job_id: int = 21) -> tuple[dict, list[dict]]:
    """A running two-node gang: its Indexed Job and a running Pod per rank (h1, h2)."""
    labels = {LABEL_BROKER: "gpush", LABEL_JOB_ID: str(job_id)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"gpush-{job_id}", "namespace": "gpush", "labels": labels},
        "spec": {"backoffLimit": 0, "completions": 2, "parallelism": 2, "completionMode": "Indexed"},
        "status": {"active": 2, "ready": 2, "startTime": "2026-12-03T10:00:00Z"},
    }
    pods = []
    for rank, node in enumerate(("h1", "h2")):
        pod = copy.deepcopy(PODS["running"])
        pod["metadata"] = {
            "name": f"gpush-{job_id}-{rank}-x7k2p",
            "namespace": "gpush",
            "creationTimestamp": "2026-12-03T10:00:00Z",
            "labels": dict(labels),
            "annotations": {COMPLETION_INDEX: str(rank)},
        }
        pod["spec"]["nodeName"] = node
        pods.append(pod)
    return job, pods


def adapter_with_a_running_gang() -> tuple[FakeKube, KubernetesAdapter, dict, list[dict]]:
    """A Kubernetes adapter over a fake cluster that holds :func:`gang_job`'s Job and Pods."""
    fake = FakeKube()
    adapter = KubernetesAdapter("k8s-a", {}, client=fake)  # type: ignore[arg-type]
    job, pods = gang_job()
    fake.put("jobs", job)
    for pod in pods:
        fake.put("pods", pod)
    return fake, adapter, job, pods


def test_a_gang_that_loses_a_rank_is_stopped_whole_and_queued_again_but_one_that_fails_is_failed():
    job, (rank0, rank1) = gang_job()
    seen = Observed(job=job)
    for pod in (rank0, rank1):
        seen.note_pod(pod)
    seen.note_started()
    assert backend_job(21, "job/gpush-21", seen).state == BackendState.RUNNING and seen.lost_rank is None
    seen.note_pod(rank1, deleted=True)  # its node went: the Pod with it
    stopping = backend_job(21, "job/gpush-21", seen)
    assert stopping.state == BackendState.RUNNING
    assert stopping.reason == (
        "rank 1 lost on node h2 (its Pod gpush-21-1-x7k2p was deleted): stopping the whole gang to queue it again"
    )
    seen.deleted = True  # the adapter deleted the Job
    lost = backend_job(21, "job/gpush-21", seen)
    assert lost.state == BackendState.LOST and lost.reason.endswith("the whole gang was stopped and queued again")

    # Failed by a disruption (the Pod garbage collector's mark of a Pod whose node is gone): lost too.
    job, (rank0, rank1) = gang_job()
    seen = Observed(job=job, pods={p["metadata"]["name"]: p for p in (rank0, rank1)})
    disrupted = copy.deepcopy(rank1)
    disrupted["status"]["phase"] = "Failed"
    disrupted["status"]["conditions"] = [
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "DeletionByPodGC",
            "message": "PodGC: node no longer exists",
        }
    ]
    seen.note_pod(disrupted)
    assert seen.lost_rank == "rank 1 lost on node h2 (PodGC: node no longer exists)"

    # The Job's Pod failure policy names the disrupted rank, seen before (or without) its Pod.
    job, (rank0, rank1) = gang_job()
    seen = Observed(pods={rank0["metadata"]["name"]: rank0})
    message = "Pod gpush/gpush-21-1-x7k2p has condition DisruptionTarget matching FailJob rule at index 0"
    job["status"]["conditions"] = [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": message}
    ]
    seen.note_job(job)
    assert seen.lost_rank == f"rank 1 lost ({message})"
    assert backend_job(21, "job/gpush-21", seen).state == BackendState.RUNNING  # being stopped, not failed

    # A rank that exits non-zero fails the gang; the Job controller deleting the other is no loss.
    job, (rank0, rank1) = gang_job()
    seen = Observed(job=job, pods={p["metadata"]["name"]: p for p in (rank0, rank1)})
    failed = copy.deepcopy(rank1)
    failed["status"] = copy.deepcopy(PODS["exit-3"]["status"])
    seen.note_pod(failed)
    seen.note_pod(rank0, deleted=True)
    assert seen.lost_rank is None
    result = backend_job(21, "job/gpush-21", seen)
    assert (result.state, result.exit_code) == (BackendState.FAILED, 3)

    # A one-node Job's Pod deleted is not a gang's loss.
    seen = observed("active", ("running",))
    seen.note_pod(PODS["running"], deleted=True)
    assert seen.lost_rank is None


def test_statuses_stop_a_gang_that_lost_a_rank_and_report_it_lost_once_gone():
    fake, adapter, job, pods = adapter_with_a_running_gang()
    fake.put("services", {"metadata": {"name": "gpush-21", "labels": job["metadata"]["labels"]}})
    page = adapter.statuses(None)
    assert [(j.job_id, j.state) for j in page.jobs] == [(21, BackendState.RUNNING)]
    fake.put("pods", pods[1], event="DELETED")
    page = adapter.statuses(page.cursor)
    assert [(j.job_id, j.state) for j in page.jobs] == [(21, BackendState.RUNNING)]
    assert "stopping the whole gang" in page.jobs[0].reason
    # The other rank does not run on alone: Job, Pods and Service deleted, not as a cancel.
    assert fake.objects["jobs"] == {} and fake.objects["pods"] == {} and fake.objects["services"] == {}
    page = adapter.statuses(page.cursor)
    assert [(j.job_id, j.state) for j in page.jobs] == [(21, BackendState.LOST)]
    assert page.jobs[0].reason.startswith("rank 1 lost on node h2")
    assert adapter.statuses(page.cursor).jobs == []


def test_a_gang_whose_job_ended_before_its_rank_was_deleted_lost_nothing():
    """The Job controller deletes a gang's ranks once its Job failed (or completed): seen before
    the Job's condition, that deletion is no loss, and the adapter reads the Job again to know."""
    fake, adapter, job, pods = adapter_with_a_running_gang()
    cursor = adapter.statuses(None).cursor
    failed = copy.deepcopy(job)
    failed["status"]["conditions"] = [
        {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "Job was active longer"}
    ]
    failed["spec"]["activeDeadlineSeconds"] = 60
    fake.objects["jobs"]["gpush-21"] = failed  # written, not yet watched
    fake.put("pods", pods[1], event="DELETED")
    page = adapter.statuses(cursor)
    assert [(j.job_id, j.state, j.reason) for j in page.jobs] == [
        (21, BackendState.FAILED, "reached its time limit (60 s)")
    ]
    assert "gpush-21" in fake.objects["jobs"]  # not deleted: nothing to stop, nothing to queue again


def test_cursor_round_trip_and_foreign_cursors():
    cursor = format_cursor({"pods": "1", "jobs": "2", "deployments": "3"})
    assert parse_cursor(cursor) == {"pods": "1", "jobs": "2", "deployments": "3"}
    assert parse_cursor("t=1700000000") is None and parse_cursor(None) is None
