"""The ``gpush`` command line: the root group, its global options, and the entry point.

The commands live in one module per concern (broker.cli.submit, broker.cli.jobs,
broker.cli.job_actions, broker.cli.policy, broker.cli.clusters, broker.cli.fleet,
broker.cli.admin, broker.cli.service, broker.cli.simulate), each click command beside
the plain function, free of click, that does its work; they are registered here on the
one root group.

Exit codes (stable, for scripts): 0 ok, 1 any other error, 2 usage error or invalid
job, 3 not found, 4 not allowed (no token, bad token, or not permitted).
"""

from __future__ import annotations

import sys
from urllib.parse import urlsplit

import click

from broker.cli import admin, clusters, fleet, job_actions, jobs, policy, service, simulate, submit
from broker.cli.command_line import RecordingGroup
from broker.cli.settings import CONTEXT, Settings
from broker.core.errors import EXIT_ERROR, EXIT_USAGE, GpushError


def broker_url(value: str | None) -> str | None:
    """``--url`` as the client needs it: ``http(s)://HOST[:PORT][/PATH]``; a bare
    ``HOST:PORT`` means ``http://HOST:PORT``; anything else is refused, naming the form.
    Empty means unset (the local broker)."""
    text = (value or "").strip()
    if not text:
        return None
    url = text if "://" in text else f"http://{text}"
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise click.BadParameter(
            f"{text!r} is not a broker URL: write http://HOST:PORT (or https://...), such as http://127.0.0.1:8642; "
            "HOST:PORT alone means http://HOST:PORT",
            param_hint="--url / GPUSH_URL",
        )
    return url


@click.group(context_settings=CONTEXT, cls=RecordingGroup)
@click.option(
    "--url",
    envvar="GPUSH_URL",
    show_envvar=True,
    metavar="URL",
    callback=lambda _ctx, _param, value: broker_url(value),
    help="Broker to talk to: http://HOST:PORT or https://... (HOST:PORT alone means http://). "
    "Unset: the local server on the local database, started on first need.",
)
@click.option(
    "--token",
    envvar="GPUSH_TOKEN",
    show_envvar=True,
    metavar="TOKEN",
    help="API token. Unset with no --url: the local admin token from the config directory.",
)
@click.option(
    "--database-url",
    envvar="GPUSH_DATABASE_URL",
    show_envvar=True,
    metavar="URL",
    help="postgresql+psycopg://user@host/db or sqlite:///path. Default: SQLite in the user data directory.",
)
@click.version_option(package_name="gpush")
@click.pass_context
def cli(ctx: click.Context, url: str | None, token: str | None, database_url: str | None) -> None:
    """gpush: one global queue of GPU jobs above Slurm and Kubernetes.

    With no --url, the first command that needs the broker starts a local server
    with its scheduler in the background, on the embedded database (SQLite in your
    data directory) and a free port of 127.0.0.1 (GPUSH_PORT picks one); later
    commands talk to it. `gpush server status|logs|stop` look after it;
    GPUSH_LOCAL_SERVER=0 runs the broker's API inside each command instead.

    Exit codes: 0 ok, 1 other error, 2 usage error or invalid job, 3 not found,
    4 not allowed.
    """
    ctx.obj = Settings(url=url, token=token, database_url=database_url)
    ctx.call_on_close(lambda: ctx.obj._client and ctx.obj._client.close())


@click.command(context_settings=CONTEXT)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> int:
    """Print the tab-completion script for SHELL (commands, options, choices):

    \b
      bash: gpush completion bash >> ~/.bashrc
      zsh:  gpush completion zsh >> ~/.zshrc
      fish: gpush completion fish > ~/.config/fish/completions/gpush.fish
    """
    from click.shell_completion import get_completion_class

    script = get_completion_class(shell)(cli, {}, "gpush", "_GPUSH_COMPLETE").source()
    click.echo(script)
    return 0


# `gpush --help` lists commands by name, so the order here shows nowhere.
for command in (
    *submit.COMMANDS,
    *jobs.COMMANDS,
    *job_actions.COMMANDS,
    *policy.COMMANDS,
    *clusters.COMMANDS,
    *fleet.COMMANDS,
    *admin.COMMANDS,
    *service.COMMANDS,
    *simulate.COMMANDS,
):
    cli.add_command(command)
cli.add_command(completion)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI and turn every outcome into a stable exit code."""
    try:
        code = cli.main(args=argv, prog_name="gpush", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code  # usage errors: 2
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        code = EXIT_ERROR
    except GpushError as exc:
        click.echo(f"gpush: error: {exc.message}", err=True)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["cli", "main", "EXIT_USAGE"]
