"""How fast the web dashboard shows a large queue and a large fleet, measured in the browser.

A scratch SQLite database (the embedded default) gets ``--jobs`` jobs of four tenants
(mostly queued, some held with their reason, some finished) and a simulated Slurm
cluster of ``--nodes`` nodes (a third MIG nodes of 7 slices a GPU, a third time-sliced
by 4, a third whole GPUs; 8 GPUs each). A real ``gpush server`` (no scheduler, so the
queue stays as written) serves it, and Debian's chromium, driven by Playwright, opens:

* **queue**: a fresh load of ``/`` through a sign-in link until the first page of active
  jobs and the counts by state are drawn (``performance.now()``: from navigation start);
* **inventory**: a fresh load of ``/#/inventory`` until every node is drawn;

each the median of ``--rounds`` loads (on SQLite, or ``--postgres`` on a scratch database of the
machine's PostgreSQL), beside the same pages on a database of 100 jobs
and a fleet of 10 nodes (the baseline: what the page costs when the data costs nothing).
The targets (queue under 1 s with 100,000 jobs, inventory under 2 s with 1,000 nodes) are
printed beside the figures, never asserted. It exits 0 when it ran, 1 when something broke.

    .venv/bin/python integration/bench/dashboard.py --json bench-dashboard.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scratch import scratch_database  # noqa: E402

from broker.core.auth import Principal, create_token  # noqa: E402
from broker.core.db import make_engine, session_factory, upgrade  # noqa: E402
from broker.core.schemas import JobSpec, Role  # noqa: E402
from broker.intake import queue  # noqa: E402

GPUSH = str(Path(sys.executable).with_name("gpush"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
QUEUE_TARGET_S, INVENTORY_TARGET_S = 1.0, 2.0
TENANTS = ("vision", "nlp", "speech", "robotics")
DEFAULT_PG_URL = os.environ.get("GPUSH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
BENCH_DATABASE = "gpush_bench_dashboard"


def fleet_yaml(nodes: int) -> str:
    lines = ["clusters:", "  slurm-big:", "    flavor: slurm", "    nodes:"]
    for i in range(nodes):
        lines += [f"      - name: n{i:04d}", "        cpus: 64", "        memory: 512G", "        gpus:"]
        if i % 3 == 0:
            lines.append(
                "          - {model: A100-SXM4-40GB, count: 8, mig: [1g.5gb, 1g.5gb, 1g.5gb, "
                "1g.5gb, 1g.5gb, 1g.5gb, 1g.5gb]}"
            )
        elif i % 3 == 1:
            lines.append("          - {model: A100-SXM4-80GB, count: 8, mps: true}")
        else:
            lines.append("          - {model: H100-SXM5-80GB, count: 8}")
    return "\n".join(lines) + "\n"


def build(directory: Path, jobs: int, nodes: int, url: str | None = None) -> tuple[str, str]:
    """A database (``url``, else SQLite in ``directory``) with ``jobs`` jobs and one
    simulated cluster of ``nodes`` nodes; its URL and an admin token."""
    url = url or f"sqlite:///{directory / 'gpush.db'}"
    engine = make_engine(url)
    upgrade(engine)
    sessions = session_factory(engine)
    now = datetime.now(UTC)
    admin = Principal(user="root", tenant="ops", role=Role.ADMIN)
    with sessions() as session, session.begin():
        _row, token = create_token(session, user="root", tenant="ops", role=Role.ADMIN, description=None, now=now)
    batch = 5000
    for start in range(0, jobs, batch):
        specs = [
            JobSpec.model_validate(
                {
                    "name": f"job-{i}",
                    "kind": "training",
                    "gpus": 1 + i % 4,
                    "tenant": TENANTS[i % 4],
                    "user": f"user{i % 40}",
                    "command": ["python", "t.py"],
                }
            )
            for i in range(start, min(start + batch, jobs))
        ]
        with sessions() as session, session.begin():
            queue.submit_jobs(session, specs, admin, now=now)
    with engine.begin() as conn:  # some held with a reason, some finished: a queue of a busy site
        conn.execute(
            text(
                "UPDATE jobs SET state='held', state_reason='held: tenant vision is at its GPU quota "
                "(32 of 32 GPU-equivalents)' WHERE id % 10 = 0"
            )
        )
        conn.execute(text("UPDATE jobs SET state='succeeded', state_reason='completed (exit 0)' WHERE id % 10 = 1"))
    engine.dispose()
    (directory / "fleet.yaml").write_text(fleet_yaml(nodes))
    subprocess.run(
        [
            GPUSH,
            "--database-url",
            url,
            "cluster",
            "add",
            "slurm-big",
            "--kind",
            "sim",
            "--fleet",
            str(directory / "fleet.yaml"),
        ],
        check=True,
        capture_output=True,
        env=_env(directory),
    )
    return url, token


def _env(directory: Path) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUSH_")} | {
        "HOME": str(directory),
        "GPUSH_LOCAL_SERVER": "0",
    }


def serve(url: str, directory: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [GPUSH, "--database-url", url, "server", "--port", str(port), "--no-scheduler", "--log-level", "warning"],
        env=_env(directory),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("gpush server did not become ready in 60 s")


def measure(base: str, token: str, rounds: int, nodes: int) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    out: dict[str, list[float]] = {"queue_s": [], "inventory_s": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for _ in range(rounds):
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            page = context.new_page()
            page.goto(f"{base}/#token={token}")
            page.wait_for_selector("[data-testid=jobs] tbody tr[data-job]")
            page.wait_for_selector("[data-testid=state-tabs] a")
            out["queue_s"].append(page.evaluate("performance.now()") / 1000)
            page.goto("about:blank")
            page.goto(f"{base}/#/inventory")
            # The nodes are appended at once: the last one there means all are.
            page.wait_for_selector(f"article[data-node='n{nodes - 1:04d}']", timeout=60_000)
            out["inventory_s"].append(page.evaluate("performance.now()") / 1000)
            context.close()
        browser.close()
    return {key: statistics.median(values) for key, values in out.items()}


def run(jobs: int, nodes: int, rounds: int, pg_url: str | None = None) -> dict[str, float]:
    """The pages measured on ``jobs`` jobs and ``nodes`` nodes: on SQLite, or (``pg_url``) on a
    scratch PostgreSQL database of that server (created here, dropped after)."""
    directory = Path(tempfile.mkdtemp(prefix="gpush-bench-web-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        url = None
        if pg_url:
            url, _ = stack.enter_context(scratch_database(pg_url, f"{BENCH_DATABASE}_{jobs}_{nodes}"))
        began = time.perf_counter()
        url, token = build(directory, jobs, nodes, url)
        built = time.perf_counter() - began
        proc, base = serve(url, directory)
        try:
            return {"jobs": jobs, "nodes": nodes, "build_s": built, **measure(base, token, rounds, nodes)}
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE", help="Also write the figures here.")
    parser.add_argument(
        "--postgres", action="store_true", help="On a scratch PostgreSQL database (of --pg-url) instead of SQLite."
    )
    parser.add_argument(
        "--pg-url",
        default=DEFAULT_PG_URL,
        help=f"PostgreSQL server for --postgres; the bench creates and drops its own databases there "
        f"(default {DEFAULT_PG_URL}; env GPUSH_BENCH_PG_URL).",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds (300 jobs, 12 nodes, one load): that the bench runs (make test runs it); "
        "its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.nodes, args.rounds = 300, 12, 1
    pg_url = args.pg_url if args.postgres else None
    try:
        baseline = run(100, 10, args.rounds, pg_url)
        large = run(args.jobs, args.nodes, args.rounds, pg_url)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what broke and exits 1
        print(f"dashboard bench failed: {exc}", file=sys.stderr)
        return 1
    rows = [
        ("queue (first page + counts)", "queue_s", f"{args.jobs:,} jobs", QUEUE_TARGET_S),
        ("inventory (every node drawn)", "inventory_s", f"{args.nodes:,} nodes", INVENTORY_TARGET_S),
    ]
    print(f"{'page':<30}{'size':>14}{'time':>8}{'baseline':>10}{'ratio':>7}{'target':>8}  met")
    for label, key, size, target in rows:
        ok = "yes" if large[key] < target else "NO"
        print(
            f"{label:<30}{size:>14}{large[key]:>7.2f}s{baseline[key]:>9.2f}s{large[key] / baseline[key]:>6.1f}x"
            f"{'< ' + format(target, 'g') + ' s':>8}  {ok}"
        )
    print(
        f"({'PostgreSQL' if args.postgres else 'SQLite'}; data written in {large['build_s']:.0f} s; "
        f"baseline: 100 jobs, 10 nodes; median of {args.rounds} loads)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"large": large, "baseline": baseline, "postgres": args.postgres, "smoke": args.smoke}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
