"""The reconciled GPU inventory on the real Slurm test cluster and the Kubernetes test API server.

Node agents run as ``gpush agent --once --recording FILE --node NODE`` into the embedded
broker on PostgreSQL, replaying the NVML recordings of tests/data/nvml/ (mig01, mps01,
gpu01 describe the Slurm cluster of integration/slurm/ exactly; t4 a node of four T4s).
A misconfiguration is made the way it happens: the agent reports a MIG layout other
than the one Slurm's gres.conf claims (the recording edited as a GPU re-cut by hand
would answer), or the time-slicing ConfigMap changes while the device plugin is not
restarted, or one host is listed by both clusters. The tests read what an operator
reads (``gpush inventory drift --json``, ``gpush slurm gres-conf``, ``gpush mig plan``)
and what Slurm does with the jobs (squeue).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from sqlalchemy import select

from broker.core.auth import Principal
from broker.core.clusters import AdapterPool, ClusterInfo, add_cluster, list_clusters
from broker.core.gpus import gpu_model, mig_layout_problem
from broker.core.models import Job
from broker.core.schemas import Role
from broker.nodeagent.agent import collect
from broker.nodeagent.nvml import RecordedLibrary
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from integration.brokers import QueueAccess
from integration.k8s import apiserver, simulator
from integration.k8s.gpu_nodes import CLUSTER_POLICY_CRD, GpuPool, node_devices, node_manifest
from integration.slurm.cluster import SlurmTestCluster

RECORDINGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "nvml"
ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)
SLURM = "slurm-x"
K8S = "k8s-x"
POLICY = f"""
rules:
  - name: isolated-on-mig
    why: hardware isolation on the smallest MIG slice that holds the job
    match: {{isolation: hardware}}
    route: {{cluster: {SLURM}, sharing: slurm/mig}}
  - name: whole
    why: everything else on whole GPUs
    match: {{}}
    route: {{cluster: {SLURM}, sharing: slurm/exclusive}}
"""


def now() -> datetime:
    return datetime.now(UTC)


def recording(name: str) -> dict[str, Any]:
    return json.loads((RECORDINGS / f"{name}.json").read_text())


def recut_gpu1_as_2g_10gb(mig01: dict[str, Any]) -> dict[str, Any]:
    """mig01's recording as NVML answers after someone re-cut GPU 1 from two 3g.20gb into
    two 2g.10gb instances (``nvidia-smi mig -i 1 -dgi; -cgi 14,14 -C``) and left gres.conf
    alone: GPU instances 3 and 4 at memory slots 0 and 2, each with one compute instance."""
    rec = copy.deepcopy(mig01)
    calls = rec["calls"]
    calls["nvmlDeviceGetGpuInstances(gpu1, 9)"] = {"return": []}
    calls["nvmlDeviceGetGpuInstances(gpu1, 14)"] = {"return": ["gpu1/p14gi0", "gpu1/p14gi1"]}
    for i, (gi, start) in enumerate(((3, 0), (4, 2))):
        calls[f"nvmlGpuInstanceGetInfo(gpu1/p14gi{i})"] = {
            "return": {"id": gi, "profileId": 14, "placement": {"start": start, "size": 2}}
        }
        calls[f"nvmlDeviceGetGpuInstanceId(gpu1/mig{i})"] = {"return": gi}
        calls[f"nvmlDeviceGetUUID(gpu1/mig{i})"] = {"return": f"MIG-2g10gb-mig01-1-{i}"}
        calls[f"nvmlDeviceGetMemoryInfo(gpu1/mig{i})"] = {
            "return": {"total": 10334765056, "free": 10321133568, "used": 13631488}
        }
    rec["description"] = "mig01 with GPU 1 re-cut into two 2g.10gb instances; gres.conf still says 3g.20gb"
    return rec


# -- the embedded broker and its command line ------------------------------------------------


@pytest.fixture
def slurm(slurm_cluster: SlurmTestCluster) -> Iterator[SlurmTestCluster]:
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()


class Broker(QueueAccess):
    """The broker's scheduler in this process, and ``gpush`` commands on the same database."""

    def __init__(self, engine, sessions, gpush, tmp_path: Path, slurm: SlurmTestCluster | None):
        self.sessions, self.gpush, self.tmp_path, self.slurm = sessions, gpush, tmp_path, slurm
        self.pool = AdapterPool(now)
        self.scheduler = Scheduler(engine, self.pool, clock=now)

    def add_cluster(self, name: str, kind: str, settings: dict[str, Any]) -> None:
        with self.sessions() as session, session.begin():
            add_cluster(session, name=name, kind=kind, config=settings, actor="root", now=now())

    def apply_policy(self, text: str) -> None:
        with self.sessions() as session, session.begin():
            views = cluster_views(session, self.pool)
            policystore.apply(
                session, text, comment="drift test", author="root", now=now(), views=views, base_version=None
            )

    def run(self, *args: Any) -> Any:
        """``gpush ARGS --json``: its parsed output (fails on a non-zero exit)."""
        result = self.gpush(*args, "--json")
        assert result.code == 0, f"gpush {' '.join(map(str, args))} exited {result.code}: {result.err}"
        return result.json

    def agent(self, node: str, nvml: dict[str, Any]) -> None:
        """One round of the node agent on ``node``, NVML answering as ``nvml`` says."""
        path = self.tmp_path / f"nvml-{node}-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(nvml))
        result = self.gpush("agent", "--once", "--node", node, "--recording", path)
        assert result.code == 0, f"gpush agent on {node} exited {result.code}: {result.err}"

    def drift(self, *args: Any) -> list[dict[str, Any]]:
        return self.run("inventory", "drift", *args)

    def summary(self) -> list[tuple]:
        with self.sessions() as session:
            rows = session.execute(select(Job.id, Job.state, Job.state_reason, Job.backend_id).order_by(Job.id)).all()
        return [tuple(r) for r in rows]

    def cycle_until(self, done: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while True:
            report = self.scheduler.run_cycle()
            if done():
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what or 'condition'} not reached after {timeout:g} s; jobs: {self.summary()}; "
                    f"last cycle: {report}"
                )
            time.sleep(0.3)

    def cycles(self, n: int, pause: float = 0.3) -> None:
        for _ in range(n):
            self.scheduler.run_cycle()
            time.sleep(pause)


@pytest.fixture
def broker(engine, sessions, gpush, database_url, tmp_path, monkeypatch) -> Broker:
    monkeypatch.setenv("GPUSH_DATABASE_URL", database_url)  # gpush commands use the embedded broker on it
    tmp_path.chmod(0o755)  # slurmd writes the jobs' output here
    return Broker(engine, sessions, gpush, tmp_path, None)


@pytest.fixture
def on_slurm(broker: Broker, slurm: SlurmTestCluster) -> Broker:
    """The broker with the Slurm test cluster as slurm-x and a policy routing onto it."""
    broker.slurm = slurm
    broker.add_cluster(
        SLURM,
        "slurm",
        {
            "slurm_conf": str(slurm.conf),
            "jobcomp_file": str(slurm.jobcomp),
            "workdir": str(broker.tmp_path),
            "cache_seconds": 0,
        },
    )
    broker.apply_policy(POLICY)
    return broker


def agents_as_recorded(b: Broker) -> None:
    for node in ("mig01", "mps01", "gpu01"):
        b.agent(node, recording(node))


def critical(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in findings if f["severity"] == "critical"]


def in_slurm(slurm: SlurmTestCluster, b: Broker, job_id: int) -> list[dict[str, Any]]:
    """The Slurm jobs that carry gpush job ``job_id`` (its tag is in the job name)."""
    tag = b.pool.get(_cluster_info(b, SLURM)).adapter.settings.tag
    return [j for j in slurm.jobs() if str(j.get("name", "")) == f"{tag}-{job_id}"]


def _cluster_info(b: Broker, name: str) -> ClusterInfo:
    with b.sessions() as session:
        return next(c for c in list_clusters(session) if c.name == name)


# -- Slurm ------------------------------------------------------------------------------------


def test_recorded_agents_agree_with_slurm(on_slurm: Broker):
    # Before any agent reports, the cluster is only unverified: no finding blocks anything.
    before = on_slurm.drift()
    assert [f["kind"] for f in before] == ["no_agents"]

    agents_as_recorded(on_slurm)
    findings = on_slurm.drift()
    assert critical(findings) == [], findings
    assert on_slurm.gpush("inventory", "drift", "--fail-on", "critical").code == 0

    view = on_slurm.run("inventory", "--cluster", SLURM)
    (cluster,) = view["clusters"]
    assert cluster["physical_gpus"] == 5  # mig01: 2, mps01: 1, gpu01: 2
    gpus = {(n["name"], g["index"]): g for n in cluster["nodes"] for g in n["gpus"]}
    assert all(g["verified"] and g["model"] == "A100-SXM4-40GB" for g in gpus.values())
    assert [s["mig_profile"] for s in gpus[("mig01", 0)]["slices"]] == ["1g.5gb"]
    assert [s["mig_profile"] for s in gpus[("mig01", 1)]["slices"]] == ["3g.20gb"]
    assert gpus[("mps01", 0)]["mode"] == "mps" and gpus[("gpu01", 1)]["mode"] == "whole"
    assert cluster["totals"]["broken"] == 0


def test_a_gres_conf_slurm_believes_but_the_gpu_lacks_is_found_and_jobs_avoid_it(on_slurm: Broker, slurm):
    b = on_slurm
    b.agent("mps01", recording("mps01"))
    b.agent("gpu01", recording("gpu01"))
    b.agent("mig01", recut_gpu1_as_2g_10gb(recording("mig01")))

    findings = b.drift("--cluster", SLURM)
    (finding,) = critical(findings)
    assert finding["kind"] == "mig_profile_without_instance" and finding["node"] == "mig01"
    assert "3g.20gb" in finding["what"]
    assert "gpush slurm gres-conf mig01" in finding["fix"]
    assert finding["breaks"] == [{"sharing": "slurm/mig", "mig_profile": "3g.20gb", "gpu": None}]
    assert b.gpush("inventory", "drift", "--fail-on", "critical").code == 1

    # The fix's command renders what the agent sees: 2g.10gb where gres.conf says 3g.20gb.
    conf = b.run("slurm", "gres-conf", "mig01")
    assert conf["gres"] == "gpu:1g.5gb:7,gpu:2g.10gb:2"
    assert "3g.20gb" not in conf["text"] and "Type=2g.10gb" in conf["text"]
    text = b.gpush("slurm", "gres-conf", "mig01").out
    assert "Gres=gpu:1g.5gb:7,gpu:2g.10gb:2" in text

    # A job that needs a 3g.20gb slice is not sent to the slices that do not exist; a
    # 1g.5gb job runs.
    big = b.submit(kind="training", isolation="hardware", gpu_memory_gb=20, command=["true"])
    small = b.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["true"])
    b.cycle_until(lambda: b.job(small).state == "succeeded", what="the 1g.5gb job to succeed")
    b.cycles(3)
    # It waits (queued, not held for good) and says which finding it waits on.
    waiting = b.job(big)
    assert waiting.state == "queued", b.summary()
    assert waiting.state_reason.startswith("waiting for the 3g.20gb units of slurm-x marked broken to be repaired")
    assert finding["what"] in waiting.state_reason and "gpush inventory drift" in waiting.state_reason
    assert in_slurm(slurm, b, big) == []
    assert b.job(small).placement["mig_profile"] == "1g.5gb"

    # GPU 1 is cut back into two 3g.20gb; the agent's next report clears the finding and
    # the job goes to Slurm and runs.
    b.agent("mig01", recording("mig01"))
    assert critical(b.drift("--cluster", SLURM)) == []
    b.cycle_until(lambda: b.job(big).state == "succeeded", what="the 3g.20gb job to succeed")
    assert b.job(big).placement["mig_profile"] == "3g.20gb"
    assert in_slurm(slurm, b, big)


def test_mig_plan_recuts_the_idle_gpu_for_the_waiting_small_slices(on_slurm: Broker):
    b = on_slurm
    agents_as_recorded(b)
    for _ in range(10):
        b.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["sleep", "30"])

    plan = b.run("mig", "plan", "--cluster", SLURM)
    assert plan["missing_agents"] == [] and "mig01" in plan["nodes"]
    assert plan["waiting_slices"] == 10
    # Today's slices hold 9 of them (seven 1g.5gb, and two on the 3g.20gb slices).
    assert plan["today"]["jobs"] == 9 and plan["planned"]["jobs"] == 10, plan["summary"]
    assert plan["unplaced"] == []
    for gpu in plan["gpus"]:
        assert mig_layout_problem(gpu_model(gpu["model"]), gpu["planned"]) is None, gpu
    changed = [(g["node"], g["index"]) for g in plan["gpus"] if g["action"] != "keep"]
    assert changed == [("mig01", 1)] and plan["drain_first"] == ["mig01"]
    planned = {(g["node"], g["index"]): g["planned"] for g in plan["gpus"]}
    assert sum(p.count("1g.5gb") for p in planned.values()) >= 10
    assert "gpush-mig01" in plan["mig_parted"] and "NodeName=mig01" in plan["gres_conf"]["mig01"]


# -- Kubernetes --------------------------------------------------------------------------------

# t4-0: four T4s time-sliced 4 ways, as tests/data/nvml/t4.json records four T4s. The
# a100w pool has no node of its own: test_a_host_in_both_clusters registers one as
# "gpu01", the name Slurm already uses (two whole A100-40GB, as gpu01.json records).
T4 = GpuPool("t4", count=1, product="Tesla-T4", gpus_per_node=4, replicas=4, cpu="32", memory="128Gi")
A100_WHOLE = GpuPool("a100w", count=0, product="NVIDIA-A100-SXM4-40GB", gpus_per_node=2)
POOLS = [T4, A100_WHOLE]


class K8sCluster:
    """The API test server, a kubeconfig for it, and the node simulator (its device plugin
    among others), which can be stopped and started again as a device plugin restarts."""

    def __init__(self, tmp_path: Path):
        self.server = apiserver.start()
        self.kubeconfig = str(self.server.write_kubeconfig(tmp_path / "kubeconfig"))
        self.api = config.new_client_from_config(config_file=self.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.sim: simulator.Simulator | None = None

    def start_simulator(self) -> None:
        self.sim = simulator.Simulator(self.api, POOLS).start()

    def stop_simulator(self) -> None:
        if self.sim is not None:
            self.sim.stop()
            self.sim = None

    def install_gpu_operator_api(self) -> None:
        """The ClusterPolicy CRD, the operator's namespace and an empty ClusterPolicy:
        what `gpush k8s timeslice apply` patches and the device plugin reads."""
        client.ApiextensionsV1Api(self.api).create_custom_resource_definition(CLUSTER_POLICY_CRD)
        self.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpu-operator"}})
        client.CustomObjectsApi(self.api).create_cluster_custom_object(
            "nvidia.com",
            "v1",
            "clusterpolicies",
            {
                "apiVersion": "nvidia.com/v1",
                "kind": "ClusterPolicy",
                "metadata": {"name": "cluster-policy"},
                "spec": {},
            },
        )

    def register_node(self, pool: GpuPool, name: str) -> None:
        """A node of ``pool`` under a name of our choosing, as its kubelet would register it."""
        body = node_manifest(pool, 0, node_devices(pool))
        body["metadata"]["name"] = name
        body["metadata"]["labels"]["kubernetes.io/hostname"] = name
        self.core.create_node(body)
        self.core.patch_node_status(name, {"status": body["status"]})

    def advertised(self, node: str) -> str:
        return self.core.read_node(node).status.allocatable.get("nvidia.com/gpu", "0")

    def close(self) -> None:
        self.stop_simulator()
        self.api.close()
        self.server.stop()


@pytest.fixture
def k8s(tmp_path) -> Iterator[K8sCluster]:
    cluster = K8sCluster(tmp_path)
    try:
        cluster.start_simulator()
        cluster.sim.create_nodes()
        yield cluster
    finally:
        cluster.close()


def add_k8s(b: Broker, k8s: K8sCluster) -> None:
    b.add_cluster(
        K8S,
        "k8s",
        {"kubeconfig": k8s.kubeconfig, "namespace": "gpush", "create_namespace": True, "image": "python:3.11"},
    )


def wait_for(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last: {value!r}")
        time.sleep(0.1)


def t4_report_matches_the_pool() -> dict[str, Any]:
    nvml = recording("t4")
    count = nvml["calls"]["nvmlDeviceGetCount()"]["return"]
    assert count == T4.gpus_per_node, f"t4.json records {count} GPUs; the simulated t4 nodes have {T4.gpus_per_node}"
    return nvml


def test_a_time_slicing_config_the_device_plugin_has_not_picked_up_is_drift(broker: Broker, k8s: K8sCluster):
    add_k8s(broker, k8s)
    k8s.install_gpu_operator_api()
    broker.agent("t4-0", t4_report_matches_the_pool())
    applied = broker.run("k8s", "timeslice", "apply", K8S, "--replicas", "4")
    assert applied, applied

    def kinds() -> list[str]:
        return [f["kind"] for f in broker.drift("--cluster", K8S)]

    wait_for(lambda: "timeslice_drift" not in kinds(), what="t4-0 to advertise what the ConfigMap says")
    view = broker.run("inventory", "--cluster", K8S)
    (t4,) = [n for c in view["clusters"] for n in c["nodes"] if n["name"] == "t4-0"]
    assert [g["mode"] for g in t4["gpus"]] == ["timeslice x4"] * 4 and all(g["verified"] for g in t4["gpus"])

    # The device plugin stops following (as the real one does until it restarts) and
    # someone edits the ConfigMap to 8 replicas: t4-0 still advertises 4 per GPU.
    k8s.stop_simulator()
    configmap = k8s.core.read_namespaced_config_map("time-slicing-config", "gpu-operator")
    (key,) = configmap.data
    configmap.data[key] = configmap.data[key].replace("replicas: 4", "replicas: 8")
    assert "replicas: 8" in configmap.data[key]
    k8s.core.patch_namespaced_config_map("time-slicing-config", "gpu-operator", {"data": configmap.data})
    assert k8s.advertised("t4-0") == "16"

    (finding,) = [f for f in broker.drift("--cluster", K8S) if f["kind"] == "timeslice_drift"]
    assert finding["node"] == "t4-0" and finding["severity"] == "warning"
    assert "advertises 4" in finding["what"] and "says 8" in finding["what"]
    assert f"gpush k8s timeslice apply {K8S} --replicas 8" in finding["fix"]
    assert "nvidia-device-plugin" in finding["fix"]  # the restart, for a config that is already right

    # The fix for a right config: restart the device plugin. It advertises 8 a GPU; no drift.
    k8s.start_simulator()
    wait_for(lambda: k8s.advertised("t4-0") == "32", what="t4-0 to advertise 4 GPUs x 8 replicas")
    assert "timeslice_drift" not in kinds()


def test_a_host_in_both_clusters_is_claimed_twice(on_slurm: Broker, k8s: K8sCluster):
    b = on_slurm
    add_k8s(b, k8s)
    k8s.register_node(A100_WHOLE, "gpu01")
    wait_for(lambda: k8s.advertised("gpu01") == "2", what="gpu01 registered in Kubernetes")
    agents_as_recorded(b)
    b.agent("t4-0", t4_report_matches_the_pool())

    twice = [f for f in b.drift() if f["kind"] == "gpu_claimed_twice"]
    assert {(f["cluster"], f["node"], f["severity"]) for f in twice} == {
        (SLURM, "gpu01", "critical"),
        (K8S, "gpu01", "critical"),
    }, twice
    uuids = [gpu.uuid for gpu in collect(RecordedLibrary(recording("gpu01")), "gpu01").gpus]
    assert all(all(uuid in f["what"] for uuid in uuids) for f in twice)
    assert all("take gpu01 out of one" in f["fix"] for f in twice)

    # Neither cluster may place on gpu01 now; the other nodes are untouched.
    view = b.run("inventory")
    units = {(c["name"], n["name"], u["sharing"]): u for c in view["clusters"] for n in c["nodes"] for u in n["units"]}
    assert units[(SLURM, "gpu01", "slurm/exclusive")]["broken"]
    assert units[(K8S, "gpu01", "k8s/exclusive")]["broken"]
    assert not units[(SLURM, "mig01", "slurm/mig")]["broken"]
    assert critical([f for f in b.drift() if f["node"] != "gpu01"]) == []
    text = b.gpush("inventory", "--gpus").out
    broken_rows = [line.split() for line in text.splitlines() if line.rstrip().endswith("/1 BROKEN")]
    assert len(broken_rows) == 4 and all(row[-4] == "0/1" for row in broken_rows), text  # FREE/TOTAL

    # A whole-GPU job (slurm-x offers whole GPUs only on gpu01) waits and says why.
    whole = b.submit(kind="training", gpus=1, command=["true"])
    b.cycles(3)
    job = b.job(whole)
    assert job.state == "queued" and "offered by slurm-x and by k8s-x" in job.state_reason, b.summary()
    assert in_slurm(b.slurm, b, whole) == []

    # gpu01 goes to Slurm alone: Kubernetes forgets the node, the agent reports again, and
    # the job runs there.
    k8s.core.delete_node("gpu01")
    b.agent("gpu01", recording("gpu01"))
    assert [f for f in b.drift() if f["kind"] == "gpu_claimed_twice"] == []
    b.cycle_until(lambda: b.job(whole).state == "succeeded", what="the whole-GPU job to succeed on gpu01")
    assert b.job(whole).placement["node"] == "gpu01"
