"""``gpush`` commands that run gpush's processes: the broker (server), the scheduling loop
(scheduler run), the node agent (agent), and the database schema they share (db)."""

from __future__ import annotations

import click

from broker.cli import commands
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.config import DEFAULT_PORT


@click.group(context_settings=CONTEXT, invoke_without_command=True)
@click.option("--host", envvar="GPUSH_HOST", show_envvar=True, default="127.0.0.1", show_default=True)
@click.option("--port", envvar="GPUSH_PORT", show_envvar=True, type=int, default=DEFAULT_PORT, show_default=True)
@click.option(
    "--workers",
    envvar="GPUSH_WORKERS",
    show_envvar=True,
    type=click.IntRange(1, 64),
    help="API worker processes. Default: 1 on SQLite (one writer); on PostgreSQL, the CPUs + 1, at most 8.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
@click.option(
    "--scheduler/--no-scheduler",
    default=True,
    show_default=True,
    help="Run the scheduling loop (one elected process schedules; API-only replicas may turn it off).",
)
@click.option("--cycle-interval", type=float, default=1.0, show_default=True, help="Seconds between cycles.")
@click.pass_context
def server(
    ctx: click.Context,
    host: str,
    port: int,
    workers: int | None,
    log_level: str,
    scheduler: bool,
    cycle_interval: float,
) -> int:
    """Run the broker: the REST API on HOST:PORT over the configured database, and its
    scheduler, in the foreground.

    With no --url on the embedded database, gpush commands start a local server in the
    background on first need; `gpush server status|logs|stop` look after that one.
    """
    if ctx.invoked_subcommand is not None:
        return 0
    import os

    settings: Settings = ctx.obj

    from broker.api.server import serve

    url = settings.resolved_database_url()
    if workers is None:
        workers = 1 if url.startswith("sqlite") else min((os.cpu_count() or 1) + 1, 8)
    if url.startswith("sqlite"):
        from broker.client.embedded import credentials_path, local_admin_token, open_database

        local_admin_token(open_database(url))
        click.echo(f"gpush: embedded database {url}; local admin token in {credentials_path()}", err=True)
    serve(url, host=host, port=port, workers=workers, log_level=log_level, scheduler=scheduler, interval=cycle_interval)
    return 0


@server.command("status", context_settings=CONTEXT)
@json_option
@click.pass_obj
def server_status(settings: Settings, json_mode: bool) -> int:
    """Whether the local server of the embedded database runs: pid, URL, log, uptime."""
    return commands.local_server_status(settings.resolved_database_url(), output(json_mode))


@server.command("start", context_settings=CONTEXT)
@json_option
@click.pass_obj
def server_start(settings: Settings, json_mode: bool) -> int:
    """Start the local server in the background now (commands also start it on first need)."""
    return commands.local_server_start(settings.resolved_database_url(), output(json_mode))


@server.command("stop", context_settings=CONTEXT)
@json_option
@click.pass_obj
def server_stop(settings: Settings, json_mode: bool) -> int:
    """Stop the local server (queued jobs stay queued; the next command starts it again)."""
    return commands.local_server_stop(settings.resolved_database_url(), output(json_mode))


@server.command("logs", context_settings=CONTEXT)
@click.option("-n", "--tail", "lines", type=click.IntRange(0), default=50, show_default=True, help="Last N lines.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the server logs until Ctrl-C.")
@click.pass_obj
def server_logs(settings: Settings, lines: int, follow: bool) -> int:
    """The local server's log: requests, placements, warnings."""
    return commands.local_server_logs(settings.resolved_database_url(), output(), lines=lines, follow=follow)


@click.group("scheduler", context_settings=CONTEXT)
def scheduler_group() -> None:
    """The scheduling loop, in the foreground (`gpush server` runs it too)."""


@scheduler_group.command("run", context_settings=CONTEXT)
@click.option("--cycles", type=click.IntRange(1), help="Stop after this many cycles (default: run until Ctrl-C).")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between cycles.")
@click.option(
    "--metrics-port",
    envvar="GPUSH_METRICS_PORT",
    show_envvar=True,
    type=click.IntRange(1, 65535),
    help="Serve /metrics (Prometheus) on this port of 127.0.0.1 (no token: keep it local).",
)
@json_option
@click.pass_obj
def scheduler_run(
    settings: Settings, cycles: int | None, interval: float, metrics_port: int | None, json_mode: bool
) -> int:
    """Elect this process the scheduler and run cycles on the database of --database-url."""
    return commands.scheduler_run(
        settings.resolved_database_url(), output(json_mode), cycles=cycles, interval=interval, metrics_port=metrics_port
    )


@click.group(context_settings=CONTEXT)
def db() -> None:
    """Database schema: upgrade it, show its version."""


@db.command("upgrade", context_settings=CONTEXT)
@json_option
@click.pass_obj
def db_upgrade(settings: Settings, json_mode: bool) -> int:
    """Apply every migration up to the head revision (safe to re-run)."""
    return commands.db_upgrade(settings.resolved_database_url(), output(json_mode))


@db.command("current", context_settings=CONTEXT)
@json_option
@click.pass_obj
def db_current(settings: Settings, json_mode: bool) -> int:
    """Show the schema revision of the database and whether it is at head."""
    return commands.db_current(settings.resolved_database_url(), output(json_mode))


@click.command(context_settings=CONTEXT)
@click.option(
    "--node",
    envvar="GPUSH_NODE",
    show_envvar=True,
    help="This node's name as the clusters know it (default: the short hostname).",
)
@click.option(
    "--interval",
    envvar="GPUSH_AGENT_INTERVAL",
    show_envvar=True,
    type=click.FloatRange(1),
    default=30.0,
    show_default=True,
    help="Seconds between reports.",
)
@click.option("--once", is_flag=True, help="Report once and exit (exit 1 if the broker did not take it).")
@click.option(
    "--recording",
    type=click.Path(exists=True, dir_okay=False),
    help="Replay a recorded NVML (tests/data/nvml/*.json) instead of reading this machine's GPUs.",
)
@click.option(
    "--allow-mig-changes",
    is_flag=True,
    help="Make the MIG layouts the broker asks for (gpush mig apply): destroy and create instances, never busy "
    "ones. Needs the node's real GPUs (not --recording).",
)
@click.pass_obj
def agent(
    settings: Settings, node: str | None, interval: float, once: bool, recording: str | None, allow_mig_changes: bool
) -> int:
    """Report this node's GPUs (NVML) to the broker every --interval seconds, with an agent token.

    An admin makes the token: `gpush admin token create --role agent --user <node>
    --tenant agents --nodes <node>`; give it as GPUSH_TOKEN, and the broker as GPUSH_URL."""
    return commands.agent(
        settings,
        output(),
        node=node,
        interval=interval,
        once=once,
        recording=recording,
        allow_mig_changes=allow_mig_changes,
    )


@click.command(context_settings=CONTEXT)
@click.option("--open", "open_browser", is_flag=True, help="Open it in the default web browser too.")
@json_option
@click.pass_obj
def dashboard(settings: Settings, open_browser: bool, json_mode: bool) -> int:
    """Print the web dashboard's address and a sign-in link for the token in use.

    The link carries the token after `#`, which the browser never sends to a server;
    the page keeps it in that tab only. Share the address, not the link. On the
    embedded database this starts the local server if it is not running.
    """
    return commands.dashboard(settings.client(), output(json_mode), open_browser=open_browser)


# Registered on the root group by broker.cli.main.
COMMANDS = (server, scheduler_group, db, agent, dashboard)
