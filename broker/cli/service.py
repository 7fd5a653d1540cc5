"""``gpush`` commands that run gpush's processes: the broker (server, and the local
server commands start on the embedded database), the scheduling loop (scheduler run),
the node agent (agent), the database schema they share (db), and the address of the web
dashboard (dashboard)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from broker.cli.console import Output
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.config import DEFAULT_PORT
from broker.core.errors import EXIT_ERROR, EXIT_OK, InvalidRequest, NotFound

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


@click.group(context_settings=CONTEXT, invoke_without_command=True)
@click.option(
    "--host",
    envvar="GPUSH_HOST",
    show_envvar=True,
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. /metrics shows tenant names and per-tenant figures: beyond loopback "
    "(0.0.0.0, a public address) the server refuses to start unless GPUSH_METRICS_TOKEN is set.",
)
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

    from broker.api.server import check_metrics_exposure, serve

    check_metrics_exposure(host)  # before the database is opened or created

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
def server_status_command(settings: Settings, json_mode: bool) -> int:
    """Whether the local server of the embedded database runs: pid, URL, log, uptime."""
    return local_server_status(settings.resolved_database_url(), output(json_mode))


def local_server_status(database: str, out: Output) -> int:
    """The local server of ``database``: running (pid, URL, log, uptime) or not (exit 1)."""
    from broker.client import local

    server = local.find(database)
    if out.json_mode:
        out.json({"running": server is not None, **(server.public() if server else {"database": database})})
    elif server is None:
        out.line(f"no local server for {database}: the next gpush command starts one (or: gpush server start)")
    else:
        shown = server.public()
        out.line(f"running: pid {server.pid} at {server.url}, up {_duration(shown['uptime_seconds'])}")
        out.line(f"database: {server.database}")
        out.line(f"log:      {server.log}  (gpush server logs -f)")
    return EXIT_OK if server is not None else EXIT_ERROR


@server.command("start", context_settings=CONTEXT)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    envvar="GPUSH_PORT",
    show_envvar=True,
    help="Port of 127.0.0.1 to listen on. Unset: a free one. Commands that start the server on first need "
    "take GPUSH_PORT too.",
)
@json_option
@click.pass_obj
def server_start_command(settings: Settings, port: int | None, json_mode: bool) -> int:
    """Start the local server in the background now (commands also start it on first need)."""
    return local_server_start(settings.resolved_database_url(), output(json_mode), port=port)


def local_server_start(database: str, out: Output, *, port: int | None = None) -> int:
    from broker.client import local

    running = local.find(database)
    if running is not None and port is not None and not running.url.endswith(f":{port}"):
        raise InvalidRequest(
            f"the local server already runs at {running.url}, not on port {port}: "
            "gpush server stop, then gpush server start --port again"
        )
    server = running or local.ensure(database, port=port)
    if out.json_mode:
        out.json({"started": running is None, **server.public()})
    else:
        verb = "already running" if running else "started"
        out.line(f"{verb}: pid {server.pid} at {server.url}, log {server.log}")
    return EXIT_OK


@server.command("stop", context_settings=CONTEXT)
@json_option
@click.pass_obj
def server_stop_command(settings: Settings, json_mode: bool) -> int:
    """Stop the local server (queued jobs stay queued; the next command starts it again)."""
    return local_server_stop(settings.resolved_database_url(), output(json_mode))


def local_server_stop(database: str, out: Output) -> int:
    from broker.client import local

    server = local.stop(database)
    if out.json_mode:
        out.json({"stopped": server is not None, "database": database, "pid": server.pid if server else None})
    elif server is None:
        out.line(f"no local server was running for {database}")
    else:
        out.line(f"stopped the local server (pid {server.pid}); queued jobs wait until the next command starts it")
    return EXIT_OK


@server.command("logs", context_settings=CONTEXT)
@click.option("-n", "--tail", "lines", type=click.IntRange(0), default=50, show_default=True, help="Last N lines.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the server logs until Ctrl-C.")
@click.pass_obj
def server_logs_command(settings: Settings, lines: int, follow: bool) -> int:
    """The local server's log: requests, placements, warnings."""
    return local_server_logs(settings.resolved_database_url(), output(), lines=lines, follow=follow)


def local_server_logs(database: str, out: Output, *, lines: int, follow: bool) -> int:
    import time

    from broker.client import local

    path = local.log_path(database)
    if not path.exists():
        raise NotFound(f"no local server log yet ({path}): the first gpush command that needs the broker starts one")
    out.raw(local.tail(path, lines))
    if follow:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            while True:  # until Ctrl-C
                chunk = fh.read(1 << 16)
                if chunk:
                    out.raw(chunk.decode(errors="replace"))
                else:
                    time.sleep(0.3)
    return EXIT_OK


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


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
def scheduler_run_command(
    settings: Settings, cycles: int | None, interval: float, metrics_port: int | None, json_mode: bool
) -> int:
    """Elect this process the scheduler and run cycles on the database of --database-url."""
    return scheduler_run(
        settings.resolved_database_url(), output(json_mode), cycles=cycles, interval=interval, metrics_port=metrics_port
    )


def scheduler_run(
    database_url: str, out: Output, *, cycles: int | None, interval: float, metrics_port: int | None = None
) -> int:
    """Run cycles in this process while it leads; report each cycle that did something."""
    import time

    from broker.client.embedded import open_database
    from broker.core.clock import utcnow
    from broker.core.clusters import AdapterPool
    from broker.core.errors import Conflict
    from broker.scheduling.cycle import Scheduler
    from broker.scheduling.leader import Leadership

    engine = open_database(database_url)
    leadership = Leadership(engine)
    if not leadership.try_acquire():
        raise Conflict("another broker process is the scheduler now: this one would only wait (stop it, or let it be)")
    scheduler = Scheduler(engine, AdapterPool(utcnow), clock=utcnow)
    if metrics_port is not None:
        from broker.api.metrics import serve

        serve(engine, metrics_port)
        out.note(f"metrics on http://127.0.0.1:{metrics_port}/metrics")
    done = 0
    try:
        while cycles is None or done < cycles:
            if done:
                time.sleep(interval)
            if not leadership.still_held():
                raise Conflict("lost scheduler leadership (the database connection broke)")
            report = scheduler.run_cycle()
            done += 1
            if out.json_mode:
                out.json({"cycle": done, **report.__dict__})
            elif any((report.placed, report.held, report.synced, report.recovered, report.failed, report.errors)):
                out.line(
                    f"cycle {done}: placed {report.placed}, held {report.held}, waiting {report.waiting}, "
                    f"status changes {report.synced}, recovered {report.recovered}, failed {report.failed}"
                )
                for error in report.errors:
                    out.note(f"[yellow]warning:[/] {error}")
    finally:
        leadership.release()
    return EXIT_OK


@click.group(context_settings=CONTEXT)
def db() -> None:
    """Database schema: upgrade it, show its version."""


@db.command("upgrade", context_settings=CONTEXT)
@json_option
@click.pass_obj
def db_upgrade_command(settings: Settings, json_mode: bool) -> int:
    """Apply every migration up to the head revision (safe to re-run)."""
    return db_upgrade(settings.resolved_database_url(), output(json_mode))


def db_upgrade(database_url: str, out: Output) -> int:
    from broker.core.db import current_revision, head_revision, make_engine, upgrade

    engine = make_engine(database_url)
    before = current_revision(engine)
    upgrade(engine)
    after = current_revision(engine)
    shown = engine.url.render_as_string(hide_password=True)
    if out.json_mode:
        out.json({"database": shown, "from": before, "to": after, "head": head_revision()})
    elif before == after:
        out.line(f"{shown}: already at {after} (head)")
    else:
        out.line(f"{shown}: upgraded from {before or 'empty'} to {after}")
    return EXIT_OK


@db.command("current", context_settings=CONTEXT)
@json_option
@click.pass_obj
def db_current_command(settings: Settings, json_mode: bool) -> int:
    """Show the schema revision of the database and whether it is at head."""
    return db_current(settings.resolved_database_url(), output(json_mode))


def db_current(database_url: str, out: Output) -> int:
    from sqlalchemy.engine import make_url

    from broker.core.db import current_revision, head_revision, make_engine

    parsed = make_url(database_url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not Path(parsed.database).exists():
        # Reading the version of a database that does not exist must not create it.
        current, head, shown = None, head_revision(), database_url
        if out.json_mode:
            out.json({"database": shown, "current": None, "head": head, "up_to_date": False})
        else:
            out.line(f"{shown}: does not exist yet; the first gpush command creates it")
        return EXIT_OK
    engine = make_engine(database_url)
    current, head = current_revision(engine), head_revision()
    shown = engine.url.render_as_string(hide_password=True)
    if out.json_mode:
        out.json({"database": shown, "current": current, "head": head, "up_to_date": current == head})
    else:
        state = "up to date" if current == head else "behind: run `gpush db upgrade`"
        out.line(f"{shown}: at {current or 'empty'}, head is {head} ({state})")
    return EXIT_OK


@click.command("agent", context_settings=CONTEXT)
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
def agent_command(
    settings: Settings, node: str | None, interval: float, once: bool, recording: str | None, allow_mig_changes: bool
) -> int:
    """Report this node's GPUs (NVML) to the broker every --interval seconds, with an agent token.

    An admin makes the token: `gpush admin token create --role agent --user <node>
    --tenant agents --nodes <node>`; give it as GPUSH_TOKEN, and the broker as GPUSH_URL."""
    return agent(
        settings,
        output(),
        node=node,
        interval=interval,
        once=once,
        recording=recording,
        allow_mig_changes=allow_mig_changes,
    )


def agent(
    settings: Any,
    out: Output,
    *,
    node: str | None,
    interval: float,
    once: bool,
    recording: str | None,
    allow_mig_changes: bool = False,
) -> int:
    """``gpush agent``: report this node's GPUs to the broker until stopped (or once).

    With ``--url`` it posts to that broker with ``--token`` (an agent token); without, into
    the embedded broker's database (a one-machine setup, the demo, tests)."""
    import socket

    from broker.nodeagent.agent import run_agent
    from broker.nodeagent.nvml import RecordedLibrary

    node = node or socket.gethostname().split(".")[0]
    if recording and allow_mig_changes:
        raise InvalidRequest(
            "--allow-mig-changes needs real GPUs: a recording replays what NVML said and cannot change them; "
            "leave out --allow-mig-changes to replay it, or run the agent on the node without --recording"
        )
    library = RecordedLibrary(Path(recording)) if recording else None
    if settings.url:
        if not settings.token:
            raise InvalidRequest(
                "gpush agent needs a token to report to the broker: an admin creates one with "
                "`gpush admin token create --role agent --user <node> --tenant agents --nodes <node>`; "
                "set it as GPUSH_TOKEN"
            )
        delivered = run_agent(
            settings.url, settings.token, node, interval, library, once, allow_mig_changes=allow_mig_changes
        )
    else:
        client = settings.client()
        delivered = run_agent(
            client.url,
            client.token,
            node,
            interval,
            library,
            once,
            client=client.http,
            allow_mig_changes=allow_mig_changes,
        )
    if once:
        if not delivered:
            out.note(f"node {node}: the broker did not take the report (see the messages above)")
            return EXIT_ERROR
        out.note(f"node {node}: report taken by the broker")
    return EXIT_OK


@click.command("dashboard", context_settings=CONTEXT)
@click.option("--open", "open_browser", is_flag=True, help="Open it in the default web browser too.")
@json_option
@click.pass_obj
def dashboard_command(settings: Settings, open_browser: bool, json_mode: bool) -> int:
    """Print the web dashboard's address and a sign-in link for the token in use.

    The link carries the token after `#`, which the browser never sends to a server;
    the page keeps it in that tab only. Share the address, not the link. On the
    embedded database this starts the local server if it is not running.
    """
    return dashboard(settings.client(), output(json_mode), open_browser=open_browser)


def dashboard(client: GpushClient, out: Output, *, open_browser: bool = False) -> int:
    from broker.client.sdk import EMBEDDED_URL

    me = client.whoami()  # the token works, or this says why
    if client.url == EMBEDDED_URL:
        raise InvalidRequest(
            "gpush talks to this database in-process, with no server to open in a browser: start one with "
            "`gpush server` (or pass --url of a running broker) and run `gpush dashboard` again"
        )
    address = client.url + "/"
    link = f"{address}#token={client.token}" if client.token else address
    if out.json_mode:
        out.json({"address": address, "login_link": link, "user": me.user, "tenant": me.tenant, "role": me.role})
    else:
        out.line(f"dashboard: {address}")
        out.line(f"sign in:   {link}")
        out.line(f"           (as {me.user}, tenant {me.tenant}, role {me.role.value}; the link holds your token)")
    if open_browser:
        import webbrowser

        webbrowser.open(link)
    return EXIT_OK


# Registered on the root group by broker.cli.main.
COMMANDS = (server, scheduler_group, db, agent_command, dashboard_command)
