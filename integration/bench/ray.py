"""Ray workers through gpush on the Slurm test cluster, beside `ray start` run by hand.

What it measures, with a real Ray head on this machine, the single-machine Slurm test
cluster of integration/slurm/ (started here in a scratch directory on ports of its own,
stopped at the end), a scratch PostgreSQL database and ``gpush server`` (API and
scheduler, a cycle every ``--interval`` seconds as in production):

* **gpush**: the time from the autoscaler's launch request (the gpush node provider's
  ``create_node_with_resources_and_labels``, as Ray's NodeLauncher calls it, for
  ``count`` workers at once) until every worker has joined the head (alive in the
  GCS). In between: one job per worker queued in gpush, routed to a MIG slice, handed to
  Slurm, started by slurmd, and ``ray start --block`` bringing up its raylet.
* **by hand**: the same number of ``ray start --address=... --block`` started directly
  on this machine at once, until every one has joined.

The ratio is by-hand time over gpush time (1.0: gpush adds nothing). For 1 and 8
workers at once (``--counts``), ``--rounds`` times each. A benchmark, not a test: it
prints figures and exits 0 when it ran.

    .venv/bin/python integration/bench/ray.py --json bench-ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# This script is named ray.py: its own directory on sys.path would hide the ray package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from integration.bench.scratch import scratch_database  # noqa: E402
from integration.ray.harness import RAY, GpushBroker, RayHead, cluster_yaml, kill_processes_naming  # noqa: E402
from integration.slurm.cluster import start  # noqa: E402

TOKEN_ENV = "GPUSH_BENCH_RAY_TOKEN"


def joined(gcs, ips: set[str]) -> set[str]:
    """The addresses among ``ips`` of nodes alive in the head's GCS."""
    return {n["NodeManagerAddress"] for n in gcs() if n["Alive"]} & ips


def wait_joined(gcs, ips: set[str], t0: float, timeout: float) -> dict[str, float]:
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(ips):
        for ip in joined(gcs, ips) - seen.keys():
            seen[ip] = time.monotonic() - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(seen)} of {len(ips)} workers joined in {timeout:g} s")
        time.sleep(0.05)
    return seen


def wait_gone(gcs, ips: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while joined(gcs, ips) and time.monotonic() < deadline:
        time.sleep(0.2)


def through_gpush(provider, gcs, count: int, round_: int, broker) -> list[float]:
    node_config = {"gpush": {"kind": "inference", "isolation": "hardware", "gpu_memory_gb": 4, "cpus": 1}}
    tags = {
        "ray-user-node-type": "mig_worker",
        "ray-launch-config": "bench",
        "ray-launch-request": f"b{round_}-{count}",
    }
    t0 = time.monotonic()
    created = provider.create_node_with_resources_and_labels(node_config, tags, count, {"CPU": 1, "GPU": 1}, {})
    ips = {provider.internal_ip(node_id) for node_id in created}
    try:
        times = wait_joined(gcs, ips, t0, timeout=120)
    finally:
        provider.terminate_nodes(list(created))
        wait_gone(gcs, ips)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # Slurm has let go of the slices before the next round
            if all(broker.admin.get(int(n)).state.value in ("cancelled", "succeeded", "failed") for n in created):
                break
            time.sleep(0.3)
    return sorted(times.values())


def by_hand(head: RayHead, gcs, count: int, round_: int) -> list[float]:
    ips = {f"127.0.{200 + round_ % 50}.{i + 1}" for i in range(count)}
    procs = []
    t0 = time.monotonic()
    for ip in sorted(ips):
        argv = [
            RAY,
            "start",
            f"--address={head.address}",
            "--block",
            "--num-cpus=1",
            "--num-gpus=1",
            f"--node-ip-address={ip}",
            f"--temp-dir={head.temp_dir}/h-{ip}",
            "--dashboard-agent-listen-port=0",
            "--disable-usage-stats",
        ]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        times = wait_joined(gcs, ips, t0, timeout=120)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
        wait_gone(gcs, ips)
    return sorted(times.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,8", help="workers launched at once, comma-separated (default 1,8)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each count (default 2)")
    parser.add_argument("--interval", type=float, default=1.0, help="gpush scheduling cycle, seconds (default 1)")
    parser.add_argument(
        "--pg-url", default=os.environ.get("GPUSH_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one worker, one round: that the bench runs (make test runs it); its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.counts, args.rounds = "1", 1
    counts = [int(c) for c in args.counts.split(",")]

    import ray

    from broker.ray.provider import GpushNodeProvider

    state = Path(tempfile.mkdtemp(prefix="gpush-slurm-raybench-"))
    os.chmod(state, 0o755)
    env = {"GPUSH_SLURMCTLD_PORT": "8817", "GPUSH_SLURMD_PORT": "8821", "GPUSH_SLURMRESTD_PORT": "8820"}
    slurm = start(state, fresh=True, env={**os.environ, **env})
    head = broker = None
    rows = []
    try:
        with scratch_database(args.pg_url, "gpush_bench_ray", migrate=True) as (url, _conninfo):
            broker = GpushBroker(url, slurm, state / "gpush", cycle_interval=args.interval)
            token = broker.token("ray", "bench")
            config = cluster_yaml(cluster_name="raybench", gpush_url=broker.url, head_address="", token_env=TOKEN_ENV)
            head = RayHead(None, {TOKEN_ENV: token})
            config["provider"].update(head_address=head.address, worker_temp_dir=str(head.temp_dir))
            os.environ[TOKEN_ENV] = token
            provider = GpushNodeProvider(config["provider"], "raybench")
            ray.init(address=head.address, log_to_driver=False, logging_level="ERROR")
            gcs = ray.nodes
            for count in counts:
                for round_ in range(args.rounds):
                    # Alternate which goes first: 8 raylets starting at once load a 2-CPU machine,
                    # and whatever runs second finds the page cache warm.
                    if round_ % 2:
                        gp = through_gpush(provider, gcs, count, round_, broker)
                        hand = by_hand(head, gcs, count, round_)
                    else:
                        hand = by_hand(head, gcs, count, round_)
                        gp = through_gpush(provider, gcs, count, round_, broker)
                    row = {
                        "workers": count,
                        "round": round_ + 1,
                        "gpush_all_joined_s": round(gp[-1], 2),
                        "gpush_first_joined_s": round(gp[0], 2),
                        "by_hand_all_joined_s": round(hand[-1], 2),
                        "by_hand_first_joined_s": round(hand[0], 2),
                        "ratio": round(hand[-1] / gp[-1], 2),
                    }
                    rows.append(row)
                    print(
                        f"{count} worker(s), round {round_ + 1}: gpush {gp[0]:.1f}-{gp[-1]:.1f} s, "
                        f"by hand {hand[0]:.1f}-{hand[-1]:.1f} s, ratio {row['ratio']:.2f}",
                        flush=True,
                    )
            ray.shutdown()
    finally:
        if head is not None:
            head.stop()
        if broker is not None:
            broker.stop()
        kill_processes_naming(str(state))
        slurm.stop(purge=True)
    summary = {}
    for count in counts:
        mine = [r for r in rows if r["workers"] == count]
        summary[count] = {
            "gpush_all_joined_s_median": statistics.median(r["gpush_all_joined_s"] for r in mine),
            "by_hand_all_joined_s_median": statistics.median(r["by_hand_all_joined_s"] for r in mine),
            "ratio_median": statistics.median(r["ratio"] for r in mine),
        }
        print(f"{count} worker(s): median {summary[count]}")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "summary": summary, "interval": args.interval, "smoke": args.smoke}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
