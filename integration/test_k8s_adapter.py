"""The Kubernetes adapter against the project's Kubernetes API test server and GPU node simulator.

Each test gets its own API server (integration/k8s/apiserver.py) and simulator
(integration/k8s/simulator.py) with three node pools: time-sliced T4s (2 GPUs x 4
replicas a node), an A100 split into two 3g.20gb MIG slices (mixed strategy), and
whole H100s. The adapter reaches them only through a kubeconfig, as it would a real
cluster. How long a simulated job runs is a Pod annotation the simulator reads
(``sim.gpush.io/duration``, ``exit-code``); the tests set it from the job's labels
``sim-duration`` / ``sim-exit`` (as gpush's own simulated fleet reads them) through a
wrapper of the adapter's renderer, so the production renderer stays free of them. What a
simulated job prints follows from its command (``echo``, ``sh -c 'echo ...; sleep 1'``:
integration/k8s/container_output.py), and the API server reads it from the simulator's
kubelet endpoint, as a real one reads a kubelet's.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

import adapters.k8s.jobs as k8s_jobs
import adapters.k8s.logs as k8s_logs
from adapters.k8s import KubernetesAdapter
from adapters.k8s.states import OOM_REASON
from broker.core.adapter import BackendJob, BackendState, Placement, Rejected, Sharing, Unreachable
from broker.core.schemas import JobSpec
from integration.k8s import apiserver, simulator
from integration.k8s.gpu_nodes import CLUSTER_POLICY_CRD, GpuPool

T4 = GpuPool("t4", count=1, product="Tesla-T4", gpus_per_node=2, replicas=4, cpu="32", memory="128Gi")
A100 = GpuPool(
    "a100",
    count=1,
    product="NVIDIA-A100-SXM4-40GB",
    gpus_per_node=1,
    mig_strategy="mixed",
    mig_layout=("3g.20gb", "3g.20gb"),
)
H100 = GpuPool("h100", count=1, product="NVIDIA-H100-80GB-HBM3", gpus_per_node=2)
NAMESPACE = "gpush-it"
TAG = "gtest"
FINAL = (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.CANCELLED, BackendState.LOST)


def wait_for(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last value: {value!r}")


@pytest.fixture(autouse=True)
def simulated_durations(monkeypatch):
    """Job labels sim-duration / sim-exit become the simulator's Pod annotations."""
    real = k8s_jobs.render

    def render(job_id, spec, placement, options, **kw):
        manifest = real(job_id, spec, placement, options, **kw)
        annotations = manifest.body["spec"]["template"]["metadata"]["annotations"]
        if "sim-duration" in spec.labels:
            annotations[simulator.ANN_DURATION] = spec.labels["sim-duration"]
        if "sim-exit" in spec.labels:
            annotations[simulator.ANN_EXIT_CODE] = spec.labels["sim-exit"]
        return manifest

    monkeypatch.setattr(k8s_jobs, "render", render)


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


def simulated_nodes(api) -> Iterator[Any]:
    """The node simulator with the T4, A100 and H100 pools, once it manages every node
    (a fixture's body; the test modules of the Kubernetes side share it)."""
    sim = simulator.Simulator(api, [T4, A100, H100]).start()
    sim.create_nodes()
    names = [n for p in (T4, A100, H100) for n in p.node_names()]
    wait_for(lambda: set(names) <= sim.c.managed, what="simulated nodes")
    yield sim
    sim.stop()


@pytest.fixture
def cluster(api) -> Iterator[Any]:
    yield from simulated_nodes(api)


def make_adapter(kubeconfig: str, **config: Any) -> KubernetesAdapter:
    settings = {
        "kubeconfig": kubeconfig,
        "namespace": NAMESPACE,
        "create_namespace": True,
        "tag": TAG,
        "image": "python:3.11-slim",
        "watch_seconds": 0.5,
        **config,
    }
    return KubernetesAdapter("k8s-test", settings)


@pytest.fixture
def adapter(kubeconfig, cluster) -> Iterator[KubernetesAdapter]:
    made = make_adapter(kubeconfig)
    yield made
    made.close()  # its Node and Pod watches, before the server goes


def job_spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {"kind": "training", "command": ["python", "-c", "print('hi')"], "labels": {}}
    labels = {**base.pop("labels"), **fields.pop("labels", {})}
    return JobSpec.model_validate({**base, **fields, "labels": labels})


def placed(sharing: Sharing, **fields: Any) -> Placement:
    base: dict[str, Any] = {"cluster": "k8s-test", "sharing": sharing, "units": 1, "gpu_equivalents": 1.0}
    return Placement(**{**base, **fields})


class Follower:
    """Reads statuses as the scheduler does, keeping the cursor and each job's last state."""

    def __init__(self, adapter: KubernetesAdapter):
        self.adapter = adapter
        self.cursor: str | None = None
        self.last: dict[int, BackendJob] = {}
        self.seen: dict[int, list[BackendState]] = {}

    def read(self) -> list[BackendJob]:
        page = self.adapter.statuses(self.cursor)
        self.cursor = page.cursor
        for job in page.jobs:
            self.last[job.job_id] = job
            self.seen.setdefault(job.job_id, []).append(job.state)
        return page.jobs

    def until(self, job_id: int, *states: BackendState, timeout: float = 15.0) -> BackendJob:
        def reached() -> BackendJob | None:
            self.read()
            job = self.last.get(job_id)
            return job if job is not None and job.state in states else None

        return wait_for(reached, timeout, f"job {job_id} in {[s.value for s in states]}")


# -- the cluster ---------------------------------------------------------------------------


def test_health_and_an_inventory_of_physical_gpus(adapter):
    health = adapter.health()
    assert health.ok and health.version.startswith("v1.")
    units = adapter.inventory()
    by_node: dict[str, list] = {}
    for unit in units:
        by_node.setdefault(unit.node, []).append(unit)
    t4 = by_node["t4-0"]
    # 8 nvidia.com/gpu on 2 GPUs: 2 physical GPUs of 4 replicas, 2 GPU-equivalents
    assert [(u.sharing, u.gpus, u.capacity, u.gpu_equivalent) for u in t4] == [
        (Sharing.K8S_TIMESLICE, (0,), 4, 0.25),
        (Sharing.K8S_TIMESLICE, (1,), 4, 0.25),
    ]
    assert all(u.gpu_model == "T4" and "drift" not in u.labels for u in t4)
    (mig,) = by_node["a100-0"]
    assert (mig.sharing, mig.mig_profile, mig.capacity, mig.gpu_model) == (
        Sharing.K8S_MIG,
        "3g.20gb",
        2,
        "A100-SXM4-40GB",
    )
    assert mig.gpu_equivalent == pytest.approx(3 / 7)
    (whole,) = by_node["h100-0"]
    assert (whole.sharing, whole.capacity, whole.gpu_model) == (Sharing.K8S_EXCLUSIVE, 2, "H100-SXM5-80GB")


def test_the_inventory_follows_the_cluster_by_watch_and_survives_a_restart(adapter, server, api):
    """Nodes and Pods come from watch-fed caches: after the first listing, a new Pod's
    GPU and a cordoned node show up without another list, also after the API server
    restarted (its old resourceVersions answer 410 and the cache lists again)."""

    def t4_allocated() -> int:
        return sum(u.allocated for u in adapter.inventory() if u.node == "t4-0")

    assert t4_allocated() == 0
    listed: list[str] = []
    real_list = adapter.client.list
    adapter.client.list = lambda kind, *a, **kw: listed.append(kind) or real_list(kind, *a, **kw)
    adapter.submit(20, job_spec(labels={"sim-duration": "30"}), placed(Sharing.K8S_TIMESLICE, gpu_model="T4"))
    wait_for(lambda: t4_allocated() == 1, what="the new Pod's replica counted")
    assert "pods" not in listed and "nodes" not in listed  # the watch brought it
    client.CoreV1Api(api).patch_node("h100-0", {"spec": {"unschedulable": True}})
    wait_for(
        lambda: any(u.node == "h100-0" and u.labels.get("unavailable") for u in adapter.inventory()),
        what="the cordoned node seen",
    )
    server.restart()
    adapter.cancel(20)
    wait_for(lambda: t4_allocated() == 0, timeout=20, what="the cancelled Pod's replica freed after the restart")


# -- jobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sharing", "fields", "node"),
    [
        (Sharing.K8S_TIMESLICE, {"gpu_model": "T4", "gpu_memory_gb": 4}, "t4-0"),
        (Sharing.K8S_MIG, {"mig_profile": "3g.20gb", "gpu_model": "A100-SXM4-40GB"}, "a100-0"),
        (Sharing.K8S_EXCLUSIVE, {"gpu_model": "H100-SXM5-80GB", "units": 2}, "h100-0"),
    ],
)
def test_each_sharing_mode_runs_a_job_to_completion(adapter, sharing, fields, node):
    isolation = {"k8s/timeslice": "none", "k8s/mig": "hardware", "k8s/exclusive": "exclusive"}[sharing.value]
    memory = {"gpu_memory_gb": 4} if isolation == "none" else {"gpu_memory_gb": 20} if isolation == "hardware" else {}
    spec = job_spec(isolation=isolation, labels={"sim-duration": "1"}, **memory)
    backend_id = adapter.submit(1, spec, placed(sharing, **fields))
    assert backend_id == f"job/{TAG}-1"
    follow = Follower(adapter)
    running = follow.until(1, BackendState.RUNNING, BackendState.SUCCEEDED)
    done = follow.until(1, BackendState.SUCCEEDED)
    assert (done.exit_code, done.node) == (0, node)
    assert running.node == node


def test_a_failing_job_says_its_exit_code(adapter):
    adapter.submit(2, job_spec(labels={"sim-duration": "0.3", "sim-exit": "3"}), placed(Sharing.K8S_EXCLUSIVE))
    failed = Follower(adapter).until(2, BackendState.FAILED)
    assert (failed.exit_code, failed.reason) == (3, "exited with code 3")


def test_a_time_sliced_pod_over_the_gpu_memory_ends_oomkilled_and_gpush_says_why(adapter):
    # Each T4 has 15 GB here; the broker would never put 9 + 9 GB on one, so this bypasses it.
    spec = job_spec(kind="inference", isolation="none", gpu_memory_gb=9, labels={"sim-duration": "30"})
    where = placed(Sharing.K8S_TIMESLICE, gpu_model="T4", gpu_memory_gb=9, node="t4-0")
    narrow = make_adapter(adapter.settings.kubeconfig, node_selector="sim.gpush.io/pool=t4")
    follow = Follower(narrow)
    narrow.submit(3, spec, where)
    follow.until(3, BackendState.RUNNING)
    # The device plugin spreads replicas over the two GPUs: a second 9 GB job gets the
    # other GPU; a third, started after it, shares a GPU and pushes it past its memory.
    # (Submitted together, the second and third would race to start: either could lose.)
    narrow.submit(4, spec, where)
    follow.until(4, BackendState.RUNNING)
    narrow.submit(5, spec, where)

    def oom_killed() -> list[BackendJob]:
        follow.read()
        return [j for j in follow.last.values() if j.state == BackendState.FAILED]

    (oom,) = wait_for(oom_killed, what="an OOM kill")
    assert (oom.job_id, oom.reason, oom.exit_code) == (5, OOM_REASON, 137)
    assert (follow.last[3].state, follow.last[4].state) == (BackendState.RUNNING, BackendState.RUNNING)


def test_a_job_too_big_for_any_node_waits_with_the_schedulers_reason(adapter):
    adapter.submit(6, job_spec(labels={"sim-duration": "1"}), placed(Sharing.K8S_EXCLUSIVE, units=4))
    follow = Follower(adapter)

    def unschedulable() -> BackendJob | None:
        follow.read()
        job = follow.last.get(6)
        return job if job and job.reason and job.reason.startswith("Unschedulable") else None

    job = wait_for(unschedulable, what="the scheduler's reason")
    assert (job.state, job.reason) == (BackendState.PENDING, "Unschedulable: Insufficient nvidia.com/gpu")
    mig = job_spec(isolation="hardware", gpu_memory_gb=20)
    adapter.submit(7, mig, placed(Sharing.K8S_MIG, mig_profile="3g.20gb", units=3))
    job = follow.until(7, BackendState.PENDING)
    wait_for(lambda: (follow.read(), follow.last[7].reason or "")[1].startswith("Unschedulable"), what="reason")
    assert follow.last[7].reason == "Unschedulable: Insufficient nvidia.com/mig-3g.20gb"


def test_a_deployment_scales_up_and_down(adapter, api):
    spec = job_spec(
        kind="inference",
        isolation="none",
        gpu_memory_gb=2,
        elastic={"min_replicas": 1, "max_replicas": 4},
        command=["python", "-m", "http.server"],
    )
    assert adapter.submit(8, spec, placed(Sharing.K8S_TIMESLICE, gpu_model="T4", replicas=1)) == f"deployment/{TAG}-8"
    follow = Follower(adapter)
    follow.until(8, BackendState.RUNNING)
    core = client.CoreV1Api(api)

    def pods(n: int) -> Callable[[], bool]:
        def check() -> bool:
            items = core.list_namespaced_pod(NAMESPACE, label_selector="gpush.io/job-id=8").items
            running = [p for p in items if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
            return len(items) == n and len(running) == n

        return check

    wait_for(pods(1), what="1 replica")
    assert adapter.scale(8, 3) == 3
    wait_for(pods(3), what="3 replicas")
    assert adapter.scale(8, 1) == 1
    wait_for(pods(1), what="back to 1 replica")
    adapter.submit(9, job_spec(labels={"sim-duration": "5"}), placed(Sharing.K8S_EXCLUSIVE))
    with pytest.raises(Rejected, match="does not scale"):
        adapter.scale(9, 2)
    with pytest.raises(Rejected, match="no Deployment"):
        adapter.scale(404, 2)


def test_cancel_deletes_the_objects(adapter, api):
    adapter.submit(10, job_spec(labels={"sim-duration": "60"}), placed(Sharing.K8S_EXCLUSIVE))
    follow = Follower(adapter)
    follow.until(10, BackendState.RUNNING)
    adapter.cancel(10)
    cancelled = follow.until(10, BackendState.CANCELLED)
    assert cancelled.reason == "cancelled by gpush"
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    assert batch.list_namespaced_job(NAMESPACE, label_selector="gpush.io/job-id=10").items == []
    wait_for(
        lambda: core.list_namespaced_pod(NAMESPACE, label_selector="gpush.io/job-id=10").items == [],
        what="the job's Pods deleted",
    )
    assert adapter.find(10) is None
    adapter.cancel(10)  # nothing there: no error


def test_a_broker_killed_between_create_and_its_write_finds_the_job_by_label(adapter, kubeconfig, api):
    spec = job_spec(labels={"sim-duration": "30"}, tenant="vision", user="alice@example.com")
    backend_id = adapter.submit(11, spec, placed(Sharing.K8S_EXCLUSIVE))
    restarted = make_adapter(kubeconfig)  # a new process: nothing in memory
    found = wait_for(lambda: restarted.find(11), what="find by label")
    assert found.backend_id == backend_id
    # The first find may come before its Pod starts; found again, the job runs (for 30 s).
    running = wait_for(
        lambda: (job := restarted.find(11)) is not None and job.state == BackendState.RUNNING and job,
        what="the found job running",
    )
    assert running.backend_id == backend_id
    assert restarted.submit(11, spec, placed(Sharing.K8S_EXCLUSIVE)) == backend_id  # not created twice
    jobs = client.BatchV1Api(api).list_namespaced_job(NAMESPACE, label_selector="gpush.io/job-id=11").items
    assert len(jobs) == 1
    assert jobs[0].metadata.labels["gpush.io/user"] == "alice_example.com"
    assert jobs[0].metadata.annotations["gpush.io/user"] == "alice@example.com"
    # An object of that name that is not this job's is never taken for it.
    client.BatchV1Api(api).create_namespaced_job(
        NAMESPACE,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{TAG}-12"},
            "spec": {
                "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "x", "image": "busybox"}]}}
            },
        },
    )
    with pytest.raises(Rejected, match="is not gpush job 12"):
        restarted.submit(12, spec, placed(Sharing.K8S_EXCLUSIVE))
    assert restarted.find(12) is None


def test_a_job_deleted_by_someone_else_before_it_started_is_lost(adapter, api):
    adapter.submit(13, job_spec(), placed(Sharing.K8S_EXCLUSIVE, units=4))  # too big: stays pending
    follow = Follower(adapter)
    follow.until(13, BackendState.PENDING)
    client.BatchV1Api(api).delete_namespaced_job(f"{TAG}-13", NAMESPACE, propagation_policy="Background")
    lost = follow.until(13, BackendState.LOST)
    assert "not by gpush" in lost.reason


def test_the_watch_survives_a_restart_of_the_api_server(adapter, server):
    follow = Follower(adapter)
    adapter.submit(14, job_spec(labels={"sim-duration": "0.5"}), placed(Sharing.K8S_EXCLUSIVE))
    follow.until(14, BackendState.RUNNING, BackendState.SUCCEEDED)
    server.restart()  # the change history is gone: the old resourceVersions answer 410
    adapter.submit(15, job_spec(labels={"sim-duration": "0.5"}), placed(Sharing.K8S_EXCLUSIVE))
    assert follow.until(15, BackendState.SUCCEEDED, timeout=20).exit_code == 0
    assert follow.last[14].state == BackendState.SUCCEEDED


def test_submit_many_creates_a_batch(adapter):
    items = [
        (100 + i, job_spec(labels={"sim-duration": "0.3"}), placed(Sharing.K8S_TIMESLICE, gpu_model="T4"))
        for i in range(6)
    ]
    items = [(i, s.model_copy(update={"isolation": "none", "gpu_memory_gb": 1}), p) for i, s, p in items]
    ids = adapter.submit_many(items)
    assert ids == [f"job/{TAG}-{100 + i}" for i in range(6)]
    follow = Follower(adapter)
    for i in range(6):
        follow.until(100 + i, BackendState.SUCCEEDED)


# -- time-slicing configuration --------------------------------------------------------------


def _install_gpu_operator_api(api) -> None:
    client.ApiextensionsV1Api(api).create_custom_resource_definition(CLUSTER_POLICY_CRD)
    client.CoreV1Api(api).create_namespace(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpu-operator"}}
    )
    client.CustomObjectsApi(api).create_cluster_custom_object(
        "nvidia.com",
        "v1",
        "clusterpolicies",
        {"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": "cluster-policy"}, "spec": {}},
    )


def test_timeslice_apply_changes_what_the_nodes_advertise(adapter, api):
    _install_gpu_operator_api(api)
    plan = adapter.timeslice(8, node_label="sim.gpush.io/pool=t4")
    done = adapter.apply_timeslice(plan)
    assert any("ConfigMap gpu-operator/time-slicing-config" in line for line in done)
    assert any(line.startswith("labelled node t4-0") for line in done)

    def t4_units():
        # GFD's labels and the device plugin's allocatable change in two writes: in between the
        # node says 8 replicas per GPU while it still advertises the old 2 x 4 (a drift finding).
        units = [u for u in adapter.inventory() if u.node == "t4-0"]
        settled = units and all(u.capacity == 8 and "drift" not in u.labels for u in units)
        return units if settled else None

    units = wait_for(t4_units, what="t4-0 advertising 8 replicas per GPU")
    assert [u.gpus for u in units] == [(0,), (1,)]  # still 2 physical GPUs
    assert all(u.gpu_equivalent == 1 / 8 and "drift" not in u.labels for u in units)
    # The H100s keep whole GPUs: the plan only labelled the T4 pool.
    assert {u.sharing for u in adapter.inventory() if u.node == "h100-0"} == {Sharing.K8S_EXCLUSIVE}
    state = adapter.timeslice_state()
    assert state is not None and state.replicas_for({"nvidia.com/device-plugin.config": plan.key})[0] == 8
    again = adapter.apply_timeslice(plan)
    assert any("already has key" in line for line in again)


# -- output (gpush logs) -----------------------------------------------------------------------


def finished(adapter: KubernetesAdapter, job_id: int, command: str, **fields: Any) -> str:
    """Submit a job that prints by ``command`` and wait until it succeeded; its backend id."""
    labels = {"sim-duration": "0.3", **fields.pop("labels", {})}
    placement = fields.pop("placement", placed(Sharing.K8S_EXCLUSIVE))
    backend_id = adapter.submit(job_id, job_spec(command=command, labels=labels, **fields), placement)
    Follower(adapter).until(job_id, BackendState.SUCCEEDED)
    return backend_id


def job_pods(api, job_id: int) -> list[Any]:
    return client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=f"gpush.io/job-id={job_id}").items


def created_pods(api, job_name: str) -> list[str]:
    """The Pods a Job's controller said it created (its SuccessfulCreate events)."""
    events = client.CoreV1Api(api).list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={job_name}")
    return [e.message.removeprefix("Created pod: ") for e in events.items if e.reason == "SuccessfulCreate"]


def test_logs_of_a_finished_job_are_what_its_command_printed(adapter, api):
    backend_id = finished(adapter, 30, "echo hello from $HOSTNAME; echo job $GPUSH_JOB_ID; echo oops >&2")
    (pod,) = job_pods(api, 30)
    name = pod.metadata.name
    out = adapter.logs(30, backend_id)
    assert out.readable and out.note is None
    assert out.location == f"pod {name} (namespace {NAMESPACE})"
    assert out.text == f"hello from {name}\njob 30\noops\n"
    assert out.next_offset == len(out.text)
    # stderr is the same log on Kubernetes, and the answer says so
    err = adapter.logs(30, backend_id, stream="stderr")
    assert err.text == out.text and "stdout and stderr as one log" in err.note
    # nothing new after the end: the next read continues there and brings nothing
    again = adapter.logs(30, backend_id, offset=out.next_offset)
    assert (again.text, again.next_offset) == ("", out.next_offset)


def test_logs_tail_and_offsets_continue_where_the_last_read_ended(adapter, monkeypatch):
    lines = ["line 1", "zweite Zeile: grün", "ligne trois: été", "第四行", "line 5"]
    script = "; ".join(f"echo '{line}'" for line in lines)
    backend_id = finished(adapter, 31, script)
    whole = "".join(f"{line}\n" for line in lines)
    tail = adapter.logs(31, backend_id, tail=2)
    assert tail.text == "第四行\nline 5\n"
    assert tail.next_offset == len(whole)  # gpush logs -f --tail 2 goes on from the end
    assert adapter.logs(31, backend_id, tail=0).text == ""
    # Small chunks: every read returns at most MAX_LOG_CHUNK characters from its offset; the
    # byte limit the adapter asks for cuts multi-byte characters, which must come back whole.
    monkeypatch.setattr(k8s_logs, "MAX_LOG_CHUNK", 7)
    read, offset = [], 0
    while True:
        out = adapter.logs(31, backend_id, offset=offset)
        assert len(out.text) <= 7 and out.next_offset == offset + len(out.text)
        if not out.text:
            break
        read.append(out.text)
        offset = out.next_offset
    assert "".join(read) == whole and "\ufffd" not in "".join(read)


def test_logs_of_each_replica_come_from_its_own_pod(adapter, api):
    backend_id = finished(
        adapter, 32, "echo replica $HOSTNAME", placement=placed(Sharing.K8S_EXCLUSIVE, units=1, replicas=2)
    )
    pods = sorted(job_pods(api, 32), key=lambda p: (p.metadata.creation_timestamp, p.metadata.name))
    assert len(pods) == 2
    first, second = (adapter.logs(32, backend_id, replica=k) for k in (0, 1))
    assert first.text == f"replica {pods[0].metadata.name}\n"
    assert second.text == f"replica {pods[1].metadata.name}\n"
    assert adapter.logs(32, backend_id).location == first.location  # the first replica by default
    with pytest.raises(Rejected, match="replica 2 is not one of them; use 0 to 1"):
        adapter.logs(32, backend_id, replica=2)


def test_logs_follow_streams_a_running_pod_until_its_container_ends(adapter, api):
    """The raw endpoint, as `kubectl logs -f` reads it: lines arrive as the container prints them,
    and the answer ends when the container does."""
    adapter.submit(
        33,
        job_spec(command="echo first; sleep 1; echo second; sleep 1; echo third", labels={"sim-duration": "2.5"}),
        placed(Sharing.K8S_EXCLUSIVE),
    )
    Follower(adapter).until(33, BackendState.RUNNING)
    (pod,) = job_pods(api, 33)
    core = client.CoreV1Api(api)
    answer = core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, follow=True, _preload_content=False)
    arrived: list[tuple[float, bytes]] = []
    try:
        for chunk in answer.stream(amt=64):
            arrived.append((time.monotonic(), chunk))
    finally:
        answer.release_conn()
    assert b"".join(c for _, c in arrived) == b"first\nsecond\nthird\n"
    first_at = next(t for t, c in arrived if b"first" in c)
    third_at = next(t for t, c in arrived if b"third" in c)
    assert third_at - first_at > 1.0  # streamed as printed, not sent at the end
    wait_for(lambda: core.read_namespaced_pod(pod.metadata.name, NAMESPACE).status.phase == "Succeeded")
    assert adapter.logs(33, f"job/{TAG}-33").text == "first\nsecond\nthird\n"


def test_logs_endpoint_answers_as_a_real_api_server_does(adapter, api):
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod_log("no-such-pod", NAMESPACE)
    assert missing.value.status == 404
    status = json.loads(missing.value.body)
    assert (status["kind"], status["reason"], status["message"]) == (
        "Status",
        "NotFound",
        'pods "no-such-pod" not found',
    )
    assert status["details"] == {"name": "no-such-pod", "kind": "pods"}
    backend_id = finished(adapter, 34, "echo one; echo two; echo three")
    name = job_pods(api, 34)[0].metadata.name
    assert core.read_namespaced_pod_log(name, NAMESPACE, tail_lines=2) == "two\nthree\n"
    assert core.read_namespaced_pod_log(name, NAMESPACE, limit_bytes=5) == "one\nt"
    assert core.read_namespaced_pod_log(name, NAMESPACE, container="job", since_seconds=3600).startswith("one\n")
    stamped = core.read_namespaced_pod_log(name, NAMESPACE, timestamps=True).splitlines()
    assert [line.split(" ", 1)[1] for line in stamped] == ["one", "two", "three"]
    assert all(line[:30].endswith("Z") and line[19] == "." for line in stamped)
    for options, code, words in (
        ({"container": "other"}, 400, f"container other is not valid for pod {name}"),
        ({"tail_lines": -1}, 422, "tailLines: Invalid value: -1: must be greater than or equal to 0"),
        ({"previous": True}, 400, f'previous terminated container "job" in pod "{name}" not found'),
    ):
        with pytest.raises(ApiException) as refused:
            core.read_namespaced_pod_log(name, NAMESPACE, **options)
        assert refused.value.status == code and words in json.loads(refused.value.body)["message"]
    assert adapter.logs(34, backend_id).text == "one\ntwo\nthree\n"


def test_logs_of_a_restarted_container_keep_the_run_before(api, cluster):
    """``previous=true`` reads the run before a restart; the current run starts a new log."""
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": "logs-restart"}})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "again", "annotations": {simulator.ANN_DURATION: "0.2", simulator.ANN_EXIT_CODE: "1"}},
        "spec": {
            "restartPolicy": "Always",
            "containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", "echo run $HOSTNAME"]}],
        },
    }
    core.create_namespaced_pod("logs-restart", pod)

    def restarted() -> bool:
        statuses = core.read_namespaced_pod("again", "logs-restart").status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count >= 1

    wait_for(restarted, what="a container restart")
    assert core.read_namespaced_pod_log("again", "logs-restart", previous=True) == "run again\n"


def test_logs_before_the_container_starts_are_refused_as_not_started(adapter, api):
    # too big for any node: the Pod waits for one
    adapter.submit(35, job_spec(command="echo never"), placed(Sharing.K8S_EXCLUSIVE, units=4))
    wait_for(lambda: job_pods(api, 35), what="the job's pod")
    with pytest.raises(
        Rejected, match=r"job 35 has no output yet: pod \S+ \(namespace gpush-it\) is Pending, on no node"
    ):
        adapter.logs(35, f"job/{TAG}-35")
    # the raw endpoint: an unbound Pod has no log anywhere (204), as on a real server
    name = job_pods(api, 35)[0].metadata.name
    _, code, _ = client.CoreV1Api(api).read_namespaced_pod_log_with_http_info(name, NAMESPACE)
    assert code == 204


def test_logs_of_a_pod_bound_but_not_started_say_it_is_waiting_to_start(kubeconfig, api):
    slow = simulator.Simulator(api, [H100], timings=simulator.Timings(pod_start=30)).start()
    try:
        slow.create_nodes()
        wait_for(lambda: set(H100.node_names()) <= slow.c.managed, what="simulated nodes")
        made = make_adapter(kubeconfig)
        try:
            made.submit(36, job_spec(command="echo later"), placed(Sharing.K8S_EXCLUSIVE))
            pods = wait_for(lambda: [p for p in job_pods(api, 36) if p.spec.node_name], what="a bound pod")
            name = pods[0].metadata.name
            with pytest.raises(ApiException) as refused:
                client.CoreV1Api(api).read_namespaced_pod_log(name, NAMESPACE)
            assert refused.value.status == 400
            status = json.loads(refused.value.body)
            assert status["reason"] == "BadRequest"
            assert status["message"] == f'container "job" in pod "{name}" is waiting to start: ContainerCreating'
            with pytest.raises(Rejected, match="job 36 has no output yet: .* is waiting to start: ContainerCreating"):
                made.logs(36, f"job/{TAG}-36")
        finally:
            made.close()
    finally:
        slow.stop()


def test_logs_of_a_cancelled_job_say_its_pod_took_them_along(adapter, api):
    adapter.submit(37, job_spec(command="echo brief", labels={"sim-duration": "60"}), placed(Sharing.K8S_EXCLUSIVE))
    Follower(adapter).until(37, BackendState.RUNNING)
    (pod,) = job_pods(api, 37)
    assert adapter.logs(37, f"job/{TAG}-37").text == "brief\n"
    adapter.cancel(37)
    wait_for(lambda: job_pods(api, 37) == [], what="the job's pods deleted")
    gone = adapter.logs(37, f"job/{TAG}-37")
    assert not gone.readable and gone.text == ""
    # Named by the Job's events: the pod seen running, or the replacement its controller made when
    # the pod went before the Job's deletion reached the controller (a race real clusters have too).
    named = re.fullmatch(rf"pod ({TAG}-37-\w+) \(namespace {NAMESPACE}\)", gone.location)
    assert named, gone.location
    created = created_pods(api, f"{TAG}-37")
    assert pod.metadata.name in created and named.group(1) in created
    assert "was deleted" in gone.note and "its log with it" in gone.note


def test_logs_when_the_cluster_does_not_answer_are_unreachable(kubeconfig, cluster, server):
    made = make_adapter(kubeconfig, timeout=2)
    server.stop()
    try:
        with pytest.raises(Unreachable):
            made.logs(38, f"job/{TAG}-38")
    finally:
        made.close()
