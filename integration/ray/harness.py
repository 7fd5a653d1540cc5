"""A gpush broker over HTTP on the Slurm test cluster, and a real Ray head whose
autoscaler gets its workers from it (integration/test_ray.py, integration/bench/ray.py).

Everything here owns what it starts and stops only that: ``gpush server`` is one
process group; the Ray head runs ``ray start --head --block`` in its own session and a
temp dir of its own, and at the end every process whose command line names that temp
dir (the head's daemons, and the workers Slurm started, which share it) is stopped.
Never ``ray stop``, which would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from broker.client.sdk import GpushClient

BIN = Path(sys.executable).parent
GPUSH = str(BIN / "gpush")
RAY = str(BIN / "ray")
HERE = Path(__file__).resolve().parent

POLICY = """
rules:
  - name: ray-workers-on-mig
    why: Ray inference workers that need hardware isolation get a MIG slice
    match: {isolation: hardware}
    route: {cluster: slurm-a, sharing: slurm/mig}
  - name: whole
    why: everything else on whole GPUs
    match: {}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str], pause: float = 0.2) -> Any:
    """The first true value of ``predicate``; ``what`` (or what it returns, on a timeout)
    says what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(pause)


def gpush(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [GPUSH, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60
    )
    if result.returncode != 0:
        raise AssertionError(f"gpush {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result.stdout.strip()


class GpushBroker:
    """``gpush server`` (API and scheduler) on ``database_url``, with the Slurm test
    cluster registered as ``slurm-a`` and a policy that sends hardware-isolated jobs to MIG."""

    def __init__(self, database_url: str, slurm, workdir: Path, *, cycle_interval: float = 0.3):
        self.database_url = database_url
        self.db = ["--database-url", database_url]
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o755)
        self.workdir = workdir
        config = {"slurm_conf": str(slurm.conf), "jobcomp_file": str(slurm.jobcomp), "workdir": str(workdir)}
        args = [f"{k}={v}" for k, v in config.items()]
        gpush(*self.db, "cluster", "add", "slurm-a", "--kind", "slurm", *[a for kv in args for a in ("--config", kv)])
        policy = workdir / "policy.yaml"
        policy.write_text(POLICY)
        gpush(*self.db, "policy", "apply", str(policy), "-m", "ray tests")
        self.admin_token = gpush(
            *self.db, "admin", "token", "create", "--user", "root", "--tenant", "ops", "--role", "admin"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "gpush-server.log").open("w")
        self.proc = subprocess.Popen(
            [
                GPUSH,
                *self.db,
                "server",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--log-level",
                "warning",
                "--cycle-interval",
                str(cycle_interval),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self._ready, 30, "gpush server to be ready")
        self.admin = GpushClient(self.url, self.admin_token)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"gpush server exited {self.proc.returncode}: {self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join((self.workdir / "gpush-server.log").read_text().splitlines()[-lines:])

    def token(self, user: str, tenant: str) -> str:
        return gpush(*self.db, "admin", "token", "create", "--user", user, "--tenant", tenant)

    def stop(self) -> None:
        self.admin.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def cluster_yaml(
    *,
    cluster_name: str,
    gpush_url: str,
    head_address: str,
    token_env: str,
    max_workers: int = 8,
    idle_timeout_minutes: float = 0.1,
    queued_idle_timeout_minutes: float | None = None,
    gpu_memory_gb: float = 4,
) -> dict[str, Any]:
    """The cluster YAML of integration/ray/cluster.yaml, filled in for this run."""
    config = yaml.safe_load((HERE / "cluster.yaml").read_text())
    config["cluster_name"] = cluster_name
    config["max_workers"] = max_workers
    config["idle_timeout_minutes"] = idle_timeout_minutes
    config["provider"].update(gpush_url=gpush_url, head_address=head_address, token_env=token_env, ray_command=RAY)
    if queued_idle_timeout_minutes is not None:
        config["provider"]["queued_idle_timeout_minutes"] = queued_idle_timeout_minutes
    worker = config["available_node_types"]["mig_worker"]
    worker["max_workers"] = max_workers
    worker["node_config"]["gpush"]["gpu_memory_gb"] = gpu_memory_gb
    return config


class RayHead:
    """A real Ray head on 127.0.0.1 with its own ports and temp dir; with a cluster
    config, its autoscaler runs the gpush node provider."""

    def __init__(self, config: dict[str, Any] | None, env: dict[str, str], *, port: int | None = None):
        # Short: Ray's unix sockets live under it and their paths are limited to 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="gpr-", dir="/tmp"))
        self.port = port or free_port()
        # Not 127.0.0.1, which Ray replaces by the host's address; the workers get 127.0.x.y.
        self.address = f"127.0.0.2:{self.port}"
        self.dashboard_port = free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        argv = [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.2",
            f"--port={self.port}",
            f"--temp-dir={self.temp_dir}",
            "--num-cpus=1",
            "--num-gpus=0",
            f"--dashboard-port={self.dashboard_port}",
            "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={free_port()}",
            "--dashboard-agent-listen-port=0",
            "--disable-usage-stats",
        ]
        if config is not None and config["provider"].get("worker_ip") == "node-id":
            argv.append('--resources={"NODE_ID_AS_RESOURCE": 1}')  # the provider calls the head "1"
        if config is not None:
            config["provider"]["head_address"] = self.address
            config["provider"]["worker_temp_dir"] = str(self.temp_dir)
            self.config_path = self.temp_dir / "cluster.yaml"
            self.config_path.write_text(yaml.safe_dump(config))
            argv.append(f"--autoscaling-config={self.config_path}")
        self.log = (self.temp_dir / "head.log").open("w")
        self.env = {**os.environ, **env, "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        wait_for(self._up, 60, "the Ray head to start", pause=0.5)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"ray start --head exited {self.proc.returncode}: {(self.temp_dir / 'head.log').read_text()[-3000:]}"
            )
        if "Node status" not in (self.status() or ""):
            return False
        try:  # the job server (gpush submit --ray) answers once the dashboard is up
            return httpx.get(f"{self.dashboard_url}/api/version", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def status(self) -> str | None:
        """`ray status` (the autoscaler's view: active and pending nodes, demands)."""
        result = subprocess.run(
            [RAY, "status", f"--address={self.address}"], capture_output=True, text=True, env=self.env, timeout=30
        )
        return result.stdout if result.returncode == 0 else None

    def run_driver(self, script: str, *args: str, timeout: float = 180) -> subprocess.Popen:
        """Start a driver program (integration/ray/<script>) connected to this head."""
        return subprocess.Popen(
            [sys.executable, str(HERE / script), self.address, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env, "RAY_ADDRESS": self.address},
            start_new_session=True,
        )

    def alive_nodes(self) -> list[dict[str, Any]]:
        """The nodes registered with the head's GCS (through the state API: no driver)."""
        result = subprocess.run(
            [RAY, "list", "nodes", f"--address={self.address}", "--format=json", "--filter", "state=ALIVE"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=30,
        )
        try:
            return json.loads(result.stdout[result.stdout.index("[") :])
        except ValueError:
            return []

    def monitor_log(self, tail: int | None = 4000) -> str:
        """The autoscaler monitor's logs (the last ``tail`` characters of each; None: all)."""
        logs = sorted(self.temp_dir.glob("session_*/logs/monitor.*"))
        return "\n".join(p.read_text()[-(tail or 0) :] for p in logs if p.suffix in (".log", ".err", ".out"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)  # it then stops its daemons one by one; what is left goes below
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        # The workers' `ray start --block` (Slurm's jobs) name the head's address; their
        # daemons name the temp dir they share with the head.
        kill_processes_naming(f"--address={self.address}", timeout=5)
        kill_processes_naming(str(self.temp_dir), timeout=5)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _processes() -> dict[int, tuple[int, str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry.name)] = (ppid, cmdline)
    return out


def kill_processes_naming(marker: str, timeout: float = 10.0) -> None:
    """Stop the processes whose command line contains ``marker``, and their children."""

    def ours() -> set[int]:
        procs = _processes()
        found = {pid for pid, (_, cmd) in procs.items() if marker in cmd and pid != os.getpid()}
        changed = True
        while changed:
            kids = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
            found |= kids
            changed = bool(kids)
        return found

    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = ours()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while ours() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not ours():
            return
