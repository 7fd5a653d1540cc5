"""Write the openb pod-list variants (FGD's sensitivity workloads) as CSV files.

Reads the trace's default pod list and GPU node list from ``--trace``, makes every
variant of :data:`broker.simulation.variants.FAMILIES` (or of one family or one
label, ``--family``) with ``--seed``, writes each as
``<out>/openb_pod_list_<label>.csv`` in the trace's own format, and prints one line
of statistics per list: pods, GPU demand (GPUs), the shares of GPU demand carried by
fractional, multi-GPU and pinned pods, and the CPU-only share of the pods. The
default list comes first; upstream's own variants, where the trace directory has
them (gpushare40, multigpu20), come last for comparison.

It exits 0 when the files were written, 1 when something was wrong (a missing trace
file, an unwritable directory), 2 on a bad option.

    .venv/bin/python integration/bench/variants.py --out /tmp/variants --seed 42
    .venv/bin/python integration/bench/variants.py --out /tmp/v --family gpushare40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from broker.core.errors import InvalidRequest
from broker.simulation import traces
from broker.simulation.variants import (
    FAMILIES,
    PodListStats,
    generate,
    pod_list_stats,
    variant,
    variant_file,
    write_pods,
)

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "alibaba-openb-2023"
DEFAULT_SEED = 42  # the first seed of the FGD artifact's scripts
UPSTREAM = ("gpushare40", "multigpu20")  # the variants the in-repository trace copy holds


def selected(choice: str | None) -> list[tuple[str, str, float]]:
    """(family, label, share) of every variant, of one family, or the one label."""
    if choice is None:
        return [(family, label, share) for family, items in FAMILIES.items() for label, share in items]
    if choice in FAMILIES:
        return [(choice, label, share) for label, share in FAMILIES[choice]]
    try:
        family, share = variant(choice)
    except InvalidRequest:
        raise InvalidRequest(
            f"--family {choice!r} is neither a family ({', '.join(FAMILIES)}) nor a variant "
            f"({', '.join(label for items in FAMILIES.values() for label, _ in items)})"
        ) from None
    return [(family, choice, share)]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def stats_table(rows: list[tuple[str, PodListStats]]) -> list[str]:
    """The statistics as lines of at most 80 characters."""
    head = f"{'list':<22} {'pods':>6} {'GPUs':>8} {'frac':>7} {'multi':>7} {'pinned':>7} {'CPU-only':>8}"
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(
            f"{name[:22]:<22} {s.pods:>6} {s.gpu_demand:>8.1f} {_pct(s.fractional):>7} "
            f"{_pct(s.multi_gpu):>7} {_pct(s.pinned):>7} {_pct(s.cpu_only):>8}"
        )
    lines.append("frac, multi, pinned: share of GPU demand; CPU-only: share of pods")
    return lines


def run(trace_dir: Path, out_dir: Path, seed: int, choice: str | None, stream: TextIO) -> None:
    chosen = selected(choice)
    pods = traces.read_pods(trace_dir / traces.DEFAULT_PODS)
    nodes = traces.read_nodes(trace_dir / traces.DEFAULT_NODES)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidRequest(f"cannot create output directory {str(out_dir)!r}: {exc.strerror or exc}") from None
    rows = [("default", pod_list_stats(pods))]
    for family, label, share in chosen:
        listed = generate(family, share, pods, nodes, seed)
        write_pods(listed, out_dir / variant_file(label))
        rows.append((label, pod_list_stats(listed)))
    for label in UPSTREAM:
        path = trace_dir / variant_file(label)
        if path.is_file() and any(label == chosen_label for _, chosen_label, _ in chosen):
            rows.append((f"upstream {label}", pod_list_stats(traces.read_pods(path))))
    print(f"seed {seed}: {len(chosen)} list(s) written to {out_dir}", file=stream)
    for line in stats_table(rows):
        print(line, file=stream)


def main(argv: list[str] | None = None, stream: TextIO = sys.stdout) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the openb trace directory")
    parser.add_argument("--out", type=Path, required=True, help="where the CSV files go")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    parser.add_argument(
        "--family", help=f"one family ({', '.join(FAMILIES)}) or one variant (gpushare40, ...); default all"
    )
    args = parser.parse_args(argv)
    try:
        selected(args.family)
    except InvalidRequest as exc:
        parser.error(exc.message)
    try:
        run(args.trace, args.out, args.seed, args.family, stream)
    except InvalidRequest as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
