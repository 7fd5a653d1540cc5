"""``gpush`` commands that read jobs: status, list (both with --watch), logs, events (a
job's, or the fleet's), and what the caller is (whoami) and used (usage).

The commands that change jobs are in broker.cli.submit (submit) and
broker.cli.job_actions (cancel, scale, checkpoint); ``state_option`` and
``label_filter``, the filters ``list`` and ``cancel`` share, are here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from broker.cli import console, job_detail
from broker.cli.console import Output
from broker.cli.settings import CONTEXT, Settings, format_option, json_option, output
from broker.core.errors import EXIT_ERROR, EXIT_OK, Conflict, GpushError, InvalidRequest
from broker.core.names import JobState, Kind

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


@click.command("status", context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.option("-w", "--watch", is_flag=True, help="Redraw when it changes, until the job ends (Ctrl-C stops).")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between looks.")
@format_option
@click.pass_obj
def status_command(settings: Settings, job_id: int, watch: bool, interval: float, fmt: str, json_mode: bool) -> int:
    """Show a job: its spec, state, reason, where it runs, where its output is, and its latest events."""
    return status(settings.client(), output(json_mode, fmt), job_id, watch=interval if watch else None)


def status(client: GpushClient, out: Output, job_id: int, *, watch: float | None = None) -> int:
    """A job's page: spec, state, reason, where it runs, its output's place, its latest
    events; ``watch``: redrawn when it changes, until the job ends (or Ctrl-C)."""
    from rich.console import Group

    job = client.get(job_id)
    if out.json_mode and watch is None:
        out.json(job)
        return EXIT_OK
    latest = [job]

    def view() -> Any:
        job = latest[0] = client.get(job_id)
        parts: list[Any] = [job_detail.job_detail(job, output=_output_location(client, job))]
        events = client.events(job_id)
        if events:
            parts += ["", console.events_table(events[-5:], width=out.console.width)]
        return Group(*parts)

    if watch is not None:
        return _watch(out, view, watch, done=lambda: latest[0].state.value in console.FINAL_STATES)
    out.print(view())
    return EXIT_OK


def _output_location(client: GpushClient, job: Any) -> str:
    """Where a job's output is, for ``gpush status`` (a word on why when there is none)."""
    if not job.cluster and not job.backend_id:
        return "none yet (it has not reached a cluster)"
    try:
        answer = client.logs(job.id, tail=0)
    except Conflict as exc:  # not started
        return f"none yet: {exc.message}"
    except GpushError:
        return "- (the cluster does not answer now)"
    hint = f"  (gpush logs {job.id})" if answer["readable"] else f"  ({answer.get('note') or 'not readable here'})"
    return answer["location"] + hint


def label_filter(values: tuple[str, ...]) -> dict[str, str] | None:
    """``--label KEY=VALUE`` filters, or None; the job-file module (YAML, pydantic) is
    imported only when there are some, so a plain `gpush list` starts fast."""
    if not values:
        return None
    from broker.intake.jobfile import parse_pairs

    return parse_pairs(values, option="--label") or None


def state_option(help_text: str):
    """``-s/--state``, repeatable, one of the job states."""
    return click.option(
        "-s", "--state", "states", multiple=True, type=click.Choice([s.value for s in JobState]), help=help_text
    )


# A cursor is a short URL-safe token (base64 of the last id seen): anything longer or
# other is not one, and is refused here rather than sent (a 100,000-character one
# would not even fit in a URL).
_CURSOR_CHARS = 128


def _cursor_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    if len(value) > _CURSOR_CHARS or not value.isascii() or not all(c.isalnum() or c in "-_=" for c in value):
        shown = f"{len(value):,} characters" if len(value) > 40 else repr(value.encode("utf-8", "surrogateescape"))[1:]
        raise click.BadParameter(
            f"{shown} is not a cursor gpush printed (those are short, of letters, digits, - and _): "
            "pass the one after `more jobs: gpush list --cursor` of the previous page"
        )
    return value


@click.command("list", context_settings=CONTEXT)
@state_option("Only jobs in this state; repeatable. Default: the active ones (not succeeded, failed or cancelled).")
@click.option("-A", "--all", "finished", is_flag=True, help="Finished jobs too.")
@click.option("--me", is_flag=True, help="Only your own jobs.")
@click.option("-u", "--user", help="Only this user's jobs.")
@click.option("--tenant", help="Only this tenant's jobs (admins).")
@click.option("-k", "--kind", type=click.Choice([k.value for k in Kind]))
@click.option(
    "-l", "--label", "labels", multiple=True, metavar="KEY=VALUE", help="Only jobs with this label; repeatable."
)
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True, help="Jobs per page.")
@click.option("--cursor", callback=_cursor_option, help="Next page: the cursor the previous page printed.")
@click.option("--all-pages", "all_pages", is_flag=True, help="Every page, not only the first.")
@click.option("-w", "--watch", is_flag=True, help="Redraw when something changes (Ctrl-C stops), as squeue -i.")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between looks.")
@format_option
@click.pass_obj
def list_command(settings: Settings, json_mode: bool, fmt: str, watch: bool, interval: float, **filters: Any) -> int:
    """List jobs, newest first: the active ones unless --all or --state says otherwise.

    \b
      gpush list                 your queue now, fitted to the terminal
      gpush list -A --me         every job of yours, finished ones too
      gpush list -o wide         every column
      gpush list -w              redraw as it changes
      gpush list -o name | xargs gpush cancel --yes
    """
    filters["states"] = list(filters["states"])
    filters["labels"] = label_filter(filters["labels"])
    return list_jobs(settings.client(), output(json_mode, fmt), watch=interval if watch else None, **filters)


def list_jobs(
    client: GpushClient,
    out: Output,
    *,
    states: list[str],
    tenant: str | None,
    user: str | None,
    kind: str | None,
    limit: int,
    cursor: str | None,
    all_pages: bool,
    labels: dict[str, str] | None = None,
    finished: bool = False,
    me: bool = False,
    watch: float | None = None,
) -> int:
    """Jobs, newest first: the active ones unless ``finished`` or ``states`` say otherwise
    (as squeue shows); ``me``: the caller's own; ``watch``: redraw every so many seconds
    when something changed, until Ctrl-C."""
    if me:
        user = client.whoami().user
    if not states and not finished:
        states = list(console.ACTIVE_STATES)
    filters = {"states": states, "tenant": tenant, "user": user, "kind": kind, "labels": labels}

    def page() -> tuple[list[Any], str | None]:
        if all_pages:
            return list(client.iter_jobs(limit=min(max(limit, 1), 1000), **filters)), None
        got = client.list(limit=limit, cursor=cursor, **filters)
        return got.jobs, got.next_cursor

    filtered = bool(filters_given(filters))
    if watch is not None:
        return _watch(out, lambda: _jobs_view(out, *page(), finished=finished, filtered=filtered, hints=True), watch)
    jobs, next_cursor = page()
    if out.json_mode:
        out.json({"jobs": jobs, "next_cursor": next_cursor})
        return EXIT_OK
    if out.fmt == "name":
        for job in jobs:
            out.line(str(job.id))
        return EXIT_OK
    if jobs:
        out.print(_jobs_view(out, jobs, next_cursor, finished=finished, filtered=filtered))
    else:
        out.note(_no_jobs(finished=finished, filtered=filtered))
    if next_cursor:
        out.note(f"more jobs: gpush list --cursor {next_cursor}  (or --all-pages)")
    return EXIT_OK


def filters_given(filters: dict[str, Any]) -> list[str]:
    return [k for k, v in filters.items() if v and k != "states"]


def _no_jobs(*, finished: bool, filtered: bool) -> str:
    if filtered:
        return "no jobs match"
    if not finished:
        return "no active jobs (`gpush list --all` adds finished ones; `gpush submit --help` adds one)"
    return "no jobs yet: `gpush submit --help` shows how to add one"


def _jobs_view(
    out: Output, jobs: list[Any], next_cursor: str | None, *, finished: bool, filtered: bool, hints: bool = False
) -> Any:
    """The table of ``jobs`` (a renderable); with ``hints`` (--watch), what the notes on
    stderr would say goes under it."""
    from rich.console import Group
    from rich.text import Text

    if not jobs:
        return Text(_no_jobs(finished=finished, filtered=filtered), style="dim")
    parts: list[Any] = [console.jobs_table(jobs, wide=out.wide, width=out.console.width)]
    if next_cursor and hints:
        parts.append(Text(f"and more: this view shows the first {len(jobs)}", style="dim"))
    return Group(*parts)


def _watch(out: Output, view: Callable[[], Any], interval: float, *, done: Callable[[], bool] | None = None) -> int:
    """Redraw ``view()`` when it changes, every ``interval`` seconds, until Ctrl-C (or
    until ``done()``): in place on a terminal (as ``watch``), one copy per change when piped."""
    import time

    from rich.live import Live

    if out.json_mode:
        raise InvalidRequest("--watch draws tables: leave out --json / -o json|yaml, or poll without --watch")
    last = None
    live = Live(console=out.console, auto_refresh=False, transient=False) if out.console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            shown = view()
            with out.console.capture() as captured:
                out.console.print(shown)
            text = captured.get()
            if text != last:
                stamp = time.strftime("%H:%M:%S")
                if live is not None:
                    from rich.console import Group
                    from rich.text import Text

                    live.update(Group(Text(f"every {interval:g}s, {stamp} (Ctrl-C stops)", style="dim"), shown))
                    live.refresh()
                else:
                    out.raw(f"--- {stamp}\n{text}")
                last = text
            if done is not None and done():
                return EXIT_OK
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if live is not None:
            live.stop()


@click.command("logs", context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.option("-f", "--follow", is_flag=True, help="Keep printing its output until the job ends.")
@click.option("-n", "--tail", type=click.IntRange(0, 100_000), help="Only the last N lines.")
@click.option(
    "-r",
    "--replica",
    "--rank",
    "replica",
    type=click.IntRange(0),
    help="Replica K of an elastic job, or rank K of a multi-node job (default: the first, 0).",
)
@click.option("--stderr", "stream", flag_value="stderr", help="The error stream (Slurm keeps it apart).")
@click.option("--stdout", "stream", flag_value="stdout", default=True, hidden=True)
@json_option
@click.pass_obj
def logs_command(
    settings: Settings, job_id: int, follow: bool, tail: int | None, replica: int | None, stream: str, json_mode: bool
) -> int:
    """Print what job JOB_ID printed, read from its cluster (Slurm's output file, the pod log).

    \b
      gpush logs 42            everything so far
      gpush logs 42 -f         and what it adds, until it ends
      gpush logs 42 -n 20      the last 20 lines
      gpush logs 42 --stderr   Slurm: the error file
    """
    return logs(settings.client(), output(json_mode), job_id, follow=follow, tail=tail, replica=replica, stream=stream)


def logs(
    client: GpushClient,
    out: Output,
    job_id: int,
    *,
    follow: bool = False,
    tail: int | None = None,
    replica: int | None = None,
    stream: str = "stdout",
    interval: float = 0.5,
) -> int:
    """Print a job's output (its last ``tail`` lines); with ``follow``, keep printing what
    it adds until it ends (waiting for it to start first)."""
    import time

    def read(offset: int, last: int | None) -> dict[str, Any] | None:
        try:
            return client.logs(job_id, stream=stream, replica=replica, offset=offset, tail=last)
        except Conflict:
            if not follow:
                raise
            return None  # not started yet: -f waits for it

    answer = read(0, tail)
    if out.json_mode:
        if answer is None:
            answer = client.logs(job_id, stream=stream, replica=replica, tail=tail)
        out.json(answer)
        return EXIT_OK if answer["readable"] else EXIT_ERROR
    waiting_said = False
    while answer is None:  # -f on a job that has not started
        if not waiting_said:
            out.note(f"job {job_id} has not started yet: waiting for its output (Ctrl-C stops waiting)")
            waiting_said = True
        time.sleep(interval)
        answer = read(0, tail)
    if not answer["readable"]:
        out.note(f"[yellow]gpush cannot read job {job_id}'s output from here:[/] {answer.get('note') or ''}")
        out.line(answer["location"])
        return EXIT_ERROR
    out.raw(answer["text"])
    offset = answer["next_offset"]
    if tail is None:  # everything: read on while chunks come
        while answer["text"]:
            answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
            out.raw(answer["text"])
            offset = answer["next_offset"]
    while follow and not answer["final"]:
        time.sleep(interval)
        answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
        out.raw(answer["text"])
        offset = answer["next_offset"]
        while answer["text"] and not answer["final"]:  # a burst larger than one chunk
            answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
            out.raw(answer["text"])
            offset = answer["next_offset"]
    if follow:  # the job ended: what it wrote last
        while True:
            answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
            if not answer["text"]:
                break
            out.raw(answer["text"])
            offset = answer["next_offset"]
        out.note(f"job {job_id} {answer['state']}")
    return EXIT_OK


@click.command("events", context_settings=CONTEXT)
@click.argument("job_id", type=int, required=False)
@click.option("-n", "--limit", type=click.IntRange(1, 1000), help="Fleet events: the newest N (default 50).")
@click.option(
    "--since", metavar="TIME", help="Fleet events since TIME: a date or time (2026-12-06T10:00) or an age (2h)."
)
@click.option("--node", help="Fleet events of this node.")
@json_option
@click.pass_obj
def events_command(
    settings: Settings, job_id: int | None, limit: int | None, since: str | None, node: str | None, json_mode: bool
) -> int:
    """Every state change of a job, with time and reason; with no JOB_ID, the fleet's events
    (admins): each step of the MIG layout changes (gpush mig apply) and of the nodes lent
    between clusters (the policy's lending pools), oldest first.

    \b
    Examples:
      gpush events 42                  a job's state changes
      gpush events                     the fleet's newest 50 events
      gpush events --node mig01 -n 20  one node's newest 20
      gpush events --since 2h          the last two hours
    """
    if job_id is None:
        return fleet_events(settings.client(), output(json_mode), limit=limit or 50, since=since, node=node)
    if since or node or limit:
        raise click.UsageError("--since, --node and -n are for the fleet's events: leave out the job id")
    return events(settings.client(), output(json_mode), job_id)


def fleet_events(client: GpushClient, out: Output, *, limit: int, since: str | None, node: str | None) -> int:
    """The fleet's events: MIG change and node move steps, oldest first."""
    from broker.core.clock import utcnow

    items = client.fleet_events(limit=limit, since=console.parse_when(since, utcnow(), "--since"), node=node)
    if out.json_mode:
        out.json(items)
    elif not items:
        where = " ".join(filter(None, [f"of node {node}" if node else "", f"since {since}" if since else ""]))
        out.note(
            f"no MIG change or node move {where}".rstrip()
            if where
            else "no MIG change or node move yet: gpush mig apply changes MIG layouts, and a policy's "
            "lending pools move nodes"
        )
    else:
        out.print(console.fleet_events_table(items, width=out.console.width))
    return EXIT_OK


def events(client: GpushClient, out: Output, job_id: int) -> int:
    items = client.events(job_id)
    if out.json_mode:
        out.json(items)
    else:
        out.print(console.events_table(items, width=out.console.width))
    return EXIT_OK


@click.command("whoami", context_settings=CONTEXT)
@json_option
@click.pass_obj
def whoami_command(settings: Settings, json_mode: bool) -> int:
    """Show the user, tenant and role of the token in use."""
    return whoami(settings.client(), output(json_mode))


def whoami(client: GpushClient, out: Output) -> int:
    me = client.whoami()
    if out.json_mode:
        out.json(me)
    else:
        out.line(f"{me.user} (tenant {me.tenant}, role {me.role.value}) at {client.url}")
    return EXIT_OK


@click.command("usage", context_settings=CONTEXT)
@click.option(
    "--since", help="Start of the window: a date or time (2026-12-01, 2026-12-01T08:00) or an age (7d, 24h, 90m)."
)
@click.option("--until", help="End of the window, as --since (default: now).")
@click.option(
    "--by",
    default="tenant",
    show_default=True,
    help="Group by one or more of tenant,user,cluster,sharing,kind (comma-separated).",
)
@click.option("--tenant", help="Only this tenant's jobs (admins; a user's token counts its own tenant).")
@click.option("--csv", "csv_mode", is_flag=True, help="Print CSV, for spreadsheets.")
@json_option
@click.pass_obj
def usage_command(
    settings: Settings,
    since: str | None,
    until: str | None,
    by: str,
    tenant: str | None,
    csv_mode: bool,
    json_mode: bool,
) -> int:
    """GPU-hours in physical GPU-equivalents, from the job events.

    A MIG slice counts its fraction of the GPU (3g.20gb of an A100: 3/7), an MPS share its
    percentage, a time-sliced job its GPU memory budget's fraction of the GPU, whole GPUs
    whole; running jobs count up to now. The README's "Accounting" says why.
    """
    return usage(
        settings.client(), output(json_mode), since=since, until=until, by=by, tenant=tenant, csv_mode=csv_mode
    )


def usage(
    client: GpushClient,
    out: Output,
    *,
    since: str | None,
    until: str | None,
    by: str,
    tenant: str | None,
    csv_mode: bool = False,
) -> int:
    from broker.accounting.usage import to_csv
    from broker.core.clock import utcnow

    now = utcnow()
    answer = client.usage(
        since=console.parse_when(since, now, "--since"),
        until=console.parse_when(until, now, "--until"),
        by=by,
        tenant=tenant,
    )
    groups = answer["by"]
    if out.json_mode:
        out.json(answer)
    elif csv_mode:
        out.raw(to_csv(answer["rows"], groups))
    else:
        out.line(console.usage_window(answer))
        out.print(console.usage_table(answer))
    return EXIT_OK


# Registered on the root group by broker.cli.main.
COMMANDS = (status_command, list_command, logs_command, events_command, whoami_command, usage_command)
