"""The embedded default: open the database, upgrade SQLite, keep a local admin token.

With no ``--url``, the CLI runs the broker's API in its own process on the local
database, so a first look needs no server and no configuration. On first use it
creates an admin token and keeps it in the user's config directory, readable by
the user alone (mode 0600).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
from pathlib import Path

from sqlalchemy import Engine

from broker.client.sdk import EMBEDDED_URL, GpushClient
from broker.core import auth
from broker.core.clock import utcnow
from broker.core.config import config_dir
from broker.core.db import open_database, session_factory
from broker.core.errors import Unauthenticated
from broker.core.schemas import Role

LOCAL_TENANT = "default"


def credentials_path() -> Path:
    return config_dir() / "credentials.json"


def _database_key(engine: Engine) -> str:
    return hashlib.sha256(engine.url.render_as_string(hide_password=True).encode()).hexdigest()[:16]


def _read_credentials() -> dict[str, dict[str, str]]:
    try:
        return json.loads(credentials_path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}


def _write_credentials(data: dict[str, dict[str, str]]) -> None:
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def local_admin_token(engine: Engine) -> str:
    """The local admin token for this database, created on first use."""
    key = _database_key(engine)
    creds = _read_credentials()
    sessions = session_factory(engine)
    stored = creds.get(key, {}).get("token")
    if stored:
        with sessions() as session:
            try:
                auth.authenticate(session, stored)
                return stored
            except Unauthenticated:
                pass  # the database was reset or the token revoked: make a new one
    with sessions() as session, session.begin():
        _row, secret = auth.create_token(
            session,
            user=getpass.getuser(),
            tenant=LOCAL_TENANT,
            role=Role.ADMIN,
            description="local admin, created on first start of the embedded broker",
            now=utcnow(),
        )
    creds[key] = {"token": secret, "database": engine.url.render_as_string(hide_password=True)}
    _write_credentials(creds)
    return secret


def embedded_client(database_url: str | None = None, token: str | None = None) -> GpushClient:
    """A client SDK whose requests go to the broker's API in this process, on the local
    database (``database_url``, or the configured or default one), as the local admin
    unless ``token`` names someone else: the embedded default, with no server to start."""
    import httpx
    from a2wsgi import ASGIMiddleware

    from broker.api.app import create_app
    from broker.core.config import database_url as resolve_url

    engine = open_database(resolve_url(database_url))
    app = create_app(engine)
    token = token or local_admin_token(engine)
    return GpushClient(EMBEDDED_URL, token, transport=httpx.WSGITransport(app=ASGIMiddleware(app)))
