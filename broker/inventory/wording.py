"""How findings word things: the commands that fix a cluster or drain a node, and the
names of units, GPUs and ages in their messages.

One place for these because every finding's ``fix`` is a command an admin pastes: a
drain or a configuration step written one way for Slurm, another for Kubernetes, and
a third for the simulator, and the same words wherever a finding needs them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.topology import Position
from broker.inventory.agent_report import NodeReport
from broker.inventory.view import MIG_SHARING

DEVICE_PLUGIN_RESTART = (
    "kubectl -n gpu-operator delete pod -l app=nvidia-device-plugin-daemonset --field-selector spec.nodeName={node}"
)


def fix_config(kind: str, node: str) -> str:
    """How to make a cluster offer what the agent sees on ``node``."""
    if kind == "slurm":
        return (
            f"`gpush slurm gres-conf {node}` renders the gres.conf block for what NVML sees: install it on {node}, "
            f"make Gres= of NodeName={node} in slurm.conf match, then `scontrol reconfigure`"
        )
    if kind == "k8s":
        return (
            f"restart the device plugin on {node} so it re-reads the GPUs: "
            f"`{DEVICE_PLUGIN_RESTART.format(node=node)}` (or set nvidia.com/mig.config on the node to the layout "
            "you want and let the MIG manager apply it)"
        )
    return f"correct the fleet file of the simulated cluster for node {node}"


# The node agent as the repository ships it (deploy/README.md): a systemd unit for hosts
# (Slurm's nodes), a DaemonSet for Kubernetes. Paths in the gpush repository.
AGENT_SYSTEMD_UNIT = "deploy/systemd/gpush-agent.service"
AGENT_DAEMONSET = "deploy/k8s/gpush-agent-daemonset.yaml"
AGENT_SELECTOR = "app.kubernetes.io/name=gpush-agent"  # the DaemonSet's pods, in namespace gpush


def agent_install(kind: str, where: str) -> str:
    """How to run the node agent on ``where`` (a node, or a cluster's GPU nodes)."""
    unit = f"the systemd unit {AGENT_SYSTEMD_UNIT}"
    daemonset = f"`kubectl apply -f {AGENT_DAEMONSET}`"
    if kind == "slurm":
        how = unit
    elif kind == "k8s":
        how = daemonset
    else:
        how = f"{unit}, or on Kubernetes {daemonset}"
    return f"run `gpush agent` on {where}: {how} (from the gpush repository; deploy/README.md)"


def agent_check(kind: str, node: str) -> str:
    """Where to look when the agent on ``node`` stopped reporting."""
    systemd = f"on {node}: `systemctl status gpush-agent` and `journalctl -u gpush-agent` ({AGENT_SYSTEMD_UNIT})"
    pods = (
        f"`kubectl -n gpush get pods -l {AGENT_SELECTOR} --field-selector spec.nodeName={node}` "
        f"and that pod's logs ({AGENT_DAEMONSET})"
    )
    if kind == "slurm":
        how = systemd
    elif kind == "k8s":
        how = pods
    else:
        how = f"{systemd}, or on Kubernetes {pods}"
    return f"{how}; it must reach the broker"


def drain_command(kind: str, node: str, why: str) -> str:
    """How to stop a cluster placing new jobs on ``node``; Slurm records ``why``."""
    if kind == "slurm":
        return f'scontrol update nodename={node} state=drain reason="{why}"'
    if kind == "k8s":
        return f"kubectl drain {node} --ignore-daemonsets --delete-emptydir-data"
    return f"drain {node}"


def units_text(n: int, unit: CapacityUnit) -> str:
    """``n`` of ``unit``'s kind in words: "3 1g.5gb slices", "50% MPS share", "2 whole GPUs"."""
    if unit.sharing in MIG_SHARING:
        return f"{n} {unit.mig_profile} slice{'s' if n != 1 else ''}"
    if unit.sharing is Sharing.SLURM_MPS:
        return f"{n}% MPS share" if n <= 100 else f"MPS shares of {math.ceil(n / 100)} GPUs"
    if unit.sharing is Sharing.K8S_TIMESLICE:
        return f"{n} time-slice replica{'s' if n != 1 else ''}"
    return f"{n} whole GPU{'s' if n != 1 else ''}"


def count_text(n: int, what: str) -> str:
    """ "1 node", "3 nodes"."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def gpus_text(indexes: Iterable[int]) -> str:
    """ "GPU 3", "GPUs 0,2"."""
    found = sorted(set(indexes))
    return ("GPU " if len(found) == 1 else "GPUs ") + ",".join(str(i) for i in found)


def age_text(delta: timedelta) -> str:
    """An age in the unit an admin reads at a glance: seconds, minutes, or hours."""
    seconds = int(delta.total_seconds())
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"


def resource_name(unit: CapacityUnit) -> str:
    """What the cluster calls the unit: its GRES, its Kubernetes resource, else the sharing mode."""
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


def type_key(unit: CapacityUnit) -> str:
    """The key of ``gpu_types`` that names this unit's model: the GRES type, or the GFD product."""
    gres = unit.labels.get("gres", "")
    parts = gres.split(":")
    if len(parts) == 3:
        return parts[1]
    return unit.labels.get("product", unit.mig_profile or unit.gpu_model)


def groups_text(groups: Iterable[Iterable[int]]) -> str:
    """ "0-1, 2-3" for the groups (0,1) and (2,3); "0+2" for (0,2); a group of one is its index."""
    return ", ".join(_span(g) for g in groups) or "none"


def _span(group: Iterable[int]) -> str:
    """ "3", "0-3" (a run), "0+3" (not one)."""
    members = sorted(set(group))
    if len(members) == 1:
        return str(members[0])
    if members == list(range(members[0], members[-1] + 1)):
        return f"{members[0]}-{members[-1]}"
    return "+".join(str(i) for i in members)


def gres_links_lines(node: str, report: NodeReport, gres_type: str | None) -> list[str]:
    """gres.conf lines, one per GPU of ``report``, whose ``Links=`` say what NVML sees: per other
    GPU of the node, in index order, the number of NVLink links to it, -1 for the GPU itself,
    0 for none. GPUs joined through NVSwitches count the GPU's links to the switches for each
    GPU of its island (every one of them is reached over those links)."""
    indexes = sorted(g.index for g in report.gpus)
    islands = {i: set(g) for g in (report.topology.nvlink if report.topology else ()) for i in g}
    counts: dict[int, dict[int, int]] = {i: {} for i in indexes}
    for gpu in report.gpus:
        for peer in gpu.nvlinks:
            if peer.kind == "gpu" and peer.gpu is not None:
                counts[gpu.index][peer.gpu] = counts[gpu.index].get(peer.gpu, 0) + peer.links
            elif peer.kind == "switch":
                for other in islands.get(gpu.index, ()):
                    if other != gpu.index:
                        counts[gpu.index][other] = counts[gpu.index].get(other, 0) + peer.links
    kind = f" Type={gres_type}" if gres_type else ""
    lines = []
    for i in indexes:
        links = ",".join("-1" if j == i else str(counts[i].get(j, 0)) for j in indexes)
        lines.append(f"NodeName={node} Name=gpu{kind} File=/dev/nvidia{i} Links={links}")
    return lines


def network_level_fix(kind: str, node: str, level: str, position: Position) -> str:
    """How to give ``node`` a domain at network ``level`` of its cluster: the topology.conf
    line for Slurm (topology/block: ``BlockName``; topology/tree: ``SwitchName``, the leaf
    ``switch`` listing nodes, the levels above it, ``switch2`` ..., listing switches), the
    node label for Kubernetes (the level's name is the label key when it is one)."""
    if kind == "slurm":
        if level == "block":
            line = f"BlockName=<block> Nodes=<its nodes>,{node}"
        elif level == "switch":
            line = f"SwitchName=<leaf switch> Nodes=<its nodes>,{node}"
        else:
            below = _level_below(level, position)
            line = f"SwitchName=<{level} switch> Switches=<its switches>,{below or '<the switch below it>'}"
        return f"add to topology.conf: `{line}`, then `scontrol reconfigure`"
    if kind == "k8s":
        key = level if ("/" in level or "." in level) else f"<the node label of level {level}>"
        return f"`kubectl label node {node} {key}=<{level.rsplit('/', 1)[-1]} name>`"
    return f"give {node} a {level} in the simulated cluster's fleet file"


def _level_below(level: str, position: Position) -> str | None:
    """The node's domain one level narrower than ``level`` (its switch under a ``switch2``)."""
    names = [name for name, _ in position]
    if level not in names or names.index(level) + 1 >= len(names):
        return None
    return position[names.index(level) + 1][1]
