"""The limits the broker's HTTP edge puts on what a client sends and what one answer
holds, and the ASGI middleware that holds requests to them before any route runs.

``HttpLimits`` names each limit with its default; ``GPUSH_*`` environment variables
override them (``HttpLimits.from_env``), as broker.core.config reads its settings, and
the README's REST API section lists them. ``EdgeLimits`` refuses, in the error
envelope: headers over ``max_header_bytes`` (431), a body whose Content-Length is over
``max_body_bytes`` or that grows past it while it is read, chunked or not (413), and a
body that is not JSON (415). The page limits are applied by the list routes
(broker.api.jobs), since only they know where a page may end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The longest Authorization header a gpush token can arrive in: "Bearer " and
# "gpush_" + 43 characters, with room for other schemes' tokens (the metrics scrape
# token) and stray spaces. Checked before any hashing or lookup.
MAX_AUTHORIZATION_CHARS = 512

# Label filters in one GET /v1/jobs or /v1/jobs:count (``label=KEY=VALUE``, repeated):
# each is one more condition of the query, and 900 went past SQLite's expression depth,
# a 503 that no retry could cure. Ray's node provider selects by 2; a job has at most
# GPUSH_MAX_LABELS (128) labels. Not a setting: the database's depth is the bound.
MAX_LABEL_FILTERS = 32


@dataclass(frozen=True)
class HttpLimits:
    """What one request may send and one answer may hold. Each field is read from the
    environment variable ``GPUSH_`` + its upper-cased name."""

    # A batch of 10,000 small jobs (the most JobBatch takes by default) is about 2 MB of JSON.
    max_body_bytes: int = 32 * 1024 * 1024
    # All request headers together: uvicorn's own default for h11 is 16 KiB too.
    max_header_bytes: int = 16 * 1024
    # Jobs in one page of GET /v1/jobs, whatever ``limit`` asks (at most 1000).
    max_page: int = 1000
    # Bytes of one page of GET /v1/jobs: a page of large jobs ends early, with a cursor.
    max_page_bytes: int = 8 * 1024 * 1024
    # Seconds a client has to send a request's head, from its connection or its head's
    # first byte (broker.api.server.HeaderDeadline); nginx allows 60, Apache 20-40.
    header_timeout_seconds: int = 10

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HttpLimits:
        environ = os.environ if environ is None else environ
        values = {}
        for field in fields(cls):
            name = f"GPUSH_{field.name.upper()}"
            raw = environ.get(name)
            if not raw:
                continue
            try:
                value = int(raw)
            except ValueError:
                value = 0
            if value < 1:
                raise ValueError(f"{name}={raw!r} is not a positive whole number: set it to one, or unset it")
            values[field.name] = value
        return cls(**values)


JSON_TYPES = ("application/json",)
BODY_METHODS = {"POST", "PUT", "PATCH"}


class _BodyTooLarge(Exception):
    pass


def _refusal(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "details": []}}, status_code=status)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


class EdgeLimits:
    """Pure ASGI middleware, so a refused request costs no routing, parsing or
    database work, and a streamed body is cut off where it passes the limit rather
    than buffered whole first."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        size = sum(len(name) + len(value) for name, value in headers)
        if size > limits.max_header_bytes:
            refusal = _refusal(
                431,
                "headers_too_large",
                f"the request's headers are {size} bytes; this broker takes at most {limits.max_header_bytes} "
                "(GPUSH_MAX_HEADER_BYTES): send fewer or shorter headers",
            )
            await refusal(scope, receive, send)
            return
        found = {name.lower(): value for name, value in headers if name.lower() in (b"content-length", b"content-type")}
        length = found.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _refusal(400, "invalid", "the Content-Length header is not a number of bytes")(
                    scope, receive, send
                )
                return
            if int(length) > limits.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
        content_type = found.get(b"content-type")
        has_body = length is None or int(length) > 0
        if scope["method"] in BODY_METHODS and has_body and content_type is not None:
            text = content_type.decode("latin-1")
            if not _is_json(text):
                refusal = _refusal(
                    415,
                    "unsupported_media_type",
                    f"the body is {text[:100]!r}; this API takes application/json: send JSON with "
                    "Content-Type: application/json",
                )
                await refusal(scope, receive, send)
                return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        overflowed = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, overflowed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    overflowed = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            # FastAPI turns any error while it reads the body into its own 400; the
            # answer to a body past the limit is 413, whoever noticed it first.
            if overflowed:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            if started:
                raise
        if overflowed and not started:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limits.max_body_bytes
        refusal = _refusal(
            413,
            "too_large",
            f"the request body is over {limit} bytes, the most this broker takes (GPUSH_MAX_BODY_BYTES): "
            "send less, such as a batch of fewer jobs",
        )
        await refusal(scope, receive, send)
