"""GPU models gpush knows, and their MIG geometry as NVIDIA documents it.

Each MIG-capable model divides its memory into 8 slots (4 on the A30) and its
compute into 7 (4) slices. A profile takes a number of contiguous memory slots
and may start only at certain slots ("placements"); a layout is valid when its
instances fit without overlap. Source: NVIDIA MIG User Guide, "Supported MIG
Profiles" (A30, A100 40/80 GB, H100 80 GB, H200 141 GB).

Physical GPU-equivalents (the unit of fair share and quotas) of a MIG instance are
its compute slices over the GPU's: a 1g slice of an A100 is 1/7, a 3g is 3/7.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache


@dataclass(frozen=True)
class MigProfile:
    name: str  # "1g.5gb"
    compute_slices: int  # the "1g" part
    memory_slots: int  # contiguous memory slots it occupies
    memory_gb: float
    placements: tuple[int, ...]  # memory slots it may start at

    @property
    def max_instances(self) -> int:
        return len(self.placements)


@dataclass(frozen=True)
class GpuModel:
    name: str  # canonical: "A100-SXM4-40GB"
    memory_gb: float
    compute_slices: int = 7
    memory_slots: int = 8
    mig_profiles: dict[str, MigProfile] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, name: str) -> MigProfile:
        try:
            return self.mig_profiles[name]
        except KeyError:
            offered = ", ".join(self.mig_profiles) or "none: it is not MIG-capable"
            raise ValueError(f"{self.name} has no MIG profile {name!r}; it offers {offered}") from None

    def gpu_equivalent(self, profile: str) -> float:
        return self.profile(profile).compute_slices / self.compute_slices

    def smallest_profile_for(self, memory_gb: float) -> MigProfile | None:
        """The smallest profile whose memory covers ``memory_gb`` (fewest slots, then compute)."""
        fits = [p for p in self.mig_profiles.values() if p.memory_gb >= memory_gb]
        return min(fits, key=lambda p: (p.memory_slots, p.compute_slices, p.memory_gb), default=None)


def _eight_slot(name: str, memory_gb: float, names: tuple[str, ...], aliases: tuple[str, ...]) -> GpuModel:
    """The 8-slot geometry of A100, H100 and H200; ``names`` are the six profiles
    in NVIDIA's order (1g small, 1g large, 2g, 3g, 4g, 7g), which differ by memory."""
    geometry = [  # compute slices, memory slots, placements
        (1, 1, (0, 1, 2, 3, 4, 5, 6)),
        (1, 2, (0, 2, 4, 6)),
        (2, 2, (0, 2, 4)),
        (3, 4, (0, 4)),
        (4, 4, (0,)),
        (7, 8, (0,)),
    ]
    profiles = {
        n: MigProfile(n, compute, slots, float(n.split(".")[1].removesuffix("gb")), placements)
        for n, (compute, slots, placements) in zip(names, geometry, strict=True)
    }
    return GpuModel(name, memory_gb, 7, 8, profiles, aliases)


MODELS: tuple[GpuModel, ...] = (
    _eight_slot(
        "A100-SXM4-40GB",
        40,
        ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
        ("A100-40GB", "A100-PCIE-40GB", "A100"),
    ),
    _eight_slot(
        "A100-SXM4-80GB",
        80,
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        ("A100-80GB", "A100-PCIE-80GB"),
    ),
    _eight_slot(
        "H100-SXM5-80GB",
        80,
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        ("H100-80GB", "H100", "H100-PCIE-80GB", "H100-80GB-HBM3"),
    ),
    _eight_slot(
        "H200-SXM5-141GB",
        141,
        ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
        ("H200", "H200-141GB"),
    ),
    GpuModel(
        "A30-24GB",
        24,
        4,
        4,
        {
            "1g.6gb": MigProfile("1g.6gb", 1, 1, 6, (0, 1, 2, 3)),
            "2g.12gb": MigProfile("2g.12gb", 2, 2, 12, (0, 2)),
            "4g.24gb": MigProfile("4g.24gb", 4, 4, 24, (0,)),
        },
        ("A30",),
    ),
    # Not MIG-capable: whole GPUs, MPS or time-slicing only.
    GpuModel("V100-SXM2-32GB", 32, aliases=("V100", "V100-32GB")),
    GpuModel("V100-SXM2-16GB", 16, aliases=("V100-16GB",)),
    GpuModel("P100-PCIE-16GB", 16, aliases=("P100",)),
    GpuModel("T4", 16, aliases=("Tesla-T4",)),
    GpuModel("L4", 24),
    GpuModel("L40S", 48),
    GpuModel("A10", 24, aliases=("A10G",)),
    GpuModel("G2", 16),
    GpuModel("G3", 32),
)


@cache
def _index() -> dict[str, GpuModel]:
    out: dict[str, GpuModel] = {}
    for model in MODELS:
        for name in (model.name, *model.aliases):
            out[name.lower()] = model
    return out


def gpu_model(name: str) -> GpuModel:
    """The model called ``name`` (canonical name or alias, any case)."""
    try:
        return _index()[name.lower()]
    except KeyError:
        known = ", ".join(m.name for m in MODELS)
        raise ValueError(f"unknown GPU model {name!r}: gpush knows {known}") from None


def mig_layout_problem(model: GpuModel, profiles: list[str]) -> str | None:
    """Why ``profiles`` cannot all live on one GPU of ``model`` at once, or None if they can.

    Tries placements in order of the largest instances first (backtracking; a GPU
    holds at most 7 instances, so the search is tiny).
    """
    if not model.mig_capable:
        return f"{model.name} is not MIG-capable"
    try:
        wanted = sorted((model.profile(p) for p in profiles), key=lambda p: -p.memory_slots)
    except ValueError as exc:
        return str(exc)
    if sum(p.compute_slices for p in wanted) > model.compute_slices:
        used = sum(p.compute_slices for p in wanted)
        return f"{', '.join(profiles)} need {used} compute slices; {model.name} has {model.compute_slices}"
    taken = [False] * model.memory_slots

    def place(i: int) -> bool:
        if i == len(wanted):
            return True
        p = wanted[i]
        for start in p.placements:
            span = range(start, start + p.memory_slots)
            if all(not taken[s] for s in span):
                for s in span:
                    taken[s] = True
                if place(i + 1):
                    return True
                for s in span:
                    taken[s] = False
        return False

    if place(0):
        return None
    return f"{', '.join(profiles)} do not fit {model.name}'s MIG placements together"


@cache
def model_of_nvml_product(product: str | None) -> GpuModel | None:
    """gpush's model for an NVML product name ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB
    PCIe", "NVIDIA H100 80GB HBM3", "Tesla T4"), or None when gpush does not know it.
    PCIe cards count as their SXM model (same MIG geometry and memory)."""
    if not product:
        return None
    base = product.strip()
    for prefix in ("NVIDIA ", "Tesla ", "Quadro "):
        base = base.removeprefix(prefix)
    dashed = base.replace(" ", "-")
    candidates = [base, dashed]
    for suffix in ("-PCIe", "-PCIE", "-HBM3e", "-HBM3", "-NVL", "-SXM"):
        if dashed.endswith(suffix):
            candidates.append(dashed.removesuffix(suffix))
    for candidate in candidates:
        try:
            return gpu_model(candidate)
        except ValueError:
            continue
    # "A100 80GB PCIe": the series and the memory pick the model when only one matches.
    series = base.replace("-", " ").split()[0].upper() if base.split() else ""
    memory = re.search(r"(\d+)\s*GB", base, re.IGNORECASE)
    matches = [m for m in MODELS if m.name.split("-")[0].upper() == series]
    if memory:
        matches = [m for m in matches if round(m.memory_gb) == int(memory.group(1))]
    return matches[0] if len(matches) == 1 else None
