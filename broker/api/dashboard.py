"""The web dashboard's routes: ``/`` (the page for a browser, the JSON index of
broker.api.docs for anything else) and ``/ui/{asset}``, its script, style and icon.

The page is static (broker/web/assets, shipped in the package: no CDN, no build step)
and reads everything through the same REST API as the CLI, with the token the user
gave it kept in the browser tab's sessionStorage and sent as ``Authorization: Bearer``
on each request. No cookie carries it, so a request another site makes the browser
send has no credentials: nothing to forge. The page is served with a Content Security
Policy that lets it run only its own script and talk only to this server, so a job
name that holds markup cannot run (the script also writes every value as text).
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from broker.api import docs
from broker.core.errors import NotFound

router = APIRouter(include_in_schema=False)

UI_PREFIX = "/ui"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def _load_assets() -> dict[str, tuple[bytes, str, str]]:
    """name -> (bytes, media type, ETag), read once from the package."""
    out = {}
    for entry in resources.files("broker.web").joinpath("assets").iterdir():
        suffix = entry.name[entry.name.rfind(".") :]
        if entry.is_file() and suffix in _TYPES:
            data = entry.read_bytes()
            out[entry.name] = (data, _TYPES[suffix], '"' + hashlib.sha256(data).hexdigest()[:20] + '"')
    return out


ASSETS = _load_assets()


def _asset(request: Request, name: str) -> Response:
    try:
        data, media_type, etag = ASSETS[name]
    except KeyError:
        raise NotFound(f"the dashboard has no file {name!r}") from None
    headers = {**SECURITY_HEADERS, "ETag": etag, "Cache-Control": "no-cache"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(data, media_type=media_type, headers=headers)


def _wants_html(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "text/html" in accept[:1024]


@router.api_route("/", methods=["GET", "HEAD"])
def index(request: Request) -> Any:
    """The dashboard for a browser; for anything else (curl, clients), what this server
    is and where to go next (no token needed for either)."""
    response = _asset(request, "index.html") if _wants_html(request) else JSONResponse(docs.index_document(request))
    response.headers["Vary"] = "Accept"  # one address, two answers: caches must keep them apart
    return response


@router.get(UI_PREFIX + "/{name}")
def asset(name: str, request: Request) -> Response:
    return _asset(request, name)
