"""What every ``gpush`` command shares: the global options as :class:`Settings` (the
client they make), click's context settings, and the ``--json`` option.

The root group (broker.cli.main) builds the Settings from ``--url``, ``--token`` and
``--database-url``; the command modules take them with ``click.pass_obj``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click

from broker.cli.console import FORMATS, Output
from broker.client import local
from broker.core.config import database_url

if TYPE_CHECKING:
    from broker.client.sdk import GpushClient

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@dataclass
class Settings:
    url: str | None
    token: str | None
    database_url: str | None
    _client: GpushClient | None = field(default=None, repr=False)

    def client(self) -> GpushClient:
        """The broker this command talks to: ``--url``; else, on the embedded database, its
        local server (started now if it is not running: broker.client.local); else (another
        database, or GPUSH_LOCAL_SERVER=0) the API in this process."""
        from broker.client.sdk import GpushClient

        if self._client is None:
            if self.url:
                self._client = GpushClient(self.url, self.token)
            else:
                url = self.resolved_database_url()
                if url.startswith("sqlite") and local.enabled():
                    server = local.ensure(url, announce=lambda text: click.echo(f"gpush: {text}", err=True))
                    self._client = GpushClient(server.url, self.token or server.token)
                else:
                    from broker.client.embedded import embedded_client

                    self._client = embedded_client(self.database_url, self.token)
        return self._client

    def resolved_database_url(self) -> str:
        return database_url(self.database_url)


def json_option(f):
    return click.option("--json", "json_mode", is_flag=True, help="Print only JSON, for scripts.")(f)


def format_option(f):
    """``-o table|wide|json|yaml|name`` (as kubectl's), and ``--json`` for ``-o json``."""
    f = json_option(f)
    return click.option(
        "-o",
        "--output",
        "fmt",
        type=click.Choice(FORMATS),
        default="table",
        show_default=True,
        help="table fits the terminal; wide shows every column; json and yaml for scripts; name prints ids.",
    )(f)


def output(json_mode: bool = False, fmt: str = "table") -> Output:
    return Output(json_mode=json_mode, fmt=fmt)
