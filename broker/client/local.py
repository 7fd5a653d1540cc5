"""The local server of the embedded default: started on first need, found again after.

With no ``--url`` on the embedded database (SQLite), a command that talks to the
broker needs its scheduler running, or a submitted job would wait for ever. So the
first such command starts ``gpush server`` in the background on a free port of
127.0.0.1 (as SkyPilot's local API server is started), records it in a state file in
the data directory (mode 0600: it holds the local admin token), and every later
command talks to it over HTTP. ``gpush server status|stop|logs`` look after it.

``GPUSH_LOCAL_SERVER=0`` keeps the older behaviour: the API runs inside the command's
own process and nothing schedules unless ``gpush server`` or ``gpush scheduler run``
does. One server per database: the state file's name carries a hash of its URL.

This module imports nothing heavy: a command that finds its server running pays only
for reading a small file and checking a process id.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from broker.core.config import data_dir
from broker.core.errors import InvalidRequest, Unavailable

ENV_SWITCH = "GPUSH_LOCAL_SERVER"
START_TIMEOUT = 30.0  # seconds for a new server to answer /healthz
STOP_TIMEOUT = 15.0
_ENTRY = "import sys; from broker.cli.main import main; main(sys.argv[1:])"


def enabled() -> bool:
    """Whether commands on the embedded database use a local server (the default)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class LocalServer:
    """A running local server, as its state file records it."""

    pid: int
    url: str
    database: str
    token: str
    log: str
    started_at: float

    def alive(self) -> bool:
        return _process_alive(self.pid)

    def public(self) -> dict[str, object]:
        """What ``gpush server status --json`` shows: everything but the token."""
        shown = {k: v for k, v in asdict(self).items() if k != "token"}
        shown["uptime_seconds"] = round(time.time() - self.started_at, 1)
        return shown


def _key(database: str) -> str:
    return hashlib.sha256(database.encode()).hexdigest()[:12]


def state_dir() -> Path:
    return data_dir() / "server"


def state_path(database: str) -> Path:
    return state_dir() / f"{_key(database)}.json"


def log_path(database: str) -> Path:
    return state_dir() / f"{_key(database)}.log"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child that exited) still answers kill(0): look closer on Linux.
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def find(database: str) -> LocalServer | None:
    """The running local server of ``database``, or None (a stale state file is removed)."""
    path = state_path(database)
    try:
        data = json.loads(path.read_text())
        server = LocalServer(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        path.unlink(missing_ok=True)
        return None
    if server.database != database or not server.alive():
        path.unlink(missing_ok=True)
        return None
    return server


def _make_private_dirs() -> None:
    """The data directory (the database, its server's token and log) and its server/,
    each created 0700 by mkdir itself: never a moment when others may enter, as a chmod
    after a mkdir under the umask would leave. Directories above the data directory
    (a home's .local/share) are not gpush's: they get the usual mode."""
    data_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    state_dir().mkdir(mode=0o700, exist_ok=True)


@contextlib.contextmanager
def _starting(database: str) -> Iterator[None]:
    """One command at a time starts a database's server; the others wait and find it."""
    _make_private_dirs()
    lock = state_dir() / f"{_key(database)}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


PORT_ENV = "GPUSH_PORT"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chosen_port(port: int | None = None) -> int | None:
    """The port the local server must take: ``port``, else ``GPUSH_PORT``, else None (a
    free one). Raises :class:`InvalidRequest` for a value that is no port."""
    if port is None:
        text = os.environ.get(PORT_ENV, "").strip()
        if not text:
            return None
        if not text.isdigit():
            raise InvalidRequest(f"{PORT_ENV}={text!r} is not a port: set a number from 1 to 65535, or unset it")
        port = int(text)
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port} is not a port: pick a number from 1 to 65535")
    return port


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise InvalidRequest(
                f"port {port} of 127.0.0.1 is taken ({exc.strerror}): pick another with --port or {PORT_ENV}, "
                "or leave both unset for a free one"
            ) from None


def _answers(url: str, timeout: float = 1.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/healthz", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _write_state(server: LocalServer) -> None:
    path = state_path(server.database)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(server), fh, indent=2)
    os.replace(tmp, path)


def ensure(database: str, *, announce=None, port: int | None = None) -> LocalServer:
    """The running local server of ``database``, started now if there is none, on
    ``port`` (else ``GPUSH_PORT``, else a free port of 127.0.0.1).

    ``announce(text)`` is told when a server is started (the CLI prints it on stderr).
    Raises :class:`Unavailable`, with the log's last lines, when it does not come up, and
    :class:`InvalidRequest` for a port that is no port or is taken.
    """
    server = find(database)
    if server is not None:
        return server
    wanted = chosen_port(port)
    with _starting(database):
        server = find(database)  # another command may have started it while we waited
        if server is not None:
            return server
        server = _start(database, wanted)
    if announce is not None:
        announce(
            f"started a local gpush server (pid {server.pid}) at {server.url} with its scheduler, "
            f"on {database}; `gpush server status|logs|stop` look after it"
        )
    return server


def _start(database: str, wanted: int | None) -> LocalServer:
    from broker.client.embedded import local_admin_token, open_database

    engine = open_database(database)  # creates and upgrades the schema before the server does
    try:
        token = local_admin_token(engine)
    finally:
        engine.dispose()
    if wanted is not None:
        _check_port_free(wanted)
    port = wanted or _free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_path(database)
    env = {**os.environ, "GPUSH_DATABASE_URL": database}
    env.pop("GPUSH_URL", None)
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        os.chmod(log, 0o600)  # one an older gpush created under the umask
        out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} gpush server starting on {url}\n".encode())
        out.flush()
        process = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, "server", "--host", "127.0.0.1", "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # not killed by the terminal's Ctrl-C or hang-up
            close_fds=True,
        )
    server = LocalServer(process.pid, url, database, token, str(log), time.time())
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(url, timeout=0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise Unavailable(
                f"the local gpush server did not start (see {log}):\n{tail(log, 15).rstrip()}\n"
                "Start it in the foreground to see why: gpush server"
            )
        time.sleep(0.05)
    _write_state(server)
    return server


def stop(database: str, *, timeout: float = STOP_TIMEOUT) -> LocalServer | None:
    """Stop the local server of ``database`` (SIGTERM, then SIGKILL); the one stopped, or None."""
    server = find(database)
    if server is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if server.alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
    state_path(database).unlink(missing_ok=True)
    return server


def tail(path: str | Path, lines: int) -> str:
    """The last ``lines`` lines of a text file, read from its end (logs grow large)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            size = min(end, 4096)
            while True:
                fh.seek(end - size)
                chunk = fh.read(size)
                if chunk.count(b"\n") > lines or size == end:
                    break
                size = min(end, size * 4)
    except FileNotFoundError:
        return ""
    text = chunk.decode(errors="replace")
    return "".join(text.splitlines(keepends=True)[-lines:]) if lines > 0 else ""
