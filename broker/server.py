"""``gpush server``: the broker process (REST API; the scheduling loop joins it later).

Several server processes may share one PostgreSQL: the API keeps no state of its
own. On SQLite (the embedded default) the schema is upgraded at start.
"""

from __future__ import annotations

import os

import uvicorn
from fastapi import FastAPI

from broker.api import create_app
from broker.config import database_url
from broker.local import open_database


def app_from_env() -> FastAPI:
    """ASGI factory for uvicorn's worker processes; reads GPUSH_DATABASE_URL."""
    return create_app(open_database(database_url()))


def serve(url: str, *, host: str, port: int, workers: int, log_level: str) -> None:
    # Open (and on SQLite upgrade) once here, so a bad URL or an old schema fails
    # with a clear message before any worker starts.
    open_database(url).dispose()
    os.environ["GPUSH_DATABASE_URL"] = url
    uvicorn.run(
        "broker.server:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers if workers > 1 else None,
        log_level=log_level,
        access_log=log_level == "debug",
    )
