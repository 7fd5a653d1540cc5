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
- **NVML says how close the GPUs are.** A fresh report's GPU groups (NVLink islands, PCIe
  switches, sockets: broker.nodeagent.topology) replace what the cluster says (gres.conf
  ``Links=``) on every unit of that node and in its view (:attr:`Inventory.gpu_topologies`),
  after the rules compared the two; a Kubernetes node's are renumbered to the device
  plugin's indexes. Topology findings are warnings: nothing is broken by them.
- **Fast.** Every step is a dict lookup per node, unit or GPU: 10,000 nodes and 80,000
  GPUs reconcile in well under two seconds (integration/bench/inventory.py).

This module owns the merge: grouping nodes into hosts, matching reports to them, the
findings about a whole cluster (``cluster_unreachable``, ``no_agents``), about agents on
nodes no cluster lists (``unscheduled_gpus``) and about one GPU UUID on two hosts, and
applying the findings to the view. The records, :class:`Finding` and :func:`mark_broken`
are broker.inventory.view (still importable from here); dealing units to GPUs is
broker.inventory.hosts; the per-host finding rules are broker.inventory.findings.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import Counter, defaultdict
from collections.abc import Mapping
from datetime import datetime, timedelta

from broker.core.adapter import Sharing
from broker.core.topology import GpuTopology, Position
from broker.inventory.agent_report import NodeReport
from broker.inventory.findings import HOST_RULES, HostContext
from broker.inventory.hosts import Entry, Host, assign, aware, read_report, short_name
from broker.inventory.view import (
    CRITICAL,
    INFO,
    WARNING,
    ClusterInventory,
    ClusterView,
    Finding,
    GpuView,
    Inventory,
    NodeView,
    SliceView,
    Totals,
    UnitRef,
    UnitUse,
    UnitView,
    mark_broken,
)
from broker.inventory.wording import agent_install, count_text, drain_command

# The records were defined here before the package was split; other modules and scripts
# still import them from here, so they stay importable from this module.
__all__ = [
    "CRITICAL",
    "DEFAULT_STALE_AFTER",
    "INFO",
    "WARNING",
    "ClusterInventory",
    "ClusterView",
    "Finding",
    "GpuView",
    "Inventory",
    "NodeView",
    "SliceView",
    "Totals",
    "UnitRef",
    "UnitUse",
    "UnitView",
    "mark_broken",
    "reconcile",
]

DEFAULT_STALE_AFTER = timedelta(minutes=5)


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
        return _reconcile(clusters, reports, aware(now), stale_after)
    finally:
        if collecting:
            gc.enable()


def _reconcile(
    clusters: Mapping[str, ClusterInventory], reports: Mapping[str, NodeReport], now: datetime, stale_after: timedelta
) -> Inventory:
    findings: list[Finding] = []
    hosts: dict[str, Host] = {}
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
            host = hosts.get(short_name(node))
            if host is None:
                host = hosts[short_name(node)] = Host(short_name(node))
            host.entries.append(Entry(inv, node, views))
            unavailable = next(
                (v.unit.labels.get("unavailable") for v in views if v.unit.labels.get("unavailable")), None
            )
            nv = NodeView(name=node, cluster=inv.name, agent="missing", unavailable=unavailable, units=views)
            nv.gpu_topology, nv.topology = _cluster_topology(views)
            view.nodes.append(nv)
            node_views[(inv.name, node)] = nv

    # A node that two clusters list and one of them keeps unavailable (drained, cordoned,
    # fenced: lent to the other, broker.fleet.lending) is offered by the other alone:
    # only the offering side's units are dealt to the GPUs and checked. Unavailable on every
    # side (a node between two clusters), nobody offers it: its first listing stands for it.
    for host in hosts.values():
        offering = [e for e in host.entries if not all(v.unit.labels.get("unavailable") for v in e.views)]
        if len(offering) < len(host.entries):
            host.entries = offering or host.entries[:1]

    # 2. Match each agent report to its host: exactly by a node name a cluster uses, else
    #    by short name; the newest report of a host wins.
    exact = {entry.node: host for host in hosts.values() for entry in host.entries}
    unscheduled: list[NodeReport] = []
    for report in reports.values():
        host = exact.get(report.node) or hosts.get(short_name(report.node))
        if host is None:
            unscheduled.append(report)
            continue
        if host.report is None or aware(report.collected_at) > aware(host.report.collected_at):
            host.report = report
    for host in hosts.values():
        report = host.report
        if report is None:
            continue
        if report.error is not None:
            host.agent = "error"
        elif now - aware(report.collected_at) > stale_after:
            host.agent = "stale"
        else:
            host.agent = "ok"
            host.facts = read_report(report)

    # 3. Per host: deal the units to GPUs, check, and build the GPU views.
    agents_per_cluster: Counter[str] = Counter()
    for host in hosts.values():
        if host.report is not None:
            for entry in host.entries:
                agents_per_cluster[entry.cluster.name] += 1
    for key in sorted(hosts):
        host = hosts[key]
        assign(host)
        context = HostContext.of(host, agents_per_cluster, now)
        for rule in HOST_RULES:
            findings.extend(rule(context))

    # 4. One finding for a cluster no agent reports on at all, rather than one per node.
    for view in cluster_views:
        if view.error is None and view.nodes and agents_per_cluster[view.name] == 0:
            findings.append(
                Finding(
                    "no_agents",
                    INFO,
                    view.name,
                    None,
                    f"no node of {view.name} runs the gpush agent ({count_text(len(view.nodes), 'node')} unverified)",
                    "MIG layouts, lost GPUs and GPUs offered twice go unnoticed until jobs strand on them",
                    agent_install(view.kind, f"the GPU nodes of {view.name}"),
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
                f"the agent on {report.node} reports {count_text(len(report.gpus), 'GPU')} that no cluster "
                f"offers{maybe}",
                "GPUs nobody schedules: paid for and idle",
                f"offer them: Slurm: `gpush slurm gres-conf {report.node}` into gres.conf, Gres= in slurm.conf, "
                f"`scontrol reconfigure`; Kubernetes: let the GPU Operator's device plugin run on {report.node}. "
                "If a cluster knows the host by another name, start the agent with that name",
            )
        )
    _check_uuids(hosts, reports, findings)

    findings.sort(key=Finding.sort_key)
    _apply(findings, hosts, node_views)
    topologies = _nvml_topology(hosts, node_views)
    return Inventory(now, cluster_views, unscheduled_views, findings, topologies)


def _cluster_topology(views: list[UnitView]) -> tuple[GpuTopology | None, Position]:
    """What the cluster says of a node's topology: its units' (the adapter gives each unit
    of a node the same), the first that says anything."""
    gpu_topology = next((v.unit.gpu_topology for v in views if v.unit.gpu_topology is not None), None)
    position = next((v.unit.topology for v in views if v.unit.topology), ())
    return gpu_topology, position


def _report_view(report: NodeReport, now: datetime, stale_after: timedelta) -> NodeView:
    fresh = report.error is None and now - aware(report.collected_at) <= stale_after
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
    if fresh and report.topology is not None:
        nv.gpu_topology = report.topology.gpu_topology()
    return nv


def _nvml_topology(
    hosts: Mapping[str, Host], node_views: Mapping[tuple[str, str], NodeView]
) -> dict[tuple[str, str], GpuTopology]:
    """The GPU groups a fresh agent report read through NVML replace what the cluster says
    (gres.conf) on every node of its host, in the view and on the units (after the rules,
    which compare the two). A Kubernetes node's GPU indexes are the device plugin's: its
    groups are renumbered to them."""
    out: dict[tuple[str, str], GpuTopology] = {}
    for host in hosts.values():
        facts = host.facts
        if facts is None or facts.report.topology is None:
            continue
        nvml = facts.report.topology.gpu_topology()
        for entry in host.entries:
            mine = nvml
            if entry.cluster.kind == "k8s" and facts.k8s_index is not None:
                mine = renumbered(nvml, facts.k8s_index)
            out[(entry.cluster.name, entry.node)] = mine
            node_views[(entry.cluster.name, entry.node)].gpu_topology = mine
            for view in entry.views:
                if view.unit.gpu_topology != mine:
                    view.unit = dataclasses.replace(view.unit, gpu_topology=mine)
    return out


def renumbered(topology: GpuTopology, order: list[int]) -> GpuTopology:
    """``topology`` over the GPUs ``order`` lists (by NVML index), each renamed to its position there."""
    position = {nvml: i for i, nvml in enumerate(order)}

    def level(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        kept = (tuple(position[i] for i in g if i in position) for g in groups)
        return tuple(g for g in kept if g)

    return GpuTopology(level(topology.nvlink), level(topology.pcie), level(topology.socket), topology.source)


def _check_uuids(hosts: Mapping[str, Host], reports: Mapping[str, NodeReport], findings: list[Finding]) -> None:
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
        if len({short_name(n) for n, _ in where}) < 2:
            continue
        holders: list[tuple[Entry, int]] = []
        for node, index in where:
            host = hosts.get(short_name(node))
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
                        f"{drain_command(entry.cluster.kind, entry.node, 'GPU owned elsewhere')}), "
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


def _apply(findings: list[Finding], hosts: Mapping[str, Host], node_views: Mapping[tuple[str, str], NodeView]) -> None:
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


def _gpus_of(entry: Entry, report: NodeReport | None, fresh: bool, host: Host) -> list[GpuView]:
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
