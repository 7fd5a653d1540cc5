"""Inventory reconciliation at fleet scale: ``broker.inventory.reconcile.reconcile`` on 10,000 nodes.

What it builds (not timed), from the adapters' own code so the units are the ones a
real inventory read gives:

* **Slurm** (``--nodes`` / 2 nodes, 8 A100-40GB each), read through ``SlurmAdapter``
  over a stand-in client: 30% MIG nodes (four GPUs of seven 1g.5gb, two of two
  3g.20gb, two of 3g.20gb + 2g.10gb + two 1g.5gb, as typed GRES), 20% MPS nodes
  (``gpu:a100:8,mps:800``), 50% whole GPUs (``gpu:a100:8``).
* **Kubernetes** (the other half), read through ``adapters.k8s.inventory.node_units``
  from Node objects with GPU Feature Discovery labels: 50% time-sliced T4s (4
  replicas a GPU), 30% A100-40GB under the mixed MIG strategy (3g.20gb + two 1g.5gb a
  GPU), 20% whole H100s; the ConfigMap's replicas given for every node.
* **Agent reports**: one NodeReport per node with what NVML would say (UUIDs,
  products, MIG instances, MPS daemons), plus 1% of extra nodes that no cluster lists.
* **Drift**, a few percent (``--drift``, default 3%): k8s nodes whose advertised
  replicas differ from the ConfigMap, Slurm MIG nodes whose GRES name a profile with no
  instance or count more than exist, lost GPUs, MPS on MIG GPUs, pending MIG mode
  changes, nodes without an agent, stale reports.

What it measures: the wall time of ``reconcile()`` (median of ``--rounds`` rounds,
default 5), of ``mark_broken`` over every unit, and of ``Inventory.to_dict()`` (the
``--json`` output of ``gpush inventory``); the memory reconcile allocates at its peak
(tracemalloc, one extra round, not timed) and the peak RSS of the whole process
(inputs included). Targets (reconcile < 2 s, < 1 GB) are printed beside the figures,
never asserted. It exits 0 when it ran, 1 when something broke.

    .venv/bin/python integration/bench/inventory.py --json inventory-results.json
    .venv/bin/python integration/bench/inventory.py --nodes 1000 --rounds 3     # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adapters.k8s.inventory import node_units  # noqa: E402
from adapters.slurm.adapter import SlurmAdapter  # noqa: E402
from adapters.slurm.records import SlurmJob, SlurmNode, parse_gres  # noqa: E402
from broker.core.adapter import CapacityUnit  # noqa: E402
from broker.inventory.agent_report import GpuReport, MigInstance, NodeReport  # noqa: E402
from broker.inventory.reconcile import reconcile  # noqa: E402
from broker.inventory.view import ClusterInventory, mark_broken  # noqa: E402

NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
GPUS_PER_NODE = 8
TARGET_SECONDS = 2.0
TARGET_MB = 1024
A100 = "NVIDIA A100-SXM4-40GB"
CONFIGMAP = "ConfigMap gpu-operator/time-slicing-config key any"


class _Slurm:
    """Stand-in SlurmClient: inventory() reads only nodes and jobs."""

    def __init__(self, nodes: list[SlurmNode]):
        self._nodes = nodes

    def nodes(self) -> list[SlurmNode]:
        return self._nodes

    def jobs(self) -> list[SlurmJob]:
        return []


def _instances(profiles: list[str], node: str, index: int) -> list[MigInstance]:
    return [
        MigInstance(
            profile=p, gi_id=n + 1, ci_id=0, uuid=f"MIG-{node}-{index}-{n}", placement_start=n, placement_size=1
        )
        for n, p in enumerate(profiles)
    ]


def _gpu(node: str, index: int, product: str, mig: list[str] | None = None, **extra: Any) -> GpuReport:
    return GpuReport(
        index=index,
        uuid=f"GPU-{node}-{index}",
        product=product,
        memory_mb=40960,
        mig_mode_current=mig is not None,
        mig_mode_pending=mig is not None,
        mig_instances=_instances(mig, node, index) if mig else [],
        **extra,
    )


SLURM_MIG_LAYOUT = [["1g.5gb"] * 7] * 4 + [["3g.20gb"] * 2] * 2 + [["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]] * 2
K8S_MIG_LAYOUT = ["3g.20gb", "1g.5gb", "1g.5gb"]


def build(nodes: int, drift: float, seed: int) -> tuple[dict[str, ClusterInventory], dict[str, NodeReport], Counter]:
    """The three sources for ``nodes`` nodes (see the module docstring), and what drift was injected."""
    rng = random.Random(seed)
    injected: Counter[str] = Counter()
    reports: dict[str, NodeReport] = {}

    def report(name: str, gpus: list[GpuReport]) -> None:
        roll = rng.random()
        if roll < drift * 0.2:
            injected["no agent"] += 1
            return
        at = NOW - timedelta(seconds=30)
        if roll < drift * 0.3:
            injected["stale report"] += 1
            at = NOW - timedelta(hours=1)
        reports[name] = NodeReport(node=name, agent_version="0.1", collected_at=at, driver_version="550.54", gpus=gpus)

    # -- Slurm ------------------------------------------------------------------------------
    slurm_nodes: list[SlurmNode] = []
    half = nodes // 2
    for n in range(half):
        name = f"s{n:05d}"
        kind = n % 10
        roll = rng.random()
        if kind < 3:  # MIG
            gres = "gpu:1g.5gb:32,gpu:3g.20gb:6,gpu:2g.10gb:2"
            layout = [list(p) for p in SLURM_MIG_LAYOUT]
            if roll < drift * 0.3:
                gres = "gpu:1g.5gb:32,gpu:3g.20gb:6,gpu:2g.10gb:2,gpu:1g.10gb:2"
                injected["GRES type without MIG instance"] += 1
            elif roll < drift * 0.6:
                gres = "gpu:1g.5gb:37,gpu:3g.20gb:6,gpu:2g.10gb:2"
                injected["GRES count above NVML"] += 1
            gpus = [_gpu(name, i, A100, layout[i]) for i in range(GPUS_PER_NODE)]
            if drift * 0.6 <= roll < drift * 0.8:
                gpus[7] = _gpu(name, 7, A100, layout[7], mps=True)
                injected["MPS on a MIG GPU"] += 1
            used = "gpu:1g.5gb:12(IDX:0-11),gpu:3g.20gb:3(IDX:28-30)"
        elif kind < 5:  # MPS
            gres, used = "gpu:a100:8,mps:800", ""
            gpus = [_gpu(name, i, A100, mps=True) for i in range(GPUS_PER_NODE)]
        else:  # whole
            gres, used = "gpu:a100:8", "gpu:a100:5(IDX:0-4)"
            gpus = [_gpu(name, i, A100) for i in range(GPUS_PER_NODE)]
            if roll < drift * 0.3:
                gpus[3] = GpuReport(index=3, uuid=f"GPU-{name}-3", error="Unknown Error (GPU is lost)")
                injected["lost GPU"] += 1
            elif roll < drift * 0.5:
                gpus[5] = gpus[5].model_copy(update={"mig_mode_pending": True})
                injected["MIG mode pending"] += 1
        slurm_nodes.append(
            SlurmNode(name, ("MIXED",), tuple(parse_gres(gres)), tuple(parse_gres(used)), ("gpu",), 128, 1_000_000)
        )
        report(name, gpus)
    slurm_units = SlurmAdapter("slurm-a", {"cache_seconds": 0}, client=_Slurm(slurm_nodes)).inventory()

    # -- Kubernetes ----------------------------------------------------------------------------
    k8s_units: list[CapacityUnit] = []
    for n in range(nodes - half):
        name = f"k{n:05d}"
        kind = n % 10
        roll = rng.random()
        labels = {"nvidia.com/gpu.count": str(GPUS_PER_NODE)}
        allocatable: dict[str, str] = {}
        expected = None
        if kind < 5:  # time-sliced T4s
            labels |= {
                "nvidia.com/gpu.product": "Tesla-T4-SHARED",
                "nvidia.com/gpu.replicas": "4",
                "nvidia.com/gpu.sharing-strategy": "time-slicing",
            }
            allocatable["nvidia.com/gpu"] = str(4 * GPUS_PER_NODE)
            expected = 4
            if roll < drift:
                expected = 2
                injected["time-slice drift"] += 1
            held = {"nvidia.com/gpu": rng.randrange(0, 4 * GPUS_PER_NODE)}
            gpus = [_gpu(name, i, "Tesla T4") for i in range(GPUS_PER_NODE)]
        elif kind < 8:  # MIG, mixed strategy
            labels |= {
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
                "nvidia.com/gpu.sharing-strategy": "none",
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/mig-3g.20gb.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
                "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
            }
            allocatable |= {
                "nvidia.com/gpu": "0",
                "nvidia.com/mig-3g.20gb": str(GPUS_PER_NODE),
                "nvidia.com/mig-1g.5gb": str(2 * GPUS_PER_NODE),
            }
            held = {"nvidia.com/mig-1g.5gb": rng.randrange(0, 2 * GPUS_PER_NODE)}
            gpus = [_gpu(name, i, A100, list(K8S_MIG_LAYOUT)) for i in range(GPUS_PER_NODE)]
        else:  # whole H100s
            labels |= {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
            }
            allocatable["nvidia.com/gpu"] = str(GPUS_PER_NODE)
            expected = 1
            held = {"nvidia.com/gpu": rng.randrange(0, GPUS_PER_NODE + 1)}
            gpus = [_gpu(name, i, "NVIDIA H100 80GB HBM3") for i in range(GPUS_PER_NODE)]
        node = {
            "metadata": {"name": name, "labels": labels},
            "spec": {},
            "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": "True"}]},
        }
        k8s_units += node_units("k8s-a", node, held, expected_replicas=expected, expected_from=CONFIGMAP)
        report(name, gpus)

    # -- agents on nodes no cluster lists ---------------------------------------------------------
    for n in range(max(1, nodes // 100)):
        name = f"orphan{n:04d}"
        reports[name] = NodeReport(
            node=name,
            agent_version="0.1",
            collected_at=NOW,
            gpus=[_gpu(name, i, A100) for i in range(GPUS_PER_NODE)],
        )
        injected["agent on an unlisted node"] += 1

    clusters = {
        "slurm-a": ClusterInventory("slurm-a", "slurm", slurm_units),
        "k8s-a": ClusterInventory("k8s-a", "k8s", k8s_units),
    }
    return clusters, reports, injected


def _rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000, help="Nodes over both clusters (8 GPUs each).")
    parser.add_argument("--rounds", type=int, default=5, help="Timed rounds of reconcile (the median is reported).")
    parser.add_argument("--drift", type=float, default=0.03, help="Share of nodes with injected drift (0.03: 3%%).")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: that the bench runs (make test runs it); its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.nodes, args.rounds = 200, 1

    started = time.perf_counter()
    clusters, reports, injected = build(args.nodes, args.drift, args.seed)
    build_seconds = time.perf_counter() - started
    units = sum(len(c.units) for c in clusters.values())
    gpus = sum(len(r.gpus) for r in reports.values())
    print(
        f"built {args.nodes} nodes: {units} capacity units, {len(reports)} agent reports with {gpus} GPUs "
        f"({build_seconds:.1f}s, not timed)"
    )
    print("injected: " + ", ".join(f"{k} {v}" for k, v in sorted(injected.items())))

    times = []
    inventory = None
    for _ in range(args.rounds):
        gc.collect()
        t = time.perf_counter()
        inventory = reconcile(clusters, reports, now=NOW)
        times.append(time.perf_counter() - t)
    assert inventory is not None
    t = time.perf_counter()
    marked = {name: mark_broken(c.units, inventory.findings) for name, c in clusters.items()}
    mark_seconds = time.perf_counter() - t
    t = time.perf_counter()
    as_json = json.dumps(inventory.to_dict())
    json_seconds = time.perf_counter() - t
    rss_mb = _rss_mb()

    gc.collect()
    tracemalloc.start()
    reconcile(clusters, reports, now=NOW)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    median = statistics.median(times)
    findings = Counter((f.kind, f.severity) for f in inventory.findings)
    broken = sum(1 for units in marked.values() for u in units if u.broken)
    print(
        f"\nreconcile: median {median:.3f}s over {args.rounds} rounds (min {min(times):.3f}s)"
        f"   (target < {TARGET_SECONDS:.0f}s)"
    )
    print(f"mark_broken over {units} units: {mark_seconds:.3f}s, {broken} marked broken")
    print(f"to_dict + json.dumps: {json_seconds:.2f}s, {len(as_json) / 1e6:.0f} MB of JSON")
    print(f"memory reconcile allocates at peak (tracemalloc): {traced_peak / 2**20:.0f} MB   (target < {TARGET_MB} MB)")
    print(f"peak RSS of the process, inputs included: {rss_mb:.0f} MB")
    print("\nfindings:")
    for (kind, severity), count in sorted(findings.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {severity:<8} {kind:<40} {count}")
    for view in inventory.clusters:
        whole, _ = view.totals()
        print(
            f"{view.name}: {whole.capacity:.1f} GPU-equivalents, {whole.allocated:.1f} allocated, "
            f"{whole.free:.1f} free, {whole.broken:.1f} broken"
        )

    if args.json:
        result = {
            "nodes": args.nodes,
            "smoke": args.smoke,
            "units": units,
            "agent_reports": len(reports),
            "agent_gpus": gpus,
            "drift": args.drift,
            "injected": dict(injected),
            "reconcile_seconds": {"median": median, "rounds": times},
            "mark_broken_seconds": mark_seconds,
            "to_dict_json_seconds": json_seconds,
            "reconcile_peak_traced_mb": traced_peak / 2**20,
            "peak_rss_mb": rss_mb,
            "findings": {f"{severity}/{kind}": n for (kind, severity), n in sorted(findings.items())},
            "targets": {"reconcile_seconds": TARGET_SECONDS, "memory_mb": TARGET_MB},
            "platform": platform.platform(),
            "python": platform.python_version(),
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
