"""The GPU cluster simulator against the Kubernetes API test server, through the official client only.

Each test gets its own test API server and simulator (both start in well under a second), so pools,
ConfigMaps and leftovers never leak between tests.
"""

from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client, config

from integration.k8s import apiserver
from integration.k8s.container_output import STDERR, STDOUT, container_env, program_output
from integration.k8s.gpu_nodes import CLUSTER_POLICY_CRD, GpuPool, SharingConfig, node_devices
from integration.k8s.simulator import ANN_DURATION, ANN_EXIT_CODE, ANN_OOM, Simulator, Timings, pod_requests

T4 = GpuPool("t4", count=2, product="Tesla-T4", gpus_per_node=4, replicas=4, cpu="32", memory="128Gi")
A100_MIXED = GpuPool(
    "a100",
    count=1,
    product="NVIDIA-A100-SXM4-40GB",
    gpus_per_node=2,
    mig_strategy="mixed",
    mig_layout=(("3g.20gb", "2g.10gb", "1g.5gb"), ("3g.20gb", "3g.20gb")),
)


def wait_for(check, timeout: float = 10.0, what: str = "condition"):
    """Polls ``check`` until it returns something truthy; fails with the last value otherwise."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last value: {value!r}")


@pytest.fixture
def server():
    srv = apiserver.start()
    yield srv
    srv.stop()


@pytest.fixture
def api(server, tmp_path):
    api_client = config.new_client_from_config(config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")))
    yield api_client
    api_client.close()


@pytest.fixture
def core(api):
    return client.CoreV1Api(api)


@pytest.fixture
def namespace(core):
    name = f"sim-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


@pytest.fixture
def simulate(api):
    """Starts a simulator over the given pools, registers their nodes, and stops it after the test."""
    started = []

    def make(*pools, **options) -> Simulator:
        sim = Simulator(api, pools, **options).start()
        started.append(sim)
        names = sim.create_nodes()
        assert sim.nodes == sorted(names)
        return sim

    yield make
    for sim in started:
        sim.stop()


def gpu_pod(name: str, resources: dict, *, annotations=None, env=None, restart="Never", node_selector=None) -> dict:
    container = {"name": "main", "image": "cuda:12", "resources": {"limits": resources}}
    if env:
        container["env"] = [{"name": k, "value": str(v)} for k, v in env.items()]
    spec = {"restartPolicy": restart, "containers": [container]}
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": spec,
    }


def phase(core, namespace: str, name: str) -> str:
    return core.read_namespaced_pod(name, namespace).status.phase


# ---------------------------------------------------------------- nodes


def test_time_sliced_t4_and_mixed_mig_a100_nodes_advertise_what_the_gpu_operator_would(core, simulate):
    simulate(T4, A100_MIXED)

    t4 = core.read_node("t4-0")
    assert t4.status.allocatable["nvidia.com/gpu"] == "16"
    assert t4.status.capacity["nvidia.com/gpu"] == "16"
    labels = t4.metadata.labels
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4-SHARED"
    assert labels["nvidia.com/gpu.count"] == "4"
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.memory"] == "15360"
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.family"] == "turing"
    assert labels["nvidia.com/mig.capable"] == "false"
    assert "nvidia.com/mig.strategy" not in labels
    assert {c.type: c.status for c in t4.status.conditions}["Ready"] == "True"

    a100 = core.read_node("a100-0")
    alloc = a100.status.allocatable
    assert alloc["nvidia.com/mig-3g.20gb"] == "3"
    assert alloc["nvidia.com/mig-2g.10gb"] == "1"
    assert alloc["nvidia.com/mig-1g.5gb"] == "1"
    assert alloc["nvidia.com/gpu"] == "0"
    labels = a100.metadata.labels
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/mig.config"] == "custom-a100"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.replicas"] == "0"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert labels["nvidia.com/mig-3g.20gb.count"] == "3"
    assert labels["nvidia.com/mig-3g.20gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb"
    assert labels["nvidia.com/mig-3g.20gb.memory"] == "20096"
    assert labels["nvidia.com/mig-3g.20gb.multiprocessors"] == "42"
    assert labels["nvidia.com/mig-3g.20gb.slices.gi"] == "3"


def test_a_configmap_change_from_4_to_8_replicas_changes_allocatable_and_labels(api, core, simulate):
    ext = client.ApiextensionsV1Api(api)
    ext.create_custom_resource_definition(CLUSTER_POLICY_CRD)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpu-operator"}})
    core.create_namespaced_config_map(
        "gpu-operator",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "time-slicing-config"},
            "data": {"tesla-t4": SharingConfig("time-slicing", {"nvidia.com/gpu": 4}).render()},
        },
    )
    client.CustomObjectsApi(api).create_cluster_custom_object(
        "nvidia.com",
        "v1",
        "clusterpolicies",
        {
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "cluster-policy"},
            "spec": {"devicePlugin": {"config": {"name": "time-slicing-config", "default": "tesla-t4"}}},
        },
    )
    plain = GpuPool("t4cm", count=2, product="Tesla-T4", gpus_per_node=2)  # no sharing of its own
    simulate(plain)
    assert core.read_node("t4cm-0").status.allocatable["nvidia.com/gpu"] == "8"

    eight = SharingConfig("time-slicing", {"nvidia.com/gpu": 8}).render()
    core.patch_namespaced_config_map("time-slicing-config", "gpu-operator", {"data": {"tesla-t4": eight}})

    def allocatable():
        return [core.read_node(f"t4cm-{i}").status.allocatable["nvidia.com/gpu"] for i in range(2)]

    wait_for(lambda: allocatable() == ["16", "16"], what="16 nvidia.com/gpu per node")
    labels = core.read_node("t4cm-1").metadata.labels
    assert labels["nvidia.com/gpu.replicas"] == "8"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4-SHARED"

    # a node label picks another key of the same ConfigMap: no key, no sharing
    core.patch_namespaced_config_map(
        "time-slicing-config", "gpu-operator", {"data": {"exclusive": SharingConfig().render()}}
    )
    core.patch_node("t4cm-1", {"metadata": {"labels": {"nvidia.com/device-plugin.config": "exclusive"}}})
    wait_for(lambda: allocatable() == ["16", "2"], what="t4cm-1 back to 2 whole GPUs")
    labels = core.read_node("t4cm-1").metadata.labels
    assert labels["nvidia.com/gpu.sharing-strategy"] == "none"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"


# ---------------------------------------------------------------- scheduler and kubelet


def test_a_mig_pod_binds_to_the_mig_node_and_runs_to_succeeded(core, namespace, simulate):
    sim = simulate(T4, A100_MIXED)
    # a job that uses its profile's named 20 GB fits, though GFD reports 20096 MiB for the device
    pod = gpu_pod(
        "mig", {"nvidia.com/mig-3g.20gb": "1"}, annotations={ANN_DURATION: "0.3"}, env={"GPUSH_GPU_MEMORY_GB": 20}
    )
    core.create_namespaced_pod(namespace, pod)

    wait_for(lambda: phase(core, namespace, "mig") == "Running", what="Running")
    running = core.read_namespaced_pod("mig", namespace)
    assert running.spec.node_name == "a100-0"
    assert {c.type: c.status for c in running.status.conditions}["Ready"] == "True"
    assert running.status.container_statuses[0].state.running is not None
    assert sim.gpu_claims(namespace, "mig")[0][0] == "nvidia.com/mig-3g.20gb"

    wait_for(lambda: phase(core, namespace, "mig") == "Succeeded", what="Succeeded")
    done = core.read_namespaced_pod("mig", namespace).status.container_statuses[0].state.terminated
    assert (done.exit_code, done.reason) == (0, "Completed")
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=mig").items
    assert any(e.reason == "Scheduled" and "to a100-0" in e.message for e in events)


def test_a_container_prints_until_its_planned_end_and_its_log_stays_with_the_pod(core, namespace, simulate):
    simulate(T4)
    pod = gpu_pod("talk", {"nvidia.com/gpu": "1"}, annotations={ANN_DURATION: "0.4", ANN_EXIT_CODE: "2"})
    pod["spec"]["containers"][0]["command"] = ["sh", "-c", "echo start $HOSTNAME; sleep 5; echo never"]
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: phase(core, namespace, "talk") == "Failed", what="Failed")
    # the container ended (exit code 2) before its second echo was due: it never printed it
    assert core.read_namespaced_pod_log("talk", namespace) == "start talk\n"
    node = core.read_node(core.read_namespaced_pod("talk", namespace).spec.node_name)
    assert node.status.addresses[0].address == "127.0.0.1" and node.status.daemon_endpoints.kubelet_endpoint.port


def test_what_a_simulated_container_prints_follows_its_command():
    def printed(command: list[str], env: dict[str, str] | None = None) -> list[tuple[float, str, str]]:
        container = {"name": "c", "command": command, "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
        return [(line.at, line.stream, line.text) for line in program_output(container, "pod-1")]

    assert printed(["echo", "a", "$(WHO)", "$$(WHO)"], {"WHO": "me"}) == [(0, STDOUT, "a me $(WHO)\n")]
    script = "X=1; echo \"$X $HOSTNAME\" '$X'; sleep 2; echo err >&2; echo gone >/dev/null; exit 3; echo no"
    assert printed(["/bin/sh", "-ec", script]) == [(0, STDOUT, "1 pod-1 $X\n"), (2, STDERR, "err\n")]
    code = "import sys, time\nprint('a', 1, sep='-')\ntime.sleep(1.5)\nprint('b', file=sys.stderr, end='')"
    assert printed(["python3", "-u", "-c", code]) == [(0, STDOUT, "a-1\n"), (1.5, STDERR, "b")]
    # what cannot be told without running it prints nothing (from that point on)
    assert printed(["python", "train.py"]) == []
    assert printed(["sh", "-c", "echo before; for i in 1 2; do echo $i; done"]) == [(0, STDOUT, "before\n")]
    assert printed(["sh", "-c", "echo $(date)"]) == []
    assert printed([]) == []  # the image's own entrypoint: unknown


def test_a_containers_field_ref_variables_and_host_name_are_the_pods_own():
    """The downward API as the kubelet resolves it: an Indexed Job's rank from its annotation."""
    index = "batch.kubernetes.io/job-completion-index"
    pod = {
        "metadata": {"name": "gang-1-x7k2p", "namespace": "ns", "annotations": {index: "1"}, "labels": {"a": "b"}},
        "spec": {"hostname": "gang-1", "subdomain": "gang", "nodeName": "n2"},
    }
    container = {
        "name": "c",
        "command": ["sh", "-c", "echo $RANK $LABEL $NODE $HOSTNAME $MISSING."],
        "env": [
            {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{index}']"}}},
            {"name": "LABEL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['a']"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "MISSING", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['none']"}}},
        ],
    }
    assert [line.text for line in program_output(container, "gang-1-x7k2p", pod)] == ["1 b n2 gang-1 .\n"]
    # Without the Pod, only literal values are known, and HOSTNAME is the Pod's name.
    assert "RANK" not in container_env(container, "gang-1-x7k2p")
    alone = {**container, "command": ["sh", "-c", "echo $HOSTNAME"]}
    assert [line.text for line in program_output(alone, "gang-1-x7k2p")] == ["gang-1-x7k2p\n"]


def test_a_pod_too_big_for_any_node_stays_pending_with_the_schedulers_message(core, namespace, simulate):
    simulate(T4, A100_MIXED)
    core.create_namespaced_pod(namespace, gpu_pod("huge", {"nvidia.com/gpu": "17"}))

    def scheduled_condition():
        conditions = core.read_namespaced_pod("huge", namespace).status.conditions or []
        return next((c for c in conditions if c.type == "PodScheduled"), None)

    condition = wait_for(scheduled_condition, what="PodScheduled condition")
    assert (condition.status, condition.reason) == ("False", "Unschedulable")
    assert condition.message == (
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. "
        "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
    )
    events = wait_for(
        lambda: core.list_namespaced_event(namespace, field_selector="involvedObject.name=huge").items,
        what="FailedScheduling event",
    )
    assert [(e.reason, e.type) for e in events] == [("FailedScheduling", "Warning")]
    assert events[0].message == condition.message
    time.sleep(0.3)  # a window for a wrong binding, not a wait: the pod must stay Pending
    assert phase(core, namespace, "huge") == "Pending"
    assert core.read_namespaced_pod("huge", namespace).spec.node_name is None


def test_pods_fill_time_sliced_replicas_and_the_next_one_waits_until_one_ends(core, namespace, simulate):
    one = GpuPool("t4one", product="Tesla-T4", gpus_per_node=1, replicas=2)
    simulate(one)
    for name in ("a", "b"):
        core.create_namespaced_pod(namespace, gpu_pod(name, {"nvidia.com/gpu": "1"}, annotations={ANN_DURATION: "1"}))
    wait_for(lambda: all(phase(core, namespace, n) == "Running" for n in "ab"), what="two replicas running")
    core.create_namespaced_pod(namespace, gpu_pod("c", {"nvidia.com/gpu": "1"}))

    def reason():
        pod = core.read_namespaced_pod("c", namespace)
        return pod.spec.node_name is None and next((c.message for c in pod.status.conditions or []), None)

    message = wait_for(reason, what="c to be unschedulable")
    assert message.startswith("0/1 nodes are available: 1 Insufficient nvidia.com/gpu. ")
    assert message.endswith("1 No preemption victims found for incoming pod.")
    wait_for(lambda: phase(core, namespace, "c") == "Running", timeout=10, what="c to run once a replica is free")


def test_node_selector_and_taints_are_honoured(core, namespace, simulate):
    tainted = GpuPool(
        "h100",
        product="NVIDIA-H100-80GB-HBM3",
        gpus_per_node=8,
        taints=({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},),
    )
    simulate(T4, tainted)
    h100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    core.create_namespaced_pod(namespace, gpu_pod("intolerant", {"nvidia.com/gpu": "1"}, node_selector=h100))
    tolerant = gpu_pod("tolerant", {"nvidia.com/gpu": "1"}, node_selector=h100)
    tolerant["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    core.create_namespaced_pod(namespace, tolerant)

    wait_for(lambda: core.read_namespaced_pod("tolerant", namespace).spec.node_name == "h100-0", what="binding")

    def message():
        conditions = core.read_namespaced_pod("intolerant", namespace).status.conditions or []
        return next((c.message for c in conditions if c.type == "PodScheduled"), None)

    assert wait_for(message, what="intolerant unschedulable") == (
        "0/3 nodes are available: 1 node(s) had untolerated taint {nvidia.com/gpu: present}, "
        "2 node(s) didn't match Pod's node affinity/selector. "
        "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
    )


def test_an_oom_annotated_pod_ends_oomkilled_with_exit_code_137(core, namespace, simulate):
    simulate(T4)
    pod = gpu_pod("oom", {"nvidia.com/gpu": "1"}, annotations={ANN_OOM: "true", ANN_DURATION: "0.2"})
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: phase(core, namespace, "oom") == "Failed", what="Failed")
    terminated = core.read_namespaced_pod("oom", namespace).status.container_statuses[0].state.terminated
    assert (terminated.reason, terminated.exit_code) == ("OOMKilled", 137)


def test_the_pod_that_pushes_a_time_sliced_gpu_past_its_memory_is_oomkilled(core, namespace, simulate):
    simulate(GpuPool("t4mem", product="Tesla-T4", gpus_per_node=1, replicas=4))
    core.create_namespaced_pod(namespace, gpu_pod("first", {"nvidia.com/gpu": "1"}, env={"GPUSH_GPU_MEMORY_GB": 9}))
    wait_for(lambda: phase(core, namespace, "first") == "Running", what="first Running")
    core.create_namespaced_pod(namespace, gpu_pod("second", {"nvidia.com/gpu": "1"}, env={"GPUSH_GPU_MEMORY_GB": 9}))
    wait_for(lambda: phase(core, namespace, "second") == "Failed", what="second OOMKilled")
    terminated = core.read_namespaced_pod("second", namespace).status.container_statuses[0].state.terminated
    assert (terminated.reason, terminated.exit_code) == ("OOMKilled", 137)
    assert phase(core, namespace, "first") == "Running"
    # 9 GB + 5 GB fit the T4's 15 GB
    core.create_namespaced_pod(namespace, gpu_pod("third", {"nvidia.com/gpu": "1"}, env={"GPUSH_GPU_MEMORY_GB": 5}))
    wait_for(lambda: phase(core, namespace, "third") == "Running", what="third Running")
    time.sleep(0.5)  # past Timings.oom_after (0.3 s): a wrong OOM kill of the fitting pod would show
    assert phase(core, namespace, "third") == "Running"


# ---------------------------------------------------------------- controllers


def job(name: str, *, annotations: dict, backoff_limit: int = 6, completions: int | None = None) -> dict:
    spec = {
        "backoffLimit": backoff_limit,
        "template": {
            "metadata": {"annotations": annotations, "labels": {"app": name}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "cuda:12", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            },
        },
    }
    if completions:
        spec["completions"] = completions
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": spec}


def test_a_job_runs_its_completions_and_completes(api, core, namespace, simulate):
    simulate(T4)
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, job("train", annotations={ANN_DURATION: "0.3"}, completions=2))

    def complete():
        status = batch.read_namespaced_job("train", namespace).status
        return status if any(c.type == "Complete" and c.status == "True" for c in status.conditions or []) else None

    status = wait_for(complete, what="Job Complete")
    assert status.succeeded == 2 and not status.failed and not status.active
    assert status.start_time and status.completion_time
    pods = core.list_namespaced_pod(namespace, label_selector="batch.kubernetes.io/job-name=train").items
    assert len(pods) == 2
    uid = batch.read_namespaced_job("train", namespace).metadata.uid
    for pod in pods:
        assert pod.metadata.owner_references[0].kind == "Job"
        assert pod.metadata.owner_references[0].uid == uid
        assert pod.metadata.labels["batch.kubernetes.io/controller-uid"] == uid
        assert pod.status.phase == "Succeeded"


def test_a_failing_job_is_retried_then_fails_with_backoff_limit_exceeded(api, core, namespace, simulate):
    simulate(T4)
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(
        namespace, job("flaky", annotations={ANN_DURATION: "0.1", ANN_EXIT_CODE: "3"}, backoff_limit=2)
    )

    def failed():
        status = batch.read_namespaced_job("flaky", namespace).status
        return next((c for c in status.conditions or [] if c.type == "Failed" and c.status == "True"), None)

    condition = wait_for(failed, timeout=15, what="Job Failed")
    assert condition.reason == "BackoffLimitExceeded"
    assert condition.message == "Job has reached the specified backoff limit"
    status = batch.read_namespaced_job("flaky", namespace).status
    assert status.failed == 3 and not status.succeeded and not status.active
    pods = core.list_namespaced_pod(namespace, label_selector="job-name=flaky").items
    assert len(pods) == 3
    assert {p.status.container_statuses[0].state.terminated.exit_code for p in pods} == {3}


def test_deleting_a_job_garbage_collects_its_pods(api, core, namespace, simulate):
    simulate(T4)
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, job("long", annotations={}))
    wait_for(lambda: core.list_namespaced_pod(namespace).items, what="a pod")
    batch.delete_namespaced_job("long", namespace, propagation_policy="Background")
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, what="pods gone")


def test_a_job_deleted_with_orphan_propagation_leaves_its_pods_running(api, core, namespace, simulate):
    sim = simulate(T4)
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, job("orphaned", annotations={}, completions=3))
    job_spec = batch.read_namespaced_job("orphaned", namespace)
    batch.patch_namespaced_job("orphaned", namespace, {"spec": {"parallelism": 3}})
    wait_for(
        lambda: len([p for p in core.list_namespaced_pod(namespace).items if p.status.phase == "Running"]) == 3,
        what="3 running pods",
    )
    batch.delete_namespaced_job("orphaned", namespace, propagation_policy="Orphan")
    wait_for(lambda: not sim.c.jobs.get(f"{namespace}/orphaned"), what="the Job gone from the cache")
    time.sleep(0.5)  # a window for a garbage collector that wrongly deletes orphans, not a wait
    pods = core.list_namespaced_pod(namespace).items
    assert len(pods) == 3 and {p.status.phase for p in pods} == {"Running"}
    assert all(not p.metadata.owner_references for p in pods)
    assert all(p.metadata.labels["batch.kubernetes.io/controller-uid"] == job_spec.metadata.uid for p in pods)


def test_a_deployment_scales_from_1_to_3_to_1(api, core, namespace, simulate):
    sim = simulate(T4)
    apps = client.AppsV1Api(api)
    apps.create_namespaced_deployment(
        namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "infer"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "infer"}},
                "template": {
                    "metadata": {"labels": {"app": "infer"}},
                    "spec": {
                        "containers": [
                            {"name": "main", "image": "vllm:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                        ]
                    },
                },
            },
        },
    )

    def ready(n):
        def check():
            status = apps.read_namespaced_deployment("infer", namespace).status
            pods = [p for p in core.list_namespaced_pod(namespace).items if not p.metadata.deletion_timestamp]
            return (status.ready_replicas or 0) == n and (status.available_replicas or 0) == n and len(pods) == n

        return check

    wait_for(ready(1), what="1 ready replica")
    apps.patch_namespaced_deployment_scale("infer", namespace, {"spec": {"replicas": 3}})
    wait_for(ready(3), what="3 ready replicas")
    pods = core.list_namespaced_pod(namespace, label_selector="app=infer").items
    assert {p.status.phase for p in pods} == {"Running"}
    assert all(p.metadata.owner_references[0].kind == "Deployment" for p in pods)
    assert len({p.metadata.labels["pod-template-hash"] for p in pods}) == 1
    apps.patch_namespaced_deployment_scale("infer", namespace, {"spec": {"replicas": 1}})
    wait_for(ready(1), what="back to 1 replica")
    status = apps.read_namespaced_deployment("infer", namespace).status
    available = next(c for c in status.conditions if c.type == "Available")
    assert (available.status, available.reason) == ("True", "MinimumReplicasAvailable")
    assert sim.server_gaps == set()


def test_the_simulator_survives_an_api_server_restart(server, core, namespace, simulate):
    sim = simulate(T4)
    server.restart()  # the change history is gone: watches resume with 410 and re-list
    core.create_namespaced_pod(namespace, gpu_pod("after", {"nvidia.com/gpu": "1"}))
    wait_for(lambda: phase(core, namespace, "after") == "Running", timeout=15, what="Running after restart")
    assert sim.c.pods.relists >= 2


# ---------------------------------------------------------------- pure parts, no server


def test_requests_count_limits_and_init_containers_as_the_scheduler_does():
    spec = {
        "containers": [
            {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "1"}, "requests": {"cpu": "500m"}}},
            {"name": "b", "resources": {"requests": {"memory": "1Gi"}}},
        ],
        "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "2"}}}],
    }
    assert pod_requests(spec) == {"nvidia.com/gpu": 2, "cpu": 2000, "memory": 1024**3}


def test_sharing_config_round_trips_the_gpu_operator_format():
    text = """version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
    parsed = SharingConfig.parse(text)
    assert parsed == SharingConfig("time-slicing", {"nvidia.com/gpu": 4}, fail_requests_greater_than_one=True)
    assert SharingConfig.parse(parsed.render()) == parsed
    with pytest.raises(ValueError, match="replicas"):
        SharingConfig.parse("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n")


def test_single_strategy_renames_and_mixed_partial_mig_keeps_whole_gpus():
    single = GpuPool("s", gpus_per_node=2, mig_strategy="single", mig_layout=("1g.5gb",) * 7)
    devices = node_devices(single)
    assert devices.resources == {"nvidia.com/gpu": 14}
    assert devices.labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert devices.labels["nvidia.com/gpu.count"] == "14"
    assert devices.labels["nvidia.com/mig.config"] == "all-1g.5gb"

    partial = GpuPool("p", gpus_per_node=4, mig_strategy="mixed", mig_layout=(("7g.40gb",), (), (), ()))
    devices = node_devices(partial, SharingConfig("time-slicing", {"nvidia.com/gpu": 2}))
    assert devices.resources == {"nvidia.com/gpu": 6, "nvidia.com/mig-7g.40gb": 1}
    assert devices.labels["nvidia.com/gpu.count"] == "3"  # GFD: whole GPUs' labels win over MIG-enabled ones
    assert devices.labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-SHARED"

    with pytest.raises(ValueError, match="more than 7 compute slices"):
        GpuPool("x", gpus_per_node=1, mig_strategy="mixed", mig_layout=("4g.20gb", "4g.20gb"))
    with pytest.raises(ValueError, match="not MIG-capable"):
        GpuPool("y", product="Tesla-T4", gpus_per_node=1, mig_strategy="mixed", mig_layout=("1g.5gb",))


def test_timings_are_divided_by_speed():
    assert Timings().scaled(4).pod_start == pytest.approx(0.05)
