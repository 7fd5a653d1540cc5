"""Say what changing one GPU's MIG layout would do on this machine, changing nothing.

Reads the GPUs as the node agent does (real NVML, or a recording with --recording) and
prints, for GPU --gpu and the layout --layout, what stays, what would be destroyed and
created, and the NVML calls in the order gpush would make them. It can only read: the
library it uses refuses every call that changes a GPU, so it is safe on a lent GPU
machine (never change a lent GPU's MIG layout or mode). From the repository root:

    .venv/bin/python integration/gpu/mig_dry_run.py --gpu 0 --layout 3g.20gb@0,2g.10gb@4,1g.5gb@6
    .venv/bin/python integration/gpu/mig_dry_run.py --recording tests/data/nvml/mig01.json \\
        --gpu 0 --layout 3g.20gb@0,3g.20gb@4

Exit 0 when the change could be made, 2 when it is refused (the reason is printed).
Not a pytest module: tests/nodeagent/test_mig_apply.py runs it on a recording.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from broker.mig.layouts import MigSlot  # noqa: E402
from broker.nodeagent.agent import collect  # noqa: E402
from broker.nodeagent.mig_apply import LayoutRefused, apply_layout_change, layout_change  # noqa: E402
from broker.nodeagent.nvml import PynvmlLibrary, RecordedLibrary  # noqa: E402

# The NVML calls that change a GPU: a read-only library refuses them all.
CHANGING = (
    "nvmlDeviceSetMigMode",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceDestroy",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    "nvmlComputeInstanceDestroy",
)


class ReadOnly:
    """``library`` with every call that changes a GPU refused."""

    def __init__(self, library: Any):
        self._library = library

    def __getattr__(self, name: str) -> Any:
        if name in CHANGING or name.startswith(("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear")):
            raise PermissionError(f"{name}: this script only reads the GPU")
        return getattr(self._library, name)


def parse_layout(text: str) -> list[MigSlot]:
    slots = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            slots.append(MigSlot.parse(part))
        except ValueError as exc:
            raise SystemExit(f"--layout: {exc}") from None
    return slots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, required=True, help="NVML index of the GPU")
    parser.add_argument("--layout", required=True, help="the target: PROFILE@SLOT,... (empty: no instances)")
    parser.add_argument("--recording", type=Path, help="replay this NVML recording instead of the real NVML")
    args = parser.parse_args(argv)
    library = ReadOnly(RecordedLibrary(args.recording) if args.recording else PynvmlLibrary())
    report = collect(library, "this-node")
    if report.error:
        print(f"cannot read the GPUs: {report.error}")
        return 1
    gpus = {g.index: g for g in report.gpus}
    if args.gpu not in gpus:
        print(f"no GPU {args.gpu}: this machine has {', '.join(map(str, sorted(gpus))) or 'none'}")
        return 2
    gpu = gpus[args.gpu]
    now = ", ".join(f"{m.profile}@{m.placement_start}" for m in gpu.mig_instances) or "(no instances)"
    print(f"GPU {gpu.index} ({gpu.product}): {now}")
    try:
        change = layout_change(gpu, parse_layout(args.layout))
    except LayoutRefused as exc:
        print(f"refused: {exc}")
        return 2
    if change.empty:
        print("nothing to change: the GPU has that layout")
        return 0
    print("keep:    " + (", ".join(map(str, change.keep)) or "-"))
    for line in apply_layout_change(library, change, dry_run=True):
        print("would " + line.split(": ", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
