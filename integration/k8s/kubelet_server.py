"""The simulated kubelets' HTTP endpoint: container logs, where an API server's ``pods/log`` reads them.

A real API server answers ``GET /api/v1/namespaces/{ns}/pods/{name}/log`` by asking the kubelet of
the Pod's node, at the node's address and ``status.daemonEndpoints.kubeletEndpoint.Port``, for
``/containerLogs/{ns}/{pod}/{container}`` with the same options, and streams the answer back. The
node simulator serves that path for all its nodes from one address, as KWOK does (its nodes'
``InternalIP`` and kubelet port name this server), so the project's test API server
(integration/k8s/apiserver_logs.py) and ``kubectl logs`` reach simulated containers the real way.

Served: ``follow``, ``previous``, ``timestamps``, ``tailLines``, ``limitBytes``, ``sinceSeconds`` and
``sinceTime``, with the kubelet's answers (k8s.io/kubernetes pkg/kubelet/server/server.go and
kubelet_pods.go ``validateContainerLogStatus``): 404 ``pod "x" does not exist`` and ``container "c"
not found in pod "x"``; 400 with the container's state (``container "c" in pod "x" is waiting to
start: ContainerCreating``, ``previous terminated container "c" in pod "x" not found``), as plain
text, which the API server turns into its Status. ``follow=true`` streams until the container ends
(or the simulator stops). Plain HTTP, no authentication: it listens on the loopback address by
default, and only the test API server calls it.
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from integration.k8s.container_output import ContainerLog

log = logging.getLogger("gpush.k8s.kubelet")

_POLL = 0.5  # seconds a follower waits at most before looking at the simulator's stop flag again


class KubeletError(Exception):
    """An answer other than the log: ``code`` and the kubelet's words."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class LogOptions:
    """The query of ``/containerLogs``, as the API server passes PodLogOptions on."""

    follow: bool = False
    previous: bool = False
    timestamps: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None
    since: float | None = None  # wall clock: sinceSeconds before now, or sinceTime

    @classmethod
    def from_query(cls, query: dict[str, list[str]]) -> LogOptions:
        def flag(name: str) -> bool:
            return (query.get(name) or [""])[-1] in ("true", "1", "True")

        def number(name: str) -> int | None:
            raw = (query.get(name) or [None])[-1]
            if raw in (None, ""):
                return None
            try:
                return int(raw)
            except ValueError:
                raise KubeletError(400, f"{name}: invalid value {raw!r}: must be an integer") from None

        since = None
        seconds = number("sinceSeconds")
        if seconds is not None:
            since = time.time() - seconds
        raw_time = (query.get("sinceTime") or [None])[-1]
        if raw_time:
            try:
                since = datetime.datetime.fromisoformat(raw_time.replace("Z", "+00:00")).timestamp()
            except ValueError:
                raise KubeletError(400, f"sinceTime: invalid value {raw_time!r}: must be RFC 3339") from None
        return cls(
            follow=flag("follow"),
            previous=flag("previous"),
            timestamps=flag("timestamps"),
            tail_lines=number("tailLines"),
            limit_bytes=number("limitBytes"),
            since=since,
        )


# (namespace, pod, container, previous) -> the container run's log, or KubeletError
FindLog = Callable[[str, str, str, bool], ContainerLog]


class KubeletServer:
    """Serves ``/containerLogs`` for every simulated node from one address (see the module docstring)."""

    def __init__(self, find: FindLog, stop: threading.Event, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.find = find
        self.stop_event = stop
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        handler = type("_Handler", (_Handler,), {"kubelet": self})
        server_class = type("_Server", (http.server.ThreadingHTTPServer,), {"address_family": family})
        self._httpd = server_class((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self._httpd.server_address[0]

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> KubeletServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="sim-kubelet", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving; open follow streams end within :data:`_POLL` seconds (the stop flag is set)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5)
            self._thread = None
        self._httpd.server_close()

    def stream(
        self,
        container_log: ContainerLog,
        options: LogOptions,
        write: Callable[[bytes], None],
        hung_up: Callable[[], bool] = lambda: False,
    ) -> None:
        """Write the log as the options select it; with ``follow``, until the container ends, the
        reader hangs up or the simulator stops."""
        budget = options.limit_bytes  # counts across the whole answer, followed lines included
        index = 0
        if options.since is not None:
            index = container_log.first_since(options.since)
        if options.tail_lines is not None:
            index = max(index, container_log.printed() - options.tail_lines)
        while True:
            printed = container_log.printed()
            chunk = b"".join(container_log.render(i, timestamps=options.timestamps) for i in range(index, printed))
            index = max(index, printed)
            if chunk:
                if budget is not None:
                    chunk = chunk[:budget]
                    budget -= len(chunk)
                write(chunk)
            if not options.follow or (budget is not None and budget <= 0):
                return
            if container_log.complete(index) or self.stop_event.is_set() or hung_up():
                return
            container_log.wait(min(container_log.due(index), time.time() + _POLL))


class _Handler(http.server.BaseHTTPRequestHandler):
    kubelet: KubeletServer
    server_version = "gpush-sim-kubelet"

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        parts = urlsplit(self.path)
        segments = [unquote(s) for s in parts.path.split("/") if s]
        if len(segments) != 4 or segments[0] != "containerLogs":
            self._error(404, "404 page not found")
            return
        _, namespace, pod, container = segments
        try:
            options = LogOptions.from_query(parse_qs(parts.query))
            container_log = self.kubelet.find(namespace, pod, container, options.previous)
        except KubeletError as exc:
            self._error(exc.code, exc.message)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()

        def write(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.kubelet.stream(container_log, options, write, self._hung_up)

    def _hung_up(self) -> bool:
        """Whether the reader closed the connection (a quiet follow would not learn it by writing)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _error(self, code: int, message: str) -> None:
        body = message.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("%s " + format, self.address_string(), *args)
