"""Topology in the reconciled inventory: the agent's NVML reading replaces gres.conf's on a
node's units (what placement reads), and two drift warnings that never break a unit:
NVLink islands that gres.conf ``Links=`` say otherwise than NVML (``nvlink_islands_differ``)
and a node without a domain at a network level its cluster names (``network_level_missing``).

Agent reports are what ``gpush agent`` collects from the synthetic NVML data of
tests/data/nvml; units are CapacityUnits carrying what the adapters fill.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.models import NodeReport as NodeReportRow
from broker.core.topology import GpuTopology
from broker.inventory.agent_report import NodeReport
from broker.inventory.report_store import DriftWatch, save_report
from broker.inventory.view import ClusterInventory, Finding, Inventory, mark_broken
from broker.nodeagent.agent import collect
from broker.nodeagent.nvml import RecordedLibrary
from tests.inventory.test_reconcile import NOW, k8s, node_view, run, slurm

NVML = Path(__file__).resolve().parents[1] / "data" / "nvml"
PAIRS = "a100pcie-01"  # a100-pcie-nvlink-pairs.json: NVLink bridges 0-1, 2-3, 4-5, 6-7
DGX = "dgxh100-01"  # h100-80gb-dgx.json: one NVSwitch island of 8, GPU 0 in MIG mode


def agent_report(recording: str, node: str, at=NOW) -> NodeReport:
    library = RecordedLibrary(NVML / recording)
    return collect(library, node, process_name=None, mps_control=None, now=lambda: at)


def whole(node: str, count: int, cluster: str = "slurm-a", sharing=Sharing.SLURM_EXCLUSIVE, **kw) -> CapacityUnit:
    return CapacityUnit(
        cluster=cluster,
        node=node,
        sharing=sharing,
        gpu_model="A100-SXM4-80GB",
        unit_memory_gb=80,
        capacity=count,
        allocated=0,
        gpu_equivalent=1.0,
        gpus=tuple(range(count)),
        **kw,
    )


def gres_links(count: int, pairs: list[tuple[int, int]]) -> GpuTopology:
    """What the Slurm adapter makes of gres.conf Links= (the pairs with a link)."""
    return GpuTopology.from_links(range(count), pairs, source="gres.conf")


def of_kind(inventory: Inventory, kind: str) -> list[Finding]:
    return [f for f in inventory.findings if f.kind == kind]


# -- NVML's groups are the ones units carry ------------------------------------------------


def test_the_agents_nvml_groups_replace_gres_conf_on_the_units_and_in_the_view():
    says = gres_links(8, [(0, 1), (2, 3), (4, 5), (6, 7)])
    unit = whole(PAIRS, 8, gpu_topology=says, labels={"gres": "gpu:a100:8"})
    inventory = run(slurm([unit]), reports=[agent_report("a100-pcie-nvlink-pairs.json", PAIRS)])

    (placed,) = inventory.units("slurm-a")
    assert placed.gpu_topology.source == "nvml"
    assert placed.gpu_topology.nvlink == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert placed.gpu_topology.socket == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert inventory.gpu_topologies == {("slurm-a", PAIRS): placed.gpu_topology}
    body = node_view(inventory, "slurm-a", PAIRS).to_dict()
    assert body["gpu_topology"]["source"] == "nvml" and body["gpu_topology"]["nvlink"] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    gpu = body["gpus"][0]
    assert (gpu["numa_node"], gpu["cpu_affinity"], gpu["nvlinks"]) == (
        0,
        "0-63",
        [{"kind": "gpu", "gpu": 1, "pci_bus_id": "00000000:1C:00.0", "links": 12}],
    )
    assert of_kind(inventory, "nvlink_islands_differ") == []  # gres.conf agrees


def test_a_stale_report_leaves_the_clusters_groups():
    says = gres_links(8, [(0, 1)])
    stale = agent_report("a100-pcie-nvlink-pairs.json", PAIRS, at=NOW - timedelta(hours=1))
    inventory = run(slurm([whole(PAIRS, 8, gpu_topology=says)]), reports=[stale])
    assert inventory.units("slurm-a")[0].gpu_topology == says
    assert node_view(inventory, "slurm-a", PAIRS).gpu_topology == says
    assert of_kind(inventory, "nvlink_islands_differ") == [] and inventory.gpu_topologies == {}


def test_a_kubernetes_nodes_groups_are_renumbered_to_the_device_plugins_indexes():
    # GPU 0 of the DGX is in MIG mode: the device plugin's whole GPUs 0-6 are NVML's 1-7.
    unit = whole(DGX, 7, cluster="k8s-a", sharing=Sharing.K8S_EXCLUSIVE)
    inventory = run(k8s([unit]), reports=[agent_report("h100-80gb-dgx.json", DGX)])
    topology = inventory.units("k8s-a")[0].gpu_topology
    assert topology.nvlink == ((0, 1, 2, 3, 4, 5, 6),)
    assert topology.socket == ((0, 1, 2), (3, 4, 5, 6))


def test_the_schedulers_units_carry_the_agents_groups(sessions, clock):
    says = gres_links(8, [])
    with sessions.begin() as session:
        save_report(session, agent_report("a100-pcie-nvlink-pairs.json", PAIRS, at=clock()), by="agent", now=clock())
    info = type("Info", (), {"kind": "slurm"})()
    with sessions.begin() as session:
        out = DriftWatch().apply(
            session, {"slurm-a": [whole(PAIRS, 8, gpu_topology=says)]}, {"slurm-a": info}, now=clock()
        )
        assert session.query(NodeReportRow).count() == 1
    (unit,) = out["slurm-a"]
    assert unit.gpu_topology.source == "nvml" and unit.gpu_topology.islands() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert unit.broken is None


# -- nvlink_islands_differ -----------------------------------------------------------------


def test_gres_conf_links_that_join_other_gpus_are_a_warning_with_the_lines_to_write():
    says = gres_links(8, [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)])  # islands 0-3, 4-7
    unit = whole(PAIRS, 8, gpu_topology=says, labels={"gres": "gpu:a100:8"})
    inventory = run(slurm([unit]), reports=[agent_report("a100-pcie-nvlink-pairs.json", PAIRS)])

    (finding,) = of_kind(inventory, "nvlink_islands_differ")
    assert (finding.severity, finding.cluster, finding.node, finding.breaks) == ("warning", "slurm-a", PAIRS, ())
    assert "Links= make NVLink islands 0-3, 4-7 while NVML sees 0-1, 2-3, 4-5, 6-7" in finding.what
    assert "GPUs 0,1,2,3,4,5,6,7 differ" in finding.what
    assert f"`NodeName={PAIRS} Name=gpu Type=a100 File=/dev/nvidia0 Links=-1,12,0,0,0,0,0,0`" in finding.fix
    assert f"`NodeName={PAIRS} Name=gpu Type=a100 File=/dev/nvidia7 Links=0,0,0,0,0,0,12,-1`" in finding.fix
    # A warning: nothing broken, placement goes on by NVML's islands.
    assert mark_broken([unit], inventory.findings) == [unit]
    assert inventory.units("slurm-a")[0].broken is None
    assert node_view(inventory, "slurm-a", PAIRS).units[0].broken is None


def test_an_nvswitch_node_whose_gres_conf_has_no_links_gets_the_switch_links_for_each_gpu():
    says = gres_links(8, [])  # Links= of zeros: islands of one
    unit = whole(DGX, 8, gpu_topology=says)
    inventory = run(slurm([unit]), reports=[agent_report("h100-80gb-dgx.json", DGX)])
    (finding,) = of_kind(inventory, "nvlink_islands_differ")
    assert "islands none while NVML sees 0-7" in finding.what
    assert f"NodeName={DGX} Name=gpu File=/dev/nvidia0 Links=-1,18,18,18,18,18,18,18`" in finding.fix
    assert "File=/dev/nvidia5 Links=18,18,18,18,18,-1,18,18`" in finding.fix


def test_gres_conf_without_links_or_agreeing_says_nothing():
    silent = whole(PAIRS, 8, gpu_topology=GpuTopology(pcie=((0, 1, 2, 3, 4, 5, 6, 7),), source="gres.conf"))
    nothing = whole(PAIRS, 8)
    for unit in (silent, nothing):
        inventory = run(slurm([unit]), reports=[agent_report("a100-pcie-nvlink-pairs.json", PAIRS)])
        assert of_kind(inventory, "nvlink_islands_differ") == []


def test_only_the_gpus_both_name_are_compared():
    # gres.conf lists GPUs 0-3 only, joined as NVML joins them.
    unit = whole(PAIRS, 4, gpu_topology=gres_links(4, [(0, 1), (2, 3)]))
    inventory = run(slurm([unit]), reports=[agent_report("a100-pcie-nvlink-pairs.json", PAIRS)])
    assert of_kind(inventory, "nvlink_islands_differ") == []


# -- network_level_missing -----------------------------------------------------------------


def test_a_slurm_node_outside_the_tree_gets_the_topology_conf_line():
    unit = whole("gpu07", 4, topology=(("switch2", None), ("switch", "s1")))
    inventory = run(slurm([unit]))
    (finding,) = of_kind(inventory, "network_level_missing")
    assert (finding.severity, finding.node, finding.breaks) == ("warning", "gpu07", ())
    assert finding.what == "gpu07 has no switch2 in slurm-a's network topology (it has switch s1)"
    assert "`SwitchName=<switch2 switch> Switches=<its switches>,s1`" in finding.fix
    assert "scontrol reconfigure" in finding.fix
    assert inventory.units("slurm-a")[0].broken is None


def test_a_slurm_node_in_no_block_and_no_leaf_switch():
    unit = whole("gpu08", 4, topology=(("block", None),))
    (finding,) = of_kind(run(slurm([unit])), "network_level_missing")
    assert "`BlockName=<block> Nodes=<its nodes>,gpu08`" in finding.fix
    leaf = whole("gpu09", 4, topology=(("switch", None),))
    (finding,) = of_kind(run(slurm([leaf])), "network_level_missing")
    assert "`SwitchName=<leaf switch> Nodes=<its nodes>,gpu09`" in finding.fix


def test_a_kubernetes_node_without_a_label_gets_the_kubectl_label_command():
    keyed = whole(
        "n1",
        2,
        cluster="k8s-a",
        sharing=Sharing.K8S_EXCLUSIVE,
        topology=(("cloud.example.com/block", "b1"), ("cloud.example.com/rack", None)),
    )
    (finding,) = of_kind(run(k8s([keyed])), "network_level_missing")
    assert "n1 has no cloud.example.com/rack" in finding.what
    assert finding.fix == "`kubectl label node n1 cloud.example.com/rack=<rack name>`"
    named = whole("n2", 2, cluster="k8s-a", sharing=Sharing.K8S_EXCLUSIVE, topology=(("rack", None),))
    (finding,) = of_kind(run(k8s([named])), "network_level_missing")
    assert finding.fix == "`kubectl label node n2 <the node label of level rack>=<rack name>`"


def test_a_node_with_every_level_has_no_finding():
    unit = whole("gpu10", 4, topology=(("block", "b1"), ("switch", "s1")))
    inventory = run(ClusterInventory("slurm-a", "slurm", [unit]))
    assert of_kind(inventory, "network_level_missing") == []
    assert node_view(inventory, "slurm-a", "gpu10").to_dict()["topology"] == [
        {"level": "block", "domain": "b1"},
        {"level": "switch", "domain": "s1"},
    ]
