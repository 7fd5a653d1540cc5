"""Job submissions per second through the gpush HTTP API, on SQLite and PostgreSQL.

What it measures, against a real ``gpush server`` started for the run on a fresh
database (its own temporary data and config directories; on PostgreSQL its own
database, dropped at the end):

* single submits, ``POST /v1/jobs``, from 1, 8 and 32 concurrent clients for
  ``--duration`` seconds each. Every client keeps one connection open and sends
  one job at a time, each with its own idempotency key, as the SDK does;
* batch submits, ``POST /v1/jobs:batch``, a few batches of ``--batch-size`` jobs
  from one client.

For each: jobs/s, the number of requests, the latency of each request (p50, p99),
and the CPU the server spent per job (all its processes, from /proc).

Why a baseline ratio: absolute rates say as much about the machine as about
gpush. In the same run the benchmark times the simplest durable write loop each
database allows, one row per transaction into a scratch table shaped like a job
row (a few text columns and a JSON document): psycopg ``INSERT; COMMIT`` on the
same PostgreSQL database, and sqlite3 ``INSERT; COMMIT`` on a file in the same
directory with gpush's pragmas (WAL, synchronous=NORMAL). gpush's rate divided
by that one is a figure that means the same on a laptop, a CI runner or a noisy
VM. Concurrent clients and batches can beat 1.0: they share commits.

The load generator is stdlib ``http.client`` in worker processes (a few threads
each): on the machine this was written on it cost about 0.3 ms of CPU per request
against about 1 ms for ``httpx``, and the clients share the CPUs with the server,
so every millisecond the client spends is taken from the server. The client CPU
per request is in the JSON, to check that it stays small.

It is a benchmark, not a test: the targets are printed beside the figures, never
asserted. It exits 0 when it ran, 1 when something broke (a server that did not
start, a request that failed).

    .venv/bin/python integration/bench/submit.py --json bench-results.json
    .venv/bin/python integration/bench/submit.py --quick --backends sqlite
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from rich.console import Console
from rich.table import Table
from scratch import scratch_database

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
BENCH_DATABASE = "gpush_bench"
BACKENDS = ("sqlite", "postgres")
# Server worker processes, by backend. gpush's submit handler does its one database
# statement on the event loop (prefork-style), so a worker waits while PostgreSQL
# commits: one more worker than CPUs keeps the CPUs busy (measured on 2 CPUs, 8
# clients: 2 workers 1,004 jobs/s, 3 workers 1,195). SQLite has one writer: a second
# process only adds lock waits (p99 90 ms with 2 workers, 18 ms with 1).
DEFAULT_WORKERS = {"sqlite": 1, "postgres": (os.cpu_count() or 1) + 1}
# Client processes, each with its share of the clients as threads (1, 2, 4 and 8
# processes for 8 clients measured within noise of each other).
DEFAULT_CLIENT_PROCS = max(1, min(os.cpu_count() or 1, 2))
# Batch clients sending at once: one, and one per CPU (a batch is served by one worker).
BATCH_CLIENTS = (1, max(1, min(os.cpu_count() or 1, 2)))
SINGLE_CLIENTS = (1, 8, 32)
REQUEST_TIMEOUT_S = 60.0
SERVER_START_TIMEOUT_S = 60.0

# The job every client submits; only the idempotency key changes.
JOB = {"kind": "training", "gpus": 1, "command": ["python", "train.py"]}

# Wide enough for the table when the output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 170)


# -- results ----------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table and one object of the JSON ``results``."""

    backend: str
    scenario: str
    clients: int
    requests: int
    jobs: int
    errors: int
    seconds: float
    jobs_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    workers: int | None = None
    baseline_per_s: float | None = None
    ratio: float | None = None
    targets: dict[str, bool] | None = None  # the goal -> met
    server_cpu_ms_per_job: float | None = None
    client_cpu_ms_per_request: float | None = None
    first_error: str | None = None


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def latency_ms(latencies_s: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) in milliseconds."""
    ordered = sorted(latencies_s)
    p50, p99 = percentile(ordered, 0.50), percentile(ordered, 0.99)
    return (None if p50 is None else p50 * 1e3, None if p99 is None else p99 * 1e3)


def apply_targets(row: Row) -> None:
    """The issue's targets for the rows they are about (printed, never asserted)."""
    if row.scenario == "single" and row.clients == 8:
        row.targets = {}
        if row.backend == "postgres":
            row.targets[">=1000/s"] = row.jobs_per_s >= 1000
        row.targets["p99<50ms"] = row.p99_ms is not None and row.p99_ms < 50
    elif row.scenario.startswith("batch"):
        row.targets = {">=20000/s": row.jobs_per_s >= 20000}


# -- the load generator -----------------------------------------------------------


def _client_process(port: int, token: str, threads: int, proc_index: int, run_id: str, pipe) -> None:
    """One client process: ``threads`` keep-alive connections submitting one job at a time.

    Handshake with the parent over ``pipe``: send "ready" once every connection has
    made one (unmeasured) request, receive (start_at, stop_at) on the monotonic
    clock, which is system-wide on Linux, and send back the measurements.
    """
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    prefix = json.dumps(JOB)[:-1].encode() + b', "idempotency_key": "'
    latencies = [array("d") for _ in range(threads)]
    errors = [0] * threads
    first_error: list[str] = []
    last_done = [0.0] * threads
    window: list[float] = []
    warm = threading.Barrier(threads + 1)
    go = threading.Event()

    def submit(link: HTTPConnection, key: str) -> int:
        link.request("POST", "/v1/jobs", body=prefix + key.encode() + b'"}', headers=headers)
        response = link.getresponse()
        response.read()
        return response.status

    def client(index: int) -> None:
        link = HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        key = f"{run_id}-{proc_index}-{index}-"
        try:
            submit(link, key + "warm")
        except (OSError, HTTPException) as exc:
            errors[index] += 1
            first_error.append(f"warm-up: {type(exc).__name__}: {exc}")
            link.close()
        warm.wait()
        go.wait()
        start_at, stop_at = window
        while time.monotonic() < start_at:
            time.sleep(0.0005)
        n = 0
        lat = latencies[index]
        while True:
            begin = time.perf_counter()
            if time.monotonic() >= stop_at:
                break
            try:
                status = submit(link, f"{key}{n}")
            except (OSError, HTTPException) as exc:
                status = f"{type(exc).__name__}: {exc}"
                link.close()  # the next request reconnects
            n += 1
            if status == 201:
                lat.append(time.perf_counter() - begin)
            else:
                errors[index] += 1
                if not first_error:
                    first_error.append(f"HTTP {status}" if isinstance(status, int) else status)
        last_done[index] = time.monotonic()
        link.close()

    workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    warm.wait()
    pipe.send("ready")
    window.extend(pipe.recv())
    cpu_before = time.process_time()
    go.set()
    for worker in workers:
        worker.join()
    pipe.send(
        {
            "latencies": [list(lat) for lat in latencies],
            "errors": sum(errors),
            "first_error": first_error[0] if first_error else None,
            "last_done": max(last_done),
            "cpu_s": time.process_time() - cpu_before,
        }
    )
    pipe.close()


@dataclass
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    client_cpu_s: float
    first_error: str | None


def run_single_submits(port: int, token: str, clients: int, duration: float, client_procs: int) -> LoadResult:
    """``clients`` concurrent keep-alive clients submitting for ``duration`` seconds."""
    ctx = multiprocessing.get_context("spawn")
    procs = max(1, min(clients, client_procs))
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    run_id = uuid.uuid4().hex[:12]
    children = []
    for index, threads in enumerate(shares):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_client_process, args=(port, token, threads, index, run_id, child_end), daemon=True)
        proc.start()
        child_end.close()
        children.append((proc, parent_end))
    try:
        for proc, pipe in children:
            if not pipe.poll(SERVER_START_TIMEOUT_S) or pipe.recv() != "ready":
                raise RuntimeError(f"client process {proc.pid} did not get ready")
        start_at = time.monotonic() + 0.1
        for _proc, pipe in children:
            pipe.send((start_at, start_at + duration))
        reports = []
        for proc, pipe in children:
            if not pipe.poll(duration + REQUEST_TIMEOUT_S + 30):
                raise RuntimeError(f"client process {proc.pid} did not report")
            reports.append(pipe.recv())
    finally:
        for proc, _pipe in children:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    latencies = [x for report in reports for lat in report["latencies"] for x in lat]
    errors = sum(r["errors"] for r in reports)
    return LoadResult(
        requests=len(latencies) + errors,
        errors=errors,
        seconds=max(r["last_done"] for r in reports) - start_at,
        latencies=latencies,
        client_cpu_s=sum(r["cpu_s"] for r in reports),
        first_error=next((r["first_error"] for r in reports if r["first_error"]), None),
    )


def run_batches(port: int, token: str, batches: int, batch_size: int, clients: int = 1) -> LoadResult:
    """``batches`` ``POST /v1/jobs:batch`` of ``batch_size`` jobs from each of ``clients``
    clients at once (threads, one keep-alive connection each).

    Bodies are built before the clock starts; the time is the wall time from the
    first request to the last answer.
    """
    run_id = uuid.uuid4().hex[:12]
    bodies = [
        [
            json.dumps(
                {"jobs": [{**JOB, "idempotency_key": f"{run_id}-{c}-{b}-{i}"} for i in range(batch_size)]}
            ).encode()
            for b in range(batches)
        ]
        for c in range(clients)
    ]
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(own: list[bytes]) -> None:
        link = HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        for body in own:
            begin = time.perf_counter()
            try:
                link.request("POST", "/v1/jobs:batch", body=body, headers=headers)
                response = link.getresponse()
                payload = response.read()
                status = response.status
                created = json.loads(payload).get("created") if status == 201 else None
            except (OSError, HTTPException, ValueError) as exc:
                status, created = f"{type(exc).__name__}: {exc}", None
                link.close()
            elapsed = time.perf_counter() - begin
            with lock:
                if status == 201 and created == batch_size:
                    latencies.append(elapsed)
                else:
                    failures.append(f"HTTP {status}, created {created}" if isinstance(status, int) else status)
        link.close()

    cpu_before = time.process_time()
    begin = time.perf_counter()
    threads = [threading.Thread(target=client, args=(own,)) for own in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return LoadResult(
        requests=batches * clients,
        errors=len(failures),
        seconds=time.perf_counter() - begin,
        latencies=latencies,
        client_cpu_s=time.process_time() - cpu_before,
        first_error=failures[0] if failures else None,
    )


# -- baselines: the bare INSERT; COMMIT loop ----------------------------------------


def _baseline_loop(insert, commit, duration: float) -> tuple[int, float, list[float]]:
    latencies = []
    start = time.perf_counter()
    stop = start + duration
    n = 0
    while True:
        begin = time.perf_counter()
        if begin >= stop:
            break
        insert(n)
        commit()
        latencies.append(time.perf_counter() - begin)
        n += 1
    return n, time.perf_counter() - start, latencies


def _baseline_row(n: int) -> tuple[str, str, str, str, str, dict[str, Any]]:
    return ("bench", "bench", "training", "queued", f"baseline-{n}", {**JOB, "idempotency_key": f"baseline-{n}"})


def baseline_postgres(conninfo: str, duration: float) -> Row:
    with psycopg.connect(conninfo) as conn:
        conn.execute(
            'CREATE TABLE bench_baseline (id bigserial PRIMARY KEY, tenant text, "user" text, kind text,'
            " state text, idempotency_key text, spec jsonb, created_at timestamptz DEFAULT now())"
        )
        conn.commit()
        cur = conn.cursor()

        def insert(n: int) -> None:
            *cols, spec = _baseline_row(n)
            cur.execute(
                'INSERT INTO bench_baseline (tenant, "user", kind, state, idempotency_key, spec)'
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (*cols, Jsonb(spec)),
            )

        n, seconds, latencies = _baseline_loop(insert, conn.commit, duration)
        conn.execute("DROP TABLE bench_baseline")
        conn.commit()
    return _baseline_result("postgres", "baseline", n, seconds, latencies)


def baseline_sqlite(path: Path, duration: float) -> Row:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(
            "CREATE TABLE bench_baseline (id INTEGER PRIMARY KEY, tenant TEXT, user TEXT, kind TEXT,"
            " state TEXT, idempotency_key TEXT, spec TEXT, created_at TEXT DEFAULT CURRENT_TIMESTAMP)"
        )
        conn.commit()

        def insert(n: int) -> None:
            *cols, spec = _baseline_row(n)
            conn.execute(
                "INSERT INTO bench_baseline (tenant, user, kind, state, idempotency_key, spec)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (*cols, json.dumps(spec)),
            )

        n, seconds, latencies = _baseline_loop(insert, conn.commit, duration)
    finally:
        conn.close()
    return _baseline_result("sqlite", "baseline", n, seconds, latencies)


def _baseline_result(backend: str, scenario: str, n: int, seconds: float, latencies: list[float]) -> Row:
    p50, p99 = latency_ms(latencies)
    rate = n / seconds
    return Row(
        backend=backend,
        scenario=scenario,
        clients=1,
        requests=n,
        jobs=n,
        errors=0,
        seconds=seconds,
        jobs_per_s=rate,
        p50_ms=p50,
        p99_ms=p99,
        baseline_per_s=rate,
        ratio=1.0,
    )


# -- the gpush server under test --------------------------------------------------


def gpush_executable() -> str:
    """The ``gpush`` console script of the Python running this benchmark."""
    beside = Path(sys.executable).parent / "gpush"
    found = str(beside) if beside.exists() else shutil.which("gpush")
    if not found:
        raise RuntimeError(f"no gpush script next to {sys.executable}: install gpush in this environment")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpush_cli(env: dict[str, str], url: str, *args: str) -> str:
    """Run ``gpush --database-url URL ARGS`` in-process mode; its stdout, or RuntimeError."""
    proc = subprocess.run(
        [gpush_executable(), "--database-url", url, *args], env=env, capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"gpush {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def process_group_cpu_s(pgid: int) -> float | None:
    """User + system CPU seconds of every live process in the group (Linux /proc)."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone, or not ours to read
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def gpush_server(env: dict[str, str], url: str, workers: int, log: Path) -> Iterator[tuple[int, int]]:
    """A ``gpush server`` in its own process group; yields (port, pgid), stops it on exit."""
    port = free_port()
    cmd = [
        gpush_executable(),
        "--database-url",
        url,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--log-level",
        "warning",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _ready(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"gpush server did not become ready on port {port}:\n{tail}")
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        _stop_group(proc)


def _ready(port: int) -> bool:
    conn = HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except (OSError, HTTPException):
        return False
    finally:
        conn.close()


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group; SIGKILL whatever is left of it after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        proc.poll()  # reap the supervisor, so that it no longer counts
        try:
            os.killpg(proc.pid, 0)  # uvicorn's workers may outlive the supervisor a moment
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=5)


# -- one backend ------------------------------------------------------------------


@dataclass
class Settings:
    duration: float
    warmup: float
    batches: int
    batch_size: int
    client_procs: int
    workers: int | None
    pg_url: str
    clients: tuple[int, ...] = SINGLE_CLIENTS


def bench_backend(backend: str, settings: Settings, workdir: Path) -> list[Row]:
    """The baseline, then every scenario against a gpush server on a fresh database."""
    # The user's own gpush settings and data stay out of it.
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSH_URL", "GPUSH_TOKEN", "GPUSH_DATABASE_URL")}
    env.update(GPUSH_DATA_DIR=str(workdir / "data"), GPUSH_CONFIG_DIR=str(workdir / "config"))
    env["GPUSH_LOCAL_SERVER"] = "0"  # the admin commands run in-process: the bench starts the one server
    if backend == "sqlite":
        data = workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        baseline = baseline_sqlite(data / "baseline.db", settings.duration)
        return _bench_server(backend, f"sqlite:///{data / 'gpush.db'}", env, baseline, settings, workdir)
    with scratch_database(settings.pg_url, BENCH_DATABASE) as (url, conninfo):
        gpush_cli(env, url, "db", "upgrade")
        baseline = baseline_postgres(conninfo, settings.duration)
        return _bench_server(backend, url, env, baseline, settings, workdir)


def _bench_server(
    backend: str, url: str, env: dict[str, str], baseline: Row, settings: Settings, workdir: Path
) -> list[Row]:
    created = json.loads(
        gpush_cli(
            env, url, "admin", "token", "create", "--user", "bench", "--tenant", "bench", "--role", "admin", "--json"
        )
    )
    token = created["token"]
    rows = [baseline]
    workers = settings.workers or DEFAULT_WORKERS[backend]
    console.print(f"  {backend}: gpush server with {workers} worker process(es)")
    with gpush_server(env, url, workers, workdir / f"server-{backend}.log") as (port, pgid):
        # Unmeasured: every worker process opens its connections and fills its caches.
        run_single_submits(port, token, 8, settings.warmup, settings.client_procs)
        for clients in settings.clients:
            console.print(f"  {backend}: {clients} client(s), {settings.duration:g} s")
            cpu = process_group_cpu_s(pgid)
            load = run_single_submits(port, token, clients, settings.duration, settings.client_procs)
            rows.append(_load_row(backend, "single", clients, 1, load, cpu, process_group_cpu_s(pgid)))
        for clients in BATCH_CLIENTS if workers > 1 else BATCH_CLIENTS[:1]:
            console.print(f"  {backend}: {clients} client(s) x {settings.batches} batches of {settings.batch_size}")
            cpu = process_group_cpu_s(pgid)
            load = run_batches(port, token, settings.batches, settings.batch_size, clients)
            scenario = f"batch {settings.batch_size}"
            rows.append(
                _load_row(backend, scenario, clients, settings.batch_size, load, cpu, process_group_cpu_s(pgid))
            )
    for row in rows[1:]:
        row.workers = workers
        row.baseline_per_s = baseline.jobs_per_s
        row.ratio = row.jobs_per_s / baseline.jobs_per_s
        apply_targets(row)
    return rows


def _load_row(
    backend: str,
    scenario: str,
    clients: int,
    jobs_per_request: int,
    load: LoadResult,
    cpu_before: float | None,
    cpu_after: float | None,
) -> Row:
    jobs = len(load.latencies) * jobs_per_request
    p50, p99 = latency_ms(load.latencies)
    server_cpu = None if cpu_before is None or cpu_after is None or not jobs else (cpu_after - cpu_before) / jobs * 1e3
    return Row(
        backend=backend,
        scenario=scenario if scenario == "single" else f"batch {jobs_per_request}",
        clients=clients,
        requests=load.requests,
        jobs=jobs,
        errors=load.errors,
        seconds=load.seconds,
        jobs_per_s=jobs / load.seconds if load.seconds > 0 else 0.0,
        p50_ms=p50,
        p99_ms=p99,
        server_cpu_ms_per_job=server_cpu,
        client_cpu_ms_per_request=load.client_cpu_s / load.requests * 1e3 if load.requests else None,
        first_error=load.first_error,
    )


# -- report -----------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpush": version("gpush"),
        "sqlite": sqlite3.sqlite_version,
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(rows: list[Row]) -> None:
    table = Table(title="gpush submissions through the HTTP API", title_justify="left")
    for name in (
        "backend",
        "scenario",
        "clients",
        "requests",
        "jobs/s",
        "p50 ms",
        "p99 ms",
        "baseline/s",
        "ratio",
        "CPU ms/job",
        "errors",
        "target",
    ):
        table.add_column(name, justify="left" if name in ("backend", "scenario", "target") else "right")
    previous = None
    for row in rows:
        if previous is not None and row.backend != previous:
            table.add_section()
        previous = row.backend
        target = ", ".join(f"{goal} {'met' if met else 'MISSED'}" for goal, met in (row.targets or {}).items())
        table.add_row(
            row.backend,
            row.scenario,
            str(row.clients),
            f"{row.requests:,}",
            _fmt(row.jobs_per_s, 0),
            _fmt(row.p50_ms, 2),
            _fmt(row.p99_ms, 2),
            _fmt(row.baseline_per_s, 0),
            _fmt(row.ratio, 3),
            _fmt(row.server_cpu_ms_per_job, 3),
            str(row.errors) if row.errors else "",
            target,
            style="red" if row.errors else None,
        )
    console.print(table)


# -- main -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    parser.add_argument(
        "--duration",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="Length of each single-submit measurement and of each baseline (default 5).",
    )
    parser.add_argument("--backends", default="sqlite,postgres", help="Comma-separated: sqlite, postgres.")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("GPUSH_BENCH_PG_URL", DEFAULT_PG_URL),
        help=f"PostgreSQL server to use; the benchmark creates and drops its own database "
        f"{BENCH_DATABASE!r} there (default {DEFAULT_PG_URL}).",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="uvicorn worker processes of the gpush server, on both backends "
        f"(default: {DEFAULT_WORKERS['sqlite']} on SQLite, one writer; "
        f"{DEFAULT_WORKERS['postgres']} on PostgreSQL, the CPUs + 1).",
    )
    parser.add_argument("--batches", type=int, default=5, help="Batch requests to send (default 5).")
    parser.add_argument("--batch-size", type=int, default=1000, help="Jobs per batch request (default 1000).")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=DEFAULT_CLIENT_PROCS,
        metavar="N",
        help=f"Client processes the concurrent clients are spread over, as threads (default {DEFAULT_CLIENT_PROCS}).",
    )
    parser.add_argument("--quick", action="store_true", help="A quick look: 1 s measurements, 2 batches.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds a backend (0.3 s measurements, 1 and 4 clients, one batch of 100): "
        "that the bench runs (make test runs it); its figures mean nothing",
    )
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        parser.error(f"--backends: use sqlite and/or postgres, not {', '.join(sorted(unknown)) or 'nothing'}")
    for name in ("duration", "workers", "batches", "batch_size", "client_procs"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be more than 0")
    if args.quick:
        args.duration = min(args.duration, 1.0)
        args.batches = min(args.batches, 2)
    args.clients = SINGLE_CLIENTS
    if args.smoke:
        args.duration, args.batches, args.batch_size, args.client_procs = 0.3, 1, 100, 1
        args.clients = (1, 4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings(
        duration=args.duration,
        warmup=min(1.0, args.duration),
        batches=args.batches,
        batch_size=args.batch_size,
        client_procs=args.client_procs,
        workers=args.workers,
        pg_url=args.pg_url,
        clients=args.clients,
    )
    machine = machine_info()
    console.print(
        f"gpush {machine['gpush']} on {machine['cpu_count']} CPUs ({machine['cpu_model']}), "
        f"Python {machine['python']}; "
        f"clients spread over up to {settings.client_procs} processes (stdlib http.client, keep-alive)"
    )
    rows: list[Row] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpush-bench-") as tmp:
        for backend in args.backends:
            console.print(f"[bold]{backend}[/bold]")
            try:
                rows += bench_backend(backend, settings, Path(tmp) / backend)
            except Exception as exc:  # report it, still run the other backends
                failures.append(f"{backend}: {type(exc).__name__}: {exc}")
                console.print(f"[red]{backend} failed: {type(exc).__name__}: {exc}[/red]")
    if rows:
        print_table(rows)
        console.print(
            "baseline: INSERT; COMMIT of one job-shaped row per transaction, one connection "
            "(psycopg on the same PostgreSQL database; sqlite3 with WAL and synchronous=NORMAL).\n"
            "ratio: gpush jobs/s over the baseline's rows/s. CPU ms/job: user+system CPU of all "
            "gpush server processes per job. p50/p99: per request (a batch is one request)."
        )
    for row in rows:
        if row.errors:
            failures.append(
                f"{row.backend} {row.scenario} x{row.clients}: {row.errors} failed requests, first: {row.first_error}"
            )
    for failure in failures:
        console.print(f"[red]error: {failure}[/red]")
    if args.json:
        report = {
            "machine": machine,
            "settings": {
                "duration_s": settings.duration,
                "warmup_s": settings.warmup,
                "clients": list(settings.clients),
                "batches": settings.batches,
                "batch_size": settings.batch_size,
                "backends": args.backends,
                "workers": settings.workers,
                "client_procs": settings.client_procs,
                "client": "stdlib http.client, one keep-alive connection per client",
            },
            "results": [asdict(row) for row in rows],
            "errors": failures,
            "smoke": args.smoke,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"results written to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
