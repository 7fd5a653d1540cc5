"""One reconciled GPU inventory: what the clusters offer, checked against what the GPUs are.

Three sources describe the same GPUs. Each cluster's adapter reports
:class:`~broker.core.adapter.CapacityUnit` records (per node and unit kind: whole GPUs, MIG
profiles, MPS shares, time-slice replicas); the node agent reports what NVML sees
(:class:`~broker.inventory.agent_report.NodeReport`: UUIDs, products, MIG mode and instances, MPS
daemons, errors). :func:`reconcile` merges them into one view, cluster → node → physical
GPU → slices, with capacity and use in units and in physical GPU-equivalents, and turns
every disagreement into a :class:`Finding` that says what is wrong, why it matters and
the command that fixes it. :func:`mark_broken` then sets ``CapacityUnit.broken`` on the
units a critical finding makes unusable, so the scheduler never routes onto them.

What callers may assume:

- **Pure.** No database, no network, no clock of its own (``now`` is passed in); the
  same inputs give the same view and the same findings, in a stable order.
- **Which GPU holds a unit is inferred where the cluster does not say.** Units that name
  their GPU (time-slicing and MPS per GPU) sit on that GPU; a Kubernetes unit's index is
  the device plugin's, which counts only GPUs not in MIG mode. Units that do not (Slurm's
  GRES counts, Kubernetes MIG resources, whole GPUs) are dealt to the GPUs the agent
  sees: MIG profiles to the MIG instances of that profile, MPS first to GPUs with an MPS
  daemon, whole GPUs to the GPUs not in MIG mode, in index order, GPUs no other cluster
  holds first. What a cluster offers beyond what the agent sees has no GPU
  (``unplaced``) and is a finding. A unit's allocation is dealt over its GPUs in index
  order when the cluster reports it per node (``SliceView.estimated``); node and
  cluster totals are exact.
- **Agents are optional.** A node without a fresh report is shown as the cluster
  reports it and is "unverified"; nothing is marked broken on the word of a stale
  report. A report older than ``stale_after`` is shown but not believed.
- **Nodes are matched by name**, exactly, else by short host name (``gpu01`` and
  ``gpu01.example.com`` are one host); GPUs across nodes by UUID.
- **Severity**: ``critical`` means jobs placed by the current inventory will strand
  (pend forever, fail at start, or share a GPU with another scheduler's jobs); the unit
  kinds a critical finding names in ``breaks`` are the ones :func:`mark_broken` marks,
  and only on that cluster and node. ``warning``: capacity wasted or a config that will
  bite later. ``info``: worth knowing.
- **Fast.** Every step is a dict lookup per node, unit or GPU: 10,000 nodes and 80,000
  GPUs reconcile in well under two seconds (integration/bench/inventory.py).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.gpus import gpu_model, model_of_nvml_product
from broker.inventory.agent_report import GpuReport, MigInstance, NodeReport

CRITICAL, WARNING, INFO = "critical", "warning", "info"
_SEVERITY_ORDER = {CRITICAL: 0, WARNING: 1, INFO: 2}
DEFAULT_STALE_AFTER = timedelta(minutes=5)

_MIG = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
_DEVICE_PLUGIN_RESTART = (
    "kubectl -n gpu-operator delete pod -l app=nvidia-device-plugin-daemonset --field-selector spec.nodeName={node}"
)


# -- inputs -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnitUse:
    """Who holds part of a unit: a job (gpush id or backend id) and how many units.
    ``gpu``: the device index, when the cluster or the broker's placement says it."""

    node: str
    sharing: Sharing
    job: str
    units: int = 1
    mig_profile: str | None = None
    gpu: int | None = None


@dataclass(frozen=True)
class ClusterInventory:
    """One cluster's answer: its units, or ``error`` when it did not answer."""

    name: str
    kind: str  # "slurm" | "k8s" | "sim"
    units: Sequence[CapacityUnit] = ()
    error: str | None = None
    uses: Sequence[UnitUse] = ()  # optional: who holds what


# -- findings ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnitRef:
    """A unit kind on a node, as its cluster reports it: ``gpu`` set only for a unit of one GPU."""

    sharing: Sharing
    mig_profile: str | None = None
    gpu: int | None = None

    @classmethod
    def of(cls, unit: CapacityUnit) -> UnitRef:
        return cls(unit.sharing, unit.mig_profile, unit.gpus[0] if len(unit.gpus) == 1 else None)

    def hits(self, unit: CapacityUnit) -> bool:
        if self.sharing is not unit.sharing:
            return False
        if self.mig_profile is not None and self.mig_profile != unit.mig_profile:
            return False
        # A unit spanning several GPUs (or not saying which) covers every GPU it may be on.
        return self.gpu is None or not unit.gpus or self.gpu in unit.gpus

    def to_dict(self) -> dict[str, Any]:
        return {"sharing": self.sharing.value, "mig_profile": self.mig_profile, "gpu": self.gpu}


@dataclass(frozen=True, slots=True)
class Finding:
    """One disagreement between the sources, with what it costs and how to fix it."""

    kind: str  # stable snake_case id
    severity: str  # critical | warning | info
    cluster: str | None  # None: no cluster lists the node
    node: str | None  # None: about the whole cluster
    what: str
    why: str
    fix: str
    gpu: int | None = None  # the device index NVML gives, when one GPU is concerned
    breaks: tuple[UnitRef, ...] = ()  # the unit kinds on cluster/node nothing may be placed on

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "cluster": self.cluster,
            "node": self.node,
            "gpu": self.gpu,
            "what": self.what,
            "why": self.why,
            "fix": self.fix,
            "breaks": [ref.to_dict() for ref in self.breaks],
        }

    def sort_key(self) -> tuple[Any, ...]:
        gpu = -1 if self.gpu is None else self.gpu
        return (_SEVERITY_ORDER[self.severity], self.cluster or "", self.node or "", gpu, self.kind)


def mark_broken(units: Iterable[CapacityUnit], findings: Iterable[Finding]) -> list[CapacityUnit]:
    """``units`` with ``broken`` set where a critical finding of the same cluster and node
    names their kind in ``breaks``; the others unchanged (the same objects). An MPS unit
    broken by ``mps_on_mig_gpu`` is also marked ``in_mig_mode`` (the policy validator
    looks for exactly those). A reason the adapter already gave is kept, first."""
    by_node: dict[tuple[str | None, str | None], list[Finding]] = defaultdict(list)
    for finding in findings:
        if finding.severity == CRITICAL and finding.breaks:
            by_node[(finding.cluster, finding.node)].append(finding)
    if not by_node:
        return list(units)
    out: list[CapacityUnit] = []
    for unit in units:
        hits = [f for f in by_node.get((unit.cluster, unit.node), ()) if any(r.hits(unit) for r in f.breaks)]
        if not hits:
            out.append(unit)
            continue
        reasons = list(dict.fromkeys(([unit.broken] if unit.broken else []) + [f.what for f in hits]))
        changes: dict[str, Any] = {"broken": "; ".join(reasons)}
        if unit.sharing is Sharing.SLURM_MPS and any(f.kind == "mps_on_mig_gpu" for f in hits):
            changes["in_mig_mode"] = True
        out.append(dataclasses.replace(unit, **changes))
    return out


# -- the view ---------------------------------------------------------------------------


@dataclass(slots=True)
class SliceView:
    """The part of one unit kind that lives on one physical GPU."""

    sharing: Sharing
    mig_profile: str | None
    capacity: int
    allocated: int
    gpu_equivalent: float  # of one unit
    estimated: bool = False  # allocation dealt in index order: the cluster reports it per node
    instances: tuple[str, ...] = ()  # MIG instances (UUID, else "gi<N>")
    users: tuple[str, ...] = ()
    broken: str | None = None

    @property
    def free(self) -> int:
        return 0 if self.broken else max(self.capacity - self.allocated, 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sharing": self.sharing.value,
            "mig_profile": self.mig_profile,
            "capacity": self.capacity,
            "allocated": self.allocated,
            "free": self.free,
            "gpu_equivalent": self.gpu_equivalent,
            "capacity_gpu_equivalents": _round(self.capacity * self.gpu_equivalent),
            "allocated_gpu_equivalents": _round(self.allocated * self.gpu_equivalent),
            "estimated": self.estimated,
            "instances": list(self.instances),
            "users": list(self.users),
            "broken": self.broken,
        }


@dataclass(slots=True)
class GpuView:
    """One physical GPU: what the agent says it is, and the slices this cluster offers on it.
    It reads the agent's record rather than copying it (80,000 GPUs, each in every view)."""

    index: int
    report: GpuReport | None = None  # None: only the cluster says there is such a GPU
    verified: bool = False  # the agent reported it, freshly
    clusters: tuple[str, ...] = ()  # every cluster that offers something on it
    slices: list[SliceView] = field(default_factory=list)

    @property
    def uuid(self) -> str | None:
        return self.report.uuid if self.report else None

    @property
    def product(self) -> str | None:
        return self.report.product if self.report else None

    @property
    def model(self) -> str | None:
        """gpush's name for the product, when it knows it."""
        product = self.product
        found = model_of_nvml_product(product) if product else None
        return found.name if found else None

    @property
    def memory_gb(self) -> float | None:
        memory = self.report.memory_mb if self.report else None
        return round(memory / 1024, 1) if memory is not None else None

    @property
    def mig_mode(self) -> bool | None:
        return self.report.mig_mode_current if self.report else None

    @property
    def mig_mode_pending(self) -> bool | None:
        return self.report.mig_mode_pending if self.report else None

    @property
    def mps(self) -> bool:
        return bool(self.report and self.report.mps)

    @property
    def error(self) -> str | None:
        return self.report.error if self.report else None

    @property
    def processes(self) -> int:
        return len(self.report.processes) if self.report else 0

    @property
    def process_memory_mb(self) -> int:
        return sum(p.used_memory_mb or 0 for p in self.report.processes) if self.report else 0

    @property
    def capacity_gpu_equivalents(self) -> float:
        return sum(s.capacity * s.gpu_equivalent for s in self.slices)

    @property
    def allocated_gpu_equivalents(self) -> float:
        return sum(s.allocated * s.gpu_equivalent for s in self.slices)

    @property
    def mode(self) -> str:
        """How it is shared, for the text view: mig, mps, timeslice xN, whole, or "-"."""
        kinds = {s.sharing for s in self.slices}
        if self.mig_mode or kinds & set(_MIG):
            return "mig+mps" if self.mps and self.mig_mode else "mig"
        if Sharing.SLURM_MPS in kinds or self.mps:
            return "mps"
        for s in self.slices:
            if s.sharing is Sharing.K8S_TIMESLICE:
                return f"timeslice x{round(1 / s.gpu_equivalent)}"
        return "whole" if self.slices else "-"

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "product": self.product,
            "model": self.model,
            "memory_gb": self.memory_gb,
            "mig_mode": self.mig_mode,
            "mig_mode_pending": self.mig_mode_pending,
            "mps": self.mps,
            "error": self.error,
            "processes": self.processes,
            "process_memory_mb": self.process_memory_mb,
            "verified": self.verified,
            "clusters": list(self.clusters),
            "mode": self.mode,
            "capacity_gpu_equivalents": _round(self.capacity_gpu_equivalents),
            "allocated_gpu_equivalents": _round(self.allocated_gpu_equivalents),
            "slices": [s.to_dict() for s in self.slices],
            # What NVML sees, whether or not a cluster offers it: slices list only what
            # clusters offer, so an unscheduled node or a re-cut GPU shows its instances here.
            "mig_instances": [m.model_dump(mode="json") for m in self.report.mig_instances] if self.report else [],
        }


@dataclass(slots=True)
class UnitView:
    """One unit the cluster reports, with the GPUs it was found on."""

    unit: CapacityUnit
    placed: list[tuple[int, int, tuple[str, ...]]] = field(default_factory=list)  # (gpu, units, MIG instances)
    unplaced: int = 0  # units no GPU the agent sees backs (0 without an agent: not checked)
    users: tuple[str, ...] = ()
    broken: str | None = None

    @property
    def capacity_gpu_equivalents(self) -> float:
        return self.unit.capacity * self.unit.gpu_equivalent

    @property
    def allocated_gpu_equivalents(self) -> float:
        return self.unit.allocated * self.unit.gpu_equivalent

    @property
    def free_gpu_equivalents(self) -> float:
        return 0.0 if self.broken else self.unit.free * self.unit.gpu_equivalent

    def to_dict(self) -> dict[str, Any]:
        u = self.unit
        return {
            "sharing": u.sharing.value,
            "mig_profile": u.mig_profile,
            "gpu_model": u.gpu_model,
            "capacity": u.capacity,
            "allocated": u.allocated,
            "free": 0 if self.broken else u.free,
            "gpu_equivalent": u.gpu_equivalent,
            "capacity_gpu_equivalents": _round(self.capacity_gpu_equivalents),
            "allocated_gpu_equivalents": _round(self.allocated_gpu_equivalents),
            "free_gpu_equivalents": _round(self.free_gpu_equivalents),
            "reported_gpus": list(u.gpus),
            "gpus": sorted({gpu for gpu, _, _ in self.placed}),
            "unplaced": self.unplaced,
            "users": list(self.users),
            "broken": self.broken,
            "labels": dict(u.labels),
        }


@dataclass(slots=True)
class NodeView:
    """One node of one cluster (or, with ``cluster`` None, a node only an agent reports)."""

    name: str
    cluster: str | None
    agent: str  # ok | stale | error | missing
    reported_at: datetime | None = None
    agent_version: str | None = None
    driver_version: str | None = None
    unavailable: str | None = None  # the cluster's own reason nothing starts here now
    units: list[UnitView] = field(default_factory=list)
    gpus: list[GpuView] = field(default_factory=list)
    findings: dict[str, int] = field(default_factory=dict)  # severity -> count

    @property
    def capacity_gpu_equivalents(self) -> float:
        return sum(u.capacity_gpu_equivalents for u in self.units)

    @property
    def allocated_gpu_equivalents(self) -> float:
        return sum(u.allocated_gpu_equivalents for u in self.units)

    @property
    def free_gpu_equivalents(self) -> float:
        return sum(u.free_gpu_equivalents for u in self.units)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cluster": self.cluster,
            "agent": self.agent,
            "reported_at": self.reported_at.isoformat() if self.reported_at else None,
            "agent_version": self.agent_version,
            "driver_version": self.driver_version,
            "unavailable": self.unavailable,
            "capacity_gpu_equivalents": _round(self.capacity_gpu_equivalents),
            "allocated_gpu_equivalents": _round(self.allocated_gpu_equivalents),
            "free_gpu_equivalents": _round(self.free_gpu_equivalents),
            "findings": dict(self.findings),
            "units": [u.to_dict() for u in self.units],
            "gpus": [g.to_dict() for g in self.gpus],
        }


@dataclass(slots=True)
class Totals:
    """Physical GPU-equivalents of one cluster, or of one sharing mode of it."""

    capacity: float = 0.0
    allocated: float = 0.0
    free: float = 0.0  # what the scheduler may still use: broken units count none
    broken: float = 0.0  # capacity of broken units

    def add(self, view: UnitView) -> None:
        self.capacity += view.capacity_gpu_equivalents
        self.allocated += view.allocated_gpu_equivalents
        self.free += view.free_gpu_equivalents
        if view.broken:
            self.broken += view.capacity_gpu_equivalents

    def to_dict(self) -> dict[str, float]:
        return {
            "capacity": _round(self.capacity),
            "allocated": _round(self.allocated),
            "free": _round(self.free),
            "broken": _round(self.broken),
        }


@dataclass(slots=True)
class ClusterView:
    name: str
    kind: str
    error: str | None = None
    nodes: list[NodeView] = field(default_factory=list)

    def totals(self) -> tuple[Totals, dict[str, Totals]]:
        """(the whole cluster, per sharing mode) in physical GPU-equivalents."""
        whole = Totals()
        by_mode: dict[str, Totals] = {}
        for node in self.nodes:
            for view in node.units:
                whole.add(view)
                by_mode.setdefault(view.unit.sharing.value, Totals()).add(view)
        return whole, dict(sorted(by_mode.items()))

    def physical_gpus(self) -> int:
        """GPUs an agent verified that this cluster offers something on."""
        return sum(1 for node in self.nodes for gpu in node.gpus if gpu.verified and gpu.slices)

    def to_dict(self) -> dict[str, Any]:
        whole, by_mode = self.totals()
        return {
            "name": self.name,
            "kind": self.kind,
            "error": self.error,
            "physical_gpus": self.physical_gpus(),
            "totals": whole.to_dict(),
            "by_sharing": {mode: t.to_dict() for mode, t in by_mode.items()},
            "nodes": [n.to_dict() for n in self.nodes],
        }


@dataclass(slots=True)
class Inventory:
    """The reconciled view (see the module docstring)."""

    generated_at: datetime
    clusters: list[ClusterView]
    unscheduled: list[NodeView]  # nodes an agent reports that no cluster lists
    findings: list[Finding]

    def units(self, cluster: str) -> list[CapacityUnit]:
        """Cluster ``cluster``'s units as the scheduler should see them (broken ones marked)."""
        for view in self.clusters:
            if view.name == cluster:
                units = [u.unit for node in view.nodes for u in node.units]
                return mark_broken(units, self.findings)
        raise KeyError(cluster)

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (``gpush inventory --json``)."""
        counts = Counter(f.severity for f in self.findings)
        return {
            "generated_at": self.generated_at.isoformat(),
            "findings_by_severity": {s: counts.get(s, 0) for s in (CRITICAL, WARNING, INFO)},
            "clusters": [c.to_dict() for c in self.clusters],
            "unscheduled": [n.to_dict() for n in self.unscheduled],
            "findings": [f.to_dict() for f in self.findings],
        }

    def table(self) -> dict[str, list[dict[str, Any]]]:
        """Flat rows for the text view: ``clusters`` (totals, one row per cluster and sharing
        mode plus one ``sharing="all"``), ``nodes`` and ``gpus``; figures in GPU-equivalents."""
        clusters: list[dict[str, Any]] = []
        nodes: list[dict[str, Any]] = []
        gpus: list[dict[str, Any]] = []
        for view in self.clusters:
            whole, by_mode = view.totals()
            for mode, t in (("all", whole), *by_mode.items()):
                clusters.append(
                    {"cluster": view.name, "kind": view.kind, "sharing": mode, "error": view.error, **t.to_dict()}
                )
        for node in [n for c in self.clusters for n in c.nodes] + self.unscheduled:
            nodes.append(
                {
                    "cluster": node.cluster,
                    "node": node.name,
                    "agent": node.agent,
                    "gpus": len(node.gpus),
                    "unavailable": node.unavailable,
                    "capacity": _round(node.capacity_gpu_equivalents),
                    "allocated": _round(node.allocated_gpu_equivalents),
                    "free": _round(node.free_gpu_equivalents),
                    "critical": node.findings.get(CRITICAL, 0),
                    "warning": node.findings.get(WARNING, 0),
                    "info": node.findings.get(INFO, 0),
                }
            )
            for gpu in node.gpus:
                gpus.append(
                    {
                        "cluster": node.cluster,
                        "node": node.name,
                        "gpu": gpu.index,
                        "uuid": gpu.uuid,
                        "model": gpu.model or gpu.product,
                        "memory_gb": gpu.memory_gb,
                        "mode": gpu.mode,
                        "slices": ", ".join(_describe_slice(s) for s in gpu.slices),
                        "capacity": _round(gpu.capacity_gpu_equivalents),
                        "allocated": _round(gpu.allocated_gpu_equivalents),
                        "processes": gpu.processes,
                        "verified": gpu.verified,
                        "error": gpu.error,
                    }
                )
        return {"clusters": clusters, "nodes": nodes, "gpus": gpus}


def _describe_slice(s: SliceView) -> str:
    name = s.mig_profile or s.sharing.value.split("/", 1)[1]
    text = f"{name} {s.allocated}/{s.capacity}"
    return text + (" BROKEN" if s.broken else "")


def _round(value: float) -> float:
    return round(value, 4)


# -- what the agent says, read once per node ---------------------------------------------


@cache
def _canonical(name: str) -> str | None:
    try:
        return gpu_model(name).name
    except ValueError:
        return None


@dataclass(slots=True)
class _Facts:
    """One fresh report, indexed in one pass for the assignment and the checks."""

    report: NodeReport
    gpus: dict[int, GpuReport]
    # MIG instances with a compute instance, on GPUs whose MIG mode is on now: profile ->
    # [(gpu index, instance id)], in index order.
    instances: dict[str, list[tuple[int, str]]]
    instance_count: int
    no_compute: list[tuple[int, MigInstance]]  # GPU instances without a compute instance
    whole: list[int]  # GPUs not in MIG mode (errors included: they still exist), in index order
    whole_for_mps: list[tuple[int, None]]  # candidates for MPS: MPS daemons first, MIG+MPS too
    whole_plain: list[tuple[int, None]]  # candidates for whole GPUs: GPUs without MPS first
    k8s_index: list[int] | None  # Kubernetes device index -> NVML index; None: the same
    lost: set[int]  # GPUs NVML could not read
    mps_on_mig: list[int]
    pending: list[int]  # MIG mode changes waiting for a reset
    models: set[str]  # gpush model names of the products
    busy: list[int]  # GPUs with processes


def _facts(report: NodeReport) -> _Facts:
    gpus = {g.index: g for g in report.gpus}
    instances: dict[str, list[tuple[int, str]]] = {}
    count = 0
    no_compute: list[tuple[int, MigInstance]] = []
    whole: list[int] = []
    lost: set[int] = set()
    mps_on_mig: list[int] = []
    pending: list[int] = []
    products: set[str] = set()
    busy: list[int] = []
    mps_gpus: list[int] = []
    for index in sorted(gpus):
        gpu = gpus[index]
        if gpu.error:
            lost.add(index)
        if gpu.product:
            products.add(gpu.product)
        if gpu.processes:
            busy.append(index)
        current = gpu.mig_mode_current
        if gpu.mig_mode_pending is not None and current is not None and gpu.mig_mode_pending != current:
            pending.append(index)
        if current:
            if gpu.mps:
                mps_on_mig.append(index)
            for inst in gpu.mig_instances:
                if inst.ci_id is None:
                    no_compute.append((index, inst))
                else:
                    instances.setdefault(inst.profile, []).append((index, inst.uuid or f"gi{inst.gi_id}"))
                    count += 1
        else:
            whole.append(index)
            if gpu.mps:
                mps_gpus.append(index)
    plain = [i for i in whole if i not in mps_gpus] + mps_gpus
    models = {m.name for p in products if (m := model_of_nvml_product(p)) is not None}
    return _Facts(
        report,
        gpus,
        instances,
        count,
        no_compute,
        whole,
        [(i, None) for i in mps_gpus + mps_on_mig + [i for i in whole if i not in mps_gpus]],
        [(i, None) for i in plain],
        None if len(whole) == len(gpus) else whole,
        lost,
        mps_on_mig,
        pending,
        models,
        busy,
    )


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _short(name: str) -> str:
    return name.split(".", 1)[0]


# -- reconciliation -------------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    """One cluster's node on a host, being reconciled."""

    cluster: ClusterInventory
    node: str
    views: list[UnitView]


@dataclass(slots=True)
class _Host:
    key: str
    entries: list[_Entry] = field(default_factory=list)
    report: NodeReport | None = None
    facts: _Facts | None = None
    agent: str = "missing"
    # (gpu, MIG instance or None) -> clusters holding it; "whole" claims use instance None
    claims: dict[tuple[int, str | None], list[str]] = field(default_factory=dict)
    holders: dict[int, set[str]] = field(default_factory=dict)  # gpu -> clusters holding any of it
    contested: bool = False  # some GPU or instance is held by two clusters
    instances_claimed: int = 0


def reconcile(
    clusters: Mapping[str, ClusterInventory],
    reports: Mapping[str, NodeReport],
    *,
    now: datetime,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> Inventory:
    """Merge the clusters' units with the agents' reports (see the module docstring)."""
    # Hundreds of thousands of objects are made here and all of them live on in the
    # result: the cyclic collector would walk the caller's heap (every report and unit)
    # again and again to free nothing, which more than doubles the time at fleet scale.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _reconcile(clusters, reports, _aware(now), stale_after)
    finally:
        if collecting:
            gc.enable()


def _reconcile(
    clusters: Mapping[str, ClusterInventory], reports: Mapping[str, NodeReport], now: datetime, stale_after: timedelta
) -> Inventory:
    findings: list[Finding] = []
    hosts: dict[str, _Host] = {}
    cluster_views: list[ClusterView] = []
    node_views: dict[tuple[str, str], NodeView] = {}

    # 1. Group each cluster's units by node, and nodes by host.
    for name in sorted(clusters):
        inv = clusters[name]
        view = ClusterView(name=inv.name, kind=inv.kind, error=inv.error)
        cluster_views.append(view)
        if inv.error is not None:
            findings.append(
                Finding(
                    "cluster_unreachable",
                    WARNING,
                    inv.name,
                    None,
                    f"cluster {inv.name} did not answer: {inv.error}",
                    "its GPUs are missing from the inventory and nothing is checked against them",
                    f"gpush cluster list (health of {inv.name}); check its API or controller",
                )
            )
            continue
        uses: dict[tuple[str, Sharing, str | None], list[UnitUse]] = defaultdict(list)
        for use in inv.uses:
            uses[(use.node, use.sharing, use.mig_profile)].append(use)
        by_node: dict[str, list[UnitView]] = {}
        for unit in inv.units:
            held = uses.get((unit.node, unit.sharing, unit.mig_profile), ())
            users = tuple(u.job for u in held if u.gpu is None or not unit.gpus or u.gpu in unit.gpus)
            by_node.setdefault(unit.node, []).append(UnitView(unit, users=users))
        for node, views in by_node.items():
            host = hosts.get(_short(node))
            if host is None:
                host = hosts[_short(node)] = _Host(_short(node))
            host.entries.append(_Entry(inv, node, views))
            unavailable = next(
                (v.unit.labels.get("unavailable") for v in views if v.unit.labels.get("unavailable")), None
            )
            nv = NodeView(name=node, cluster=inv.name, agent="missing", unavailable=unavailable, units=views)
            view.nodes.append(nv)
            node_views[(inv.name, node)] = nv

    # 2. Match each agent report to its host: exactly by a node name a cluster uses, else
    #    by short name; the newest report of a host wins.
    exact = {entry.node: host for host in hosts.values() for entry in host.entries}
    unscheduled: list[NodeReport] = []
    for report in reports.values():
        host = exact.get(report.node) or hosts.get(_short(report.node))
        if host is None:
            unscheduled.append(report)
            continue
        if host.report is None or _aware(report.collected_at) > _aware(host.report.collected_at):
            host.report = report
    for host in hosts.values():
        report = host.report
        if report is None:
            continue
        if report.error is not None:
            host.agent = "error"
        elif now - _aware(report.collected_at) > stale_after:
            host.agent = "stale"
        else:
            host.agent = "ok"
            host.facts = _facts(report)

    # 3. Per host: deal the units to GPUs, check, and build the GPU views.
    agents_per_cluster: Counter[str] = Counter()
    for host in hosts.values():
        if host.report is not None:
            for entry in host.entries:
                agents_per_cluster[entry.cluster.name] += 1
    for key in sorted(hosts):
        host = hosts[key]
        _assign(host)
        _check_host(host, findings, agents_per_cluster, now)

    # 4. One finding for a cluster no agent reports on at all, rather than one per node.
    for view in cluster_views:
        if view.error is None and view.nodes and agents_per_cluster[view.name] == 0:
            findings.append(
                Finding(
                    "no_agents",
                    INFO,
                    view.name,
                    None,
                    f"no node of {view.name} runs the gpush agent ({_count(len(view.nodes), 'node')} unverified)",
                    "MIG layouts, lost GPUs and GPUs offered twice go unnoticed until jobs strand on them",
                    f"run `gpush agent` on the GPU nodes of {view.name} (a systemd unit or a DaemonSet)",
                )
            )
    # 5. Agents whose node no cluster lists.
    unreachable = [c.name for c in cluster_views if c.error is not None]
    unscheduled_views = []
    for report in sorted(unscheduled, key=lambda r: r.node):
        nv = _report_view(report, now, stale_after)
        unscheduled_views.append(nv)
        if not report.gpus:
            continue
        maybe = f" (it may belong to {', '.join(unreachable)}, which did not answer)" if unreachable else ""
        findings.append(
            Finding(
                "unscheduled_gpus",
                INFO if unreachable else WARNING,
                None,
                report.node,
                f"the agent on {report.node} reports {_count(len(report.gpus), 'GPU')} that no cluster offers{maybe}",
                "GPUs nobody schedules: paid for and idle",
                f"offer them: Slurm: `gpush slurm gres-conf {report.node}` into gres.conf, Gres= in slurm.conf, "
                f"`scontrol reconfigure`; Kubernetes: let the GPU Operator's device plugin run on {report.node}. "
                "If a cluster knows the host by another name, start the agent with that name",
            )
        )
    _check_uuids(hosts, reports, findings)

    findings.sort(key=Finding.sort_key)
    _apply(findings, hosts, node_views)
    return Inventory(now, cluster_views, unscheduled_views, findings)


def _report_view(report: NodeReport, now: datetime, stale_after: timedelta) -> NodeView:
    fresh = report.error is None and now - _aware(report.collected_at) <= stale_after
    agent = "error" if report.error else ("ok" if fresh else "stale")
    nv = NodeView(
        name=report.node,
        cluster=None,
        agent=agent,
        reported_at=report.collected_at,
        agent_version=report.agent_version,
        driver_version=report.driver_version,
    )
    nv.gpus = [GpuView(g.index, g, fresh) for g in sorted(report.gpus, key=lambda g: g.index)]
    return nv


def _assign(host: _Host) -> None:
    """Deal every cluster's units on the host to the GPUs the agent sees (module docstring).
    Passes run over all clusters in turn, so a GPU one cluster names is not dealt to another."""
    facts = host.facts
    if facts is None:
        return
    claims = host.claims
    holders = host.holders

    def claim(index: int, instance: str | None, cluster: str) -> None:
        held = claims.get((index, instance))
        if held is None:
            claims[(index, instance)] = [cluster]
            if instance is not None:
                host.instances_claimed += 1
        else:
            if cluster not in held:
                host.contested = True
            held.append(cluster)
        on_gpu = holders.get(index)
        if on_gpu is None:
            holders[index] = {cluster}
        elif cluster not in on_gpu:
            on_gpu.add(cluster)
            # A GPU taken whole by one cluster while another holds it or a slice of it.
            if instance is None or (index, None) in claims:
                host.contested = True

    def pick(candidates: list[tuple[int, Any]], cluster: str, n: int) -> list[tuple[int, Any]]:
        """``n`` of ``candidates``: unclaimed first, then those another cluster holds; never
        one this cluster holds already."""
        if n <= 0:
            return []
        free = [c for c in candidates if c not in claims]
        if len(free) >= n:
            return free[:n]
        others = [c for c in candidates if c in claims and cluster not in claims[c]]
        return (free + others)[:n]

    gpus = facts.gpus
    # Pass 1: units that name their GPUs (time-slicing and MPS per GPU; the simulator's pools).
    for entry in host.entries:
        name = entry.cluster.name
        remap = facts.k8s_index if entry.cluster.kind == "k8s" else None
        for view in entry.views:
            unit = view.unit
            if not unit.gpus or unit.sharing in _MIG:
                continue
            share, extra = divmod(unit.capacity, len(unit.gpus))
            for pos, reported in enumerate(unit.gpus):
                units = share + (1 if pos < extra else 0)
                index = reported if remap is None else (remap[reported] if 0 <= reported < len(remap) else None)
                if index is None or index not in gpus:
                    view.unplaced += units
                    continue
                claim(index, None, name)
                view.placed.append((index, units, ()))
    # Pass 2: MIG units, to the instances of their profile.
    for entry in host.entries:
        name = entry.cluster.name
        for view in entry.views:
            unit = view.unit
            if unit.sharing not in _MIG or not unit.mig_profile:
                continue
            per_instance = max(1, int(unit.labels.get("replicas", "1") or 1)) if unit.sharing is Sharing.K8S_MIG else 1
            instances = facts.instances.get(unit.mig_profile, [])
            if unit.gpus:
                allowed = set(unit.gpus)
                instances = [i for i in instances if i[0] in allowed]
            got = pick(instances, name, math.ceil(unit.capacity / per_instance))
            left = unit.capacity
            on_gpu: dict[int, list[str]] = {}
            for index, instance in got:
                claim(index, instance, name)
                on_gpu.setdefault(index, []).append(instance)
            for index, ids in on_gpu.items():
                units = min(left, len(ids) * per_instance)
                left -= units
                view.placed.append((index, units, tuple(ids)))
            view.unplaced += left
    # Pass 3 and 4: MPS, then whole GPUs (and time-slicing reported per node), by count.
    for kinds in ((Sharing.SLURM_MPS,), (Sharing.SLURM_EXCLUSIVE, Sharing.K8S_EXCLUSIVE, Sharing.K8S_TIMESLICE)):
        for entry in host.entries:
            name = entry.cluster.name
            for view in entry.views:
                unit = view.unit
                if unit.gpus or unit.sharing not in kinds or unit.capacity <= 0:
                    continue
                per_gpu = max(1, round(1 / unit.gpu_equivalent)) if unit.gpu_equivalent < 1 else 1
                candidates = facts.whole_for_mps if unit.sharing is Sharing.SLURM_MPS else facts.whole_plain
                got = pick(candidates, name, math.ceil(unit.capacity / per_gpu))
                left = unit.capacity
                for index, _ in sorted(got):
                    claim(index, None, name)
                    units = min(left, per_gpu)
                    left -= units
                    view.placed.append((index, units, ()))
                view.unplaced += left


def _physical(kind: str, reported: int, facts: _Facts) -> int | None:
    """The NVML index of a GPU a cluster names. The Kubernetes device plugin counts only
    GPUs not in MIG mode, so its n-th GPU is the n-th of those."""
    remap = facts.k8s_index if kind == "k8s" else None
    if remap is None:
        return reported
    return remap[reported] if 0 <= reported < len(remap) else None


def _units_text(n: int, unit: CapacityUnit) -> str:
    if unit.sharing in _MIG:
        return f"{n} {unit.mig_profile} slice{'s' if n != 1 else ''}"
    if unit.sharing is Sharing.SLURM_MPS:
        return f"{n}% MPS share" if n <= 100 else f"MPS shares of {math.ceil(n / 100)} GPUs"
    if unit.sharing is Sharing.K8S_TIMESLICE:
        return f"{n} time-slice replica{'s' if n != 1 else ''}"
    return f"{n} whole GPU{'s' if n != 1 else ''}"


def _fix_config(kind: str, node: str) -> str:
    """How to make a cluster offer what the agent sees on ``node``."""
    if kind == "slurm":
        return (
            f"`gpush slurm gres-conf {node}` renders the gres.conf block for what NVML sees: install it on {node}, "
            f"make Gres= of NodeName={node} in slurm.conf match, then `scontrol reconfigure`"
        )
    if kind == "k8s":
        return (
            f"restart the device plugin on {node} so it re-reads the GPUs: "
            f"`{_DEVICE_PLUGIN_RESTART.format(node=node)}` (or set nvidia.com/mig.config on the node to the layout "
            "you want and let the MIG manager apply it)"
        )
    return f"correct the fleet file of the simulated cluster for node {node}"


def _drain(kind: str, node: str, why: str) -> str:
    if kind == "slurm":
        return f'scontrol update nodename={node} state=drain reason="{why}"'
    if kind == "k8s":
        return f"kubectl drain {node} --ignore-daemonsets --delete-emptydir-data"
    return f"drain {node}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _gpus_text(indexes: Iterable[int]) -> str:
    found = sorted(set(indexes))
    return ("GPU " if len(found) == 1 else "GPUs ") + ",".join(str(i) for i in found)


def _check_host(host: _Host, findings: list[Finding], agents_per_cluster: Counter[str], now: datetime) -> None:
    facts = host.facts
    entries = host.entries
    offering = [e for e in entries if any(v.unit.capacity > 0 for v in e.views)]

    # Things the adapters already know, agent or not.
    for entry in entries:
        name, node, kind = entry.cluster.name, entry.node, entry.cluster.kind
        drift = next((v.unit.labels["drift"] for v in entry.views if v.unit.labels.get("drift")), None)
        if drift:
            says = re.search(r"says (\d+)", drift)
            replicas = says.group(1) if says else "N"
            findings.append(
                Finding(
                    "timeslice_drift",
                    WARNING,
                    name,
                    node,
                    f"{node} {drift}",
                    "jobs are fitted to what the device plugin advertises, not to the configuration: more "
                    "replicas than planned share a GPU's memory, fewer leave capacity unused",
                    f"`gpush k8s timeslice apply {name} --replicas {replicas}` (add --node-label if {node} uses a "
                    f"key of its own); if the config is already right, restart the device plugin: "
                    f"`{_DEVICE_PLUGIN_RESTART.format(node=node)}`",
                )
            )
        for view in entry.views:
            unit = view.unit
            if not unit.broken:
                continue
            single = "strategy is single" in unit.broken
            findings.append(
                Finding(
                    "k8s_mig_strategy_single" if single else "unit_broken",
                    CRITICAL,
                    name,
                    node,
                    f"{node}: {unit.broken}",
                    "nothing gpush places there can start",
                    "kubectl patch clusterpolicy/cluster-policy --type merge -p "
                    '\'{"spec":{"mig":{"strategy":"mixed"}}}\''
                    if single
                    else f"see the cluster's own report for {node}",
                    breaks=(UnitRef.of(unit),),
                )
            )

    if facts is None:
        _check_unverified(host, offering, findings, agents_per_cluster, now)
        return
    gpus = facts.gpus

    # Units beyond what the agent sees, and GPUs lost.
    lost = facts.lost
    for entry in entries:
        name, node, kind = entry.cluster.name, entry.node, entry.cluster.kind
        excess = [v for v in entry.views if v.unplaced > 0]
        if not excess and not lost:
            continue
        on_lost = [v for v in entry.views if any(i in lost for i, _, _ in v.placed)]
        if lost and (excess or on_lost):
            for index in sorted(lost):
                hit = [v for v in entry.views if any(i == index for i, _, _ in v.placed)] + excess
                findings.append(
                    Finding(
                        "gpu_lost",
                        CRITICAL,
                        name,
                        node,
                        f"GPU {index} of {node} does not answer NVML ({gpus[index].error}) while {name} still "
                        "offers its GPUs",
                        "jobs given it fail at start or hang",
                        f"{_drain(kind, node, f'GPU {index} lost')}; look for Xid errors (`dmesg | grep -i xid`, "
                        f"`nvidia-smi -q -i {index}`); reset it (`nvidia-smi -i {index} -r`) or reboot; if it stays "
                        f"gone: {_fix_config(kind, node)}",
                        gpu=index,
                        breaks=tuple(dict.fromkeys(UnitRef.of(v.unit) for v in hit)),
                    )
                )
            continue  # the lost GPU explains what is missing: no count findings on top
        for view in excess:
            unit = view.unit
            placed = unit.capacity - view.unplaced
            if unit.sharing in _MIG:
                have = len(facts.instances.get(unit.mig_profile or "", []))
                no_ci = sum(1 for _, inst in facts.no_compute if inst.profile == unit.mig_profile)
                seen = f"NVML sees {have}" + (f" (and {no_ci} without a compute instance)" if no_ci else "")
                if have == 0:
                    kind_id = "mig_profile_without_instance"
                    offered = "GRES type" if kind == "slurm" else "resource"
                    what = (
                        f"{name} offers {_units_text(unit.capacity, unit)} on {node} ({offered} "
                        f"{_resource_name(unit)}), but {node} has no {unit.mig_profile} MIG instance: {seen}"
                    )
                    why = f"jobs asking for {unit.mig_profile} there wait forever (Slurm keeps them PENDING)"
                else:
                    kind_id = "mig_count_above_nvml"
                    what = (
                        f"{name} counts {_units_text(unit.capacity, unit)} on {node}; {seen} of them "
                        f"({view.unplaced} do not exist)"
                    )
                    why = "jobs given a slice that does not exist fail at start or wait" + (
                        "; slurmd drains the node when it next registers fewer GPUs than configured"
                        if kind == "slurm"
                        else ""
                    )
            else:
                kind_id = "gpu_count_above_nvml"
                mig_gpus = len(gpus) - len(facts.whole)
                what = (
                    f"{name} offers {_units_text(unit.capacity, unit)} on {node}; only {placed} are backed by a GPU "
                    f"NVML sees ({len(gpus)} GPUs" + (f", {mig_gpus} in MIG mode" if mig_gpus else "") + ")"
                )
                why = "jobs placed on the missing GPUs fail at start or wait forever"
            findings.append(
                Finding(kind_id, CRITICAL, name, node, what, why, _fix_config(kind, node), breaks=(UnitRef.of(unit),))
            )

    # Nobody holds it twice: a GPU (or MIG instance) two clusters both offer.
    twice: dict[str, set[int]] = defaultdict(set)
    claimed = host.claims.items() if host.contested else ()
    whole_holders = {index: set(holders) for (index, instance), holders in claimed if instance is None}
    for (index, instance), holders in claimed:
        # Two clusters on one MIG instance, or on a GPU one of them takes whole.
        names = set(holders) | (whole_holders.get(index, set()) if instance is not None else set())
        if len(names) > 1:
            for holder in names:
                twice[holder].add(index)
    for entry in entries:
        shared = twice.get(entry.cluster.name)
        if not shared:
            continue
        others = sorted({h for (i, _), hs in host.claims.items() if i in shared for h in hs} - {entry.cluster.name})
        hit = [v for v in entry.views if any(i in shared for i, _, _ in v.placed)]
        uuids = [gpus[i].uuid for i in sorted(shared) if gpus[i].uuid]
        findings.append(
            Finding(
                "gpu_claimed_twice",
                CRITICAL,
                entry.cluster.name,
                entry.node,
                f"{_gpus_text(shared)} of {entry.node} ({', '.join(uuids) or 'no UUID reported'}) are offered by "
                f"{entry.cluster.name} and by {', '.join(others)}",
                "two schedulers place jobs on the same GPU: they share its memory unknowingly, or one finds it busy",
                f"give each GPU to one cluster: take {entry.node} out of one ("
                f"{_drain(entry.cluster.kind, entry.node, 'GPUs owned by ' + others[0])}), or split its GPUs "
                "(Slurm: only its devices in gres.conf File=, see `gpush slurm gres-conf "
                f"{entry.node}`; Kubernetes: label the node nvidia.com/gpu.deploy.device-plugin=false)",
                gpu=min(shared) if len(shared) == 1 else None,
                breaks=tuple(dict.fromkeys(UnitRef.of(v.unit) for v in hit)),
            )
        )

    first = entries[0]
    mig_entry = next((e for e in entries if any(v.unit.sharing in _MIG for v in e.views)), first)

    # What the agent sees that no cluster offers.
    unclaimed_instances: Counter[str] = Counter()
    everything_claimed = host.instances_claimed == facts.instance_count
    for profile, instances in () if everything_claimed else facts.instances.items():
        for index, instance in instances:
            if (index, instance) not in host.claims and index not in lost:
                unclaimed_instances[profile] += 1
    for profile, n in sorted(unclaimed_instances.items()):
        have = len(facts.instances[profile])
        offered = sum(
            v.unit.capacity
            for e in entries
            for v in e.views
            if v.unit.sharing in _MIG and v.unit.mig_profile == profile
        )
        findings.append(
            Finding(
                "mig_count_below_nvml",
                WARNING,
                mig_entry.cluster.name,
                mig_entry.node,
                f"{mig_entry.node} has {have} {profile} MIG instances; the clusters offer {offered} ({n} unused)",
                "capacity wasted: no job can be placed on those slices",
                _fix_config(mig_entry.cluster.kind, mig_entry.node),
            )
        )
    idle = [i for i in facts.whole if (i, None) not in host.claims and i not in lost]
    if idle:
        findings.append(
            Finding(
                "gpus_not_offered",
                WARNING,
                first.cluster.name,
                first.node,
                f"{_gpus_text(idle)} of {first.node} (not in MIG mode) are offered by no cluster",
                "capacity wasted: no job can be placed on them",
                _fix_config(first.cluster.kind, first.node),
                gpu=idle[0] if len(idle) == 1 else None,
            )
        )

    for index in sorted(lost | set(facts.mps_on_mig) | set(facts.pending)):
        gpu = gpus[index]
        if gpu.error and not any(index == i for e in offering for v in e.views for i, _, _ in v.placed):
            if not any(e for e in entries if any(v.unplaced for v in e.views)):
                findings.append(
                    Finding(
                        "gpu_error",
                        WARNING,
                        first.cluster.name,
                        first.node,
                        f"GPU {index} of {first.node} does not answer NVML: {gpu.error}",
                        "one GPU fewer than the node has; no cluster offers it now",
                        f"`nvidia-smi -q -i {index}`, `dmesg | grep -i xid`; reset (`nvidia-smi -i {index} -r`) "
                        "or replace it",
                        gpu=index,
                    )
                )
        if gpu.mig_mode_current and gpu.mps:
            with_mps = [e for e in entries if any(v.unit.sharing is Sharing.SLURM_MPS for v in e.views)] or [first]
            for entry in with_mps:
                refs = tuple(
                    dict.fromkeys(
                        UnitRef.of(v.unit)
                        for v in entry.views
                        if v.unit.sharing is Sharing.SLURM_MPS
                        and (not v.unit.gpus or index in (_physical(entry.cluster.kind, g, facts) for g in v.unit.gpus))
                    )
                )
                findings.append(
                    Finding(
                        "mps_on_mig_gpu",
                        CRITICAL,
                        entry.cluster.name,
                        entry.node,
                        f"GPU {index} of {entry.node} is in MIG mode and an MPS daemon serves it",
                        "MPS shares of a MIG-mode GPU have no compute to run on, and the daemon sits between "
                        "the MIG slices' processes: jobs fail or hang",
                        f"on {entry.node}: `echo quit | nvidia-cuda-mps-control` and remove gres/mps from its "
                        f"gres.conf ({_fix_config('slurm', entry.node)}), or drain it and turn MIG off "
                        f"(`nvidia-smi -i {index} -mig 0`, `nvidia-smi -i {index} -r`)"
                        if entry.cluster.kind == "slurm"
                        else f"on {entry.node}: stop the MPS control daemon (`echo quit | nvidia-cuda-mps-control`), "
                        f"or turn MIG off on GPU {index}",
                        gpu=index,
                        breaks=refs,
                    )
                )
        if (
            gpu.mig_mode_pending is not None
            and gpu.mig_mode_current is not None
            and gpu.mig_mode_pending != gpu.mig_mode_current
        ):
            kind = first.cluster.kind
            to = "on" if gpu.mig_mode_pending else "off"
            findings.append(
                Finding(
                    "mig_mode_pending_reset",
                    WARNING,
                    first.cluster.name,
                    first.node,
                    f"GPU {index} of {first.node} has MIG mode {to} pending; it takes effect at the next GPU reset",
                    "what the clusters offer now changes without notice at the next reset or reboot",
                    f"{_drain(kind, first.node, 'MIG mode change pending')}; when it is idle: "
                    f"`nvidia-smi -i {index} -r` (or reboot); then resume "
                    + (f"(`scontrol update nodename={first.node} state=resume`)" if kind == "slurm" else "the node")
                    + f" and {_fix_config(kind, first.node)}",
                    gpu=index,
                )
            )
    for index, inst in facts.no_compute:
        findings.append(
            Finding(
                "mig_instance_without_compute_instance",
                WARNING,
                mig_entry.cluster.name,
                mig_entry.node,
                f"MIG GPU instance {inst.gi_id} ({inst.profile}) on GPU {index} of {mig_entry.node} has no compute "
                "instance",
                "CUDA cannot run on it, so it is counted as no slice",
                f"`nvidia-smi mig -i {index} -gi {inst.gi_id} -cci` on {mig_entry.node}",
                gpu=index,
            )
        )

    # Products: the cluster's model name against NVML's.
    only_model = next(iter(facts.models)) if len(facts.models) == 1 else None
    for entry in entries:
        for view in entry.views:
            unit = view.unit
            said = _canonical(unit.gpu_model)
            if said is None or said == only_model:
                continue
            seen = {
                m.name
                for index, _, _ in view.placed
                if gpus[index].product and (m := model_of_nvml_product(gpus[index].product)) is not None
            }
            wrong = sorted(seen - {said})
            if not wrong:
                continue
            findings.append(
                Finding(
                    "gpu_model_mismatch",
                    WARNING,
                    entry.cluster.name,
                    entry.node,
                    f"{entry.cluster.name} says its {_resource_name(unit)} on {entry.node} are {said}; NVML says "
                    f"{', '.join(wrong)}",
                    "jobs routed by GPU model go to the wrong GPUs or miss these; MIG slice sizes may be wrong",
                    f"gpush cluster add {entry.cluster.name} --kind {entry.cluster.kind} --replace --config "
                    f"gpu_types={_type_key(unit)}={wrong[0]} (keep its other settings)",
                )
            )

    # Processes no scheduler accounts for.
    busy = facts.busy
    if busy and all(not v.unit.allocated and not v.unit.labels.get("unavailable") for e in entries for v in e.views):
        findings.append(
            Finding(
                "processes_outside_scheduler",
                WARNING,
                first.cluster.name,
                first.node,
                f"{_gpus_text(busy)} of {first.node} {'runs' if len(busy) == 1 else 'run'} processes while no "
                "cluster has anything allocated there",
                "jobs placed there share the GPU with work no scheduler knows of",
                f"`nvidia-smi` on {first.node} shows the processes; stop them or run them through a scheduler",
                gpu=busy[0] if len(busy) == 1 else None,
            )
        )


def _check_unverified(
    host: _Host, offering: list[_Entry], findings: list[Finding], agents_per_cluster: Counter[str], now: datetime
) -> None:
    """A host without a fresh, readable report: only the clusters' own word."""
    report = host.report
    for entry in host.entries:
        name, node = entry.cluster.name, entry.node
        if report is None:
            if agents_per_cluster[name]:  # else one "no_agents" finding for the whole cluster
                findings.append(
                    Finding(
                        "no_agent_report",
                        WARNING,
                        name,
                        node,
                        f"no agent reports on {node}; its GPUs are unverified",
                        "MIG layouts, lost GPUs and GPUs offered twice on it go unnoticed",
                        f"run `gpush agent` on {node} (other nodes of {name} run it)",
                    )
                )
        elif report.error is not None:
            findings.append(
                Finding(
                    "agent_nvml_error",
                    WARNING,
                    name,
                    node,
                    f"the agent on {node} cannot read NVML: {report.error}",
                    "its GPUs are unverified; a node without a working driver runs no GPU job",
                    f"on {node}: `nvidia-smi` (driver loaded? `lsmod | grep nvidia`); reinstall or reload the driver",
                )
            )
        else:
            age = now - _aware(report.collected_at)
            findings.append(
                Finding(
                    "agent_report_stale",
                    WARNING,
                    name,
                    node,
                    f"the agent on {node} last reported {_age(age)} ago ({report.collected_at.isoformat()})",
                    "its GPUs are unverified: nothing is checked or marked on the word of an old report",
                    f"on {node}: `systemctl status gpush-agent` (or its pod's logs); it must reach the broker",
                )
            )
    if len({e.cluster.name for e in offering}) < 2:
        return
    # Two clusters offer GPUs on one host and no agent tells which GPUs: refuse unless both
    # name their GPUs and the names do not overlap.
    named: dict[str, set[int]] = {}
    for entry in offering:
        indexes = set()
        for view in entry.views:
            if not view.unit.gpus:
                indexes = None
                break
            indexes.update(view.unit.gpus)
        if indexes is None:
            named.clear()
            break
        named[entry.cluster.name] = indexes
    if named:
        all_named = list(named.values())
        if all(not (a & b) for pos, a in enumerate(all_named) for b in all_named[pos + 1 :]):
            return
    for entry in offering:
        others = sorted({e.cluster.name for e in offering} - {entry.cluster.name})
        findings.append(
            Finding(
                "gpu_claimed_twice",
                CRITICAL,
                entry.cluster.name,
                entry.node,
                f"{entry.node} offers GPUs in {entry.cluster.name} and in {', '.join(others)}, and no agent shows "
                "they are different GPUs",
                "two schedulers place jobs on the same GPUs: they share its memory unknowingly, or one finds it busy",
                f"give {entry.node} to one cluster ({_drain(entry.cluster.kind, entry.node, 'GPUs owned elsewhere')}), "
                f"or run `gpush agent` on it and split its GPUs so each cluster lists only its own",
                breaks=tuple(dict.fromkeys(UnitRef.of(v.unit) for v in entry.views)),
            )
        )


def _check_uuids(hosts: Mapping[str, _Host], reports: Mapping[str, NodeReport], findings: list[Finding]) -> None:
    """The same GPU UUID in the reports of two hosts: one GPU under two names."""
    first: dict[str, tuple[str, int]] = {}
    seen: dict[str, list[tuple[str, int]]] = {}  # only UUIDs reported more than once
    for report in reports.values():
        node = report.node
        for gpu in report.gpus:
            uuid = gpu.uuid
            if uuid:
                where = first.setdefault(uuid, (node, gpu.index))
                if where[0] != node or where[1] != gpu.index:
                    seen.setdefault(uuid, [where]).append((node, gpu.index))
    for uuid, where in sorted(seen.items()):
        if len({_short(n) for n, _ in where}) < 2:
            continue
        holders: list[tuple[_Entry, int]] = []
        for node, index in where:
            host = hosts.get(_short(node))
            for entry in host.entries if host is not None else ():
                holders.append((entry, index))
        names = " and ".join(f"{n} (GPU {i})" for n, i in where)
        if len({e.cluster.name for e, _ in holders}) > 1:
            for entry, index in holders:
                refs = tuple(
                    dict.fromkeys(UnitRef.of(v.unit) for v in entry.views if any(i == index for i, _, _ in v.placed))
                )
                findings.append(
                    Finding(
                        "gpu_claimed_twice",
                        CRITICAL,
                        entry.cluster.name,
                        entry.node,
                        f"GPU {uuid} is reported on {names}, and {entry.cluster.name} offers it on {entry.node} "
                        "while another cluster offers it under the other name",
                        "two schedulers place jobs on the same GPU",
                        f"give the host to one cluster ("
                        f"{_drain(entry.cluster.kind, entry.node, 'GPU owned elsewhere')}), "
                        "and run one agent per host under the name the clusters use",
                        gpu=index,
                        breaks=refs,
                    )
                )
        else:
            findings.append(
                Finding(
                    "gpu_reported_twice",
                    WARNING,
                    holders[0][0].cluster.name if holders else None,
                    where[0][0],
                    f"GPU {uuid} is reported by the agents of {names}",
                    "one of the reports describes a host under a wrong name; its checks are about the wrong node",
                    "run one agent per host, under the name the clusters use for it",
                )
            )


def _apply(findings: list[Finding], hosts: Mapping[str, _Host], node_views: Mapping[tuple[str, str], NodeView]) -> None:
    """Broken reasons onto the unit views, the GPU views of every node, and finding counts."""
    by_node: dict[tuple[str | None, str | None], list[Finding]] = defaultdict(list)
    for finding in findings:
        by_node[(finding.cluster, finding.node)].append(finding)
    for host in hosts.values():
        report = host.report
        fresh = host.facts is not None
        for entry in host.entries:
            nv = node_views[(entry.cluster.name, entry.node)]
            nv.agent = host.agent
            if report is not None:
                nv.reported_at = report.collected_at
                nv.agent_version = report.agent_version
                nv.driver_version = report.driver_version
            mine = by_node.get((entry.cluster.name, entry.node), ())
            nv.findings = dict(Counter(f.severity for f in mine))
            breakers = [f for f in mine if f.severity == CRITICAL and f.breaks]
            for view in entry.views:
                reasons = [view.unit.broken] if view.unit.broken else []
                reasons += [f.what for f in breakers if any(r.hits(view.unit) for r in f.breaks)]
                view.broken = "; ".join(dict.fromkeys(reasons)) or None
            nv.gpus = _gpus_of(entry, report if report is not None and report.error is None else None, fresh, host)


def _gpus_of(entry: _Entry, report: NodeReport | None, fresh: bool, host: _Host) -> list[GpuView]:
    """The node's GPUs, each with this cluster's slices on it. Without a report, the GPUs
    the cluster names (per-GPU units) are shown unverified."""
    gpus: dict[int, GpuView] = {}
    if report is not None:
        for gpu in report.gpus:
            gpus[gpu.index] = GpuView(gpu.index, gpu, fresh)
    holders = host.holders
    for view in entry.views:
        unit = view.unit
        placed = view.placed
        estimated = False
        if not fresh:
            # Only the cluster's word: a unit of one GPU sits there, the rest on no GPU.
            placed = [(unit.gpus[0], unit.capacity, ())] if len(unit.gpus) == 1 else []
        elif len(placed) > 1 or view.unplaced:
            estimated = unit.allocated > 0
        left = unit.allocated
        for index, units, instances in placed:
            taken = min(left, units)
            left -= taken
            gpu = gpus.get(index)
            if gpu is None:
                gpu = gpus[index] = GpuView(index=index)
            gpu.slices.append(
                SliceView(
                    unit.sharing,
                    unit.mig_profile,
                    units,
                    taken,
                    unit.gpu_equivalent,
                    estimated=estimated,
                    instances=instances,
                    users=view.users if len(placed) == 1 else (),
                    broken=view.broken,
                )
            )
    for index, gpu in gpus.items():
        gpu.clusters = tuple(sorted(holders.get(index, ())))
    return [gpus[i] for i in sorted(gpus)]


def _age(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"


def _resource_name(unit: CapacityUnit) -> str:
    gres = unit.labels.get("gres")
    if gres:
        return gres
    if unit.labels.get("resource"):
        return unit.labels["resource"]
    if unit.sharing is Sharing.K8S_MIG:
        return f"nvidia.com/mig-{unit.mig_profile}"
    if unit.sharing.flavor == "k8s":
        return "nvidia.com/gpu"
    return unit.sharing.value


def _type_key(unit: CapacityUnit) -> str:
    """The key of ``gpu_types`` that names this unit's model: the GRES type, or the GFD product."""
    gres = unit.labels.get("gres", "")
    parts = gres.split(":")
    if len(parts) == 3:
        return parts[1]
    return unit.labels.get("product", unit.mig_profile or unit.gpu_model)
