"""One host under reconciliation, and which of its GPUs holds each cluster's units.

A host is what one short host name names: the nodes the clusters list under it
(:class:`Entry`, one per cluster), the newest agent report, indexed once for the
dealing and the checks (:class:`Facts`), and the claims the dealing makes.
:func:`assign` deals every cluster's units to the GPUs the agent sees, by the rules
the broker.inventory.reconcile docstring states ("which GPU holds a unit is inferred
where the cluster does not say"); the finding rules (broker.inventory.findings) read
the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from broker.core.adapter import Sharing
from broker.core.gpus import model_of_nvml_product
from broker.inventory.agent_report import GpuReport, MigInstance, NodeReport
from broker.inventory.view import MIG_SHARING, ClusterInventory, UnitView

# -- what the agent says, read once per node ---------------------------------------------


@dataclass(slots=True)
class Facts:
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


def read_report(report: NodeReport) -> Facts:
    """Index a fresh, readable report in one pass over its GPUs, in index order."""
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
    return Facts(
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


def aware(moment: datetime) -> datetime:
    """``moment`` with a time zone: a naive one is taken as UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def short_name(name: str) -> str:
    """What matches a node to its host: ``gpu01`` and ``gpu01.example.com`` are one host."""
    return name.split(".", 1)[0]


# -- the host, being reconciled ----------------------------------------------------------


@dataclass(slots=True)
class Entry:
    """One cluster's node on a host, being reconciled."""

    cluster: ClusterInventory
    node: str
    views: list[UnitView]


@dataclass(slots=True)
class Host:
    """One host (by short name): the clusters' nodes on it, its agent's report, and the claims."""

    key: str
    entries: list[Entry] = field(default_factory=list)
    report: NodeReport | None = None
    facts: Facts | None = None
    agent: str = "missing"
    # (gpu, MIG instance or None) -> clusters holding it; "whole" claims use instance None
    claims: dict[tuple[int, str | None], list[str]] = field(default_factory=dict)
    holders: dict[int, set[str]] = field(default_factory=dict)  # gpu -> clusters holding any of it
    contested: bool = False  # some GPU or instance is held by two clusters
    instances_claimed: int = 0


def assign(host: Host) -> None:
    """Deal every cluster's units on the host to the GPUs the agent sees (broker.inventory.reconcile's docstring).
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
            if not unit.gpus or unit.sharing in MIG_SHARING:
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
            if unit.sharing not in MIG_SHARING or not unit.mig_profile:
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


def physical_index(kind: str, reported: int, facts: Facts) -> int | None:
    """The NVML index of a GPU a cluster names. The Kubernetes device plugin counts only
    GPUs not in MIG mode, so its n-th GPU is the n-th of those."""
    remap = facts.k8s_index if kind == "k8s" else None
    if remap is None:
        return reported
    return remap[reported] if 0 <= reported < len(remap) else None
