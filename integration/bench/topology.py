"""Topology-aware placement in ``gpush simulate`` (issue 35): the same workload placed once
with the clusters' topology and once blind to it, in one run.

The fleet: ``--nodes`` Slurm nodes of 8 A100s (64 by default) in ``--blocks`` network
blocks (8), half of them NVLink pairs on PCIe switches of four (``nvlink-pairs``) and half
on an NVSwitch (``nvswitch``), each block holding both kinds. The workload, drawn with
``--seed`` over ``--hours``: 1-, 2- and 4-GPU one-node jobs and gangs of 2 to 8 nodes x 8
GPUs, about 90% of the fleet asked for. Both runs replay it through the one decision
(``broker.placement.decision``); the blind run strips the topology fields from the units
before placement sees them (``replay(topology=False)``), while the simulated nodes still
pick a job's GPUs on their own topology, as Slurm (gres.conf ``Links=``) and the device
plugin do. Reported per run:

- ``island_share``: of the multi-GPU one-node jobs started on a node that had an NVLink
  island with enough free GPUs, the share whose GPUs are on one island (the simulated
  node picks the closest GPUs itself, so blind placement scores high here too);
  ``island_share_of_all``: the share on one island of every multi-GPU one-node job
  (where blind placement picks nodes with no island free);
- ``gang_share``: of the gangs, the share started on the fewest blocks their start
  allowed (the free nodes per block, as the cluster saw them when the gang started);
- ``wait``: queue wait p50 and p95 (seconds) over all jobs, one-node jobs and gangs;
- ``allocation``: GPU-seconds held over the arrival window, of the fleet's GPUs.

Targets (issue 35): island and gang shares at least 95% topology-aware, allocation no more
than one point below blind.

    python integration/bench/topology.py --nodes 64 --blocks 8 --hours 24 --json bench-topology.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from broker.core.topology import domain_of, fewest_domains  # noqa: E402
from broker.routing.policy import load_policy  # noqa: E402
from broker.simulation.cluster.engine import EventEngine  # noqa: E402
from broker.simulation.fleet import load_fleet  # noqa: E402
from broker.simulation.pools import Pool  # noqa: E402
from broker.simulation.replay import replay  # noqa: E402
from broker.simulation.results import _percentile  # noqa: E402
from broker.simulation.workload import parse_workload  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gangs import JobClass, mixed_jobs  # noqa: E402

POLICY = "rules:\n  - {name: all, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}\n"
MODEL = "A100-SXM4-80GB"

# The mix on 8-GPU nodes, by share of the asked GPU-hours.
CLASSES = (
    JobClass(0.15, (1,), 1, (600, 1800, 3600, 7200)),
    JobClass(0.2, (1,), 2, (1800, 3600, 7200)),
    JobClass(0.2, (1,), 4, (1800, 3600, 7200, 10800)),
    JobClass(0.45, (2, 2, 3, 4, 4, 6, 8), 8, (3600, 7200, 10800)),
)


def fleet(nodes: int, blocks: int) -> str:
    half = nodes // 2
    entry = {"cpus": 128, "memory": "1T", "gpus": [{"model": MODEL, "count": 8}], "blocks": blocks}
    return yaml.safe_dump(
        {
            "clusters": {
                "slurm-a": {
                    "flavor": "slurm",
                    "nodes": [
                        {"name": "pairs", "count": half, "gpu_topology": "nvlink-pairs", **entry},
                        {"name": "switch", "count": nodes - half, "gpu_topology": "nvswitch", **entry},
                    ],
                }
            }
        }
    )


class Watch:
    """What the simulated cluster saw when each job started: whether a multi-GPU job's
    node had an island with room and whether its GPUs are on one; a gang's blocks against
    the fewest its start allowed."""

    def __init__(self) -> None:
        self.island = Counter()  # had_room, on_one
        self.gangs = Counter()  # started, fewest

    @contextmanager
    def watching(self):
        take, start = Pool.take, EventEngine._start
        watch = self

        def pool_take(pool: Pool, job) -> list[int]:
            before = list(pool.free_gpus) if pool.free_gpus is not None else None
            over = take(pool, job)
            if before is not None and not job.gang and job.need > 1 and pool.topology is not None:
                free = set(before)
                watch.island["jobs"] += 1
                watch.island["on_one_of_all"] += pool.topology.closeness(pool.taken[job.job_id]) == 0
                if any(len(free.intersection(island)) >= job.need for island in pool.topology.nvlink):
                    watch.island["had_room"] += 1
                    watch.island["on_one"] += pool.topology.closeness(pool.taken[job.job_id]) == 0
            return over

        def engine_start(engine: EventEngine, job, pool: Pool, t: int) -> None:
            if job.gang:
                watch.gang(engine, job)
            start(engine, job, pool, t)

        Pool.take, EventEngine._start = pool_take, engine_start
        try:
            yield self
        finally:
            Pool.take, EventEngine._start = take, start

    def gang(self, engine: EventEngine, job) -> None:
        """Count a gang about to start: the blocks it spans against the fewest possible."""
        held = set(job.pools)
        free: Counter = Counter()
        for pool in engine.state.pools:
            if pool.free_gpus is None or pool.fenced is not None:
                continue
            if pool in held or (pool.free >= job.units and not pool.waiting_count):
                free[domain_of(pool.position, "block")] += 1
        used = len({domain_of(pool.position, "block") for pool in job.pools})
        self.gangs["started"] += 1
        self.gangs["fewest"] += used <= fewest_domains(free.values(), len(job.pools))


def allocation(jobs, gpus: int, span: float) -> float:
    """GPU-seconds held within [0, span], of ``gpus`` GPUs over it."""
    held = 0.0
    for job in jobs:
        if job.start is None or job.start >= span:
            continue
        end = span if job.end is None else min(job.end, span)
        held += job.gpu_equivalents * max(end - job.start, 0.0)
    return held / (gpus * span)


def waits(jobs, gangs: bool | None = None) -> dict[str, float | None]:
    values = [j.wait for j in jobs if j.wait is not None and (gangs is None or (j.nodes > 1) == gangs)]
    return {"jobs": len(values), "p50": _percentile(values, 50), "p95": _percentile(values, 95)}


def run(nodes: int, blocks: int, hours: float, seed: int, load: float) -> dict:
    span = hours * 3600
    jobs = mixed_jobs(CLASSES, nodes * 8, span, seed, load)
    for job in jobs:
        job["command"] = ["run"]
    arrivals = parse_workload(yaml.safe_dump({"jobs": jobs}, sort_keys=False), "topology-workload.yaml")
    loaded = load_fleet(fleet(nodes, blocks), "topology-fleet.yaml")
    policy = load_policy(POLICY)
    rows = {}
    for label, aware in (("topology-aware", True), ("blind", False)):
        watch = Watch()
        began = time.perf_counter()
        with watch.watching():
            result = replay(loaded, policy, arrivals, topology=aware, label=label)
        island, gangs = watch.island, watch.gangs
        rows[label] = {
            "island_share": island["on_one"] / island["had_room"] if island["had_room"] else None,
            "island_jobs": island["had_room"],
            "island_share_of_all": island["on_one_of_all"] / island["jobs"] if island["jobs"] else None,
            "multi_gpu_jobs": island["jobs"],
            "gang_share": gangs["fewest"] / gangs["started"] if gangs["started"] else None,
            "gangs_started": gangs["started"],
            "wait": {
                "all": waits(result.jobs),
                "one_node": waits(result.jobs, False),
                "gangs": waits(result.jobs, True),
            },
            "allocation": allocation(result.jobs, nodes * 8, span),
            "allocation_mean_to_end": result.summary()["allocation_mean"],
            "still_waiting": sum(1 for j in result.jobs if j.state == "waiting"),
            "wall_seconds": time.perf_counter() - began,
        }
    return {"jobs": len(arrivals), "runs": rows}


def minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.0f} min"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--smoke", action="store_true", help="16 nodes in 4 blocks over 3 hours: does it run")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.smoke:
        args.nodes, args.blocks, args.hours = 16, 4, 3
    out = run(args.nodes, args.blocks, args.hours, args.seed, args.load)
    print(
        f"{out['jobs']} jobs on {args.nodes} nodes x 8 GPUs in {args.blocks} blocks over {args.hours:g} h, "
        f"seed {args.seed}, load {args.load:g}"
    )
    for label, row in out["runs"].items():
        share = "-" if row["island_share"] is None else f"{row['island_share']:.1%}"
        gangs = "-" if row["gang_share"] is None else f"{row['gang_share']:.1%}"
        w = row["wait"]
        print(f"{label}:")
        print(f"  multi-GPU jobs on one island where their node had one with room: {share} of {row['island_jobs']}")
        every = "-" if row["island_share_of_all"] is None else f"{row['island_share_of_all']:.1%}"
        print(f"  multi-GPU jobs on one island, of all: {every} of {row['multi_gpu_jobs']}")
        print(f"  gangs on the fewest blocks possible at their start: {gangs} of {row['gangs_started']}")
        for part in ("all", "one_node", "gangs"):
            p50, p95 = minutes(w[part]["p50"]), minutes(w[part]["p95"])
            print(f"  wait {part}: p50 {p50}, p95 {p95} ({w[part]['jobs']} jobs)")
        print(f"  GPU allocation over the arrival window: {row['allocation']:.1%}; waiting {row['still_waiting']}")
        print(f"  wall time: {row['wall_seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "smoke": args.smoke, **out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
