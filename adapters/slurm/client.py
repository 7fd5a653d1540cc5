"""The one layer that talks to Slurm: a slurmrestd backend and a command-line backend.

Both backends answer the same five questions in version-independent records
(:mod:`adapters.slurm.records`): ``version()``, ``ping()``, ``submit(Submission)``,
``jobs()``, ``nodes()``, ``cancel(job_id)``, and ``finished(since)`` for jobs that
have left squeue. What callers may assume:

- **Typed failures.** A submission Slurm answers with an error about the job (a GRES
  no node has, an unknown partition, a script sbatch refuses) raises
  :class:`broker.core.adapter.Rejected` with Slurm's own words; only a controller or
  slurmrestd that could not be asked or could not answer now (:data:`_OUTAGES`) raises
  :class:`broker.core.adapter.Unreachable`, and so does an answer that is not Slurm's.
  Calls are retried only where they are safe to repeat (reads, cancel), never a
  submission.
- **Slurm's versions.** The REST backend asks the server which OpenAPI versions it
  serves and takes the newest it knows (:data:`REST_VERSIONS`: v0.0.38 in Slurm 22.05,
  v0.0.40-42 in 24.11, v0.0.42-45 in 26.05, each run against the real server by
  integration/test_slurm_versions.py); the CLI backend reads ``squeue --json`` /
  ``sinfo --json``, which every version has. Neither needs pyslurm, which PyPI does not carry for
  Debian's Slurm.
- **Jobs that left squeue** (older than ``MinJobAge``) come from ``sacct`` when the
  cluster has accounting, or from the job completion log (``jobcomp/filetxt``) when
  the broker can read it (``jobcomp_file``); without either, ``finished`` is empty.

Production brokers use REST (one central broker, a JWT from ``scontrol token`` or the
site's issuer); the CLI backend suits a broker on a login node.

One module of about 770 lines, over the project's 600, on purpose: it is everything gpush
sends to Slurm (each command line, as which user; each HTTP call, with which token; the
site's ``mig_reload`` command aside, adapters.slurm.mig_publish), kept in the one file
DEVELOPERS.md names for an audit, and its two backends keep one contract (the same
records, the same rule for an outage against a refusal, :data:`_OUTAGES`) that reading
them side by side keeps in step.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from adapters.slurm.identity import TokenCache
from adapters.slurm.records import FinishedRecord, SlurmJob, SlurmNode, Submission, exit_code, states, timestamp
from adapters.slurm.render import DEFAULT_PATH
from broker.core.adapter import Rejected, Unreachable

# Newest first: the REST backend takes the first the server offers.
REST_VERSIONS = ("v0.0.45", "v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40", "v0.0.39", "v0.0.38")

# Slurm's errors that say the controller could not be asked, or could not answer now:
# a later try may succeed. Any other error Slurm gives a submission is about the job (a
# GRES no node has, DOS line ends, a name too long) and no retry fixes it. A list of
# known refusals instead took every refusal not on it for an outage, and the job was
# submitted again every cycle, for ever.
_OUTAGES = (
    "Unable to contact slurm controller",
    "Slurm controller not responding",
    "not responding",
    "Socket timed out",
    "Zero Bytes were transmitted or received",
    "Communication connection failure",
    "Connection refused",
    "Connection reset",
    "Transport endpoint is not connected",
    "temporarily unable to accept job",
    "Resource temporarily unavailable",
    "try again",  # "Unable to create job record, try again"
    "standby mode",  # a backup controller that is not in charge
    "shutting down",
    "Protocol authentication error",  # munge on the broker's host or the controller
    "slurm.conf",  # the broker's own Slurm configuration, not the job
)
# Slurm's error numbers (slurm_errno.h) of its communication layer (1000s) and sockets
# (5000s), and the system's of a connection, as slurmrestd reports them.
_OUTAGE_NUMBERS = (range(1000, 2000), range(5000, 6000))
_OUTAGE_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)

_read_retry = retry(
    retry=retry_if_exception_type(Unreachable),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.2, max=2),
    reraise=True,
)


class SlurmClient(Protocol):
    def version(self) -> str: ...
    def ping(self) -> str: ...
    def submit(self, job: Submission) -> str: ...
    def jobs(self) -> list[SlurmJob]: ...
    def nodes(self) -> list[SlurmNode]: ...
    def cancel(self, job_id: str) -> None: ...
    def signal(self, job_id: str, signal: str) -> None: ...
    def finished(self, since: datetime | None) -> list[FinishedRecord]: ...
    def drain(self, node: str, reason: str) -> None: ...
    def resume(self, node: str) -> None: ...
    def network_topology(self) -> str: ...


def _outage(message: str, numbers: tuple[int, ...] = ()) -> bool:
    """Whether Slurm's error says it could not be asked or answer now (see _OUTAGES)."""
    text = message.lower()
    return any(words.lower() in text for words in _OUTAGES) or any(
        n in _OUTAGE_ERRNOS or any(n in span for span in _OUTAGE_NUMBERS) for n in numbers
    )


# -- the command line -----------------------------------------------------------------


class CliBackend:
    """sbatch, squeue, sinfo, scancel, sacct on this host, as the broker's user."""

    def __init__(
        self,
        *,
        slurm_conf: str | None = None,
        bin_dir: str | None = None,
        jobcomp_file: str | None = None,
        timeout: float = 30.0,
        command_prefix: Sequence[str] = (),
        switch_user: str | None = None,
    ):
        self.env = dict(os.environ)
        # Run every command under this one (a chroot with another Slurm, ssh to a login
        # node): its commands are then looked up there, by name or in bin_dir.
        self.prefix = tuple(command_prefix)
        self.switch_user = switch_user or ("runuser" if os.geteuid() == 0 else "sudo")
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.bin_dir = bin_dir
        self.jobcomp_file = jobcomp_file
        self.timeout = timeout
        self._has_sacct: bool | None = None

    def _cmd(self, name: str) -> str:
        if self.prefix:
            return str(Path(self.bin_dir) / name) if self.bin_dir else name
        path = str(Path(self.bin_dir) / name) if self.bin_dir else shutil.which(name, path=self.env.get("PATH"))
        if not path or not Path(path).exists():
            raise Unreachable(f"{name} not found (install Slurm's client commands, or set the cluster's bin_dir)")
        return path

    def _run(
        self,
        name: str,
        *args: str,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = [self._cmd(name), *args]
        if user is not None:
            argv = [*self._as_user(user, env or {}), *argv]
        try:
            return subprocess.run(
                [*self.prefix, *argv],
                input=stdin,
                capture_output=True,
                text=True,
                env=dict(self.env if env is None else env),
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{name} did not answer in {self.timeout:g} s") from None

    def _as_user(self, user: str, env: Mapping[str, str]) -> list[str]:
        """The command that runs what follows as ``user``, passing on ``env``'s names
        (runuser and sudo reset the environment; the job's comes from sbatch's)."""
        # runuser: the broker is root (util-linux). sudo -n never asks for a password: a
        # sudoers rule lets the broker's user run Slurm's commands as the site's users
        # (README: "Jobs as their users").
        switch = ["runuser", "-u", user] if self.switch_user == "runuser" else ["sudo", "-n", "-u", user]
        return [*switch, "--", "env", *(f"{k}={env[k]}" for k in sorted(env))]

    def _ok(self, name: str, *args: str) -> str:
        done = self._run(name, *args)
        if done.returncode != 0:
            raise Unreachable(f"{name} {' '.join(args)}: {_last_line(done.stderr) or f'exit {done.returncode}'}")
        return done.stdout

    def drain(self, node: str, reason: str) -> None:
        """``scontrol update NodeName=N State=DRAIN Reason=...``: no new job starts there."""
        self._update_node(node, "State=DRAIN", f"Reason={reason}")

    def resume(self, node: str) -> None:
        self._update_node(node, "State=RESUME")

    def _update_node(self, node: str, *settings: str) -> None:
        done = self._run("scontrol", "update", f"NodeName={node}", *settings)
        if done.returncode != 0:
            message = _last_line(done.stderr) or f"exit {done.returncode}"
            if "invalid node name" in message.lower():
                raise Rejected(f"Slurm has no node {node}: {message}")
            raise Unreachable(f"scontrol update NodeName={node} {' '.join(settings)}: {message}")

    def version(self) -> str:
        # "slurm 22.05.8" or "slurm-wlm 24.11.5"
        return self._ok("sinfo", "--version").split()[-1]

    def ping(self) -> str:
        out = self._ok("scontrol", "ping")
        if "UP" not in out:
            raise Unreachable(f"slurmctld is not up: {out.strip()}")
        return out.strip()

    def submit(self, job: Submission) -> str:
        # sbatch's environment becomes the job's (--export=ALL): only what Slurm needs.
        clean = {"PATH": self.env.get("PATH", DEFAULT_PATH)} | {
            k: v for k, v in self.env.items() if k in ("SLURM_CONF", "LANG", "LC_ALL")
        }
        done = self._run("sbatch", *job.sbatch_args(), stdin=job.script, env=clean, user=job.user)
        if done.returncode == 0:
            return done.stdout.strip().split(";", 1)[0]
        # sbatch says why in "sbatch: error: ..." lines, sometimes two for one reason
        # (DOS line breaks). No such line (killed, a missing library) is not Slurm's answer.
        said = [line.split(" error: ", 1)[1] for line in done.stderr.splitlines() if " error: " in line]
        if job.user is not None and not said and _switch_refused(done.stderr):
            raise Rejected(f"cannot run sbatch as {job.user}: {_last_line(done.stderr)}")
        message = " ".join(said) or _last_line(done.stderr) or f"sbatch exited {done.returncode}"
        if done.returncode > 0 and said and not _outage(message):
            raise Rejected(f"Slurm refused the job: {message}")
        raise Unreachable(f"sbatch: {message}")

    @_read_retry
    def jobs(self) -> list[SlurmJob]:
        # Every job slurmctld still knows, finished ones too (for MinJobAge), as REST's /jobs
        # lists them: 22.05's squeue --json ignores filters and lists them all, while 24.11
        # and 26.05 apply squeue's default filter and leave finished jobs out unless asked
        # for all states (recorded: tests/data/slurm/2411/squeue_default.json).
        out = self._ok("squeue", "--json", "--states=all")
        return [SlurmJob.of(raw) for raw in _json(out, "squeue").get("jobs", [])]

    @_read_retry
    def nodes(self) -> list[SlurmNode]:
        data = _json(self._ok("sinfo", "--json"), "sinfo")
        if not isinstance(data.get("nodes"), list):
            # From 23.02 sinfo --json groups nodes; scontrol --json lists them one by one.
            data = _json(self._ok("scontrol", "--json", "show", "nodes"), "scontrol")
        return [SlurmNode.of(raw) for raw in data.get("nodes", [])]

    @_read_retry
    def network_topology(self) -> str:
        """``scontrol show topology``'s text (adapters.slurm.topology reads it); empty when
        the cluster has no topology plugin."""
        done = self._run("scontrol", "show", "topology")
        if done.returncode != 0:
            message = _last_line(done.stderr) or f"exit {done.returncode}"
            if _outage(message):
                raise Unreachable(f"scontrol show topology: {message}")
            return ""  # "No topology information available" and the like
        return done.stdout

    @_read_retry
    def cancel(self, job_id: str) -> None:
        done = self._run("scancel", job_id)
        if done.returncode != 0 and "Invalid job id" not in done.stderr and "already completing" not in done.stderr:
            raise Unreachable(f"scancel {job_id}: {_last_line(done.stderr)}")

    @_read_retry
    def signal(self, job_id: str, signal: str) -> None:
        """``scancel --full --signal``: the batch script and every process of the job get it."""
        done = self._run("scancel", "--full", f"--signal={signal.removeprefix('SIG')}", job_id)
        if done.returncode != 0 and "Invalid job id" not in done.stderr and "already completing" not in done.stderr:
            raise Unreachable(f"scancel --signal={signal} {job_id}: {_last_line(done.stderr)}")

    def finished(self, since: datetime | None) -> list[FinishedRecord]:
        records = self._sacct(since)
        if records is None and self.jobcomp_file:
            records = read_jobcomp(Path(self.jobcomp_file), since)
        return records or []

    def _sacct(self, since: datetime | None) -> list[FinishedRecord] | None:
        """Finished jobs from accounting, or None when the cluster keeps none."""
        if self._has_sacct is False:
            return None
        start = (since or datetime(1970, 1, 2, tzinfo=UTC)).strftime("%Y-%m-%dT%H:%M:%S")
        try:
            # -E now: with -s and no end time, sacct 23.02 and later end the window at its
            # start and list nothing.
            done = self._run("sacct", "--json", "-a", "-S", start, "-E", "now", "-s", "CD,F,CA,TO,OOM,NF,PR,BF,DL")
        except Unreachable:
            return None
        if done.returncode != 0:
            # "Slurm accounting storage is disabled": no slurmdbd; do not ask again.
            self._has_sacct = False
            return None
        self._has_sacct = True
        out = []
        for raw in _json(done.stdout, "sacct").get("jobs", []):
            state = raw.get("state") or {}
            words = states(state.get("current") if isinstance(state, dict) else state)
            times = raw.get("time") if isinstance(raw.get("time"), dict) else {}
            end = times.get("end")
            out.append(
                FinishedRecord(
                    job_id=str(raw.get("job_id")),
                    name=str(raw.get("name") or ""),
                    state=words[0] if words else "UNKNOWN",
                    exit_code=exit_code(raw.get("exit_code")),
                    end_time=timestamp(end),
                    nodes=str(raw.get("nodes") or ""),
                    start_time=timestamp(times.get("start")),
                    # 23.02 on; 24.05 on also expands the patterns for us
                    standard_output=str(raw.get("stdout_expanded") or raw.get("stdout") or ""),
                    standard_error=str(raw.get("stderr_expanded") or raw.get("stderr") or ""),
                    work_dir=str(raw.get("working_directory") or ""),
                    user=str(raw.get("user") or ""),
                    account=str(raw.get("account") or ""),
                )
            )
        return out


def read_jobcomp(path: Path, since: datetime | None) -> list[FinishedRecord]:
    """Records of Slurm's ``jobcomp/filetxt`` log (``JobId=12 ... Name=x JobState=COMPLETED
    ... EndTime=2026-12-03T10:00:00 ... ExitCode=0:0``) that ended at or after ``since``."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" not in fields:
            continue
        end = _local_time(fields.get("EndTime"))
        if since is not None and end is not None and end < since:
            continue
        code = fields.get("ExitCode", "")
        out.append(
            FinishedRecord(
                job_id=fields["JobId"],
                name=fields.get("Name", ""),
                state=fields.get("JobState", "UNKNOWN").upper(),
                exit_code=_jobcomp_exit(code),
                end_time=end,
                nodes=fields.get("NodeList", ""),
                start_time=_local_time(fields.get("StartTime")),
                work_dir=fields.get("WorkDir", ""),
                user=fields.get("UserId", "").split("(", 1)[0],  # "alice(1000)"
                account=fields.get("Account", ""),
            )
        )
    return out


def _jobcomp_exit(code: str) -> int | None:
    """``ExitCode=3:0`` -> 3; ``0:9`` (killed by signal 9) -> 137, as a shell reports it."""
    status, _, signal = code.partition(":")
    if not status.isdigit():
        return None
    if status == "0" and signal.isdigit() and signal != "0":
        return 128 + int(signal)
    return int(status)


def _local_time(text: str | None) -> datetime | None:
    # Slurm writes local time without a zone.
    if not text or text in ("Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(text).astimezone(UTC)
    except ValueError:
        return None


# -- slurmrestd -------------------------------------------------------------------------


class RestBackend:
    """slurmrestd over HTTP (``http://host:6820``) or its unix socket, with a JWT."""

    def __init__(
        self,
        *,
        url: str,
        user: str,
        token: str | None = None,
        token_env: str | None = None,
        token_file: str | None = None,
        socket: str | None = None,
        api_version: str | None = None,
        jobcomp_file: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        jwt_key_file: str | None = None,
        token_lifetime: int = 600,
        scontrol: CliBackend | None = None,
    ):
        self.user = user
        # slurmrestd has no topology endpoint (22.05's v0.0.38 to 26.05's v0.0.45): the
        # network is read with scontrol where the broker has it (CLI settings), else unknown.
        self.scontrol = scontrol
        # Tokens for the users jobs run as, minted with the site's key; without a key a
        # job runs as its user by proxy: the service token names the user in its header.
        self._minted = TokenCache(jwt_key_file, token_lifetime) if jwt_key_file else None
        self._token, self._token_env, self._token_file = token, token_env, token_file
        self.jobcomp_file = jobcomp_file
        if transport is None and socket:
            transport = httpx.HTTPTransport(uds=socket)
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout, transport=transport)
        self._version = api_version
        self._has_db: bool | None = None

    def _headers(self, user: str | None = None) -> dict[str, str]:
        """The service identity's headers, or ``user``'s: a token minted for them with the
        site's key, else the service token naming them (proxy mode, which slurmrestd
        allows for a token of root or SlurmUser)."""
        if user is not None and self._minted is not None:
            return {"X-SLURM-USER-NAME": user, "X-SLURM-USER-TOKEN": self._minted.token(user)}
        headers = self._service_headers()
        if user is not None:
            headers["X-SLURM-USER-NAME"] = user
        return headers

    def _service_headers(self) -> dict[str, str]:
        token = self._token
        if self._token_env:
            token = os.environ.get(self._token_env)
            if not token:
                raise Unreachable(f"no Slurm token: environment variable {self._token_env} is not set")
        elif self._token_file:
            try:
                token = Path(self._token_file).read_text().strip().removeprefix("SLURM_JWT=")
            except OSError as exc:
                raise Unreachable(f"cannot read the Slurm token file {self._token_file}: {exc}") from None
        if not token:
            raise Unreachable("no Slurm token: set token_env or token_file for the cluster")
        return {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": token}

    def _request(
        self, method: str, path: str, body: Any = None, *, plugin: str = "slurm", user: str | None = None
    ) -> dict[str, Any]:
        url = f"/{plugin}/{self.api_version()}/{path}"
        try:
            response = self.http.request(method, url, headers=self._headers(user), json=body)
        except httpx.HTTPError as exc:
            raise Unreachable(f"slurmrestd at {self.http.base_url}: {exc}") from None
        if response.status_code in (401, 403):
            if user is not None and (self._minted is not None or self._service_accepted()):
                how = "a token minted with jwt_key_file" if self._minted else f"the token of {self.user} by proxy"
                raise UserRefused(
                    f"slurmrestd did not accept {how} for user {user} ({response.status_code}): the user must "
                    "exist on the Slurm controller, and proxy mode needs the token of root or SlurmUser"
                )
            raise Unreachable(f"slurmrestd refused the token ({response.status_code}): renew it (scontrol token)")
        try:
            data = response.json()
        except ValueError:
            data = {}
        errors = [
            e for e in data.get("errors") or [] if isinstance(e, dict) and (e.get("error") or e.get("description"))
        ]
        if response.status_code >= 400 or (errors and method != "GET"):
            message = "; ".join(str(e.get("error") or e.get("description")) for e in errors) or response.text[:200]
            numbers = tuple(
                n for e in errors for n in (e.get("error_number"), e.get("error_code")) if isinstance(n, int)
            )
            raise RestError(response.status_code, message, numbers=numbers, from_slurm=bool(errors), answer=data)
        return data

    def _service_accepted(self) -> bool:
        """Whether slurmrestd accepts the service token (so a refusal was of the user)."""
        try:
            return self.http.get(f"/slurm/{self.api_version()}/ping", headers=self._headers()).status_code == 200
        except (httpx.HTTPError, Unreachable):
            return False

    def api_version(self) -> str:
        if self._version is None:
            self._version = self._discover()
        return self._version

    def _discover(self) -> str:
        """The newest OpenAPI version of the slurm plugin the server serves."""
        offered: set[str] = set()
        for path in ("/openapi/v3", "/openapi"):
            try:
                response = self.http.get(path, headers=self._headers())
            except httpx.HTTPError as exc:
                raise Unreachable(f"slurmrestd at {self.http.base_url}: {exc}") from None
            if response.status_code == 200:
                try:
                    paths = " ".join((response.json().get("paths") or {}).keys())
                except ValueError:
                    paths = ""
                offered = set(re.findall(r"/slurm/(v\d+\.\d+\.\d+)/", paths))
                if offered:
                    break
        for version in REST_VERSIONS:
            if version in offered:
                return version
        if offered:
            raise Unreachable(
                f"slurmrestd serves {', '.join(sorted(offered))}; gpush speaks {', '.join(REST_VERSIONS)}"
            )
        raise Unreachable(f"slurmrestd at {self.http.base_url} lists no slurm API (is it slurmrestd?)")

    def version(self) -> str:
        data = self._request("GET", "ping")
        meta = data.get("meta") or {}
        release = (meta.get("Slurm") or meta.get("slurm") or {}).get("release")
        if not release:
            v = (meta.get("Slurm") or meta.get("slurm") or {}).get("version") or {}
            release = ".".join(str(v.get(k, "?")) for k in ("major", "minor", "micro")) if v else "unknown"
        return str(release)

    @_read_retry
    def ping(self) -> str:
        data = self._request("GET", "ping")
        pings = data.get("pings") or []
        up = [p for p in pings if str(p.get("ping") or p.get("pinged") or "").upper() == "UP" or p.get("responding")]
        if not up:
            raise Unreachable(f"slurmctld is not up: {pings}")
        return "UP"

    def submit(self, job: Submission) -> str:
        body = {"script": job.script, "job": self._job_body(job)}
        try:
            data = self._request("POST", "job/submit", body, user=job.user)
        except UserRefused as exc:
            raise Rejected(str(exc)) from None
        except RestError as exc:
            created = exc.answer.get("job_id")
            if exc.status < 400 and isinstance(created, int) and not isinstance(created, bool) and created > 0:
                # Slurm created the job and says why it does not start it now, as the error
                # of an HTTP 200 that carries the id (recorded on 22.05): 2042 "Job is in
                # held state, pending scheduler release" for a job submitted held, 2068
                # "Required node not available (down, drained or reserved)" while the nodes
                # have not registered with a slurmctld that just restarted. sbatch prints the
                # id and nothing else. Taken for a refusal, the job failed in gpush and ran
                # in Slurm, untracked.
                return str(created)
            if exc.from_slurm and not _outage(exc.message, exc.numbers):
                raise Rejected(f"Slurm refused the job: {exc.message}") from None
            raise Unreachable(f"slurmrestd: {exc.message}") from None
        job_id = data.get("job_id")
        if job_id is None:
            raise Unreachable(f"slurmrestd answered without a job id: {str(data)[:200]}")
        return str(job_id)

    def _job_body(self, job: Submission) -> dict[str, Any]:
        legacy = self.api_version() in ("v0.0.38", "v0.0.39")
        body: dict[str, Any] = {
            "name": job.name,
            "comment": job.comment,
            "current_working_directory": job.workdir,
            "standard_output": job.output,
            "standard_error": job.error,
            "cpus_per_task": job.cpus_per_task,
        }
        if job.hold:
            body["hold"] = True
        if legacy:
            if job.gres:
                body["gres"] = job.gres
            body["environment"] = dict(job.environment)
            if job.memory_mb:
                body["memory_per_node"] = job.memory_mb
            if job.time_limit_minutes:
                body["time_limit"] = job.time_limit_minutes
        else:
            if job.gres:
                body["tres_per_job" if job.gpus_per_job else "tres_per_node"] = _tres(job.gres)
            body["environment"] = [f"{k}={v}" for k, v in job.environment.items()]
            if job.memory_mb:
                body["memory_per_node"] = {"set": True, "number": job.memory_mb}
            if job.time_limit_minutes:
                body["time_limit"] = {"set": True, "number": job.time_limit_minutes}
        if job.nodes > 1 or job.tasks_per_node > 1:
            # sbatch's -N and --ntasks-per-node: v0.0.38 parses them as sbatch options ("2"
            # or 2), v0.0.40 on takes "nodes" as a count range string.
            body["nodes"] = str(job.nodes)
            body["tasks_per_node"] = job.tasks_per_node
        if job.switches and not legacy:
            # v0.0.38 refuses "required_switches" ("Disabled key") and knows no other name for
            # it: a gang there runs on its --nodelist alone, which holds the same nodes.
            body["required_switches"] = job.switches
        if job.segment:
            body["segment_size"] = job.segment  # v0.0.41 on (Slurm 24.11 on)
        if job.nodelist:
            # sbatch's -w: v0.0.38 refuses "required_nodes" ("Disabled key") and takes
            # "nodelist"; v0.0.39 on take "required_nodes", a list of names.
            if self.api_version() == "v0.0.38":
                body["nodelist"] = ",".join(job.nodelist)
            else:
                body["required_nodes"] = list(job.nodelist)
        for key, value in (("partition", job.partition), ("account", job.account), ("qos", job.qos)):
            if value:
                body[key] = value
        return body

    @_read_retry
    def jobs(self) -> list[SlurmJob]:
        return [SlurmJob.of(raw) for raw in self._get("jobs").get("jobs", [])]

    @_read_retry
    def nodes(self) -> list[SlurmNode]:
        return [SlurmNode.of(raw) for raw in self._get("nodes").get("nodes", [])]

    def _get(self, path: str) -> dict[str, Any]:
        try:
            return self._request("GET", path)
        except RestError as exc:
            raise Unreachable(f"slurmrestd GET {path}: {exc.message}") from None

    def drain(self, node: str, reason: str) -> None:
        """POST node/{name} with state DRAIN (slurmrestd v0.0.39, Slurm 23.02, on)."""
        self._update_node(node, {"state": ["DRAIN"], "reason": reason}, "drain")

    def resume(self, node: str) -> None:
        self._update_node(node, {"state": ["RESUME"]}, "resume")

    def _update_node(self, node: str, body: dict[str, Any], what: str) -> None:
        version = self.api_version()
        if version in ("v0.0.38",):
            raise Rejected(
                f"slurmrestd {version} (Slurm 22.05) cannot {what} a node; Slurm 23.02 adds it. "
                "Use the command-line backend for this cluster, or drain the node by hand (scontrol update)"
            )
        try:
            self._request("POST", f"node/{node}", body)
        except RestError as exc:
            if "invalid node" in exc.message.lower() or exc.status == 404:
                raise Rejected(f"Slurm has no node {node}: {exc.message}") from None
            raise Unreachable(f"slurmrestd {what} {node}: {exc.message}") from None

    @_read_retry
    def cancel(self, job_id: str) -> None:
        self._delete_job(job_id, "", f"cancel {job_id}")

    @_read_retry
    def signal(self, job_id: str, signal: str) -> None:
        """DELETE job/{id} with ``signal`` and the FULL_JOB flag: the batch script and every
        process of the job get it, as ``scancel --full --signal`` gives it."""
        self._delete_job(job_id, f"?signal={signal}&flags=FULL_JOB", f"signal {signal} to {job_id}")

    def _delete_job(self, job_id: str, query: str, what: str) -> None:
        """DELETE job/{id} (a cancel, or a signal with ``query``); a job that has ended is no error."""
        try:
            answer = self._request("DELETE", f"job/{job_id}{query}")
            # From v0.0.40 on a request Slurm refused still answers HTTP 200, with the
            # error in status[] (one entry per job or step it signalled).
            problems = [
                str((entry.get("error") or {}).get("message") or (entry.get("error") or {}).get("string") or "")
                for entry in (answer.get("status") or [])
                if isinstance(entry, dict) and (entry.get("error") or {}).get("code")
            ]
            if problems:
                raise RestError(200, "; ".join(p for p in problems if p) or "refused", from_slurm=True, answer=answer)
        except RestError as exc:
            if "Invalid job id" in exc.message or "already completing" in exc.message.lower():
                return
            raise Unreachable(f"slurmrestd {what}: {exc.message}") from None

    def finished(self, since: datetime | None) -> list[FinishedRecord]:
        if self.jobcomp_file:
            return read_jobcomp(Path(self.jobcomp_file), since)
        return []

    def network_topology(self) -> str:
        return self.scontrol.network_topology() if self.scontrol is not None else ""


class UserRefused(Unreachable):
    """slurmrestd did not accept the identity of the user a job runs as."""


class RestError(Unreachable):
    """slurmrestd answered with an error: Unreachable unless a caller knows it is a refusal.

    ``from_slurm``: the answer carried Slurm's own errors (``numbers``: their error
    numbers), rather than being a proxy's page or a server that is not slurmrestd."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        numbers: tuple[int, ...] = (),
        from_slurm: bool = False,
        answer: dict[str, Any] | None = None,
    ):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.numbers = numbers
        self.from_slurm = from_slurm
        self.answer = answer or {}  # the body, which may still name a job


def _tres(gres: str) -> str:
    """``gpu:1g.5gb:1`` -> ``gres/gpu:1g.5gb=1``, the TRES form newer APIs take."""
    name, _, rest = gres.partition(":")
    kind, _, count = rest.rpartition(":")
    return f"gres/{name}:{kind}={count}" if kind else f"gres/{name}={count}"


def _json(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        raise Unreachable(f"{what} --json printed no JSON: {text[:200]!r}") from None
    return data if isinstance(data, dict) else {}


def _switch_refused(stderr: str) -> bool:
    """Whether runuser or sudo, not sbatch, refused: no such user, no sudo rule."""
    text = stderr.lower()
    return any(
        words in text for words in ("runuser:", "sudo:", "does not exist", "unknown user", "a password is required")
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def make_client(config: Mapping[str, Any]) -> SlurmClient:
    """The backend a cluster's config asks for: ``rest_url`` → REST, else the command line."""
    timeout = float(config.get("timeout", 30))
    cli = CliBackend(
        slurm_conf=config.get("slurm_conf"),
        bin_dir=config.get("bin_dir"),
        jobcomp_file=config.get("jobcomp_file"),
        timeout=timeout,
        command_prefix=shlex.split(config.get("command_prefix") or ""),
        switch_user=config.get("switch_user"),
    )
    if config.get("rest_url") or config.get("rest_socket"):
        return RestBackend(
            url=str(config.get("rest_url") or "http://localhost"),
            socket=config.get("rest_socket"),
            user=str(config.get("user") or os.environ.get("USER") or "root"),
            token=config.get("token"),
            token_env=config.get("token_env"),
            token_file=config.get("token_file"),
            api_version=config.get("api_version"),
            jobcomp_file=config.get("jobcomp_file"),
            timeout=timeout,
            jwt_key_file=config.get("jwt_key_file"),
            token_lifetime=int(config.get("token_lifetime") or 600),
            scontrol=cli,
        )
    return cli
