"""Where gpush keeps its data and how it finds its database.

The embedded default needs no configuration: SQLite in the user's data directory
(platformdirs), the local admin credentials in the user's config directory. Every
setting can be overridden by a ``GPUSH_*`` environment variable or a CLI option.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import platformdirs

from broker.core.errors import GpushError

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


def positive_int_settings(variables: Mapping[str, str]) -> dict[str, int]:
    """The settings of ``variables`` (name -> environment variable) that are set, as
    whole numbers above zero, by name; unset ones are left out (their default holds).

    A value that is not such a number is an error naming the variable, rather than a
    limit quietly left at its default.
    """
    settings = {}
    for name, variable in variables.items():
        text = os.environ.get(variable, "").strip()
        if not text:
            continue
        if not (text.isascii() and text.isdigit() and int(text) > 0):
            raise GpushError(f"{variable}={text!r} is not a whole number above 0: set it to one, or unset it")
        settings[name] = int(text)
    return settings
