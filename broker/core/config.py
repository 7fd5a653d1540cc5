"""Where gpush keeps its data and how it finds its database.

The embedded default needs no configuration: SQLite in the user's data directory
(platformdirs), the local admin credentials in the user's config directory. Every
setting can be overridden by a ``GPUSH_*`` environment variable or a CLI option.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "gpush"
DEFAULT_PORT = 8642


def data_dir() -> Path:
    return Path(os.environ.get("GPUSH_DATA_DIR") or platformdirs.user_data_dir(APP_NAME))


def config_dir() -> Path:
    return Path(os.environ.get("GPUSH_CONFIG_DIR") or platformdirs.user_config_dir(APP_NAME))


def default_database_url() -> str:
    return f"sqlite:///{data_dir() / 'gpush.db'}"


def normalize_database_url(url: str) -> str:
    """Accept the URLs people paste (``postgres://``, ``postgresql://``) and pick psycopg 3.

    SQLAlchemy's bare ``postgresql://`` means psycopg2, which gpush does not install.
    """
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def database_url(explicit: str | None = None) -> str:
    return normalize_database_url(explicit or os.environ.get("GPUSH_DATABASE_URL") or default_database_url())
