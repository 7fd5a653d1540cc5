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
