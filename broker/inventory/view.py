"""The records of the reconciled inventory: what reconcile takes, what it gives, and findings.

In: one cluster's answer (:class:`ClusterInventory`, with :class:`UnitUse` for who holds
what). Out: the view, cluster → node → physical GPU → slices (:class:`Inventory`,
:class:`ClusterView`, :class:`NodeView`, :class:`UnitView`, :class:`GpuView`,
:class:`SliceView`, with :class:`Totals` in GPU-equivalents), and the disagreements
between the sources as :class:`Finding` records. :func:`mark_broken` is here, beside
:class:`Finding` and :class:`UnitRef`, because what a critical finding breaks is part of
the finding's meaning and :meth:`Inventory.units` applies it. How the view is built, and
what callers may assume of it, is broker.inventory.reconcile; the rules that write the
findings are broker.inventory.findings.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.gpus import model_of_nvml_product
from broker.core.topology import GpuTopology, Position
from broker.inventory.agent_report import GpuReport

CRITICAL, WARNING, INFO = "critical", "warning", "info"
_SEVERITY_ORDER = {CRITICAL: 0, WARNING: 1, INFO: 2}

MIG_SHARING = (Sharing.SLURM_MIG, Sharing.K8S_MIG)


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


def with_gpu_topology(
    units: Iterable[CapacityUnit], topologies: Mapping[tuple[str, str], GpuTopology]
) -> list[CapacityUnit]:
    """``units`` with ``gpu_topology`` set to the one an agent read through NVML on their
    (cluster, node) (what the hardware is, over what gres.conf says), so placement reads a
    node's GPU groups from one place; the others unchanged (the same objects)."""
    if not topologies:
        return list(units)
    out: list[CapacityUnit] = []
    for unit in units:
        found = topologies.get((unit.cluster, unit.node))
        out.append(
            unit if found is None or found == unit.gpu_topology else dataclasses.replace(unit, gpu_topology=found)
        )
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
        if self.mig_mode or kinds & set(MIG_SHARING):
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
            # Where it sits (the agent's NVML reading; None/[]: not read): NUMA node, close CPUs, NVLink peers.
            "numa_node": self.report.numa_node if self.report else None,
            "cpu_affinity": self.report.cpu_affinity if self.report else None,
            "nvlinks": [p.model_dump(mode="json") for p in self.report.nvlinks] if self.report else [],
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
    # How close its GPUs are (the agent's NVML reading when fresh, else the cluster's gres.conf),
    # and its network position (the cluster's levels, widest first; a domain of None: none).
    gpu_topology: GpuTopology | None = None
    topology: Position = ()

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
            "gpu_topology": self.gpu_topology.to_dict() if self.gpu_topology is not None else None,
            "topology": [{"level": level, "domain": domain} for level, domain in self.topology],
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
    # (cluster, node) -> the GPU groups a fresh agent report read through NVML (what units carry)
    gpu_topologies: dict[tuple[str, str], GpuTopology] = field(default_factory=dict)

    def add(self, findings: Iterable[Finding]) -> None:
        """Findings from beyond the reconciliation (a MIG change that failed): listed among
        the others, worst first, and counted on their node."""
        nodes = {(c.name, n.name): n for c in self.clusters for n in c.nodes}
        for finding in findings:
            self.findings.append(finding)
            node = nodes.get((finding.cluster, finding.node))
            if node is not None:
                node.findings[finding.severity] = node.findings.get(finding.severity, 0) + 1
        self.findings.sort(key=lambda f: f.sort_key())

    def only(self, cluster: str) -> None:
        """Keep cluster ``cluster`` alone: its nodes and its findings. A node no cluster
        lists belongs to none, so a view of one cluster leaves it (and its findings) out;
        the agent's reports of the other clusters' nodes read as such when only one
        cluster was asked for, and would list them under this one."""
        self.clusters = [c for c in self.clusters if c.name == cluster]
        self.unscheduled = []
        self.findings = [f for f in self.findings if f.cluster == cluster]

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
