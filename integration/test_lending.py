"""Lending a node between the real Slurm test cluster and the Kubernetes test server.

Both clusters list ``gpu01`` (two A100-40GB): slurmd's in a Slurm test cluster of this module's
own (its own ports: the test drains and resumes its nodes), and a simulated kubelet's in the
node simulator behind the project's Kubernetes API test server. The broker runs in-process on
PostgreSQL with the real scheduling cycle; gpu01's agent reports over a stateful fake NVML
(tests.doubles.fake_nvml). Kubernetes also has ``t4-0``, a time-sliced T4.

The policy's lending pool makes Slurm gpu01's home and has Kubernetes set it up with the device
plugin config ``time-sliced-4`` (four time-slicing replicas a GPU) when it takes the node; on
Slurm it serves whole GPUs. A burst of inference moves it to Kubernetes (the training there is
preempted and waits), and the training that then waits brings it back. Every cycle checks that
no GPU is offered by both clusters, and at the end no job is lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client, config
from sqlalchemy import select

from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.core.models import NodeMove, NodeMoveEvent
from broker.inventory.reconcile import reconcile
from broker.inventory.report_store import load_reports, save_report
from broker.inventory.view import ClusterInventory
from broker.nodeagent.agent import collect
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from integration.brokers import QueueAccess
from integration.k8s import apiserver, simulator
from integration.k8s.gpu_nodes import (
    DEFAULT_MIG_PARTED_CONFIG,
    MIG_CONFIG_LABEL,
    MIG_CONFIG_STATE_LABEL,
    MIG_PARTED_KEY,
    GpuPool,
    time_slicing,
)
from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import own_cluster
from integration.test_k8s_adapter import simulated_durations  # noqa: F401  (autouse: sim-duration labels)
from integration.test_slurm_adapter import Clock
from tests.doubles.fake_nvml import FakeNvml

# lend_slurm starts a Slurm test cluster of this module's own (own_cluster), on fixed ports.
pytestmark = pytest.mark.slurm
PORTS = {"GPUSH_SLURMCTLD_PORT": "9517", "GPUSH_SLURMRESTD_PORT": "9520", "GPUSH_SLURMD_PORT": "9521"}
OPERATOR = "gpu-operator"
SHORT = {"sim-duration": "6"}  # seconds an inference Pod runs
DEVICE_PLUGIN_CONFIG = "time-slicing-config"
SEVEN, TWO = ("1g.5gb",) * 7, ("3g.20gb",) * 2  # mig01's layout in the Slurm test cluster's gres.conf
POOLS = [
    GpuPool("gpu01", names=("gpu01",), product="NVIDIA-A100-SXM4-40GB", gpus_per_node=2, cpu="16", memory="64Gi"),
    GpuPool(
        "mig01",
        names=("mig01",),
        product="NVIDIA-A100-SXM4-40GB",
        gpus_per_node=2,
        mig_strategy="mixed",
        mig_layout=(SEVEN, TWO),
        mig_config="slurm-layout",
        cpu="16",
        memory="64Gi",
    ),
    GpuPool("t4", product="Tesla-T4", gpus_per_node=1, replicas=2, cpu="16", memory="64Gi"),
]
# The MIG manager's configs: MIG off, and Slurm's layout of mig01.
MIG_PARTED = """\
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  slurm-layout:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.5gb": 7}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"3g.20gb": 2}
"""
RULES = """
rules:
  - name: inference-time-sliced
    why: elastic inference tolerates sharing
    match: {kind: inference, isolation: [none], gpu_memory_gb: {max: 8}}
    route: {cluster: k8s-a, sharing: k8s/timeslice}
  - name: isolated-on-mig
    why: hardware isolation on the smallest MIG slice that holds the job
    match: {isolation: hardware}
    route: {cluster: slurm-a, sharing: slurm/mig}
  - name: training-whole
    why: training on whole GPUs
    match: {}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
preemption:
  grace: 1
"""
WHOLE_NODE = (
    RULES
    + """
lending:
  - nodes: [gpu01]
    clusters: [slurm-a, k8s-a]
    hold: 0
    threshold: 1
    setup:
      k8s-a: {device_plugin: time-sliced-4}
"""
)
# Kubernetes' MIG manager turns MIG off when it takes mig01, and gives Slurm's layout back
# before the node goes home: Slurm's gres.conf holds for it again.
MIG_NODE = (
    RULES
    + """
lending:
  - nodes: [mig01]
    clusters: [slurm-a, k8s-a]
    hold: 0
    threshold: 0.4  # one 3g.20gb job (3/7 of a GPU) waiting brings it home
    setup:
      k8s-a: {mig: all-disabled, device_plugin: time-sliced-4, mig_on_leave: slurm-layout}
"""
)


@pytest.fixture(scope="module")
def lend_slurm() -> Iterator[SlurmTestCluster]:
    yield from own_cluster("gpush-slurm-lend-", PORTS, "for lending")


class Site(QueueAccess):
    def __init__(self, engine, sessions, pool: AdapterPool, clock, slurm: SlurmTestCluster, core, node: str):
        self.sessions, self.pool, self.clock, self.slurm, self.core = sessions, pool, clock, slurm, core
        self.scheduler = Scheduler(engine, pool, clock=clock)
        self.node = node
        self.mig_config = "slurm-layout" if node == "mig01" else None  # what the node's GPUs have
        self.gpus = self._gpus()
        self.offered_twice: list = []
        self.cycles = 0

    def _gpus(self) -> FakeNvml:
        """The node's GPUs as its MIG config made them (the driver's view, behind its agent)."""
        if self.mig_config == "slurm-layout":
            return FakeNvml.with_layouts(
                "A100-SXM4-40GB", [[f"1g.5gb@{i}" for i in range(7)], ["3g.20gb@0", "3g.20gb@4"]]
            )
        return FakeNvml.with_layouts("A100-SXM4-40GB", [None, None])  # two whole GPUs, MIG off

    def follow_mig_manager(self) -> None:
        """What the MIG manager applied to the node (label state ``success``), its GPUs now have."""
        labels = self.core.read_node(self.node).metadata.labels or {}
        applied = labels.get(MIG_CONFIG_LABEL) if labels.get(MIG_CONFIG_STATE_LABEL) == "success" else None
        if applied and applied != self.mig_config:
            self.mig_config = applied
            self.gpus = self._gpus()

    def adapter(self, name: str):
        with self.sessions() as session:
            (info,) = [c for c in list_clusters(session) if c.name == name]
        return self.pool.get(info)

    def cycle(self) -> None:
        """gpu01's agent reports, one scheduling cycle runs, and the inventory is checked."""
        self.follow_mig_manager()
        with self.sessions() as session, session.begin():
            save_report(session, collect(self.gpus, self.node, now=self.clock), by="agent", now=self.clock())
        self.scheduler.run_cycle()
        self.cycles += 1
        inventories = {
            name: ClusterInventory(name=name, kind=kind, units=self.adapter(name).inventory())
            for name, kind in (("slurm-a", "slurm"), ("k8s-a", "k8s"))
        }
        with self.sessions() as session:
            reports = load_reports(session)
        # (the other node both clusters list is in no pool of this test's policy: it is offered twice)
        findings = reconcile(inventories, reports, now=self.clock()).findings
        twice = [f for f in findings if f.kind == "gpu_claimed_twice" and f.node == self.node]
        fenced = [name for name in ("slurm-a", "k8s-a") if self.node in self.adapter(name).fenced()]
        if twice or not fenced:
            self.offered_twice.append((self.cycles, fenced, [f.what for f in twice]))

    def cycle_until(self, done, timeout: float = 60.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not done after {timeout:g} s: {what}; moves: {self.moves()}"
            self.cycle()
            time.sleep(0.2)

    def moves(self) -> list[tuple]:
        with self.sessions() as session:
            rows = session.scalars(select(NodeMove).order_by(NodeMove.id)).all()
            return [
                (
                    m.source,
                    m.target,
                    m.step,
                    # each step once, in order (draining notes each preemption too)
                    list(
                        dict.fromkeys(
                            session.scalars(
                                select(NodeMoveEvent.step)
                                .where(NodeMoveEvent.move_id == m.id)
                                .order_by(NodeMoveEvent.id)
                            ).all()
                        )
                    ),
                )
                for m in rows
            ]


@pytest.fixture
def make_site(engine, sessions, lend_slurm: SlurmTestCluster, tmp_path) -> Iterator[Callable[[str, str], Site]]:
    """A site lending ``node`` under ``policy``."""
    made: list[Site] = []
    clock = Clock()
    server = apiserver.start()
    kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
    api = config.new_client_from_config(config_file=kubeconfig)
    core = client.CoreV1Api(api)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR}})
    core.create_namespaced_config_map(
        OPERATOR,
        {
            "metadata": {"name": DEVICE_PLUGIN_CONFIG},
            "data": {"whole": "version: v1\n", "time-sliced-4": time_slicing(4).render()},
        },
    )
    core.create_namespaced_config_map(
        OPERATOR, {"metadata": {"name": DEFAULT_MIG_PARTED_CONFIG}, "data": {MIG_PARTED_KEY: MIG_PARTED}}
    )
    sim = simulator.Simulator(api, POOLS, device_plugin_config=DEVICE_PLUGIN_CONFIG).start()
    sim.create_nodes()
    pool = AdapterPool(clock)
    tmp_path.chmod(0o755)
    with sessions() as session, session.begin():
        add_cluster(
            session,
            name="slurm-a",
            kind="slurm",
            config={
                "slurm_conf": str(lend_slurm.conf),
                "jobcomp_file": str(lend_slurm.jobcomp),
                "workdir": str(tmp_path),
                "cache_seconds": 0,
                "gpu_types": "a100=A100-SXM4-40GB",
            },
            actor="root",
            now=clock(),
        )
        add_cluster(
            session,
            name="k8s-a",
            kind="k8s",
            config={"kubeconfig": kubeconfig, "namespace": "gpush", "create_namespace": True, "image": "python:3.11"},
            actor="root",
            now=clock(),
        )

    def make(node: str, policy: str) -> Site:
        with sessions() as session, session.begin():
            policystore.apply(
                session,
                policy,
                comment="lending",
                author="root",
                now=clock(),
                views=cluster_views(session, pool),
                base_version=None,
            )
        made.append(Site(engine, sessions, pool, clock, lend_slurm, core, node))
        return made[-1]

    yield make
    lend_slurm.cancel_all()
    for node in ("gpu01", "mig01"):
        lend_slurm.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
    pool.close()
    sim.stop()
    api.close()
    server.stop()


def test_inference_borrows_a_slurm_node_set_up_time_sliced_and_training_brings_it_back(make_site, lend_slurm):
    site = make_site("gpu01", WHOLE_NODE)
    # gpu01 is offered by both at first: Kubernetes fences it, Slurm (its home) keeps it.
    site.cycle()
    assert site.adapter("k8s-a").fenced() == {"gpu01": "lent to slurm-a (gpush lending pool)"}
    training = site.submit(kind="training", gpus=1, command=["sleep", "600"], preemptible=True)
    site.cycle_until(lambda: site.job(training).state == "running", what="training runs on Slurm")
    assert site.job(training).placement["node"] == "gpu01"

    # A burst of inference: t4-0 runs two replicas' worth, the rest waits, and gpu01 moves over.
    burst = [
        site.submit(
            kind="inference", isolation="none", gpu_memory_gb=4, command=["serve"], labels={"sim-duration": "6"}
        )
        for _ in range(6)
    ]
    site.cycle_until(lambda: all(site.job(j).state in ("running", "succeeded") for j in burst), what="the burst runs")
    first = site.moves()[0]
    assert first[:3] == ("slurm-a", "k8s-a", "done"), site.moves()
    assert first[3] == ["draining", "configuring", "joining", "done"]
    assert "gpu01" in site.adapter("slurm-a").fenced()
    assert "DRAIN" in lend_slurm.run("scontrol", "show", "node", "gpu01").stdout
    # Set up as the pool says: four time-slicing replicas a GPU, eight in all.
    units = [u for u in site.adapter("k8s-a").inventory() if u.node == "gpu01"]
    assert sum(u.capacity for u in units if u.sharing.value == "k8s/timeslice") == 8, units
    on_gpu01 = [j for j in burst if (site.job(j).placement or {}).get("node") == "gpu01"]
    assert on_gpu01, [site.job(j).placement for j in burst]
    # The training was preempted for the move and waits for Slurm: it is not lost.
    assert site.job(training).state in ("queued", "preempted", "running")

    # The burst ends; the training still waits, and gpu01 goes home to run it.
    site.cycle_until(lambda: all(site.job(j).state == "succeeded" for j in burst), what="the burst ends")
    site.cycle_until(
        lambda: site.job(training).state == "running" and len(site.moves()) >= 2,
        timeout=90,
        what="gpu01 goes back to Slurm and the training runs again",
    )
    back = site.moves()[1]
    assert back[:3] == ("k8s-a", "slurm-a", "done") and back[3] == ["draining", "joining", "done"], site.moves()
    assert site.job(training).placement["node"] == "gpu01"
    assert "DRAIN" not in lend_slurm.run("scontrol", "show", "node", "gpu01").stdout
    assert "gpu01" in site.adapter("k8s-a").fenced()
    # Never offered by both, in any cycle.
    assert site.offered_twice == [], site.offered_twice


def test_inference_borrows_a_slurm_mig_node_time_sliced_and_training_brings_it_back(make_site, lend_slurm):
    """The issue's case: Slurm's MIG node goes to Kubernetes time-slicing for a burst of
    inference (the MIG manager turns MIG off there) and comes back to Slurm's MIG layout when
    training waits again (the MIG manager gives the layout back before it leaves)."""
    site = make_site("mig01", MIG_NODE)
    site.cycle()
    assert site.adapter("k8s-a").fenced() == {"mig01": "lent to slurm-a (gpush lending pool)"}
    training = site.submit(
        kind="training", isolation="hardware", gpu_memory_gb=20, command=["sleep", "600"], preemptible=True
    )
    site.cycle_until(lambda: site.job(training).state == "running", what="training runs on a 3g.20gb of mig01")
    assert site.job(training).placement["mig_profile"] == "3g.20gb"

    burst = [
        site.submit(kind="inference", isolation="none", gpu_memory_gb=4, command=["serve"], labels=SHORT)
        for _ in range(6)
    ]
    site.cycle_until(lambda: all(site.job(j).state in ("running", "succeeded") for j in burst), what="the burst runs")
    first = site.moves()[0]
    assert first[:3] == ("slurm-a", "k8s-a", "done") and first[3] == ["draining", "configuring", "joining", "done"]
    assert site.mig_config == "all-disabled"  # MIG off: two whole GPUs, four time-slices each
    units = [u for u in site.adapter("k8s-a").inventory() if u.node == "mig01"]
    assert sum(u.capacity for u in units if u.sharing.value == "k8s/timeslice") == 8, units
    assert not [u for u in units if u.sharing.value == "k8s/mig" and u.capacity]

    site.cycle_until(lambda: all(site.job(j).state == "succeeded" for j in burst), what="the burst ends")
    site.cycle_until(
        lambda: site.job(training).state == "running" and len(site.moves()) >= 2,
        timeout=90,
        what="mig01 goes back to Slurm with its MIG layout and the training runs again",
    )
    back = site.moves()[1]
    assert back[:3] == ("k8s-a", "slurm-a", "done") and back[3] == ["draining", "configuring", "joining", "done"]
    assert site.mig_config == "slurm-layout"
    assert site.job(training).placement["mig_profile"] == "3g.20gb"
    node = lend_slurm.run("scontrol", "show", "node", "mig01").stdout
    assert "DRAIN" not in node and "gpu:1g.5gb:7" in node
    assert site.offered_twice == [], site.offered_twice
    with site.sessions() as session:  # no drift: the agent's GPUs are what Slurm's gres.conf says
        reports = load_reports(session)
    inventories = {
        name: ClusterInventory(name=name, kind=kind, units=site.adapter(name).inventory())
        for name, kind in (("slurm-a", "slurm"), ("k8s-a", "k8s"))
    }
    findings = reconcile(inventories, reports, now=site.clock()).findings
    critical = [f.what for f in findings if f.severity == "critical" and f.node == "mig01"]
    assert critical == []
