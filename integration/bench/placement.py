"""Placement quality and replay speed on the Alibaba openb trace.

What it measures, on the trace's GPU node list (1,213 nodes, 6,212 GPUs) and its
default pod list (``--pods``; its 1,088 CPU-only pods are left out, gpush places
GPU jobs only):

* **inflation** (the FGD paper's experiment, Weng et al., USENIX ATC '23): per seed,
  the GPU pods in a random order, then pods drawn from them with replacement until
  the arrived GPU demand reaches 130% of capacity; nothing leaves, a pod that fits
  nowhere is dropped. Each arrival sequence is placed by gpush's fragmentation-aware
  placement (``broker.placement.fragmentation``, FGD), by best fit (``broker.placement.capacity``'s rule
  on the same GPU-sharing nodes) and with whole GPUs (every pod one whole GPU per GPU
  it touches, best fit). Reported: GPU allocation (GPU demand placed over capacity)
  when the arrived demand reaches 100% of capacity, and when the first pod is
  refused ("until the first failure"), medians over ``--seeds`` seeds (default 10:
  42..51, the seeds of the paper's artifact scripts). The paper's medians at 100%:
  FGD 95.2%, best fit 92.9% (its best fit weighs CPU and GPU); whole GPUs about 81%.
  CPU and host memory count by default, as in the paper (``--gpu-only`` drops them).
* **replay**: the whole default pod list, each pod arriving at its creation time and
  running until its deletion, routed by the trace's policy and placed by FGD, and
  again on whole GPUs: wall time of each (target: under 60 s).

It is a benchmark, not a test: targets are printed beside the figures, never
asserted. It exits 0 when it ran, 1 when something broke (a missing trace file).

    .venv/bin/python integration/bench/placement.py --json placement-results.json
    .venv/bin/python integration/bench/placement.py --seeds 3            # a quicker look
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from broker.core.errors import InvalidRequest
from broker.simulation import traces
from broker.simulation.inflation import InflationRun, inflation_experiment, variant_name
from broker.simulation.shared import replay_shared

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "alibaba-openb-2023"
FIRST_SEED = 42  # the paper's artifact scripts use seeds 42..51
FGD, BEST_FIT, WHOLE = variant_name("fgd", False), variant_name("best-fit", False), variant_name("best-fit", True)
PAPER = {FGD: 0.952, BEST_FIT: 0.929, WHOLE: 0.81}
TARGETS = {FGD: 0.95}
REPLAY_TARGET_S = 60.0


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def inflation(trace: traces.OpenbTrace, seeds: int, gpu_only: bool) -> dict[str, Any]:
    nodes = trace.shared_nodes(account_cpu=not gpu_only)

    def progress(run: InflationRun) -> None:
        name = variant_name(run.placement, run.whole_gpus)
        print(
            f"  seed {run.seed:>3} {name:<21} at 100%: {_pct(run.at_full):>6}   "
            f"at the first failure: {_pct(run.at_first_failure):>6}   {run.seconds:.1f}s",
            flush=True,
        )

    began = time.perf_counter()
    result = inflation_experiment(nodes, trace.tasks(), seeds=range(FIRST_SEED, FIRST_SEED + seeds), progress=progress)
    result["wall_seconds"] = time.perf_counter() - began
    result["account_cpu"] = not gpu_only
    return result


def replay_times(trace: traces.OpenbTrace) -> dict[str, Any]:
    nodes = trace.shared_nodes()
    began = time.perf_counter()
    workload = trace.workload()
    load = time.perf_counter() - began
    out: dict[str, Any] = {"jobs": len(workload), "convert_seconds": load}
    for name, placement, whole in ((FGD, "fgd", False), (WHOLE, "best-fit", True)):
        result = replay_shared(nodes, trace.cluster, trace.policy(), workload, placement=placement, whole_gpus=whole)
        summary = result.summary()
        out[name] = {
            "seconds": result.wall_seconds,
            "placed": summary["placed"],
            "held": summary["held"],
            "still_waiting": summary["still_waiting"],
            "allocation_peak": summary["allocation_peak"],
            "wait_p99_s": summary["waits"]["all"]["p99"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help=f"openb trace directory (default {DEFAULT_TRACE}).")
    parser.add_argument("--pods", default=traces.DEFAULT_PODS, help="Pod list file in the trace directory.")
    parser.add_argument("--nodes", default=traces.DEFAULT_NODES, help="Node list file in the trace directory.")
    parser.add_argument("--seeds", type=int, default=10, help="Inflation seeds (default 10: 42..51).")
    parser.add_argument("--gpu-only", action="store_true", help="Inflation without CPU and host memory limits.")
    parser.add_argument("--skip-inflation", action="store_true")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    args = parser.parse_args(argv)

    try:
        trace = traces.load_openb(args.trace, pods_file=args.pods, nodes_file=args.nodes)
    except InvalidRequest as exc:
        print(f"placement bench: {exc}", file=sys.stderr)
        return 1
    print(
        f"openb: {trace.pods_file} ({len(trace.gpu_pods)} GPU pods, {trace.cpu_only_pods} CPU-only left out) "
        f"on {trace.nodes_file} ({trace.gpu_count} GPUs)"
    )
    report: dict[str, Any] = {
        "trace": args.trace,
        "pods": trace.pods_file,
        "nodes": trace.nodes_file,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }

    if not args.skip_inflation:
        print(f"\ninflation to 130%, {args.seeds} seeds, CPU and memory {'ignored' if args.gpu_only else 'counted'}:")
        result = inflation(trace, args.seeds, args.gpu_only)
        report["inflation"] = result
        print("\nmedians                at 100% arrived   at the first failure   paper (at 100%)   target")
        for name, m in result["medians"].items():
            paper = _pct(PAPER[name]) if name in PAPER else "-"
            target = f">= {_pct(TARGETS[name])}" if name in TARGETS else ""
            print(
                f"  {name:<21}{_pct(m['at_full']):>10}        {_pct(m['at_first_failure']):>12}"
                f"        {paper:>10}     {target}"
            )
        print(f"  ({result['wall_seconds']:.0f}s for {args.seeds * len(result['medians'])} runs)")

    if not args.skip_replay:
        print("\nreplay of the whole pod list (creation to deletion times):")
        times = replay_times(trace)
        report["replay"] = times
        for name in (FGD, WHOLE):
            r = times[name]
            print(
                f"  {name:<21} {r['seconds']:6.2f}s   {r['placed']} placed, {r['held']} held, "
                f"peak allocation {_pct(r['allocation_peak'])}   (target < {REPLAY_TARGET_S:.0f}s)"
            )
        print(f"  (reading the pods into jobs: {times['convert_seconds']:.2f}s)")

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
