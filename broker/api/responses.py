"""How the broker's REST API answers: job rows rendered by orjson, and the error
envelope ``{"error": {"code", "message", "details"}}`` with the status of the
error's type, for gpush's own errors, for requests FastAPI refuses (validation,
unknown paths, methods a path does not have) and for OPTIONS.

It also owns the envelope's schema (``ErrorBody``) and ``errors(...)``, which routes
use to declare the 4xx answers they can give in the OpenAPI document.
"""

import math
import re
import reprlib
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Mount, Route, compile_path

from broker.core.db import storage_full
from broker.core.errors import GpushError, InvalidRequest, NotFound, Unavailable
from broker.core.validation import describe_details, validation_details


class JSONBytes(JSONResponse):
    """A JSON response rendered by orjson from plain dicts (job rows), without
    re-validating them against the response model: the hot path of submit and list.
    A JSONResponse, so the OpenAPI document shows the route's response model."""

    def render(self, content: Any) -> bytes:
        if isinstance(content, bytes):
            return content
        return orjson.dumps(content, option=orjson.OPT_UTC_Z)


# -- the envelope's schema, for the OpenAPI document ----------------------------------


class ErrorDetail(BaseModel):
    field: str = Field(description="the dotted path of the value, such as jobs.3.gpus")
    value: Any = Field(None, description="what was sent there (shortened when long)")
    message: str


class ErrorInfo(BaseModel):
    code: str = Field(description="invalid, not_found, unauthenticated, not_allowed, conflict, too_large, ...")
    message: str = Field(description="what was wrong and what to do")
    details: list[ErrorDetail]


class ErrorBody(BaseModel):
    error: ErrorInfo


_WHY = {
    400: "the body is not JSON (not UTF-8, cut short or nested too deeply)",
    401: "no API token, or one that is unknown, revoked or too long",
    403: "the token's role may not do this",
    404: "no such resource (or one in another tenant)",
    409: "the request contradicts what is stored",
    413: "the body is over GPUSH_MAX_BODY_BYTES",
    415: "the body is not application/json",
    422: "a value is not valid",
    431: "the headers are over GPUSH_MAX_HEADER_BYTES",
    503: "the database does not answer",
    507: "the database's disk is full: nothing was written (free space, then send it again)",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that can answer with these statuses, each in the
    error envelope; 401 and 431 go with every route that takes a token."""
    return {status: {"model": ErrorBody, "description": _WHY[status]} for status in sorted(statuses)}


# With a token; with a JSON body too.
AUTH = (401, 422, 431)
BODY = (400, 413, 415, 422)


# -- echoing what was sent, safely ----------------------------------------------------

_echo = reprlib.Repr()
_echo.maxstring = _echo.maxother = 120
_echo.maxlevel = 3
MAX_ECHO_CHARS = 200


def safe_echo(value: Any) -> Any:
    """``value`` as JSON can always carry it: plain numbers, short strings, booleans and
    None as they are; NaN and the infinities, bytes, long strings, lone surrogates and
    anything nested as a short repr (bounded in depth and length)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else _echo.repr(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str) and len(value) <= MAX_ECHO_CHARS:
        return _clean(value)
    return _clean(_echo.repr(value))


def _clean(text: str) -> str:
    # A lone surrogate cannot be encoded as UTF-8: it would fail the whole answer.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _safe_error(exc: GpushError) -> dict[str, Any]:
    message = _clean(exc.message)
    details = []
    for d in exc.details:
        # Every detail has the envelope's three keys, whoever raised the error; a
        # detail without its own message is explained by the error's.
        detail = {
            key: safe_echo(v) if key == "value" else v if isinstance(v, bool | int) else _clean(str(v))
            for key, v in d.items()
        }
        detail.setdefault("field", "")
        detail.setdefault("value", None)
        detail.setdefault("message", message)
        details.append(detail)
    return {"code": exc.code, "message": message, "details": details}


def error_response(
    exc: GpushError, headers: dict[str, str] | None = None, *, status: int | None = None
) -> JSONResponse:
    """``exc`` in the envelope, with its own status unless ``status`` says otherwise."""
    headers = dict(headers or {})
    if exc.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": _safe_error(exc)}, status_code=status or exc.http_status, headers=headers or None)


async def gpush_error(_request: Request, exc: GpushError) -> JSONResponse:
    return error_response(exc)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The route's body model, so an unknown field is named against its own fields
    # (a node report's, a token's), not a job's.
    body_field = getattr(request.scope.get("route"), "body_field", None)
    body = getattr(getattr(body_field, "field_info", None), "annotation", None)
    body = body if isinstance(body, type) and issubclass(body, BaseModel) else None
    details = validation_details(list(exc.errors()), skip=1, body=body)
    for detail in details:
        detail["value"] = safe_echo(detail["value"])
        detail["message"] = _clean(str(detail["message"]))[:1000]
    return error_response(InvalidRequest(describe_details(details), details=details))


# -- what Starlette refuses: unknown paths, other methods, unreadable bodies ------------


class _HttpError(GpushError):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.http_status = status
        self.code = code


def route_methods(routes: list[BaseRoute]) -> list[tuple[re.Pattern[str], set[str]]]:
    """Each route's path pattern and methods, read once when the app is built, for the
    Allow header (several routes share a path: GET and POST /v1/jobs). A mount (the
    docs' assets) serves files: GET. Anything else (an included router) is skipped:
    pass its routes."""
    table = []
    for route in routes:
        if isinstance(route, APIRoute | Route) and route.methods:
            table.append((compile_path(route.path)[0], set(route.methods)))
        elif isinstance(route, Mount):
            table.append((compile_path(route.path + "/{path:path}")[0], {"GET"}))
    return table


def allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    for pattern, route_methods in request.app.state.route_methods:
        if pattern.match(request.url.path):
            methods |= route_methods
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods | {"OPTIONS"}) if methods else []


async def http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 405:
        allow = allowed_methods(request)
        headers = {"Allow": ", ".join(allow)}
        if request.method == "OPTIONS":
            return Response(status_code=204, headers=headers)
        message = f"{request.method} is not a method of {request.url.path}: use {', '.join(allow)}"
        return error_response(_HttpError(405, "method_not_allowed", message), headers)
    if exc.status_code == 404:
        return error_response(NotFound(f"no such path {request.url.path!r}: /docs lists the API's paths"))
    if exc.status_code == 400:
        # FastAPI's answer to a body its JSON parser gave up on.
        message = "the body could not be read as JSON (not UTF-8, cut short or nested too deeply): send a JSON document"
        return error_response(_HttpError(400, "invalid", message))
    return error_response(_HttpError(exc.status_code, "error", _clean(str(exc.detail))), exc.headers)


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """The database dropped the connection or does not answer (a restart, a failover):
    503 with Retry-After, which clients and the SDK retry, instead of a 500. SQLAlchemy
    has already reset the pool, so the next request gets a fresh connection.

    A write the database refused because its disk is full is 507 instead, without
    Retry-After: a moment later it fails again, until someone frees space, so the SDK
    must not retry it and the message must say what to do. /readyz remembers it
    (broker.api.health.DiskFullMemory), so a load balancer stops sending writes here."""
    full = storage_full(exc, request.app.state.engine)
    if full is not None:
        request.app.state.disk_full.remember(full)
        return error_response(full)
    error = Unavailable(
        "the broker's database does not answer right now (restarting or failing over?): try again in a moment"
    )
    return error_response(error, headers={"Retry-After": "1"})
