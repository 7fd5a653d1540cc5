"""Multi-node jobs (gangs) on the project's Kubernetes API test server and GPU node simulator.

A gang is an Indexed Job with a headless Service (adapters/k8s/render.py): each rank a Pod on one
of the nodes gpush chose, never two on one node, seeing its rank and rank 0's stable host name.
The simulator's Job controller plays Indexed Jobs as kube-controller-manager does (the completion
index annotation, ``JOB_COMPLETION_INDEX``, host names ``<job>-<index>``), its scheduler the
required Pod anti-affinity, and its kubelet runs each rank's command with the rank's variables,
so what each rank prints is what it saw. Three H100 nodes of two GPUs: the gang takes two of
them, the third shows that the ranks go where gpush said and nowhere else. The last test runs
the broker (on PostgreSQL) over it: a gang placed whole, a node lost, the gang queued again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client, config

from adapters.k8s import KubernetesAdapter
from broker.core.adapter import BackendState, Placement, Sharing
from broker.core.clusters import AdapterPool, add_cluster
from broker.intake import queue
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from integration.brokers import ADMIN, QueueAccess
from integration.k8s import apiserver, simulator
from integration.k8s.gpu_nodes import GpuPool
from integration.test_k8s_adapter import (  # noqa: F401  (fixtures: the API server and its client)
    NAMESPACE,
    TAG,
    Follower,
    api,
    job_spec,
    kubeconfig,
    make_adapter,
    server,
    simulated_durations,
    wait_for,
)

POLICY = """
rules:
  - name: whole-gpus
    why: the H100 nodes, whole GPUs on each
    match: {}
    route: {cluster: k8s-a, sharing: k8s/exclusive}
"""
H100 = GpuPool("h100", count=3, product="NVIDIA-H100-80GB-HBM3", gpus_per_node=2)
INDEX = "batch.kubernetes.io/job-completion-index"


@pytest.fixture
def cluster(api) -> Iterator[Any]:  # noqa: F811
    sim = simulator.Simulator(api, [H100]).start()
    sim.create_nodes()
    wait_for(lambda: set(H100.node_names()) <= sim.c.managed, what="simulated nodes")
    yield sim
    sim.stop()


@pytest.fixture
def adapter(kubeconfig, cluster) -> Iterator[KubernetesAdapter]:  # noqa: F811
    made = make_adapter(kubeconfig)
    yield made
    made.close()


def gang(*nodes: str) -> Placement:
    """Two whole H100s on each of ``nodes``, rank 0 first."""
    return Placement(
        "k8s-test",
        Sharing.K8S_EXCLUSIVE,
        units=2,
        gpu_equivalents=2.0 * len(nodes),
        node=nodes[0],
        gpu_model="H100-SXM5-80GB",
        nodes=nodes,
    )


def pods_of(api, job_id: int) -> list[Any]:  # noqa: F811
    return client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=f"gpush.io/job-id={job_id}").items


PRINT_RANK = (
    "echo rank $NODE_RANK index $JOB_COMPLETION_INDEX of $WORLD_SIZE on $HOSTNAME via $MASTER_ADDR:$MASTER_PORT"
)


def test_a_two_node_gang_runs_a_rank_on_each_chosen_node_and_each_knows_its_rank_and_rank_0(adapter, api):  # noqa: F811
    spec = job_spec(nodes=2, gpus=2, command=["sh", "-c", PRINT_RANK], labels={"sim-duration": "1"})
    backend_id = adapter.submit(30, spec, gang("h100-2", "h100-0"))
    assert backend_id == f"job/{TAG}-30"
    follow = Follower(adapter)
    done = follow.until(30, BackendState.SUCCEEDED, timeout=20)
    assert done.exit_code == 0

    core = client.CoreV1Api(api)
    pods = sorted(pods_of(api, 30), key=lambda p: int(p.metadata.annotations[INDEX]))
    assert [p.metadata.annotations[INDEX] for p in pods] == ["0", "1"]
    # On the chosen nodes, one rank each; h100-1 took none.
    assert {p.spec.node_name for p in pods} == {"h100-0", "h100-2"}
    for rank, pod in enumerate(pods):
        assert (pod.spec.hostname, pod.spec.subdomain) == (f"{TAG}-30-{rank}", f"{TAG}-30")
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"  # per node
        printed = core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE)
        assert printed == f"rank {rank} index {rank} of 2 on {TAG}-30-{rank} via {TAG}-30-0.{TAG}-30:29500\n"
        assert adapter.logs(30, backend_id, replica=rank).text == printed  # gpush logs -r RANK
    # The headless Service that makes <job>-<rank>.<job> resolve, owned by the Job.
    service = core.read_namespaced_service(f"{TAG}-30", NAMESPACE)
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses is True
    assert service.spec.selector == {"gpush.io/broker": TAG, "gpush.io/job-id": "30"}
    assert [r.kind for r in service.metadata.owner_references] == ["Job"]
    assert client.BatchV1Api(api).read_namespaced_job(f"{TAG}-30", NAMESPACE).status.completed_indexes == "0-1"

    # Cancel (or clean-up) takes the Job and its Service, found by label.
    adapter.cancel(30)
    assert client.BatchV1Api(api).list_namespaced_job(NAMESPACE, label_selector="gpush.io/job-id=30").items == []
    assert core.list_namespaced_service(NAMESPACE, label_selector="gpush.io/job-id=30").items == []


def test_a_gang_that_sets_its_own_master_port_keeps_it_as_on_slurm(adapter, api):  # noqa: F811
    spec = job_spec(
        nodes=2, gpus=2, command=["sh", "-c", PRINT_RANK], env={"MASTER_PORT": "1234"}, labels={"sim-duration": "1"}
    )
    backend_id = adapter.submit(31, spec, gang("h100-0", "h100-1"))
    assert Follower(adapter).until(31, BackendState.SUCCEEDED, timeout=20).exit_code == 0
    for rank in (0, 1):
        printed = adapter.logs(31, backend_id, replica=rank).text
        assert printed.endswith(f"of 2 on {TAG}-31-{rank} via {TAG}-31-0.{TAG}-31:1234\n"), printed
    adapter.cancel(31)


def test_a_gang_found_again_by_a_restarted_broker_is_one_job(adapter, kubeconfig, api):  # noqa: F811
    spec = job_spec(nodes=2, gpus=2, labels={"sim-duration": "60"})
    backend_id = adapter.submit(32, spec, gang("h100-0", "h100-1"))
    wait_for(lambda: [p.status.phase for p in pods_of(api, 32)] == ["Running", "Running"], what="both ranks running")
    restarted = make_adapter(kubeconfig)
    try:
        found = restarted.find(32)
        assert found is not None and (found.backend_id, found.state) == (backend_id, BackendState.RUNNING)
        assert restarted.submit(32, spec, gang("h100-0", "h100-1")) == backend_id  # not created twice
        assert [(j.job_id, j.state) for j in restarted.statuses(None).jobs] == [(32, BackendState.RUNNING)]
        restarted.cancel(32)
        wait_for(lambda: pods_of(api, 32) == [], what="the ranks deleted")
        core = client.CoreV1Api(api)
        assert core.list_namespaced_service(NAMESPACE, label_selector="gpush.io/job-id=32").items == []
    finally:
        restarted.close()


def test_a_preempted_gang_is_stopped_on_every_node_by_one_call(adapter, api):  # noqa: F811
    """What the broker's preemption step does to a gang victim (broker.scheduling.preemption):
    one preempt of its job id deletes every rank's Pod, with the grace, and its Job and Service."""
    spec = job_spec(nodes=2, gpus=2, labels={"sim-duration": "600"})
    adapter.submit(33, spec, gang("h100-0", "h100-1"))
    wait_for(lambda: [p.status.phase for p in pods_of(api, 33)] == ["Running", "Running"], what="both ranks running")
    adapter.preempt(33, "SIGTERM", 5)
    wait_for(lambda: pods_of(api, 33) == [], what="both ranks stopped")
    assert client.BatchV1Api(api).list_namespaced_job(NAMESPACE, label_selector="gpush.io/job-id=33").items == []
    assert client.CoreV1Api(api).list_namespaced_service(NAMESPACE, label_selector="gpush.io/job-id=33").items == []
    assert adapter.find(33) is None


def test_a_node_lost_mid_run_stops_the_whole_gang_which_is_queued_again(adapter, api):  # noqa: F811
    spec = job_spec(nodes=2, gpus=2, labels={"sim-duration": "60"})
    adapter.submit(31, spec, gang("h100-0", "h100-2"))
    follow = Follower(adapter)
    follow.until(31, BackendState.RUNNING)
    wait_for(lambda: [p.status.phase for p in pods_of(api, 31)] == ["Running", "Running"], what="both ranks running")
    client.CoreV1Api(api).delete_node("h100-2")  # the node goes, and its rank with it

    lost = follow.until(31, BackendState.LOST, timeout=20)
    assert re.fullmatch(
        r"rank [01] lost on node h100-2 \(.*\): the whole gang was stopped and queued again", lost.reason
    ), lost.reason
    # The rank on h100-0 did not run on alone: the Job, its Pods and Service are gone.
    wait_for(lambda: pods_of(api, 31) == [], what="the other rank stopped")
    assert client.BatchV1Api(api).list_namespaced_job(NAMESPACE, label_selector="gpush.io/job-id=31").items == []
    assert client.CoreV1Api(api).list_namespaced_service(NAMESPACE, label_selector="gpush.io/job-id=31").items == []
    assert BackendState.FAILED not in follow.seen[31] and BackendState.CANCELLED not in follow.seen[31]

    # Queued again, the broker places it on nodes that are there: it runs whole, under its own name.
    adapter.submit(31, spec, gang("h100-0", "h100-1"))
    follow.until(31, BackendState.RUNNING)
    wait_for(
        lambda: (
            sorted(p.spec.node_name for p in pods_of(api, 31) if p.status.phase == "Running") == ["h100-0", "h100-1"]
        ),
        what="the gang running again on h100-0 and h100-1",
    )
    adapter.cancel(31)


# -- through the broker -----------------------------------------------------------------------------


def now() -> datetime:
    return datetime.now(UTC)


class Broker(QueueAccess):
    job_defaults = {"command": ["train"]}

    def __init__(self, engine, sessions, pool: AdapterPool, api):  # noqa: F811
        self.sessions, self.pool, self.api = sessions, pool, api
        self.scheduler = Scheduler(engine, pool, clock=now)

    def cycle_until(self, done: Callable[[], Any], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not done after {timeout:g} s; last cycle {self.scheduler.run_cycle()}"
            self.scheduler.run_cycle()
            time.sleep(0.2)

    def running_ranks(self, job_id: int) -> list[str]:
        pods = client.CoreV1Api(self.api).list_namespaced_pod("gpush", label_selector=f"gpush.io/job-id={job_id}")
        return sorted(p.spec.node_name for p in pods.items if p.status.phase == "Running")


@pytest.fixture
def broker(engine, sessions, tmp_path) -> Iterator[Broker]:
    test_server = apiserver.start()
    path = str(test_server.write_kubeconfig(tmp_path / "kubeconfig"))
    api_client = config.new_client_from_config(config_file=path)
    sim = simulator.Simulator(api_client, [H100]).start()
    sim.create_nodes()
    pool = AdapterPool(now)
    with sessions() as session, session.begin():
        settings = {"kubeconfig": path, "namespace": "gpush", "create_namespace": True, "image": "python:3.11"}
        add_cluster(session, name="k8s-a", kind="k8s", config=settings, actor="root", now=now())
    with sessions() as session, session.begin():
        views = cluster_views(session, pool)
        policystore.apply(session, POLICY, comment="gangs", author="root", now=now(), views=views, base_version=None)
    yield Broker(engine, sessions, pool, api_client)
    pool.close()
    sim.stop()
    api_client.close()
    test_server.stop()


def test_the_broker_places_a_gang_whole_and_queues_it_again_when_a_node_is_lost(broker: Broker):
    job_id = broker.submit(kind="training", nodes=2, gpus=2)
    broker.cycle_until(lambda: len(broker.running_ranks(job_id)) == 2 and broker.job(job_id).state == "running")
    job = broker.job(job_id)
    assert len(job.placement["nodes"]) == 2
    assert broker.running_ranks(job_id) == sorted(job.placement["nodes"])  # where gpush placed it, one rank each
    lost_node = job.placement["nodes"][1]
    client.CoreV1Api(broker.api).delete_node(lost_node)

    def requeued() -> bool:
        with broker.sessions() as session:
            return any(e.to_state == "requeued" for e in queue.job_events(session, job_id, ADMIN))

    broker.cycle_until(requeued)
    with broker.sessions() as session:
        (why,) = [e.reason for e in queue.job_events(session, job_id, ADMIN) if e.to_state == "requeued"]
    assert why.startswith("rank ") and f"lost on node {lost_node}" in why and "queued again" in why
    # Placed afresh on the two nodes left, and running whole there.
    left = sorted(set(H100.node_names()) - {lost_node})
    broker.cycle_until(lambda: broker.running_ranks(job_id) == left and broker.job(job_id).state == "running")
    assert sorted(broker.job(job_id).placement["nodes"]) == left
