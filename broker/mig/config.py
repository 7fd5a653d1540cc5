"""What an admin applies for a MIG plan: the nvidia-mig-parted config, Slurm's gres.conf
lines and slurm.conf ``Gres=`` field, and a plain-text summary.

- nvidia-mig-parted (github.com/NVIDIA/mig-parted) reads ``version: v1`` and
  ``mig-configs``: named configs, each a list of ``{devices, mig-enabled, mig-devices}``
  where ``mig-devices`` counts instances per profile. It does not take placements:
  it finds an order that fits. It re-creates every instance of a device whose counts
  differ, so a node is drained before ``nvidia-mig-parted apply``.
- Slurm (gres.conf(5), "MIG"): with ``AutoDetect=nvml`` slurmd finds the GPUs and MIG
  instances itself; without it, each MIG instance is one line whose files are the
  parent GPU's device and the instance's capability devices under /dev/nvidia-caps,
  whose minors /proc/driver/nvidia-caps/mig-minors lists (``gpu<G>/gi<I>/access`` is
  ``3 + 135*G + 9*I``; its compute instance ``C`` follows at ``+ 1 + C``). MPS is never
  detected: ``Name=mps Count=100`` per GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from broker.core.gpus import GpuModel, model_of_nvml_product
from broker.inventory.agent_report import GpuReport
from broker.mig.layouts import MigSlot, layout_counts
from broker.mig.plan import MigPlan

GresStyle = Literal["nvml", "multiple-files", "file"]
GRES_STYLES = ("multiple-files", "file", "nvml")


# --- nvidia-mig-parted ---------------------------------------------------------------------


def mig_parted_name(node: str, prefix: str = "gpush-") -> str:
    return f"{prefix}{node}"


def mig_parted_config(plan: MigPlan, *, prefix: str = "gpush-") -> dict[str, Any]:
    """The plan as a mig-parted config: one named config per node, its MIG-capable GPUs
    grouped by identical layout. GPUs not MIG-capable are left out (mig-parted refuses them)."""
    configs: dict[str, list[dict[str, Any]]] = {}
    for node in sorted({g.node for g in plan.gpus}):
        groups: dict[tuple, list[int]] = {}
        entries: dict[tuple, dict[str, Any]] = {}
        for g in sorted((g for g in plan.gpus if g.node == node and g.model.mig_capable), key=lambda g: g.index):
            entry: dict[str, Any] = {"mig-enabled": g.mig_enabled_planned}
            if g.mig_enabled_planned:
                entry["mig-devices"] = layout_counts(g.model, g.planned)
            key = (g.mig_enabled_planned, tuple(entry.get("mig-devices", {}).items()))
            groups.setdefault(key, []).append(g.index)
            entries[key] = entry
        if groups:
            configs[mig_parted_name(node, prefix)] = [{"devices": idx, **entries[key]} for key, idx in groups.items()]
    return {"version": "v1", "mig-configs": configs}


def render_mig_parted(plan: MigPlan, *, prefix: str = "gpush-") -> str:
    header = [
        "# nvidia-mig-parted config from gpush's MIG plan. On each node, after draining it:",
        f"#   nvidia-mig-parted apply -f THIS_FILE -c {prefix}<node>",
        "# mig-parted re-creates every instance of a GPU whose counts change.",
    ]
    busy = [g for g in plan.changed if g.busy_instances]
    for g in busy:
        kept = ", ".join(str(s) for s in g.busy_instances)
        header.append(
            f"# {g.node} GPU {g.index}: {kept} run work and stay where they are: change this GPU by hand "
            "(nvidia-smi mig -dgi/-cgi on the idle instances), not with mig-parted"
        )
    body = yaml.safe_dump(mig_parted_config(plan, prefix=prefix), sort_keys=False, default_flow_style=None)
    return "\n".join(header) + "\n" + body


# --- Slurm ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GresConf:
    """A node's gres.conf block and the ``Gres=`` field of its slurm.conf NodeName line."""

    node: str
    lines: tuple[str, ...]
    gres: str

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    @property
    def device_lines(self) -> tuple[str, ...]:
        """The lines that declare a device (no comments, no AutoDetect)."""
        return tuple(line for line in self.lines if line and not line.startswith("#") and " Name=" in line)


def gpu_type(gpu: GpuReport) -> str:
    """Slurm GRES type of a whole GPU: the gpush model's family in lower case ("a100",
    "h100", "t4"), else NVML's name in lower case with underscores."""
    model = model_of_nvml_product(gpu.product)
    if model is not None:
        return model.name.split("-")[0].lower()
    if gpu.product:
        return gpu.product.removeprefix("NVIDIA ").strip().lower().replace(" ", "_").replace("-", "_")
    return "gpu"


def mig_cap_minor(gpu_minor: int, gi_id: int, ci_id: int | None = None) -> int:
    """The /dev/nvidia-caps minor of a GPU instance's (or its compute instance's) access
    capability, as the driver numbers them in /proc/driver/nvidia-caps/mig-minors."""
    gi = 3 + 135 * gpu_minor + 9 * gi_id
    return gi if ci_id is None else gi + 1 + ci_id


def render_gres_conf(
    node: str,
    gpus: Sequence[GpuReport],
    *,
    style: GresStyle = "multiple-files",
    dev: str = "/dev",
    type_of: Callable[[GpuReport], str] = gpu_type,
) -> GresConf:
    """gres.conf lines and the ``Gres=`` field for ``node``'s GPUs as the agent reports them.

    ``style``: ``nvml`` (``AutoDetect=nvml``; slurmd reads the GPUs and MIG instances),
    ``multiple-files`` (one line per MIG instance: the GPU's device and its GPU- and
    compute-instance capability devices; Slurm 21.08 and later), ``file`` (one line per
    MIG instance naming only its GPU-instance capability, as the integration cluster does).
    Device paths assume the GPU's /dev/nvidiaN minor equals its NVML index, which is
    usual; the block says where to check. ``dev`` roots the paths (fake devices in tests).
    """
    types: dict[str, int] = {}
    lines = [f"# {node}: written by gpush from the node agent's report"]
    if style == "nvml":
        lines.append(f"NodeName={node} AutoDetect=nvml")
    else:
        lines += [
            f"# Alternative to the lines below: NodeName={node} AutoDetect=nvml (slurmd reads them through NVML).",
            "# Files assume /dev/nvidiaN has the NVML index N, and nvidia-cap minors as in",
            "# /proc/driver/nvidia-caps/mig-minors: check both on the node before use.",
            f"NodeName={node} AutoDetect=off",
        ]
    mps = 0
    for gpu in sorted(gpus, key=lambda g: g.index):
        if gpu.error:
            lines.append(f"# GPU {gpu.index}: left out, NVML could not read it: {gpu.error}")
            continue
        device = f"{dev}/nvidia{gpu.index}"
        if gpu.mig_mode_pending is not None and gpu.mig_mode_pending != gpu.mig_mode_current:
            lines.append(f"# GPU {gpu.index}: MIG mode changes at the next GPU reset; re-render after it")
        if gpu.mig_mode_current:
            if not gpu.mig_instances:
                lines.append(f"# GPU {gpu.index}: MIG mode is on with no instances: nothing to schedule on it")
            for inst in sorted(gpu.mig_instances, key=lambda i: i.placement_start):
                types[inst.profile] = types.get(inst.profile, 0) + 1
                if style == "nvml":
                    continue
                gi = f"{dev}/nvidia-caps/nvidia-cap{mig_cap_minor(gpu.index, inst.gi_id)}"
                note = ""
                if inst.ci_id is None:
                    note = "  # no compute instance yet: create one (nvidia-smi mig -cci)"
                if style == "file":
                    files = f"File={gi}"
                else:
                    parts = [device, gi]
                    if inst.ci_id is not None:
                        parts.append(f"{dev}/nvidia-caps/nvidia-cap{mig_cap_minor(gpu.index, inst.gi_id, inst.ci_id)}")
                    files = "MultipleFiles=" + ",".join(parts)
                lines.append(f"NodeName={node} Name=gpu Type={inst.profile} {files}{note}")
            if gpu.mps:
                lines.append(f"# GPU {gpu.index}: MPS is on, but Slurm does not share MIG instances through MPS")
            continue
        kind = type_of(gpu)
        types[kind] = types.get(kind, 0) + 1
        if style != "nvml":
            lines.append(f"NodeName={node} Name=gpu Type={kind} File={device}")
        if gpu.mps:
            mps += 100
            lines.append(f"NodeName={node} Name=mps Count=100 File={device}")
    gres = [f"gpu:{t}:{n}" for t, n in types.items()]
    if mps:
        gres.append(f"mps:{mps}")
    return GresConf(node, tuple(lines), ",".join(gres))


def render_planned_gres(plan: MigPlan, node: str) -> GresConf:
    """gres.conf for ``node`` as the plan leaves it. Which GPU-instance ids the driver
    gives the new instances is known only once they exist, so the block relies on
    ``AutoDetect=nvml``; for explicit files render_gres_conf the agent's next report."""
    gpus = [g for g in plan.gpus if g.node == node]
    if not gpus:
        raise ValueError(f"node {node} has no GPU in this plan")
    types: dict[str, int] = {}
    lines = [
        f"# {node}: written by gpush from a MIG plan (instances as planned, not yet created)",
        f"NodeName={node} AutoDetect=nvml",
        "# For explicit File= lines, render them from the node agent's report once the instances exist.",
    ]
    for g in sorted(gpus, key=lambda g: g.index):
        if g.mig_enabled_planned:
            for profile, n in layout_counts(g.model, g.planned).items():
                types[profile] = types.get(profile, 0) + n
        else:
            kind = g.model.name.split("-")[0].lower()
            types[kind] = types.get(kind, 0) + 1
    return GresConf(node, tuple(lines), ",".join(f"gpu:{t}:{n}" for t, n in types.items()))


# --- summary -----------------------------------------------------------------------------


def layout_text(model: GpuModel, layout: Sequence[MigSlot], mig_enabled: bool = True) -> str:
    """``7×1g.5gb``, ``3g.20gb+2g.10gb+1g.5gb+1g.5gb``, ``whole GPU``, ``none``."""
    if not mig_enabled:
        return "whole GPU (MIG off)"
    if not layout:
        return "no instances"
    counts = layout_counts(model, layout)
    if len(counts) == 1:
        ((profile, n),) = counts.items()
        return f"{n}×{profile}" if n > 1 else profile
    return "+".join(p for p, n in reversed(counts.items()) for _ in range(n))


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' * (n != 1)}"


def render_summary(plan: MigPlan) -> list[str]:
    """Plain-text lines: one per MIG-capable GPU, the totals, then the jobs left out."""
    out: list[str] = []
    for g in plan.gpus:
        if not g.model.mig_capable:
            continue
        today = layout_text(g.model, g.today, g.mig_enabled_today)
        label = f"{g.node} GPU {g.index} ({g.model.name})"
        if g.changed:
            planned = layout_text(g.model, g.planned, g.mig_enabled_planned)
            out.append(f"{label}: today {today} → plan {planned} [{g.action}: {g.reason}]")
        else:
            out.append(f"{label}: {today}, kept ({g.reason})")
    changed = len(plan.changed)
    out.append(
        f"today places {plan.today.jobs} of {plan.waiting} waiting jobs ({plan.today.gpu_equivalents:.2f} GPU-eq), "
        f"the plan places {plan.planned.jobs} ({plan.planned.gpu_equivalents:.2f} GPU-eq), "
        f"{_gpus(changed)} to re-partition"
    )
    if plan.nodes_to_drain:
        out.append(f"drain first: {', '.join(plan.nodes_to_drain)}")
    for u in plan.unplaced:
        out.append(f"not placed: job {u.job} ({u.wants}): {u.reason}")
    return out
