"""Changing one GPU's MIG layout through NVML, the node agent's half of ``gpush mig apply``.

:func:`layout_change` compares what the agent read of a GPU (its report: instances with
their GPU instance ids, placements and the processes on them) with a target layout
(broker.mig.layouts, every instance placed) and says what to destroy and what to create;
instances in both (same profile, same first memory slot) are kept, so work on them is
never touched. :func:`apply_layout_change` makes the NVML calls in NVIDIA's order (a GPU
instance's compute instances before it; new GPU instances with their placement, then one
compute instance spanning each), or with ``dry_run`` only says which calls it would make.

It never destroys an instance that a process runs on (:class:`LayoutRefused`: the
scheduler drains and preempts first), and checks the target is a valid layout of the
GPU's model before any call. An NVML error mid-way leaves the GPU part changed; the
caller reads the GPU again and goes on from what it finds (the change is computed from
what is, not from what was planned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from broker.core.gpus import GpuModel, MigProfile, model_of_nvml_product
from broker.inventory.agent_report import GpuReport
from broker.mig.layouts import Layout, MigSlot, layout_problem
from broker.nodeagent.nvml import COMPUTE_PROFILES, PROFILE_SHAPES


class LayoutRefused(ValueError):
    """The change cannot be made as asked; the message says why and what to do."""


@dataclass(frozen=True)
class LayoutChange:
    """What changes on GPU ``index``: GPU instances to destroy (ids, with their slot) and
    instances to create, in placement order; ``keep``: those left as they are."""

    index: int
    model: GpuModel
    destroy: tuple[tuple[int, MigSlot], ...]
    create: tuple[MigSlot, ...]
    keep: tuple[MigSlot, ...]

    @property
    def empty(self) -> bool:
        return not self.destroy and not self.create


def layout_change(gpu: GpuReport, target: Sequence[MigSlot]) -> LayoutChange:
    """From the GPU as the agent read it to ``target`` (module docstring)."""
    model = model_of_nvml_product(gpu.product)
    if model is None or not model.mig_capable:
        raise LayoutRefused(f"GPU {gpu.index} ({gpu.product}) is not a MIG-capable model gpush knows")
    if not gpu.mig_mode_current:
        raise LayoutRefused(
            f"GPU {gpu.index} is not in MIG mode: an administrator enables it (nvidia-smi -i {gpu.index} -mig 1, "
            "with the GPU idle) before gpush can lay out slices"
        )
    wanted: Layout = tuple(sorted(target, key=lambda s: (s.start if s.start is not None else -1, s.profile)))
    problem = layout_problem(model, wanted)
    if problem:
        raise LayoutRefused(f"GPU {gpu.index}: the target layout is not valid: {problem}")
    busy = {p.mig_uuid for p in gpu.processes if p.mig_uuid}
    have = {(m.profile, m.placement_start): m for m in gpu.mig_instances}
    keep = [s for s in wanted if (s.profile, s.start) in have]
    create = tuple(s for s in wanted if (s.profile, s.start) not in have)
    kept = {(s.profile, s.start) for s in keep}
    destroy = []
    for m in gpu.mig_instances:
        if (m.profile, m.placement_start) in kept:
            continue
        if m.uuid is not None and m.uuid in busy:
            raise LayoutRefused(
                f"GPU {gpu.index}: {m.profile} at slot {m.placement_start} runs work ({m.uuid}); "
                "its jobs must end or be preempted before the layout changes"
            )
        destroy.append((m.gi_id, MigSlot(m.profile, m.placement_start)))
    return LayoutChange(gpu.index, model, tuple(destroy), create, tuple(keep))


def apply_layout_change(library: Any, change: LayoutChange, *, dry_run: bool = False) -> list[str]:
    """Make (or, with ``dry_run``, only describe) the NVML calls of ``change``; returns them
    as lines. NVML errors are raised as the library raises them."""
    lines: list[str] = []
    device = library.nvmlDeviceGetHandleByIndex(change.index)
    for gi_id, slot in change.destroy:
        profile, profile_id = _profile(change.model, slot)
        lines.append(f"GPU {change.index}: destroy {slot.profile} at slot {slot.start} (GPU instance {gi_id})")
        if dry_run:
            continue
        (gpu_instance,) = [
            g
            for g in library.nvmlDeviceGetGpuInstances(device, profile_id)
            if library.nvmlGpuInstanceGetInfo(g).id == gi_id
        ]
        ci_profile = COMPUTE_PROFILES[profile.compute_slices]
        for compute_instance in library.nvmlGpuInstanceGetComputeInstances(gpu_instance, ci_profile):
            library.nvmlComputeInstanceDestroy(compute_instance)
        library.nvmlGpuInstanceDestroy(gpu_instance)
    for slot in change.create:
        profile, profile_id = _profile(change.model, slot)
        lines.append(f"GPU {change.index}: create {slot.profile} at slot {slot.start}")
        if dry_run:
            continue
        placement = SimpleNamespace(start=slot.start, size=profile.memory_slots)
        gpu_instance = library.nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, placement)
        library.nvmlGpuInstanceCreateComputeInstance(gpu_instance, COMPUTE_PROFILES[profile.compute_slices])
    return lines


def _profile(model: GpuModel, slot: MigSlot) -> tuple[MigProfile, int]:
    """The slot's MIG profile and NVML's id for it."""
    profile = model.profile(slot.profile)
    return profile, PROFILE_SHAPES[(profile.compute_slices, profile.memory_slots)][1]
