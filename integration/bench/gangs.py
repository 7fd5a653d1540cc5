"""Multi-node jobs among a stream of small ones, in ``gpush simulate``: gang waits with and
without reservations (issue 34, item 3 and 7).

The fleet: ``--nodes`` Slurm nodes of 8 A100s (64 by default: 512 GPUs). The workload,
drawn with ``--seed`` over ``--hours``: 1-GPU jobs (10 minutes to 2 hours, time limit
half again), 8-GPU one-node jobs (1 to 4 hours) and gangs of 2 to 8 nodes x 8 GPUs (1 to
4 hours), about 90% of the fleet asked for on average. Both runs replay it through the one
decision (``broker.placement.decision``); the comparison is the same replay without
reservations. Printed: gang waits p50/p95 per size class, jobs that never started, the
small jobs' p95 wait, GPU allocation and the GPUs left free while jobs wait (the
utilisation reservations cost: nodes held partly idle until their gang starts), the GPU-hours
backfilled onto reserved nodes, and the wall time.

    python integration/bench/gangs.py --nodes 64 --hours 24 --report /tmp/gangs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from broker.simulation.report import run_simulation  # noqa: E402

POLICY = """
rules:
  - name: everything-on-whole-gpus
    match: {}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""


def fleet(nodes: int) -> str:
    return yaml.safe_dump(
        {
            "clusters": {
                "slurm-a": {
                    "flavor": "slurm",
                    "nodes": [
                        {
                            "name": "gpu",
                            "count": nodes,
                            "cpus": 128,
                            "memory": "1T",
                            "gpus": [{"model": "A100-SXM4-80GB", "count": 8}],
                        }
                    ],
                }
            }
        }
    )


@dataclass(frozen=True)
class JobClass:
    """One part of a mixed workload: its share of the asked GPU-seconds, the node counts
    drawn from (one: no draw), GPUs per node, and the durations drawn from (seconds)."""

    share: float
    nodes: tuple[int, ...]
    gpus: int
    durations: tuple[int, ...]


# This bench's mix on 8-GPU nodes: 40% of the GPU-hours 1-GPU jobs, 30% 8-GPU jobs, 30% gangs.
CLASSES = (
    JobClass(0.4, (1,), 1, (600, 1800, 3600, 5400, 7200)),
    JobClass(0.3, (1,), 8, (3600, 7200, 10800, 14400)),
    JobClass(0.3, (2, 2, 3, 4, 4, 6, 8), 8, (3600, 7200, 10800, 14400)),
)


def mixed_jobs(classes: tuple[JobClass, ...], gpus: int, span: float, seed: int, load: float = 0.9) -> list[dict]:
    """A seeded stream of jobs arriving over ``span`` seconds on a fleet of ``gpus`` GPUs,
    ``load`` of it asked for: each class draws jobs until its share is spent. Each job:
    ``name`` (``gang-I`` or ``job-I``), ``kind``, ``gpus`` (per node), ``nodes`` (gangs
    only), ``at`` and ``duration`` (seconds), ``time_limit`` (minutes: half again the
    duration, rounded up); sorted by ``at``. Shared by this bench and
    integration/bench/gangs_slurm.py (the same mix, scaled down, on the Slurm test cluster)."""
    rng = random.Random(seed)
    jobs = []
    for job_class in classes:
        budget = job_class.share * load * gpus * span
        while budget > 0:
            # A class of one node count draws none, so the stream stays what it was.
            n = rng.choice(job_class.nodes) if len(job_class.nodes) > 1 else job_class.nodes[0]
            duration = rng.choice(job_class.durations)
            budget -= n * job_class.gpus * duration
            job = {
                "kind": "training" if n > 1 else "batch",
                "gpus": job_class.gpus,
                "at": round(rng.uniform(0, span)),
                "duration": duration,
                "time_limit": -(-duration * 3 // 120),  # minutes: half again the duration
            }
            if n > 1:
                job["nodes"] = n
            jobs.append(job)
    jobs.sort(key=lambda j: j["at"])
    for i, job in enumerate(jobs):
        job["name"] = f"{'gang' if job.get('nodes') else 'job'}-{i}"
    return jobs


def workload(nodes: int, hours: float, seed: int, load: float = 0.9) -> str:
    return yaml.safe_dump({"jobs": mixed_jobs(CLASSES, nodes * 8, hours * 3600, seed, load)}, sort_keys=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", default="/tmp/gpush-gangs")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    out = Path(args.report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.yaml").write_text(fleet(args.nodes))
    (out / "policy.yaml").write_text(POLICY)
    (out / "workload.yaml").write_text(workload(args.nodes, args.hours, args.seed))
    began = time.perf_counter()
    result = run_simulation(
        str(out / "fleet.yaml"),
        str(out / "workload.yaml"),
        None,
        str(out / "policy.yaml"),
        None,
        str(out / "report"),
        plots=False,
        reservations=True,
    )
    wall = time.perf_counter() - began
    rows = {}
    for key in ("primary", "comparison"):
        s = result[key]
        rows[s["label"]] = {
            "gang_waits": s["gang_waits"],
            "small_wait_p95": s["waits"]["batch"]["p95"] if "batch" in s["waits"] else None,
            "allocation_mean": s["allocation_mean"],
            "stranded_mean_gpus": s["stranded_mean_gpus"],
            "makespan": s["makespan"],
            "backfilled_gpu_hours": s["backfilled_gpu_hours"],
            "backfilled_jobs": s["backfilled_jobs"],
            "still_waiting": s["still_waiting"],
            "jobs": s["jobs"],
        }
    print(f"{result['inputs']['jobs']} jobs on {args.nodes} nodes x 8 GPUs over {args.hours:g} h, seed {args.seed}")
    for label, row in rows.items():
        print(f"{label}:")
        for size, w in row["gang_waits"].items():
            p50 = "-" if w["p50"] is None else f"{w['p50'] / 60:.0f} min"
            p95 = "-" if w["p95"] is None else f"{w['p95'] / 60:.0f} min"
            print(f"  gangs of {size}: {w['jobs']} jobs, wait p50 {p50}, p95 {p95}, never started {w['never_started']}")
        p95 = row["small_wait_p95"]
        print(f"  1-GPU and 8-GPU jobs (batch) wait p95: {'-' if p95 is None else f'{p95 / 60:.0f} min'}")
        print(
            f"  GPU allocation mean: {row['allocation_mean']:.1%}; GPUs free while jobs wait, mean: "
            f"{row['stranded_mean_gpus']:.1f}; still waiting at the end: {row['still_waiting']}"
        )
        print(
            f"  backfilled onto reserved nodes: {row['backfilled_jobs']} jobs, {row['backfilled_gpu_hours']:.1f} GPU-h"
        )
    print(f"wall time, both runs: {wall:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows, "wall_seconds": wall}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
