"""The reconciled inventory: clusters' units checked against what the node agents see.

Units come from the adapters' own code: the Slurm adapter's inventory over recorded
``sinfo``/``squeue`` answers (tests/data/slurm/2205) or nodes written in that shape,
and the Kubernetes adapter's ``node_units`` over Node objects (tests/data/k8s). Agent
reports are NodeReports as ``gpush agent`` posts them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from adapters.k8s.inventory import node_units
from adapters.slurm.adapter import SlurmAdapter
from adapters.slurm.records import SlurmJob, SlurmNode, parse_gres
from broker.core.adapter import CapacityUnit, Sharing
from broker.core.gpus import model_of_nvml_product
from broker.inventory.agent_report import GpuProcess, GpuReport, MigInstance, NodeReport
from broker.inventory.reconcile import reconcile
from broker.inventory.view import (
    CRITICAL,
    INFO,
    WARNING,
    ClusterInventory,
    Finding,
    Inventory,
    UnitRef,
    UnitUse,
    mark_broken,
)
from broker.routing.policy import cluster_view

DATA = Path(__file__).resolve().parents[1] / "data"
NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
A100_40 = "NVIDIA A100-SXM4-40GB"


# -- the three sources, built as the real ones build them --------------------------------


class StubSlurm:
    """A SlurmClient that answers only what inventory() reads: nodes and jobs."""

    def __init__(self, nodes: Sequence[SlurmNode], jobs: Sequence[SlurmJob] = ()):
        self._nodes, self._jobs = list(nodes), list(jobs)

    def nodes(self) -> list[SlurmNode]:
        return self._nodes

    def jobs(self) -> list[SlurmJob]:
        return self._jobs


def slurm_node(name: str, gres: str, used: str = "", states: tuple[str, ...] = ("IDLE",)) -> SlurmNode:
    return SlurmNode(name, states, tuple(parse_gres(gres)), tuple(parse_gres(used)), ("gpu",), 64, 512_000)


def slurm_units(*nodes: SlurmNode, name: str = "slurm-a", jobs: Sequence[SlurmJob] = ()) -> list[CapacityUnit]:
    return SlurmAdapter(name, {"cache_seconds": 0}, client=StubSlurm(nodes, jobs)).inventory()


def recorded_slurm_units() -> list[CapacityUnit]:
    """slurm-a as recorded on Slurm 22.05: mig01 (1g.5gb:7, 3g.20gb:2), mps01, gpu01 (a100:2)."""
    nodes = [SlurmNode.of(raw) for raw in json.loads((DATA / "slurm" / "2205" / "sinfo.json").read_text())["nodes"]]
    jobs = [SlurmJob.of(raw) for raw in json.loads((DATA / "slurm" / "2205" / "squeue.json").read_text())["jobs"]]
    return slurm_units(*nodes, jobs=jobs)


def recorded_k8s_node(key: str) -> dict[str, Any]:
    return copy.deepcopy(json.loads((DATA / "k8s" / "nodes.json").read_text())[key])


def k8s_units(*nodes: dict[str, Any], name: str = "k8s-a", held: dict[str, dict[str, int]] | None = None, **kw):
    units: list[CapacityUnit] = []
    for node in nodes:
        units += node_units(name, node, (held or {}).get(node["metadata"]["name"], {}), **kw)
    return units


def k8s_whole_node(name: str, count: int, product: str = "NVIDIA-A100-SXM4-40GB") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(count),
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
            },
        },
        "spec": {},
        "status": {"allocatable": {"nvidia.com/gpu": str(count)}, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def gpu(
    index: int,
    product: str = A100_40,
    *,
    mig: Sequence[str] | None = None,
    mps: bool = False,
    pending: bool | None = None,
    error: str | None = None,
    uuid: str | None = None,
    processes: int = 0,
    no_compute: Sequence[str] = (),
    node: str = "n",
) -> GpuReport:
    instances = [
        MigInstance(
            profile=p, gi_id=n + 1, ci_id=0, uuid=f"MIG-{node}-{index}-{n}", placement_start=n, placement_size=1
        )
        for n, p in enumerate(mig or ())
    ]
    instances += [
        MigInstance(profile=p, gi_id=20 + n, placement_start=n, placement_size=1) for n, p in enumerate(no_compute)
    ]
    in_mig = mig is not None or bool(no_compute)
    return GpuReport(
        index=index,
        uuid=uuid or f"GPU-{node}-{index}",
        product=None if error else product,
        memory_mb=None if error else 40960,
        mig_mode_current=None if error else in_mig,
        mig_mode_pending=(in_mig if pending is None else pending) if not error else None,
        mig_instances=instances,
        mps=mps,
        processes=[GpuProcess(pid=1000 + n, used_memory_mb=100) for n in range(processes)],
        error=error,
    )


def agent(node: str, gpus: Sequence[GpuReport], *, at: datetime = NOW, error: str | None = None) -> NodeReport:
    """A report from ``node``; GPUs built without a node name get UUIDs of this node."""
    gpus = [g.model_copy(update={"uuid": f"GPU-{node}-{g.index}"}) if g.uuid == f"GPU-n-{g.index}" else g for g in gpus]
    return NodeReport(
        node=node, agent_version="0.1", collected_at=at, driver_version="550.54", gpus=list(gpus), error=error
    )


def slurm(units: list[CapacityUnit], name: str = "slurm-a", **kw) -> ClusterInventory:
    return ClusterInventory(name, "slurm", units, **kw)


def k8s(units: list[CapacityUnit], name: str = "k8s-a", **kw) -> ClusterInventory:
    return ClusterInventory(name, "k8s", units, **kw)


def run(*clusters: ClusterInventory, reports: Sequence[NodeReport] = (), **kw) -> Inventory:
    return reconcile({c.name: c for c in clusters}, {r.node: r for r in reports}, now=NOW, **kw)


def kinds(inventory: Inventory) -> list[tuple[str, str, str | None, str | None]]:
    return [(f.kind, f.severity, f.cluster, f.node) for f in inventory.findings]


def only(inventory: Inventory, kind: str) -> Finding:
    (found,) = [f for f in inventory.findings if f.kind == kind]
    return found


def node_view(inventory: Inventory, cluster: str, node: str):
    return next(n for c in inventory.clusters if c.name == cluster for n in c.nodes if n.name == node)


# The recorded cluster's real GPUs: mig01 has two A100-40GB (seven 1g.5gb; two 3g.20gb),
# mps01 one under MPS, gpu01 two whole ones. t4-1 has two T4s, a100-1 two A100s in MIG
# (mixed strategy: 3g.20gb + two 1g.5gb each), h100-1 eight H100s.
def consistent_reports() -> list[NodeReport]:
    return [
        agent("mig01", [gpu(0, mig=["1g.5gb"] * 7, node="mig01"), gpu(1, mig=["3g.20gb"] * 2, node="mig01")]),
        agent("mps01", [gpu(0, mps=True, node="mps01")]),
        agent("gpu01", [gpu(0, node="gpu01"), gpu(1, node="gpu01")]),
        agent("t4-1", [gpu(i, "Tesla T4", node="t4-1") for i in range(2)]),
        agent("a100-1", [gpu(i, mig=["3g.20gb", "1g.5gb", "1g.5gb"], node="a100-1") for i in range(2)]),
        agent("h100-1", [gpu(i, "NVIDIA H100 80GB HBM3", node="h100-1") for i in range(8)]),
    ]


def consistent_clusters() -> list[ClusterInventory]:
    nodes = [recorded_k8s_node(k) for k in ("t4-timeslice", "a100-mig-mixed", "h100-whole")]
    return [slurm(recorded_slurm_units()), k8s(k8s_units(*nodes, held={"t4-1": {"nvidia.com/gpu": 5}}))]


# -- a consistent fleet -------------------------------------------------------------------


def test_a_consistent_inventory_has_no_findings_and_nothing_broken():
    clusters = consistent_clusters()
    inventory = run(*clusters, reports=consistent_reports())
    assert inventory.findings == []
    for cluster in clusters:
        assert mark_broken(cluster.units, inventory.findings) == list(cluster.units)
        assert all(u.broken is None for u in inventory.units(cluster.name))
    for view in inventory.clusters:
        for node in view.nodes:
            assert node.agent == "ok"
            assert all(u.unplaced == 0 and u.broken is None for u in node.units)
            assert all(g.verified for g in node.gpus)


def test_gpu_equivalents_add_up():
    inventory = run(*consistent_clusters(), reports=consistent_reports())
    t4 = node_view(inventory, "k8s-a", "t4-1")
    # 8 nvidia.com/gpu time-slice replicas on 2 GPUs are 2 GPU-equivalents, 5 replicas held
    assert t4.capacity_gpu_equivalents == pytest.approx(2.0)
    assert t4.allocated_gpu_equivalents == pytest.approx(5 / 4)
    assert [(g.index, g.mode, g.slices[0].capacity, g.slices[0].allocated) for g in t4.gpus] == [
        (0, "timeslice x4", 4, 4),
        (1, "timeslice x4", 4, 1),
    ]
    mig01 = node_view(inventory, "slurm-a", "mig01")
    assert mig01.capacity_gpu_equivalents == pytest.approx(7 / 7 + 2 * 3 / 7)
    assert [g.capacity_gpu_equivalents for g in mig01.gpus] == [pytest.approx(1.0), pytest.approx(6 / 7)]
    assert mig01.gpus[0].slices[0].instances[0] == "MIG-mig01-0-0"
    assert mig01.gpus[0].uuid == "GPU-mig01-0" and mig01.gpus[0].model == "A100-SXM4-40GB"

    k8s_view, slurm_view = inventory.clusters  # in name order
    whole, by_mode = slurm_view.totals()
    assert whole.capacity == pytest.approx(13 / 7 + 1 + 2)
    assert by_mode["slurm/mps"].capacity == pytest.approx(1.0)
    assert by_mode["slurm/mps"].allocated == pytest.approx(0.25)  # the recorded mps:25 job
    assert by_mode["slurm/mig"].free == pytest.approx(1 * 3 / 7)  # 7 small busy, one 3g free
    k8s_whole, k8s_modes = k8s_view.totals()
    assert k8s_modes["k8s/timeslice"].capacity == pytest.approx(2.0)
    assert k8s_modes["k8s/mig"].capacity == pytest.approx(2 * 3 / 7 + 4 / 7)
    assert k8s_modes["k8s/exclusive"].capacity == pytest.approx(8.0)
    assert slurm_view.physical_gpus() == 5 and k8s_view.physical_gpus() == 12


def test_json_and_table_views():
    inventory = run(*consistent_clusters(), reports=consistent_reports())
    data = json.loads(json.dumps(inventory.to_dict()))
    assert data["findings_by_severity"] == {"critical": 0, "warning": 0, "info": 0}
    slurm_json = data["clusters"][1]
    assert slurm_json["totals"]["capacity"] == pytest.approx(13 / 7 + 3, abs=1e-3)
    mig01 = next(n for n in slurm_json["nodes"] if n["name"] == "mig01")
    assert mig01["gpus"][1]["slices"][0]["mig_profile"] == "3g.20gb"
    assert mig01["units"][0]["labels"]["gres"] == "gpu:1g.5gb:7"

    table = inventory.table()
    timeslice = next(r for r in table["clusters"] if r["sharing"] == "k8s/timeslice")
    assert (timeslice["cluster"], timeslice["capacity"], timeslice["allocated"]) == ("k8s-a", 2.0, 1.25)
    rows = [r for r in table["gpus"] if r["node"] == "mig01"]
    assert [(r["gpu"], r["mode"], r["slices"]) for r in rows] == [(0, "mig", "1g.5gb 7/7"), (1, "mig", "3g.20gb 1/2")]
    assert {r["node"] for r in table["nodes"]} >= {"mig01", "t4-1", "h100-1"}


def test_who_uses_a_unit():
    units = k8s_units(recorded_k8s_node("t4-timeslice"), held={"t4-1": {"nvidia.com/gpu": 2}})
    uses = [
        UnitUse("t4-1", Sharing.K8S_TIMESLICE, "job-7", gpu=0),
        UnitUse("t4-1", Sharing.K8S_TIMESLICE, "job-8", gpu=1),
    ]
    inventory = run(k8s(units, uses=uses), reports=[consistent_reports()[3]])
    t4 = node_view(inventory, "k8s-a", "t4-1")
    assert [g.slices[0].users for g in t4.gpus] == [("job-7",), ("job-8",)]


# -- Slurm's GRES against the MIG instances ---------------------------------------------------


def test_a_gres_type_with_no_mig_instance_is_critical_and_only_that_unit_breaks():
    units = slurm_units(slurm_node("mig02", "gpu:1g.5gb:7,gpu:2g.10gb:1"))
    report = agent("mig02", [gpu(0, mig=["1g.5gb"] * 7), gpu(1, mig=["3g.20gb"] * 2)])
    inventory = run(slurm(units), reports=[report])
    missing = only(inventory, "mig_profile_without_instance")
    assert (missing.severity, missing.cluster, missing.node) == (CRITICAL, "slurm-a", "mig02")
    assert "gpu:2g.10gb:1" in missing.what and "PENDING" in missing.why
    assert "gpush slurm gres-conf mig02" in missing.fix and "scontrol reconfigure" in missing.fix
    # the two 3g.20gb instances no GRES offers are capacity wasted
    assert only(inventory, "mig_count_below_nvml").severity == WARNING

    marked = mark_broken(units, inventory.findings)
    broken = {(u.mig_profile, bool(u.broken)) for u in marked}
    assert broken == {("1g.5gb", False), ("2g.10gb", True)}
    assert marked[0] is units[0]  # untouched units are the same objects
    view = cluster_view("slurm-a", "slurm", marked)
    assert set(view.mig_profiles) == {"1g.5gb"}  # the policy validator no longer sees 2g.10gb offered


def test_gres_counts_above_and_below_what_nvml_sees():
    units = slurm_units(slurm_node("mig03", "gpu:1g.5gb:7"), slurm_node("mig04", "gpu:1g.5gb:4"))
    reports = [agent("mig03", [gpu(0, mig=["1g.5gb"] * 4)]), agent("mig04", [gpu(0, mig=["1g.5gb"] * 7)])]
    inventory = run(slurm(units), reports=reports)
    assert kinds(inventory) == [
        ("mig_count_above_nvml", CRITICAL, "slurm-a", "mig03"),
        ("mig_count_below_nvml", WARNING, "slurm-a", "mig04"),
    ]
    above = inventory.findings[0]
    assert "counts 7 1g.5gb slices on mig03; NVML sees 4" in above.what
    marked = {u.node: u.broken for u in mark_broken(units, inventory.findings)}
    assert marked["mig03"] and marked["mig04"] is None
    assert node_view(inventory, "slurm-a", "mig03").units[0].unplaced == 3


def test_a_mig_instance_without_a_compute_instance_is_not_a_slice():
    units = slurm_units(slurm_node("mig05", "gpu:1g.5gb:7"))
    report = agent("mig05", [gpu(0, mig=["1g.5gb"] * 6, no_compute=["1g.5gb"])])
    inventory = run(slurm(units), reports=[report])
    assert [f.kind for f in inventory.findings] == ["mig_count_above_nvml", "mig_instance_without_compute_instance"]
    assert "without a compute instance" in inventory.findings[0].what
    assert "nvidia-smi mig -i 0 -gi 20 -cci" in inventory.findings[1].fix


def test_more_whole_gpus_than_exist():
    units = slurm_units(slurm_node("gpu02", "gpu:a100:4"))
    inventory = run(slurm(units), reports=[agent("gpu02", [gpu(0), gpu(1), gpu(2, mig=["7g.40gb"])])])
    found = only(inventory, "gpu_count_above_nvml")
    assert found.severity == CRITICAL and "only 2 are backed" in found.what and "1 in MIG mode" in found.what
    # the 7g.40gb instance nobody offers is wasted capacity
    assert only(inventory, "mig_count_below_nvml").severity == WARNING
    assert all(u.broken for u in mark_broken(units, inventory.findings))


def test_gpus_nobody_offers_on_a_listed_node():
    units = slurm_units(slurm_node("gpu03", "gpu:a100:2"))
    inventory = run(slurm(units), reports=[agent("gpu03", [gpu(i) for i in range(4)])])
    found = only(inventory, "gpus_not_offered")
    assert (found.severity, found.what) == (WARNING, "GPUs 2,3 of gpu03 (not in MIG mode) are offered by no cluster")


# -- MPS, MIG mode, lost GPUs ----------------------------------------------------------------


def test_mps_on_a_mig_gpu_is_critical_and_marks_the_mps_unit():
    units = slurm_units(slurm_node("mps02", "gpu:1g.5gb:7,mps:100"))
    report = agent("mps02", [gpu(0, mig=["1g.5gb"] * 7, mps=True)])
    inventory = run(slurm(units), reports=[report])
    found = only(inventory, "mps_on_mig_gpu")
    assert (found.severity, found.gpu) == (CRITICAL, 0)
    assert "nvidia-cuda-mps-control" in found.fix
    assert [f.kind for f in inventory.findings] == ["mps_on_mig_gpu"]
    marked = {u.sharing: u for u in mark_broken(units, inventory.findings)}
    assert marked[Sharing.SLURM_MPS].broken and marked[Sharing.SLURM_MPS].in_mig_mode
    assert marked[Sharing.SLURM_MIG].broken is None
    assert cluster_view("slurm-a", "slurm", list(marked.values())).mps_on_mig_nodes == ("mps02",)


def test_mig_mode_pending_a_reset():
    units = slurm_units(slurm_node("gpu04", "gpu:a100:2"))
    report = agent("gpu04", [gpu(0), gpu(1, pending=True)])
    inventory = run(slurm(units), reports=[report])
    found = only(inventory, "mig_mode_pending_reset")
    assert (found.severity, found.gpu) == (WARNING, 1)
    assert "nvidia-smi -i 1 -r" in found.fix and "state=drain" in found.fix
    assert mark_broken(units, inventory.findings) == units


def test_a_lost_gpu_the_cluster_still_offers_breaks_that_kind_on_that_node_only():
    units = slurm_units(slurm_node("gpu05", "gpu:a100:2"), slurm_node("gpu06", "gpu:a100:2"))
    reports = [
        agent("gpu05", [gpu(0), gpu(1, error="Unknown Error (GPU is lost)")]),
        agent("gpu06", [gpu(0), gpu(1)]),
    ]
    inventory = run(slurm(units), reports=reports)
    assert kinds(inventory) == [("gpu_lost", CRITICAL, "slurm-a", "gpu05")]
    assert inventory.findings[0].gpu == 1 and "nvidia-smi -i 1 -r" in inventory.findings[0].fix
    marked = {u.node: u.broken for u in mark_broken(units, inventory.findings)}
    assert marked["gpu05"] and marked["gpu06"] is None
    assert node_view(inventory, "slurm-a", "gpu05").gpus[1].error


def test_a_product_the_cluster_names_wrongly():
    # 1g.10gb is offered by A100-80GB and H100 alike; without gpu_types Slurm's adapter guesses the A100
    units = slurm_units(slurm_node("h100-9", "gpu:1g.10gb:7"))
    report = agent("h100-9", [gpu(0, "NVIDIA H100 80GB HBM3", mig=["1g.10gb"] * 7)])
    inventory = run(slurm(units), reports=[report])
    found = only(inventory, "gpu_model_mismatch")
    assert found.severity == WARNING and "H100-SXM5-80GB" in found.what
    assert "gpu_types=1g.10gb=H100-SXM5-80GB" in found.fix


def test_nvml_names_map_to_gpush_models():
    assert model_of_nvml_product("NVIDIA A100-SXM4-80GB").name == "A100-SXM4-80GB"
    assert model_of_nvml_product("NVIDIA A100 80GB PCIe").name == "A100-SXM4-80GB"
    assert model_of_nvml_product("NVIDIA H100 80GB HBM3").name == "H100-SXM5-80GB"
    assert model_of_nvml_product("Tesla T4").name == "T4"
    assert model_of_nvml_product("NVIDIA GeForce RTX 4090") is None


def test_processes_no_scheduler_knows_of():
    units = slurm_units(slurm_node("gpu07", "gpu:a100:2"))
    inventory = run(slurm(units), reports=[agent("gpu07", [gpu(0, processes=2), gpu(1)])])
    assert kinds(inventory) == [("processes_outside_scheduler", WARNING, "slurm-a", "gpu07")]


# -- Kubernetes ------------------------------------------------------------------------


def test_time_slice_replicas_that_differ_from_the_configmap():
    units = k8s_units(recorded_k8s_node("t4-timeslice"), expected_replicas=2, expected_from="ConfigMap x key any")
    inventory = run(k8s(units), reports=[consistent_reports()[3]])
    found = only(inventory, "timeslice_drift")
    assert (found.severity, found.node) == (WARNING, "t4-1")
    assert "says 2" in found.what
    assert "gpush k8s timeslice apply k8s-a --replicas 2" in found.fix and "device-plugin" in found.fix
    assert mark_broken(units, inventory.findings) == units


def test_the_single_mig_strategy():
    units = k8s_units(recorded_k8s_node("single-mig"))
    report = agent("a100-2", [gpu(i, mig=["1g.5gb"] * 7, node="a100-2") for i in range(2)])
    inventory = run(k8s(units), reports=[report])
    assert kinds(inventory) == [("k8s_mig_strategy_single", CRITICAL, "k8s-a", "a100-2")]
    assert "strategy" in inventory.findings[0].fix and "mixed" in inventory.findings[0].fix


def test_a_k8s_mig_resource_with_no_instance_points_to_the_device_plugin():
    node = recorded_k8s_node("a100-mig-mixed")
    inventory = run(
        k8s(k8s_units(node)), reports=[agent("a100-1", [gpu(i, mig=["3g.20gb", "3g.20gb"]) for i in (0, 1)])]
    )
    found = only(inventory, "mig_profile_without_instance")
    assert found.cluster == "k8s-a" and "nvidia.com/mig-1g.5gb" in found.what
    assert "nvidia-device-plugin-daemonset" in found.fix


def test_k8s_device_indexes_count_only_gpus_not_in_mig_mode():
    # GPU 0 in MIG mode (mixed strategy), GPUs 1 and 2 time-sliced: the device plugin's
    # GPUs 0 and 1 are NVML's 1 and 2
    node = recorded_k8s_node("t4-timeslice")
    node["metadata"]["labels"]["nvidia.com/mig-1g.5gb.count"] = "7"
    node["status"]["allocatable"]["nvidia.com/mig-1g.5gb"] = "7"
    units = k8s_units(node)
    report = agent("t4-1", [gpu(0, mig=["1g.5gb"] * 7), gpu(1, "Tesla T4"), gpu(2, "Tesla T4")])
    inventory = run(k8s(units), reports=[report])
    view = node_view(inventory, "k8s-a", "t4-1")
    assert [(g.index, g.mode) for g in view.gpus] == [(0, "mig"), (1, "timeslice x4"), (2, "timeslice x4")]
    assert [f.kind for f in inventory.findings] == []


# -- one GPU, two clusters ---------------------------------------------------------------


def test_a_node_in_both_clusters_offering_the_same_gpus():
    slurm_side = slurm_units(slurm_node("shared01", "gpu:a100:2"))
    k8s_side = k8s_units(k8s_whole_node("shared01", 2))
    report = agent("shared01", [gpu(0, node="shared01"), gpu(1, node="shared01")])
    inventory = run(slurm(slurm_side), k8s(k8s_side), reports=[report])
    assert kinds(inventory) == [
        ("gpu_claimed_twice", CRITICAL, "k8s-a", "shared01"),
        ("gpu_claimed_twice", CRITICAL, "slurm-a", "shared01"),
    ]
    assert "GPU-shared01-0" in inventory.findings[0].what and "slurm-a" in inventory.findings[0].what
    assert all(u.broken for u in mark_broken(slurm_side, inventory.findings))
    assert all(u.broken for u in mark_broken(k8s_side, inventory.findings))
    assert node_view(inventory, "slurm-a", "shared01").gpus[0].clusters == ("k8s-a", "slurm-a")


def test_a_node_lent_between_two_clusters_is_offered_by_one_or_none():
    """Lending (broker.fleet.lending) keeps a shared node unavailable on one side, or on
    both while it moves: neither is a GPU offered twice."""
    report = agent("shared01", [gpu(0, node="shared01"), gpu(1, node="shared01")])
    drained = slurm_units(slurm_node("shared01", "gpu:a100:2", states=("IDLE", "DRAIN")))
    cordoned = k8s_units(k8s_whole_node("shared01", 2))
    for unit in cordoned:
        unit.labels["unavailable"] = "node shared01 is cordoned"
    lent = run(slurm(drained), k8s(k8s_units(k8s_whole_node("shared01", 2))), reports=[report])
    assert [f.kind for f in lent.findings if f.severity != "info"] == []
    assert [g.clusters for g in node_view(lent, "k8s-a", "shared01").gpus] == [("k8s-a",), ("k8s-a",)]
    moving = run(slurm(drained), k8s(cordoned), reports=[report])
    assert [f.kind for f in moving.findings if f.severity != "info"] == []


def test_a_node_split_between_two_clusters_is_fine():
    slurm_side = slurm_units(slurm_node("split01", "gpu:a100:2"))
    k8s_side = k8s_units(k8s_whole_node("split01", 2))
    report = agent("split01", [gpu(i) for i in range(4)])
    inventory = run(slurm(slurm_side), k8s(k8s_side), reports=[report])
    assert inventory.findings == []
    # clusters are dealt GPUs in name order: k8s-a the first two, slurm-a the others
    assert [g.clusters for g in node_view(inventory, "slurm-a", "split01").gpus] == [
        ("k8s-a",),
        ("k8s-a",),
        ("slurm-a",),
        ("slurm-a",),
    ]


def test_a_node_in_both_clusters_without_an_agent_is_refused():
    slurm_side = slurm_units(slurm_node("shared02", "gpu:a100:2"))
    k8s_side = k8s_units(k8s_whole_node("shared02.example.com", 2))  # one host, two spellings
    inventory = run(slurm(slurm_side), k8s(k8s_side))
    assert [(f.kind, f.cluster) for f in inventory.findings if f.severity == CRITICAL] == [
        ("gpu_claimed_twice", "k8s-a"),
        ("gpu_claimed_twice", "slurm-a"),
    ]
    assert all(u.broken for u in mark_broken(slurm_side + k8s_side, inventory.findings))


def test_one_gpu_under_two_node_names_by_uuid():
    slurm_side = slurm_units(slurm_node("gpu08", "gpu:a100:1"))
    k8s_side = k8s_units(k8s_whole_node("worker-8", 1))
    reports = [agent("gpu08", [gpu(0, uuid="GPU-abc")]), agent("worker-8", [gpu(0, uuid="GPU-abc")])]
    inventory = run(slurm(slurm_side), k8s(k8s_side), reports=reports)
    assert kinds(inventory) == [
        ("gpu_claimed_twice", CRITICAL, "k8s-a", "worker-8"),
        ("gpu_claimed_twice", CRITICAL, "slurm-a", "gpu08"),
    ]
    assert "GPU-abc" in inventory.findings[0].what
    assert all(u.broken for u in mark_broken(slurm_side + k8s_side, inventory.findings))


# -- agents missing, stale, unknown ---------------------------------------------------------


def test_nodes_without_an_agent_and_agents_without_a_node():
    units = slurm_units(slurm_node("gpu09", "gpu:a100:2"), slurm_node("gpu10", "gpu:a100:2"))
    reports = [agent("gpu09", [gpu(0), gpu(1)]), agent("orphan1", [gpu(0), gpu(1)])]
    inventory = run(slurm(units), reports=reports)
    assert kinds(inventory) == [
        ("unscheduled_gpus", WARNING, None, "orphan1"),
        ("no_agent_report", WARNING, "slurm-a", "gpu10"),
    ]
    assert inventory.findings[1].what == "no agent reports on gpu10; its GPUs are unverified"
    assert [n.name for n in inventory.unscheduled] == ["orphan1"]
    assert node_view(inventory, "slurm-a", "gpu10").agent == "missing"


def test_a_cluster_without_any_agent_gets_one_finding():
    inventory = run(slurm(recorded_slurm_units()))
    assert kinds(inventory) == [("no_agents", INFO, "slurm-a", None)]


def test_a_stale_report_is_shown_but_not_believed():
    units = slurm_units(slurm_node("mig06", "gpu:2g.10gb:3"))
    old = agent("mig06", [gpu(0, mig=["1g.5gb"] * 7)], at=NOW - timedelta(hours=2))
    inventory = run(slurm(units), reports=[old])
    assert kinds(inventory) == [("agent_report_stale", WARNING, "slurm-a", "mig06")]
    assert "2 h ago" in inventory.findings[0].what
    assert mark_broken(units, inventory.findings) == units
    view = node_view(inventory, "slurm-a", "mig06")
    assert view.agent == "stale" and not view.gpus[0].verified


def test_an_agent_that_cannot_read_nvml():
    units = slurm_units(slurm_node("gpu11", "gpu:a100:2"))
    inventory = run(slurm(units), reports=[agent("gpu11", [], error="NVML Shared Library Not Found")])
    assert kinds(inventory) == [("agent_nvml_error", WARNING, "slurm-a", "gpu11")]


def test_a_cluster_that_did_not_answer():
    report = agent("gpu12", [gpu(0)])
    inventory = run(slurm([], error="slurmctld timed out"), reports=[report])
    assert kinds(inventory) == [
        ("cluster_unreachable", WARNING, "slurm-a", None),
        ("unscheduled_gpus", INFO, None, "gpu12"),  # it may be that cluster's
    ]


def test_mark_broken_is_precise_per_gpu():
    node = recorded_k8s_node("t4-timeslice")
    units = k8s_units(node)
    finding = Finding(
        "gpu_lost", CRITICAL, "k8s-a", "t4-1", "GPU 1 lost", "", "", gpu=1, breaks=(UnitRef.of(units[1]),)
    )
    marked = mark_broken(units, [finding])
    assert [u.broken for u in marked] == [None, "GPU 1 lost"]
    other = mark_broken(units, [Finding("x", CRITICAL, "k8s-a", "other", "no", "", "", breaks=(UnitRef.of(units[1]),))])
    assert other == units
    warning = mark_broken(units, [Finding("x", WARNING, "k8s-a", "t4-1", "no", "", "", breaks=(UnitRef.of(units[1]),))])
    assert warning == units
