"""The single-machine Slurm test cluster, seen from Python tests.

``start(state)`` runs ``start.sh`` and returns a :class:`SlurmTestCluster` read from
``STATE/env.sh``; the cluster object runs Slurm's commands against that cluster only
(``SLURM_CONF`` of its own), hands out JWTs for slurmrestd, and waits for jobs by
polling ``squeue --json``. The JSON differs between Slurm 22.05 (Debian 12) and 24.11
(Debian 13): states are a string in one and a list in the other, and nodes come from
``sinfo --json`` in one and ``scontrol --json show nodes`` in the other. The helpers
here even that out so that tests need not care.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
START = HERE / "start.sh"
STOP = HERE / "stop.sh"
INSTALL = HERE / "install.sh"
CHROOT = HERE / "chroot.sh"
# Where start.sh and stop.sh are copied inside a chroot of a newer Slurm.
IN_CHROOT = "/opt/gpush-slurm"
# Set by integration/conftest.py to the id of a running test that is not marked `slurm`:
# make test-integration runs those beside each other (pytest-xdist), and a Slurm test
# cluster takes fixed ports, so such a test may not start one (nor may a bench it runs).
NOT_A_SLURM_TEST = "GPUSH_NOT_A_SLURM_TEST"

# A job in one of these states will not change any more.
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
# Jobs that hold resources or still may: cancel_all() ends these.
ACTIVE_STATES = "PENDING,RUNNING,SUSPENDED,CONFIGURING,COMPLETING,REQUEUED,RESIZING"


class SlurmClusterError(RuntimeError):
    """The test cluster would not start, or a Slurm command failed; the message says why."""


def _states(value: Any) -> frozenset[str]:
    """A job's or node's state as a set of upper-case words, from either JSON shape."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset({value.upper()})
    return frozenset(str(v).upper() for v in value)


def job_states(job: dict[str, Any]) -> frozenset[str]:
    """``{"RUNNING"}`` from 22.05's ``"RUNNING"`` as from 24.11's ``["RUNNING"]``."""
    return _states(job.get("job_state"))


def node_states(node: dict[str, Any]) -> frozenset[str]:
    """``{"IDLE"}`` from 22.05's ``"idle"`` as from 24.11's ``["IDLE"]``."""
    return _states(node.get("state"))


def _read_env_file(path: Path) -> dict[str, str]:
    """The ``export NAME=value`` lines of env.sh (values are shell-quoted)."""
    values = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            values[name] = value
    return values


@dataclass(frozen=True)
class SlurmTestCluster:
    """A running test cluster, as described by its ``STATE/env.sh``."""

    state: Path
    conf: Path  # slurm.conf: SLURM_CONF for every Slurm command
    rest_url: str  # http://127.0.0.1:PORT
    rest_socket: Path  # slurmrestd's unix socket
    version: str  # Slurm's, e.g. "22.05.8"
    rest_api: str  # newest OpenAPI version slurmrestd serves, e.g. "v0.0.38"
    log_dir: Path
    jobcomp: Path  # jobcomp/filetxt: one line per finished job
    accounting: bool = False  # started with --accounting: slurmdbd, associations enforced
    # The Debian chroot of a newer Slurm the cluster runs in (chroot.sh), or None for the
    # host's; Slurm's commands then run as ``chroot ROOT command`` (command_prefix).
    chroot: Path | None = None

    @classmethod
    def load(cls, state: str | os.PathLike[str]) -> SlurmTestCluster:
        env_file = Path(state) / "env.sh"
        if not env_file.is_file():
            raise SlurmClusterError(f"no Slurm test cluster in {state}: {env_file} is missing (start.sh writes it)")
        env = _read_env_file(env_file)
        return cls(
            state=Path(env["GPUSH_SLURM_STATE"]),
            conf=Path(env["SLURM_CONF"]),
            rest_url=env["SLURMRESTD_URL"],
            rest_socket=Path(env["SLURMRESTD_SOCKET"]),
            version=env["GPUSH_SLURM_VERSION"],
            rest_api=env["GPUSH_SLURMRESTD_API"],
            log_dir=Path(env["GPUSH_SLURM_LOG_DIR"]),
            jobcomp=Path(env["GPUSH_SLURM_JOBCOMP"]),
            accounting=env.get("GPUSH_SLURM_ACCOUNTING") == "1",
            chroot=Path(env["GPUSH_SLURM_CHROOT"]) if env.get("GPUSH_SLURM_CHROOT") else None,
        )

    @property
    def version_info(self) -> tuple[int, int]:
        """(22, 5) for 22.05.8."""
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    # -- running Slurm's commands --------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess that should talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env.update(
            SLURM_CONF=str(self.conf),
            SLURMRESTD_URL=self.rest_url,
            SLURMRESTD_SOCKET=str(self.rest_socket),
            GPUSH_SLURM_VERSION=self.version,
            GPUSH_SLURMRESTD_API=self.rest_api,
        )
        return env

    @property
    def command_prefix(self) -> tuple[str, ...]:
        """What runs a Slurm command of this cluster's version: ``("chroot", ROOT)`` or nothing."""
        return ("chroot", str(self.chroot)) if self.chroot else ()

    def run(self, *args: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``sbatch``, ``squeue``...) against this cluster."""
        args = (*self.command_prefix, *args)
        result = subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"{shlex.join(args)} exited {result.returncode}: {result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def _json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.run(*args).stdout)

    def token(self, lifespan: int = 3600, username: str = "root") -> str:
        """A JWT for slurmrestd (header X-SLURM-USER-TOKEN), signed by slurmctld."""
        out = self.run("scontrol", "token", f"username={username}", f"lifespan={lifespan}").stdout.strip()
        name, _, value = out.partition("=")
        if name != "SLURM_JWT" or not value:
            raise SlurmClusterError(f"scontrol token printed {out!r}, expected SLURM_JWT=...")
        return value

    def rest_headers(self, token: str | None = None, username: str = "root") -> dict[str, str]:
        """Headers slurmrestd's rest_auth/jwt expects; a new token unless one is given."""
        return {"X-SLURM-USER-NAME": username, "X-SLURM-USER-TOKEN": token or self.token(username=username)}

    def rest_path(self, endpoint: str) -> str:
        """``/slurm/v0.0.38/jobs`` for ``"jobs"``, with the API version this Slurm serves."""
        return f"/slurm/{self.rest_api}/{endpoint.lstrip('/')}"

    # -- accounting (clusters started with --accounting) ---------------------------

    def sacctmgr(self, *args: str, timeout: float = 20.0) -> str:
        """``sacctmgr -i ARGS`` (no questions asked); its output. sacctmgr waits for ever on a
        slurmdbd that does not answer, hence the timeout."""
        self._needs_accounting("sacctmgr")
        return self.run("sacctmgr", "-i", *args, timeout=timeout).stdout

    def sacct(self, *job_ids: int) -> list[dict[str, str]]:
        """What Slurm's own accounting (slurmdbd) recorded of the jobs: one row each (the
        allocation, not its steps) with JobID, User, Account, QOS, State, AllocTRES and
        ElapsedRaw (the seconds it ran)."""
        self._needs_accounting("sacct")
        fields = ["JobID", "User", "Account", "QOS", "State", "AllocTRES", "ElapsedRaw"]
        out = self.run(
            "sacct",
            "-a",
            "-X",
            "-n",
            "-P",
            f"--format={','.join(fields)}",
            "-j",
            ",".join(str(i) for i in job_ids),
        ).stdout
        return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]

    def _needs_accounting(self, what: str) -> None:
        if not self.accounting:
            raise SlurmClusterError(
                f"{what}: the cluster in {self.state} runs without slurmdbd (start.sh --accounting)"
            )

    # -- jobs and nodes ------------------------------------------------------------

    def submit(self, *sbatch_args: str) -> int:
        """``sbatch --parsable ARGS``; the job id."""
        out = self.run("sbatch", "--parsable", *sbatch_args).stdout.strip()
        return int(out.split(";")[0])

    def jobs(self) -> list[dict[str, Any]]:
        """Every job slurmctld still knows, finished ones included (for MinJobAge seconds).

        ``squeue --json`` of 22.05 ignores filters and lists every job; ``--states=all``
        keeps finished jobs in the list where a later Slurm applies filters.
        """
        return self._json("squeue", "--json", "--states=all").get("jobs", [])

    def job(self, job_id: int) -> dict[str, Any] | None:
        return next((j for j in self.jobs() if j.get("job_id") == job_id), None)

    def wait_for(self, job_id: int, states: Collection[str] | str, timeout: float = 15.0) -> dict[str, Any]:
        """Poll until the job is in one of ``states``; returns its ``squeue --json`` record.

        Fails at once if the job reached a final state it was not asked to reach (it
        will not change any more), and after ``timeout`` seconds otherwise. A batch job
        starts at the next pass of slurmctld's once-a-second loop: poll, don't sleep.
        """
        wanted = frozenset({states} if isinstance(states, str) else states)
        deadline = time.monotonic() + timeout
        job: dict[str, Any] | None = None
        while True:
            job = self.job(job_id)
            current = job_states(job) if job else frozenset()
            if current & wanted:
                return job
            final = current & FINAL_STATES
            if final or time.monotonic() > deadline:
                what = f"job {job_id} is {'/'.join(sorted(current)) or 'unknown to squeue'}"
                if job:
                    what += f" (reason {job.get('state_reason')}, exit code {job.get('exit_code')})"
                raise SlurmClusterError(
                    f"{what}, not {'/'.join(sorted(wanted))}"
                    + ("" if final else f" after {timeout:g}s")
                    + f"\n{self.log_tail(10)}"
                )
            time.sleep(0.1)

    def cancel_all(self, timeout: float = 15.0) -> None:
        """Cancel every job that is not finished and wait until none holds resources."""
        ids = self.run("squeue", "-h", "-t", ACTIVE_STATES, "-o", "%i").stdout.split()
        if not ids:
            return
        self.run("scancel", *ids)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-t", ACTIVE_STATES, "-o", "%i").stdout.strip():
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"jobs still active {timeout:g}s after scancel\n{self.log_tail(10)}")
            time.sleep(0.1)

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Every node's JSON record by name (``gres``, ``gres_used``, ``state``...).

        22.05 has no ``scontrol --json`` and its ``sinfo --json`` lists nodes; from 23.02
        on ``sinfo --json`` groups them instead, and ``scontrol --json show nodes`` has
        the per-node list.
        """
        data = self._json("sinfo", "--json")
        if not isinstance(data.get("nodes"), list):
            data = self._json("scontrol", "--json", "show", "nodes")
        return {node["name"]: node for node in data["nodes"]}

    def partitions(self) -> dict[str, str]:
        """Partition name -> its nodes as Slurm prints them (``gpu01,mig01,mps01``)."""
        out = self.run("sinfo", "-h", "-o", "%R %N").stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    # -- state and logs ------------------------------------------------------------

    def is_up(self) -> bool:
        """slurmctld answers, every node is usable and slurmrestd accepts connections."""
        try:
            states = self.run("sinfo", "-h", "-N", "-o", "%t", timeout=5).stdout.split()
        except (SlurmClusterError, subprocess.TimeoutExpired):
            return False
        # a suffix (idle*, idle~...) means not responding, powered down and the like
        if len(states) < 3 or any(s not in {"idle", "mix", "alloc"} for s in states):
            return False
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(2)
            try:
                conn.connect(str(self.rest_socket))
            except OSError:
                return False
        return True

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of each daemon's log, for failure messages."""
        return _log_tail(self.log_dir, lines)

    def stop(self, purge: bool = False) -> None:
        """Cancel running jobs and stop the daemons; ``purge`` also deletes STATE."""
        _run_script(STOP, str(self.state), *(["--purge"] if purge else []), chroot=self.chroot)


def _log_tail(log_dir: Path, lines: int) -> str:
    parts = []
    for log in sorted(log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log}\n" + "\n".join(tail))
    return "\n".join(parts) or f"(no logs in {log_dir})"


def _run_script(
    script: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 180.0,
    chroot: Path | None = None,
) -> str:
    """Run one of the cluster's scripts (inside ``chroot``, from its copy there); its output,
    or SlurmClusterError with all of it."""
    command = [str(script), *args]
    if chroot is not None:
        command = ["chroot", str(chroot), "bash", f"{IN_CHROOT}/{script.name}", *args]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise SlurmClusterError(f"{shlex.join(command)} did not finish in {timeout:g}s") from exc
    if result.returncode != 0:
        raise SlurmClusterError(f"{shlex.join(command)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result.stdout


def start(
    state: str | os.PathLike[str],
    fresh: bool = True,
    *,
    env: Mapping[str, str] | None = None,
    accounting: bool = False,
    chroot: Path | None = None,
    whole_nodes: int = 1,
    topology: str | None = None,
) -> SlurmTestCluster:
    """Start (or restart) the cluster in ``state`` and return it once it is usable.

    With ``chroot`` (a root :func:`chroot_of` made and mounted) the cluster runs that
    chroot's Slurm; ``state`` must then be under /tmp, which the chroot shares.

    ``fresh`` forgets the jobs and node state of an earlier run in the same directory.
    Ports and the start timeout come from the environment, or ``env`` on top of it:
    ``GPUSH_SLURMCTLD_PORT``, ``GPUSH_SLURMD_PORT``, ``GPUSH_SLURMRESTD_PORT``,
    ``GPUSH_SLURM_START_TIMEOUT`` (and ``GPUSH_SLURMDBD_PORT`` with ``accounting``: slurmdbd
    on the machine's MariaDB, associations enforced). Raises :class:`SlurmClusterError` with the daemons'
    log tails when the cluster does not come up; start.sh then leaves nothing running.
    ``whole_nodes``: how many nodes of two whole A100s (gpu01, gpu02, ...): two for
    multi-node jobs. ``topology``: ``tree`` or ``block`` (24.11 on), a topology.conf and the
    node nvl01 of four H100s in two NVLink pairs (start.sh --topology).
    """
    if test := os.environ.get(NOT_A_SLURM_TEST):
        raise SlurmClusterError(
            f"{test} starts a Slurm test cluster but is not marked slurm; a cluster takes fixed ports, so "
            "make test-integration runs such tests in one process of their own: use the slurm_cluster, "
            "slurm_site or slurm_chroots fixture, or mark the test @pytest.mark.slurm (integration/conftest.py)"
        )
    if chroot is not None:
        if not str(Path(state).resolve()).startswith("/tmp/"):
            raise SlurmClusterError(
                f"a cluster in a chroot keeps its STATE under /tmp (shared with the host), not {state}"
            )
        (chroot / IN_CHROOT.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for script in (START, STOP):
            copy = chroot / IN_CHROOT.lstrip("/") / script.name
            copy.write_bytes(script.read_bytes())
            copy.chmod(0o755)
    _run_script(
        START,
        str(state),
        *(["--fresh"] if fresh else []),
        *(["--accounting"] if accounting else []),
        *([f"--whole-nodes={whole_nodes}"] if whole_nodes != 1 else []),
        *([f"--topology={topology}"] if topology else []),
        env=env,
        chroot=chroot,
    )
    if chroot is not None:
        with (Path(state) / "env.sh").open("a") as env_file:
            env_file.write(f"export GPUSH_SLURM_CHROOT={shlex.quote(str(chroot))}\n")
    return SlurmTestCluster.load(state)


def chroot_of(suite: str, users: Collection[str] = ()) -> tuple[Path, bool]:
    """The chroot of Debian ``suite``'s Slurm (trixie: 24.11; sid: the newest), built the
    first time (about a minute), mounted, with the host's ``users``; and whether this call
    mounted it (else another test run did, and its clusters may be using it)."""
    root = Path(_run_script(CHROOT, "build", suite, timeout=900).strip().splitlines()[-1])
    mounted = _run_script(CHROOT, "mount", str(root)).strip() == "mounted"
    if users:
        _run_script(CHROOT, "users", str(root), *users)
    return root, mounted


def unmount_chroot(root: Path) -> None:
    _run_script(CHROOT, "umount", str(root))


def install() -> str:
    """Install the Debian packages (a no-op taking milliseconds when they are there)."""
    return _run_script(INSTALL, timeout=600)
