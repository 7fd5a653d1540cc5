"""gpush end to end on Kubernetes: submit, route, place, run, scale and cancel through the broker.

The broker runs in-process on PostgreSQL with the shipped all-Kubernetes policy
(policies/all-kubernetes.yaml) and one cluster, ``k8s-a``, registered with the
Kubernetes adapter against the project's API test server and GPU node simulator
(time-sliced T4s, an A100 in two 3g.20gb MIG slices, whole H100s), reached only
through a kubeconfig, as a real cluster would be.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from kubernetes import client, config

from broker.core.auth import Principal
from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.core.schemas import Role
from broker.intake import queue
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from broker.scheduling.scaling import scale_job
from integration.brokers import QueueAccess
from integration.k8s import apiserver, simulator
from integration.k8s.gpu_nodes import GpuPool

ROOT = Path(__file__).resolve().parents[1]
POLICY = (ROOT / "policies" / "all-kubernetes.yaml").read_text()
ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)
POOLS = [
    GpuPool("t4", count=2, product="Tesla-T4", gpus_per_node=2, replicas=4, cpu="32", memory="128Gi"),
    GpuPool(
        "a100", count=1, product="NVIDIA-A100-SXM4-40GB", gpus_per_node=1, mig_strategy="mixed",
        mig_layout=("3g.20gb", "3g.20gb"),
    ),
    GpuPool("h100", count=1, product="NVIDIA-H100-80GB-HBM3", gpus_per_node=2),
]  # fmt: skip


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def broker(engine, sessions, tmp_path):
    server = apiserver.start()
    kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
    api = config.new_client_from_config(config_file=kubeconfig)
    sim = simulator.Simulator(api, POOLS).start()
    sim.create_nodes()
    pool = AdapterPool(now)
    with sessions() as session, session.begin():
        add_cluster(
            session,
            name="k8s-a",
            kind="k8s",
            config={"kubeconfig": kubeconfig, "namespace": "gpush", "create_namespace": True, "image": "python:3.11"},
            actor="root",
            now=now(),
        )
    with sessions() as session, session.begin():
        views = cluster_views(session, pool)
        policystore.apply(session, POLICY, comment="k8s test", author="root", now=now(), views=views, base_version=None)
    b = Broker(engine, sessions, pool, api)
    yield b
    pool.close()
    sim.stop()
    api.close()
    server.stop()


class Broker(QueueAccess):
    job_defaults = {"command": ["serve"]}

    def __init__(self, engine, sessions, pool, api):
        self.sessions, self.pool, self.api = sessions, pool, api
        self.scheduler = Scheduler(engine, pool, clock=now)

    def cycle_until(self, done, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not done after {timeout:g} s; last cycle {self.scheduler.run_cycle()}"
            self.scheduler.run_cycle()
            time.sleep(0.2)

    def pods(self, job_id: int) -> list[dict]:
        pods = client.CoreV1Api(self.api).list_namespaced_pod("gpush", label_selector=f"gpush.io/job-id={job_id}")
        return [self.api.sanitize_for_serialization(p) for p in pods.items]


def test_elastic_inference_lands_on_time_sliced_gpus_with_a_memory_guard_and_scales(broker: Broker):
    job_id = broker.submit(
        kind="inference", isolation="none", gpu_memory_gb=3, elastic={"min_replicas": 2, "max_replicas": 6}
    )
    broker.cycle_until(lambda: broker.job(job_id).state == "running")
    job = broker.job(job_id)
    assert job.placement["sharing"] == "k8s/timeslice" and job.placement["replicas"] == 2
    assert job.gpu_equivalents == pytest.approx(2 / 4)  # two replicas of a T4 split four ways
    (pod, *_) = broker.pods(job_id)
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    # 3 GB of a T4's 16 GB (broker.core.gpus, the model's nominal memory, not GFD's 15360 MiB).
    assert env["GPUSH_GPU_MEMORY_FRACTION"] == "0.1875"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    with broker.sessions() as session, session.begin():
        scale_job(session, job_id, 5, ADMIN, now=now(), adapter_for=lambda name: broker.pool.get(_info(session, name)))
    broker.cycle_until(lambda: len([p for p in broker.pods(job_id) if p["status"].get("phase") == "Running"]) == 5)
    assert broker.job(job_id).gpu_equivalents == pytest.approx(5 / 4)

    with broker.sessions() as session, session.begin():
        queue.cancel_job(session, job_id, ADMIN, now=now())
    broker.cycle_until(lambda: broker.job(job_id).state == "cancelled")
    broker.cycle_until(lambda: broker.pods(job_id) == [])


def test_training_that_needs_isolation_gets_a_mig_slice_and_a_too_big_job_is_held(broker: Broker):
    mig = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=16, labels={"tier": "critical"})
    huge = broker.submit(kind="training", gpus=4)  # whole GPUs: the largest node has 2
    broker.cycle_until(lambda: broker.job(mig).state in ("submitted", "running"))
    assert broker.job(mig).placement["mig_profile"] == "3g.20gb"
    (pod,) = broker.pods(mig)
    # The slice and nothing else: the job asked for no host memory (render.pod_template).
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.20gb": "1"}
    held = broker.job(huge)
    assert held.state == "held" and "4 whole GPUs" in held.state_reason


def _info(session, name):
    (info,) = [c for c in list_clusters(session) if c.name == name]
    return info


def test_the_pod_watch_wakes_the_scheduler_when_a_job_of_its_changes(broker: Broker):
    """The adapter pushes changes (ChangeNotifier): the pool's callback is told when the
    Pods of the broker's jobs change, with no scheduling cycle running in between, so a
    leader waiting for its next tick reads the new status at once."""
    import threading

    woken = threading.Event()
    broker.pool.on_change = woken.set
    broker.pool.close()  # rebuilt on the next get(), with the callback
    job_id = broker.submit(kind="inference", isolation="none", gpu_memory_gb=3)
    broker.scheduler.run_cycle()  # submits the Job; its Pod is created and started after
    assert broker.job(job_id).state == "submitted"
    assert woken.wait(15), "no wake-up while the job's pod was created and started"
    broker.cycle_until(lambda: broker.job(job_id).state == "running")
    other = client.CoreV1Api(broker.api)  # a Pod that is not gpush's wakes nobody
    woken.clear()
    other.create_namespaced_pod(
        "gpush", {"metadata": {"name": "not-ours"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    )
    assert not woken.wait(2)


def test_a_protected_job_preempts_a_preemptible_one_which_is_queued_again(broker: Broker):
    with broker.sessions() as session, session.begin():
        policystore.apply(
            session,
            POLICY + "preemption: {min_priority_gap: 5, grace: 45s}\n",
            comment="preemption",
            author="root",
            now=now(),
            views=cluster_views(session, broker.pool),
            base_version=policystore.active_version(session),
        )
    # The h100 pool's node has 2 whole GPUs: the victim holds both.
    victim = broker.submit(
        kind="training",
        gpus=2,
        preemptible=True,
        checkpoint={"signal": "SIGTERM", "grace": 3},
    )
    broker.cycle_until(lambda: broker.job(victim).state == "running")
    (pod,) = broker.pods(victim)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 3  # the kubelet's grace on the deletion
    urgent = broker.submit(tenant="prod", kind="training", gpus=2, priority=10)
    broker.cycle_until(lambda: broker.job(urgent).state in ("submitted", "running"))
    with broker.sessions() as session:
        story = [(e.type, e.to_state, e.reason) for e in queue.job_events(session, victim, ADMIN)]
    told = f"preempted by job {urgent} (priority 10, tenant prod): to be told with SIGTERM"
    assert ("preemption", "running", told) in story
    assert ("preemption", "running", "told with SIGTERM; 3 s to save its state") in story
    assert [r for t, s, r in story if s == "requeued"] == [
        f"preempted by job {urgent} (priority 10, tenant prod); ended stopped by its cluster"
    ]
    # Queued again; it runs once the protected job is done (cancelled here: the simulator's
    # containers run until stopped), as a new Job of the same name.
    with broker.sessions() as session, session.begin():
        queue.cancel_job(session, urgent, ADMIN, now=now())
    broker.cycle_until(lambda: broker.job(victim).state == "running", timeout=30)
    assert broker.job(victim).placement["sharing"] == "k8s/exclusive"


def test_a_fair_share_reclaim_storm_is_rate_limited(broker: Broker):
    """research holds every time-sliced replica with preemptible work; vision, at the same
    priority and holding nothing, is below its share and reclaims, but at most twice in the
    hour however many of its jobs wait: the fleet does not thrash."""
    with broker.sessions() as session, session.begin():
        policystore.apply(
            session,
            POLICY
            + "preemption:\n  reclaim: true\n  reclaims_per_hour: 2\n  grace: 1s\n"
            + "  defaults:\n    - {match: {tenant: research}, preemptible: true}\n",
            comment="reclaim",
            author="root",
            now=now(),
            views=cluster_views(session, broker.pool),
            base_version=policystore.active_version(session),
        )
    shared = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 3}
    held = [broker.submit(tenant="research", **shared) for _ in range(16)]  # 2 nodes x 2 T4s x 4 replicas
    broker.cycle_until(lambda: all(broker.job(j).state == "running" for j in held), timeout=30)
    storm = [broker.submit(tenant="vision", **shared) for _ in range(6)]
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        broker.scheduler.run_cycle()
        time.sleep(0.2)
    # The two reclaims freed two replicas: two of the storm run there (their Pods start a
    # moment after their submission), the other four wait.
    broker.cycle_until(lambda: sum(broker.job(j).state == "running" for j in storm) == 2, timeout=15)
    states = [broker.job(j).state for j in storm]
    assert sorted(states) == ["queued"] * 4 + ["running"] * 2, states
    with broker.sessions() as session:
        reasons = [e.reason for j in held for e in queue.job_events(session, j, ADMIN) if e.to_state == "requeued"]
    assert len(reasons) == 2
    assert all("reclaims its fair share" in r for r in reasons), reasons
    waiting = [broker.job(j).state_reason for j in storm if broker.job(j).state == "queued"]
    assert len(waiting) == 4 and all(r.startswith("waiting for") for r in waiting), waiting
