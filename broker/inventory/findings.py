"""The finding rules of one host: each misconfiguration that strands jobs, as one function.

A rule reads one host after its units were dealt to its GPUs (:class:`HostContext`) and
yields :class:`~broker.inventory.view.Finding` records; :data:`HOST_RULES` is every rule,
in the order reconcile runs them on each host. Each rule's docstring says what it finds
and why jobs strand on it; severities are the ones broker.inventory.reconcile's
docstring defines, and a critical finding's ``breaks`` names the unit kinds
:func:`~broker.inventory.view.mark_broken` takes out of scheduling.

Reconcile sorts all findings by (severity, cluster, node, GPU, kind), stably, so the
order of the rules only decides the order of findings of one kind on one node: keep the
rules that share a kind (``gpu_claimed_twice``) in this order. Checks across hosts (a
GPU UUID on two hosts) and across a cluster (no agent at all, a cluster that did not
answer) are reconcile's own steps.

One module of about 750 lines, over the project's 600, on purpose: it is the list of
every host rule, each a short function with the docstring an operator reads when a
finding surprises them, and reading them side by side in the order they run is the point
(a new finding is a function and a line in :data:`HOST_RULES`, here, not a new module).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import cache

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.gpus import gpu_model, model_of_nvml_product
from broker.core.topology import position_words
from broker.inventory.hosts import Entry, Facts, Host, aware, physical_index
from broker.inventory.view import CRITICAL, MIG_SHARING, WARNING, Finding, UnitRef, UnitView
from broker.inventory.wording import (
    DEVICE_PLUGIN_RESTART,
    age_text,
    agent_check,
    agent_install,
    drain_command,
    fix_config,
    gpus_text,
    gres_links_lines,
    groups_text,
    network_level_fix,
    resource_name,
    type_key,
    units_text,
)


@dataclass(frozen=True, slots=True)
class HostContext:
    """What the rules read about one host, after its units were dealt to its GPUs.

    ``facts`` is its agent's fresh, readable report, indexed; None when there is none,
    and then only the clusters' own word is known (the rules of an unverified host)."""

    host: Host
    facts: Facts | None
    offering: list[Entry]  # the host's nodes that offer any capacity
    agents_per_cluster: Counter[str]  # nodes of each cluster that have an agent report, fresh or not
    now: datetime

    @classmethod
    def of(cls, host: Host, agents_per_cluster: Counter[str], now: datetime) -> HostContext:
        offering = [e for e in host.entries if any(v.unit.capacity > 0 for v in e.views)]
        return cls(host, host.facts, offering, agents_per_cluster, now)

    @property
    def entries(self) -> list[Entry]:
        return self.host.entries

    @property
    def first(self) -> Entry:
        """The node a finding about the host as a whole is filed under."""
        return self.host.entries[0]

    @property
    def mig_entry(self) -> Entry:
        """The node a finding about MIG instances is filed under: the first offering MIG."""
        return next((e for e in self.host.entries if any(v.unit.sharing in MIG_SHARING for v in e.views)), self.first)


Rule = Callable[[HostContext], Iterable[Finding]]


@cache
def _canonical(name: str) -> str | None:
    try:
        return gpu_model(name).name
    except ValueError:
        return None


# -- what the adapters already know, agent or not ---------------------------------------


def timeslice_drift(ctx: HostContext) -> Iterator[Finding]:
    """The device plugin advertises other time-slice replicas than the time-slicing
    ConfigMap says (the adapter's ``drift`` label). Jobs are fitted to what is advertised:
    more replicas than planned share one GPU's memory and run out of it, fewer waste it."""
    for entry in ctx.entries:
        name, node = entry.cluster.name, entry.node
        drift = next((v.unit.labels["drift"] for v in entry.views if v.unit.labels.get("drift")), None)
        if not drift:
            continue
        says = re.search(r"says (\d+)", drift)
        replicas = says.group(1) if says else "N"
        yield Finding(
            "timeslice_drift",
            WARNING,
            name,
            node,
            f"{node} {drift}",
            "jobs are fitted to what the device plugin advertises, not to the configuration: more "
            "replicas than planned share a GPU's memory, fewer leave capacity unused",
            f"`gpush k8s timeslice apply {name} --replicas {replicas}` (add --node-label if {node} uses a "
            f"key of its own); if the config is already right, restart the device plugin: "
            f"`{DEVICE_PLUGIN_RESTART.format(node=node)}`",
        )


def k8s_mig_strategy_single(ctx: HostContext) -> Iterator[Finding]:
    """A Kubernetes node whose GPU Operator uses the single MIG strategy: its slices are
    advertised as nvidia.com/gpu, and gpush asks for nvidia.com/mig-<profile>, so a job
    placed there pends forever. The adapter marks the unit ``broken``."""
    for entry, unit in _broken_units(ctx):
        if "strategy is single" in unit.broken:
            yield Finding(
                "k8s_mig_strategy_single",
                CRITICAL,
                entry.cluster.name,
                entry.node,
                f"{entry.node}: {unit.broken}",
                "nothing gpush places there can start",
                'kubectl patch clusterpolicy/cluster-policy --type merge -p \'{"spec":{"mig":{"strategy":"mixed"}}}\'',
                breaks=(UnitRef.of(unit),),
            )


def unit_broken(ctx: HostContext) -> Iterator[Finding]:
    """Any other unit the adapter itself marks ``broken``: it knows nothing placed there
    can start, so the finding carries its reason and keeps the scheduler off it."""
    for entry, unit in _broken_units(ctx):
        if "strategy is single" not in unit.broken:
            yield Finding(
                "unit_broken",
                CRITICAL,
                entry.cluster.name,
                entry.node,
                f"{entry.node}: {unit.broken}",
                "nothing gpush places there can start",
                f"see the cluster's own report for {entry.node}",
                breaks=(UnitRef.of(unit),),
            )


def _broken_units(ctx: HostContext) -> Iterator[tuple[Entry, CapacityUnit]]:
    """The units the adapters marked ``broken`` themselves, node by node."""
    for entry in ctx.entries:
        for view in entry.views:
            if view.unit.broken:
                yield entry, view.unit


# -- no fresh, readable report: only the clusters' own word ------------------------------


def no_agent_report(ctx: HostContext) -> Iterator[Finding]:
    """A node with no agent report while other nodes of its cluster have one (a cluster
    with none at all gets one ``no_agents`` finding instead). Its GPUs go unchecked, so
    a MIG layout, a lost GPU or a GPU offered twice there strands jobs unnoticed."""
    if ctx.facts is not None or ctx.host.report is not None:
        return
    for entry in ctx.entries:
        name, node = entry.cluster.name, entry.node
        if ctx.agents_per_cluster[name]:
            yield Finding(
                "no_agent_report",
                WARNING,
                name,
                node,
                f"no agent reports on {node}; its GPUs are unverified",
                "MIG layouts, lost GPUs and GPUs offered twice on it go unnoticed",
                agent_install(entry.cluster.kind, f"{node} (other nodes of {name} run it)"),
            )


def agent_nvml_error(ctx: HostContext) -> Iterator[Finding]:
    """The agent runs but cannot read NVML at all: usually no driver loaded, and a node
    without a working driver starts no GPU job, whatever its cluster offers."""
    report = ctx.host.report
    if ctx.facts is not None or report is None or report.error is None:
        return
    for entry in ctx.entries:
        node = entry.node
        yield Finding(
            "agent_nvml_error",
            WARNING,
            entry.cluster.name,
            node,
            f"the agent on {node} cannot read NVML: {report.error}",
            "its GPUs are unverified; a node without a working driver runs no GPU job",
            f"on {node}: `nvidia-smi` (driver loaded? `lsmod | grep nvidia`); reinstall or reload the driver",
        )


def agent_report_stale(ctx: HostContext) -> Iterator[Finding]:
    """The agent's last report is older than ``stale_after``: nothing is checked or marked
    broken on its word, so what changed since (a lost GPU, a new MIG layout) goes unseen."""
    report = ctx.host.report
    if ctx.facts is not None or report is None or report.error is not None:
        return
    for entry in ctx.entries:
        node = entry.node
        yield Finding(
            "agent_report_stale",
            WARNING,
            entry.cluster.name,
            node,
            f"the agent on {node} last reported {age_text(ctx.now - aware(report.collected_at))} ago "
            f"({report.collected_at.isoformat()})",
            "its GPUs are unverified: nothing is checked or marked on the word of an old report",
            agent_check(entry.cluster.kind, node),
        )


def gpus_maybe_claimed_twice(ctx: HostContext) -> Iterator[Finding]:
    """Two clusters offer GPUs on one host and no agent tells which GPUs: unless both name
    their GPUs and the names do not overlap, two schedulers may place jobs on the same
    GPU, which then runs out of memory or is busy. Kind ``gpu_claimed_twice``."""
    offering = ctx.offering
    if ctx.facts is not None or len({e.cluster.name for e in offering}) < 2:
        return
    named: dict[str, set[int]] = {}
    for entry in offering:
        indexes: set[int] | None = set()
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
        yield Finding(
            "gpu_claimed_twice",
            CRITICAL,
            entry.cluster.name,
            entry.node,
            f"{entry.node} offers GPUs in {entry.cluster.name} and in {', '.join(others)}, and no agent shows "
            "they are different GPUs",
            "two schedulers place jobs on the same GPUs: they share its memory unknowingly, or one finds it busy",
            f"give {entry.node} to one cluster "
            f"({drain_command(entry.cluster.kind, entry.node, 'GPUs owned elsewhere')}), "
            f"or run `gpush agent` on it and split its GPUs so each cluster lists only its own",
            breaks=tuple(dict.fromkeys(UnitRef.of(v.unit) for v in entry.views)),
        )


# -- a fresh report: the clusters' units checked against the GPUs ------------------------


def gpu_lost(ctx: HostContext) -> Iterator[Finding]:
    """A GPU NVML cannot read (fallen off the bus, Xid errors) while the node's cluster
    still offers its GPUs: jobs given it fail at start or hang. It also explains units
    beyond what NVML sees, so the count rules stay quiet on such a host."""
    facts = ctx.facts
    if facts is None or not facts.lost:
        return
    lost, gpus = facts.lost, facts.gpus
    for entry in ctx.entries:
        name, node, kind = entry.cluster.name, entry.node, entry.cluster.kind
        excess = [v for v in entry.views if v.unplaced > 0]
        if not excess and not any(i in lost for v in entry.views for i, _, _ in v.placed):
            continue
        for index in sorted(lost):
            hit = [v for v in entry.views if any(i == index for i, _, _ in v.placed)] + excess
            yield Finding(
                "gpu_lost",
                CRITICAL,
                name,
                node,
                f"GPU {index} of {node} does not answer NVML ({gpus[index].error}) while {name} still offers its GPUs",
                "jobs given it fail at start or hang",
                f"{drain_command(kind, node, f'GPU {index} lost')}; look for Xid errors (`dmesg | grep -i xid`, "
                f"`nvidia-smi -q -i {index}`); reset it (`nvidia-smi -i {index} -r`) or reboot; if it stays "
                f"gone: {fix_config(kind, node)}",
                gpu=index,
                breaks=tuple(dict.fromkeys(UnitRef.of(v.unit) for v in hit)),
            )


def mig_profile_without_instance(ctx: HostContext) -> Iterator[Finding]:
    """A cluster offers a MIG profile (a GRES type, a nvidia.com/mig-* resource) of which
    the node has no instance at all: jobs asking for it there pend forever."""
    for entry, view, facts in _beyond_nvml(ctx):
        unit = view.unit
        if unit.sharing not in MIG_SHARING:
            continue
        have, seen = _mig_seen(facts, unit.mig_profile)
        if have:
            continue
        name, node, kind = entry.cluster.name, entry.node, entry.cluster.kind
        offered = "GRES type" if kind == "slurm" else "resource"
        yield Finding(
            "mig_profile_without_instance",
            CRITICAL,
            name,
            node,
            f"{name} offers {units_text(unit.capacity, unit)} on {node} ({offered} "
            f"{resource_name(unit)}), but {node} has no {unit.mig_profile} MIG instance: {seen}",
            f"jobs asking for {unit.mig_profile} there wait forever (Slurm keeps them PENDING)",
            fix_config(kind, node),
            breaks=(UnitRef.of(unit),),
        )


def mig_count_above_nvml(ctx: HostContext) -> Iterator[Finding]:
    """A cluster counts more instances of a MIG profile than the node has: a job given a
    slice that does not exist fails at start or waits, and slurmd drains the node when it
    next registers fewer GPUs than configured."""
    for entry, view, facts in _beyond_nvml(ctx):
        unit = view.unit
        if unit.sharing not in MIG_SHARING:
            continue
        have, seen = _mig_seen(facts, unit.mig_profile)
        if not have:
            continue
        name, node, kind = entry.cluster.name, entry.node, entry.cluster.kind
        yield Finding(
            "mig_count_above_nvml",
            CRITICAL,
            name,
            node,
            f"{name} counts {units_text(unit.capacity, unit)} on {node}; {seen} of them ({view.unplaced} do not exist)",
            "jobs given a slice that does not exist fail at start or wait"
            + ("; slurmd drains the node when it next registers fewer GPUs than configured" if kind == "slurm" else ""),
            fix_config(kind, node),
            breaks=(UnitRef.of(unit),),
        )


def gpu_count_above_nvml(ctx: HostContext) -> Iterator[Finding]:
    """A cluster offers more whole GPUs, MPS shares or time-slice replicas than the GPUs
    NVML sees can back (GPUs in MIG mode back none): jobs placed on the missing GPUs fail
    at start or wait forever."""
    for entry, view, facts in _beyond_nvml(ctx):
        unit = view.unit
        if unit.sharing in MIG_SHARING:
            continue
        name, node, kind = entry.cluster.name, entry.node, entry.cluster.kind
        gpus = len(facts.gpus)
        mig_gpus = gpus - len(facts.whole)
        yield Finding(
            "gpu_count_above_nvml",
            CRITICAL,
            name,
            node,
            f"{name} offers {units_text(unit.capacity, unit)} on {node}; only {unit.capacity - view.unplaced} are "
            f"backed by a GPU NVML sees ({gpus} GPUs" + (f", {mig_gpus} in MIG mode" if mig_gpus else "") + ")",
            "jobs placed on the missing GPUs fail at start or wait forever",
            fix_config(kind, node),
            breaks=(UnitRef.of(unit),),
        )


def _beyond_nvml(ctx: HostContext) -> Iterator[tuple[Entry, UnitView, Facts]]:
    """The units no GPU the agent sees backs, unless a lost GPU explains them (gpu_lost)."""
    facts = ctx.facts
    if facts is None or facts.lost:
        return
    for entry in ctx.entries:
        for view in entry.views:
            if view.unplaced > 0:
                yield entry, view, facts


def _mig_seen(facts: Facts, profile: str | None) -> tuple[int, str]:
    """How many instances of ``profile`` NVML sees, and that in words."""
    have = len(facts.instances.get(profile or "", []))
    no_ci = sum(1 for _, inst in facts.no_compute if inst.profile == profile)
    return have, f"NVML sees {have}" + (f" (and {no_ci} without a compute instance)" if no_ci else "")


def gpu_claimed_twice(ctx: HostContext) -> Iterator[Finding]:
    """One GPU, or one MIG instance, that two clusters both offer (or a GPU one takes
    whole while another offers a slice of it): two schedulers place jobs on it, which
    share its memory unknowingly or find it busy."""
    facts = ctx.facts
    host = ctx.host
    if facts is None or not host.contested:
        return
    twice: dict[str, set[int]] = defaultdict(set)
    claimed = host.claims.items()
    whole_holders = {index: set(holders) for (index, instance), holders in claimed if instance is None}
    for (index, instance), holders in claimed:
        # Two clusters on one MIG instance, or on a GPU one of them takes whole.
        names = set(holders) | (whole_holders.get(index, set()) if instance is not None else set())
        if len(names) > 1:
            for holder in names:
                twice[holder].add(index)
    for entry in ctx.entries:
        shared = twice.get(entry.cluster.name)
        if not shared:
            continue
        others = sorted({h for (i, _), hs in host.claims.items() if i in shared for h in hs} - {entry.cluster.name})
        hit = [v for v in entry.views if any(i in shared for i, _, _ in v.placed)]
        uuids = [facts.gpus[i].uuid for i in sorted(shared) if facts.gpus[i].uuid]
        yield Finding(
            "gpu_claimed_twice",
            CRITICAL,
            entry.cluster.name,
            entry.node,
            f"{gpus_text(shared)} of {entry.node} ({', '.join(uuids) or 'no UUID reported'}) are offered by "
            f"{entry.cluster.name} and by {', '.join(others)}",
            "two schedulers place jobs on the same GPU: they share its memory unknowingly, or one finds it busy",
            f"give each GPU to one cluster: take {entry.node} out of one ("
            f"{drain_command(entry.cluster.kind, entry.node, 'GPUs owned by ' + others[0])}), or split its GPUs "
            "(Slurm: only its devices in gres.conf File=, see `gpush slurm gres-conf "
            f"{entry.node}`; Kubernetes: label the node nvidia.com/gpu.deploy.device-plugin=false)",
            gpu=min(shared) if len(shared) == 1 else None,
            breaks=tuple(dict.fromkeys(UnitRef.of(v.unit) for v in hit)),
        )


def mig_count_below_nvml(ctx: HostContext) -> Iterator[Finding]:
    """MIG instances no cluster offers: capacity wasted, since no job can be placed on
    those slices (nothing strands, but the cluster's configuration lags the GPUs)."""
    facts = ctx.facts
    host = ctx.host
    if facts is None or host.instances_claimed == facts.instance_count:
        return
    unclaimed: Counter[str] = Counter()
    for profile, instances in facts.instances.items():
        for index, instance in instances:
            if (index, instance) not in host.claims and index not in facts.lost:
                unclaimed[profile] += 1
    mig_entry = ctx.mig_entry
    for profile, n in sorted(unclaimed.items()):
        offered = sum(
            v.unit.capacity
            for e in ctx.entries
            for v in e.views
            if v.unit.sharing in MIG_SHARING and v.unit.mig_profile == profile
        )
        yield Finding(
            "mig_count_below_nvml",
            WARNING,
            mig_entry.cluster.name,
            mig_entry.node,
            f"{mig_entry.node} has {len(facts.instances[profile])} {profile} MIG instances; the clusters offer "
            f"{offered} ({n} unused)",
            "capacity wasted: no job can be placed on those slices",
            fix_config(mig_entry.cluster.kind, mig_entry.node),
        )


def gpus_not_offered(ctx: HostContext) -> Iterator[Finding]:
    """GPUs not in MIG mode that no cluster offers: paid for and idle, because no job can
    be placed on them."""
    facts = ctx.facts
    if facts is None:
        return
    idle = [i for i in facts.whole if (i, None) not in ctx.host.claims and i not in facts.lost]
    if idle:
        first = ctx.first
        yield Finding(
            "gpus_not_offered",
            WARNING,
            first.cluster.name,
            first.node,
            f"{gpus_text(idle)} of {first.node} (not in MIG mode) are offered by no cluster",
            "capacity wasted: no job can be placed on them",
            fix_config(first.cluster.kind, first.node),
            gpu=idle[0] if len(idle) == 1 else None,
        )


def gpu_error(ctx: HostContext) -> Iterator[Finding]:
    """A GPU NVML cannot read that no cluster offers now (else ``gpu_lost``): the node has
    one GPU fewer than it should, and a reset or a replacement brings it back."""
    facts = ctx.facts
    if facts is None:
        return
    first = ctx.first
    for index in sorted(facts.lost):
        if any(index == i for e in ctx.offering for v in e.views for i, _, _ in v.placed):
            continue
        if any(e for e in ctx.entries if any(v.unplaced for v in e.views)):
            continue
        yield Finding(
            "gpu_error",
            WARNING,
            first.cluster.name,
            first.node,
            f"GPU {index} of {first.node} does not answer NVML: {facts.gpus[index].error}",
            "one GPU fewer than the node has; no cluster offers it now",
            f"`nvidia-smi -q -i {index}`, `dmesg | grep -i xid`; reset (`nvidia-smi -i {index} -r`) or replace it",
            gpu=index,
        )


def mps_on_mig_gpu(ctx: HostContext) -> Iterator[Finding]:
    """An MPS daemon serving a GPU in MIG mode: MPS shares of it have no compute to run
    on, and the daemon sits between the MIG slices' processes, so jobs fail or hang."""
    facts = ctx.facts
    if facts is None:
        return
    entries = ctx.entries
    for index in facts.mps_on_mig:
        with_mps = [e for e in entries if any(v.unit.sharing is Sharing.SLURM_MPS for v in e.views)] or [ctx.first]
        for entry in with_mps:
            kind = entry.cluster.kind
            refs = tuple(
                dict.fromkeys(
                    UnitRef.of(v.unit)
                    for v in entry.views
                    if v.unit.sharing is Sharing.SLURM_MPS
                    and (not v.unit.gpus or index in (physical_index(kind, g, facts) for g in v.unit.gpus))
                )
            )
            yield Finding(
                "mps_on_mig_gpu",
                CRITICAL,
                entry.cluster.name,
                entry.node,
                f"GPU {index} of {entry.node} is in MIG mode and an MPS daemon serves it",
                "MPS shares of a MIG-mode GPU have no compute to run on, and the daemon sits between "
                "the MIG slices' processes: jobs fail or hang",
                f"on {entry.node}: `echo quit | nvidia-cuda-mps-control` and remove gres/mps from its "
                f"gres.conf ({fix_config('slurm', entry.node)}), or drain it and turn MIG off "
                f"(`nvidia-smi -i {index} -mig 0`, `nvidia-smi -i {index} -r`)"
                if entry.cluster.kind == "slurm"
                else f"on {entry.node}: stop the MPS control daemon (`echo quit | nvidia-cuda-mps-control`), "
                f"or turn MIG off on GPU {index}",
                gpu=index,
                breaks=refs,
            )


def mig_mode_pending_reset(ctx: HostContext) -> Iterator[Finding]:
    """A MIG mode change waiting for the GPU's next reset: what the clusters offer changes
    without notice at the next reset or reboot, under the jobs placed by today's layout."""
    facts = ctx.facts
    if facts is None:
        return
    first = ctx.first
    kind = first.cluster.kind
    for index in facts.pending:
        to = "on" if facts.gpus[index].mig_mode_pending else "off"
        yield Finding(
            "mig_mode_pending_reset",
            WARNING,
            first.cluster.name,
            first.node,
            f"GPU {index} of {first.node} has MIG mode {to} pending; it takes effect at the next GPU reset",
            "what the clusters offer now changes without notice at the next reset or reboot",
            f"{drain_command(kind, first.node, 'MIG mode change pending')}; when it is idle: "
            f"`nvidia-smi -i {index} -r` (or reboot); then resume "
            + (f"(`scontrol update nodename={first.node} state=resume`)" if kind == "slurm" else "the node")
            + f" and {fix_config(kind, first.node)}",
            gpu=index,
        )


def mig_instance_without_compute_instance(ctx: HostContext) -> Iterator[Finding]:
    """A MIG GPU instance without a compute instance: CUDA cannot run on it, so it is
    counted as no slice, and a cluster that counts it offers a slice no job can use."""
    facts = ctx.facts
    if facts is None:
        return
    mig_entry = ctx.mig_entry
    for index, inst in facts.no_compute:
        yield Finding(
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


def gpu_model_mismatch(ctx: HostContext) -> Iterator[Finding]:
    """A cluster names its GPUs' model otherwise than NVML's product: jobs routed by GPU
    model go to the wrong GPUs or miss these, and MIG slice sizes may be wrong."""
    facts = ctx.facts
    if facts is None:
        return
    gpus = facts.gpus
    only_model = next(iter(facts.models)) if len(facts.models) == 1 else None
    for entry in ctx.entries:
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
            yield Finding(
                "gpu_model_mismatch",
                WARNING,
                entry.cluster.name,
                entry.node,
                f"{entry.cluster.name} says its {resource_name(unit)} on {entry.node} are {said}; NVML says "
                f"{', '.join(wrong)}",
                "jobs routed by GPU model go to the wrong GPUs or miss these; MIG slice sizes may be wrong",
                f"gpush cluster add {entry.cluster.name} --kind {entry.cluster.kind} --replace --config "
                f"gpu_types={type_key(unit)}={wrong[0]} (keep its other settings)",
            )


def processes_outside_scheduler(ctx: HostContext) -> Iterator[Finding]:
    """GPUs running processes while no cluster has anything allocated on the node: work
    no scheduler knows of, which jobs placed there share the GPU with."""
    facts = ctx.facts
    if facts is None or not facts.busy:
        return
    entries = ctx.entries
    if any(v.unit.allocated or v.unit.labels.get("unavailable") for e in entries for v in e.views):
        return
    busy, first = facts.busy, ctx.first
    yield Finding(
        "processes_outside_scheduler",
        WARNING,
        first.cluster.name,
        first.node,
        f"{gpus_text(busy)} of {first.node} {'runs' if len(busy) == 1 else 'run'} processes while no "
        "cluster has anything allocated there",
        "jobs placed there share the GPU with work no scheduler knows of",
        f"`nvidia-smi` on {first.node} shows the processes; stop them or run them through a scheduler",
        gpu=busy[0] if len(busy) == 1 else None,
    )


# -- topology: warnings, never breaking (placement works, only less tight) -----------------


def nvlink_islands_differ(ctx: HostContext) -> Iterator[Finding]:
    """gres.conf's ``Links=`` join other GPUs by NVLink than NVML sees. gpush places by
    NVML's islands, but Slurm picks GPUs by ``Links=`` for jobs gpush does not place (and
    for GPUs gpush leaves it to choose): a job asking for close GPUs gets GPUs that talk
    over PCIe, several times slower. Compared over the GPUs both name."""
    facts = ctx.facts
    if facts is None or facts.report.topology is None:
        return
    nvml = facts.report.topology.gpu_topology()
    for entry in ctx.entries:
        said = next((v.unit.gpu_topology for v in entry.views if v.unit.gpu_topology is not None), None)
        if said is None or said.source != "gres.conf" or not said.nvlink:
            continue
        common = {i for g in said.nvlink for i in g} & {i for g in nvml.nvlink for i in g}
        ours, theirs = _island_of(said.nvlink, common), _island_of(nvml.nvlink, common)
        differ = sorted(i for i in common if ours[i] != theirs[i])
        if not differ:
            continue
        node = entry.node
        gres = next((v.unit.labels.get("gres") for v in entry.views if v.unit.labels.get("gres")), "")
        gres_type = gres.split(":")[1] if gres.count(":") == 2 else None
        lines = gres_links_lines(node, facts.report, gres_type)
        yield Finding(
            "nvlink_islands_differ",
            WARNING,
            entry.cluster.name,
            node,
            f"on {node} gres.conf's Links= make NVLink islands {groups_text(_multi(said.nvlink))} while NVML "
            f"sees {groups_text(_multi(nvml.nvlink))} ({gpus_text(differ)} differ)",
            "Slurm keeps a job's GPUs together by Links=: where they are wrong, GPUs it thinks close talk over "
            "PCIe, and jobs it places itself run slower; gpush places by what NVML sees",
            f"write Links= as NVML sees them in gres.conf on {node} (the other keys of each line as they are): "
            + "; ".join(f"`{line}`" for line in lines)
            + ", then restart slurmd there and `scontrol reconfigure`",
        )


def _island_of(groups: tuple[tuple[int, ...], ...], common: set[int]) -> dict[int, frozenset[int]]:
    return {i: frozenset(g) & common for g in groups for i in g if i in common}


def _multi(groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    """The islands of more than one GPU (those of one say nothing)."""
    return [g for g in groups if len(g) > 1]


def network_level_missing(ctx: HostContext) -> Iterator[Finding]:
    """The cluster names a network level (a Slurm block or switch, a Kubernetes node label)
    that this node has no domain at. Placement (broker.core.topology.choose_nodes) counts the
    node as a domain of its own at that level: a job that requires its nodes within one domain
    of the level never gets it, and one that prefers that takes it after every node that has
    one. Needs no agent."""
    for entry in ctx.entries:
        position = next((v.unit.topology for v in entry.views if v.unit.topology), ())
        missing = [level for level, domain in position if domain is None]
        if not missing:
            continue
        node, kind = entry.node, entry.cluster.kind
        yield Finding(
            "network_level_missing",
            WARNING,
            entry.cluster.name,
            node,
            f"{node} has no {' and no '.join(missing)} in {entry.cluster.name}'s network topology"
            + (
                f" (it has {known})"
                if (known := position_words(tuple(p for p in position if p[1] is not None)))
                else ""
            ),
            "placement counts it as a domain of its own: jobs that require their nodes in one domain of that "
            "level never get it, jobs that prefer it take it last",
            "; ".join(network_level_fix(kind, node, level, position) for level in missing),
        )


HOST_RULES: list[Rule] = [
    # The adapters' own word, agent or not.
    timeslice_drift,
    k8s_mig_strategy_single,
    unit_broken,
    # No fresh, readable report.
    no_agent_report,
    agent_nvml_error,
    agent_report_stale,
    gpus_maybe_claimed_twice,
    # A fresh report. gpu_lost first: it explains units beyond NVML, which the next three count.
    gpu_lost,
    mig_profile_without_instance,
    mig_count_above_nvml,
    gpu_count_above_nvml,
    gpu_claimed_twice,
    mig_count_below_nvml,
    gpus_not_offered,
    gpu_error,
    mps_on_mig_gpu,
    mig_mode_pending_reset,
    mig_instance_without_compute_instance,
    gpu_model_mismatch,
    processes_outside_scheduler,
    nvlink_islands_differ,
    network_level_missing,
]
