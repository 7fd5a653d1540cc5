"""How fast the commands a user types answer, and how soon a job starts on the embedded default.

Runs ``gpush`` as a user does (a new process each time, in a scratch HOME, on the
embedded default with its local server, the demo's simulated fleet registered) and
reports the median and the worst of ``--rounds`` runs of each command:

* ``gpush --help`` (import and argument parsing only);
* ``gpush list``, ``gpush status ID``, ``gpush submit ...`` (to the running local server);
* ``python -c pass`` beside them: the interpreter's own start, the floor no command beats;
* **submit to running**: from ``gpush submit`` returning to the job being ``running``, polled
  through the API every 20 ms, beside the scheduler's cycle interval (1 s): the leader
  wakes on a submission rather than waiting for its next tick.

The target (every command under 0.5 s on this machine) is printed beside the figures,
never asserted. It exits 0 when it ran, 1 when something broke.

    .venv/bin/python integration/bench/cli.py --json bench-cli.json
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
GPUSH = [str(Path(sys.executable).with_name("gpush"))]
TARGET_S = 0.5


def run(env: dict[str, str], *args: str) -> tuple[float, str]:
    begin = time.perf_counter()
    done = subprocess.run([*GPUSH, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - begin
    if done.returncode != 0:
        raise RuntimeError(f"gpush {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return took, done.stdout


def timed(label: str, rounds: int, call) -> dict[str, float]:
    times = [call() for _ in range(rounds)]
    return {"command": label, "median_s": statistics.median(times), "max_s": max(times), "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="FILE", help="Also write the figures here.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one round, a few seconds: that the bench runs (make test runs it); its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds = 1

    home = Path(tempfile.mkdtemp(prefix="gpush-bench-cli-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSH_")} | {
        "HOME": str(home),
        "GPUSH_DATA_DIR": str(home / "data"),
        "GPUSH_CONFIG_DIR": str(home / "config"),
        "COLUMNS": "100",
    }
    rows: list[dict[str, float]] = []
    try:
        run(env, "cluster", "add", "slurm-a", "--kind", "sim", "--fleet", "examples/fleet.yaml")
        run(env, "cluster", "add", "k8s-a", "--kind", "sim", "--fleet", "examples/fleet.yaml")
        run(env, "policy", "apply", "policies/default.yaml", "-m", "bench")
        submit = [
            "submit",
            "-k",
            "training",
            "-i",
            "hardware",
            "--gpu-memory-gb",
            "4",
            "-l",
            "sim-duration=3600",
            "--",
            "python",
            "t.py",
        ]
        job = run(env, *submit)[1].strip()

        def python_start() -> float:
            begin = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            return time.perf_counter() - begin

        rows.append(timed("python -c pass (floor)", args.rounds, python_start))
        rows.append(timed("gpush --help", args.rounds, lambda: run(env, "--help")[0]))
        rows.append(timed("gpush list", args.rounds, lambda: run(env, "list")[0]))
        rows.append(timed(f"gpush status {job}", args.rounds, lambda: run(env, "status", job)[0]))
        rows.append(timed("gpush submit", args.rounds, lambda: run(env, *submit)[0]))

        # Submit to running, through the SDK against the local server the commands use.
        sys.path.insert(0, str(ROOT))
        os.environ.update({k: env[k] for k in ("GPUSH_DATA_DIR", "GPUSH_CONFIG_DIR")})
        from broker.client import local
        from broker.client.sdk import GpushClient
        from broker.core.config import database_url
        from broker.core.schemas import JobSpec

        server = local.find(database_url())
        assert server is not None, "the local server is not running"
        client = GpushClient(server.url, server.token)
        spec = JobSpec.model_validate(
            {
                "kind": "training",
                "isolation": "hardware",
                "gpu_memory_gb": 4,
                "command": ["x"],
                "labels": {"sim-duration": "3600"},
            }
        )
        waits = []
        for _ in range(args.rounds):
            created = client.submit(spec)
            begin = time.perf_counter()
            while client.get(created.id).state.value != "running":
                if time.perf_counter() - begin > 10:
                    raise RuntimeError(f"job {created.id} not running after 10 s")
                time.sleep(0.02)
            waits.append(time.perf_counter() - begin)
            client.cancel(created.id)
        rows.append(
            {
                "command": "submit -> running (scheduler interval 1 s)",
                "median_s": statistics.median(waits),
                "max_s": max(waits),
                "rounds": args.rounds,
            }
        )
    except Exception as exc:  # noqa: BLE001 - a bench reports what broke
        print(f"cli bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        subprocess.run([*GPUSH, "server", "stop"], env=env, cwd=ROOT, capture_output=True, timeout=60)

    print(f"gpush commands as a user types them (median and worst of {args.rounds}; target < {TARGET_S} s)")
    print(f"  {'command':<44} {'median':>8} {'worst':>8}")
    for row in rows:
        print(f"  {row['command']:<44} {row['median_s']:>7.3f}s {row['max_s']:>7.3f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "target_s": TARGET_S, "smoke": args.smoke}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
