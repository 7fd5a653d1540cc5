"""What a person opening the broker in a browser gets: ``/``, a small JSON index that says
what this is and where to go, and the API's documentation pages served from the
installed packages, so that they work where no CDN can be reached (an air-gapped site).

The pages are FastAPI's own (Swagger UI at ``/docs``, ReDoc at ``/redoc``); their
scripts, styles and icon come from the ``fastapi-offline`` package, mounted at
``ASSETS_URL``. ``documented_app`` builds the app with them; ``index_document`` is what ``/``
answers to anything but a browser (broker.api.dashboard serves ``/``).
None of these is in the OpenAPI document: they describe the API, they are not part of it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi_offline import FastAPIOffline

ASSETS_URL = "/docs/assets"
DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OPENAPI_URL = "/openapi.json"
API_PREFIX = "/v1"


def documented_app(**fastapi_kwargs: Any) -> FastAPI:
    """A FastAPI app whose /docs and /redoc load their assets from this server."""
    return FastAPIOffline(
        docs_url=DOCS_URL,
        redoc_url=REDOC_URL,
        openapi_url=OPENAPI_URL,
        static_url=ASSETS_URL,
        # Swagger UI's default sends the document to an online validator for its badge:
        # nothing on these pages may call out.
        swagger_ui_parameters={"validatorUrl": None},
        **fastapi_kwargs,
    )


def index_document(request: Request) -> dict[str, Any]:
    """What this server is and where to go next (``/`` answers it to anything but a
    browser, broker.api.dashboard)."""
    app: FastAPI = request.app
    root = request.scope.get("root_path", "")
    return {
        "name": app.title,
        "version": app.version,
        "description": app.description,
        "docs": root + DOCS_URL,
        "redoc": root + REDOC_URL,
        "openapi": root + OPENAPI_URL,
        "api_prefix": root + API_PREFIX,
        "authentication": (
            f"every {API_PREFIX} path needs `Authorization: Bearer <token>` "
            "(an admin creates one with `gpush admin token create`)"
        ),
        "health": root + "/healthz",
        "ready": root + "/readyz",
        "metrics": root + "/metrics",
        "dashboard": root + "/ (in a browser)",
    }
