"""``gpush server``: the broker process: the REST API and, on the elected leader, the
scheduling loop.

Several server processes may share one PostgreSQL: the API keeps no state of its
own, and leader election (broker.scheduling.leader) lets one of them schedule at a time. On
SQLite (the embedded default) the schema is upgraded at start.

What uvicorn leaves open is closed here: a client gets ``header_timeout_seconds`` to send
a request's head (uvicorn 0.55 has no such timeout: a connection that dribbles its
headers, or sends nothing, was held for ever), the access log never shows a token sent
in a query, and a server that listens beyond loopback refuses to start without a
metrics token (``/metrics`` names every tenant).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import re
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from sqlalchemy import Engine
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from broker.api.app import create_app
from broker.api.limits import HttpLimits
from broker.core.clock import utcnow
from broker.core.config import database_url
from broker.core.db import open_database
from broker.core.errors import InvalidRequest
from broker.core.metrics import TOKEN_ENV as METRICS_TOKEN_ENV
from broker.scheduling.cycle import Scheduler
from broker.scheduling.leader import run_scheduler_loop


def attach_scheduler(app: FastAPI, engine: Engine, *, interval: float) -> None:
    """Run the scheduling loop in a thread for the app's lifetime (it schedules only
    while this process holds leadership)."""
    stop = threading.Event()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(
            target=run_scheduler_loop,
            args=(engine, lambda: Scheduler(engine, app.state.adapters, clock=utcnow), stop),
            kwargs={"interval": interval, "wakeup": app.state.wakeup},
            name="gpush-scheduler",
            daemon=True,
        )
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)

    app.router.lifespan_context = lifespan


def app_from_env() -> FastAPI:
    """ASGI factory for uvicorn's worker processes; reads GPUSH_DATABASE_URL and
    GPUSH_SCHEDULER (0 turns the scheduling loop off in this process)."""
    _log_to_stderr(os.environ.get("GPUSH_LOG_LEVEL", "info"))
    redact_access_log()
    engine = open_database(database_url())
    app = create_app(engine)
    if os.environ.get("GPUSH_SCHEDULER", "1") != "0":
        attach_scheduler(app, engine, interval=float(os.environ.get("GPUSH_CYCLE_INTERVAL", "1")))
    return app


def _log_to_stderr(level: str) -> None:
    """gpush's own loggers (the scheduler's placements, warnings) beside uvicorn's lines."""
    logger = logging.getLogger("gpush")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)-9s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False


def serve(url: str, *, host: str, port: int, workers: int, log_level: str, scheduler: bool, interval: float) -> None:
    check_metrics_exposure(host)
    # Open (and on SQLite upgrade) once here, so a bad URL or an old schema fails
    # with a clear message before any worker starts.
    open_database(url).dispose()
    os.environ["GPUSH_DATABASE_URL"] = url
    os.environ["GPUSH_SCHEDULER"] = "1" if scheduler else "0"
    os.environ["GPUSH_CYCLE_INTERVAL"] = str(interval)
    os.environ["GPUSH_LOG_LEVEL"] = log_level
    limits = HttpLimits.from_env()
    uvicorn.run(
        "broker.api.server:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers if workers > 1 else None,
        log_level=log_level,
        access_log=log_level in ("info", "debug"),  # one line a request
        # h11 buffers at most this much of a request's head; the app's EdgeLimits
        # refuses larger headers (431) whichever parser uvicorn picked.
        h11_max_incomplete_event_size=limits.max_header_bytes,
        http=HeaderDeadline,
    )


# -- /metrics beyond loopback -----------------------------------------------------------


def listens_beyond_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` can be reached from other machines. A name
    other than localhost counts as reachable: it may resolve to anything."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True


def check_metrics_exposure(host: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse to listen beyond loopback with /metrics open to all.

    /metrics shows tenant names and per-tenant figures. Refusing to start, rather than
    answering /metrics to loopback peers only, because a peer address cannot be trusted
    (a reverse proxy on this host makes every client 127.0.0.1) and because the mistake
    then shows where it is made, in the terminal of whoever starts the server, not days
    later as a scrape target that went down."""
    environ = os.environ if environ is None else environ
    if listens_beyond_loopback(host) and not environ.get(METRICS_TOKEN_ENV):
        raise InvalidRequest(
            f"gpush server would listen on {host}, beyond this machine, where /metrics shows every tenant's "
            f"name and figures to anyone who reaches the port: set {METRICS_TOKEN_ENV} to a secret (Prometheus "
            "then scrapes with `authorization: {credentials: <it>}`), or listen on 127.0.0.1"
        )


# -- the access log -----------------------------------------------------------------------

# A query parameter whose name says it holds a secret, and anything shaped like a gpush
# token wherever it is in the path (gpush reads tokens from the Authorization header
# only, but a client may still put one in the URL).
_SECRET_PARAM = re.compile(r"(?i)((?:^|[&;])[^=&;]*(?:token|secret|passw|api[-_]?key|auth)[^=&;]*=)[^&;]*")
_GPUSH_TOKEN = re.compile(r"gpush_[A-Za-z0-9_-]{8,}")
REDACTED = "REDACTED"


def redact(path: str) -> str:
    """``path`` (with its query) as the access log may show it."""
    path, mark, query = path.partition("?")
    return _GPUSH_TOKEN.sub("gpush_" + REDACTED, path + mark + _SECRET_PARAM.sub(r"\1" + REDACTED, query))


class RedactSecrets(logging.Filter):
    """Takes secrets out of uvicorn's access lines (``client - "METHOD PATH HTTP/v" status``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact(args[2]), *args[3:])
        return True


def redact_access_log() -> None:
    """Put :class:`RedactSecrets` on uvicorn's access logger of this process (once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecrets) for f in logger.filters):
        logger.addFilter(RedactSecrets())


# -- a deadline on a request's head ----------------------------------------------------------


@functools.cache
def _header_timeout() -> float:
    # Read in each worker process: uvicorn's spawned workers import this class by name.
    return float(HttpLimits.from_env().header_timeout_seconds)


class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol (httptools, or h11 without it), closing a connection whose
    request head has not all arrived ``header_timeout_seconds`` after the connection was
    made or the head's first byte came. uvicorn closes a connection idle between
    requests itself (``timeout_keep_alive``), but not one that is slow to send a head,
    or sends nothing at all, so slow clients could hold every file descriptor."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._awaiting_head():
            self._arm()
        super().data_received(data)
        if not self._awaiting_head():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(_header_timeout(), self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()
