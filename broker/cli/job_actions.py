"""``gpush`` commands that act on queued and running jobs: cancel (by id, or every job a
filter selects), scale (an elastic job's replicas) and checkpoint (a job saved its state)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from broker.cli import console
from broker.cli.console import Output
from broker.cli.jobs import label_filter, state_option
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.errors import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, InvalidRequest, NotFound

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


@click.command("cancel", context_settings=CONTEXT)
@click.argument("job_ids", type=int, nargs=-1)
@state_option("Every active job in this state (repeatable), instead of ids.")
@click.option("-u", "--user", help="Every job of this user (admins); with no ids.")
@click.option("-l", "--label", "labels", multiple=True, metavar="KEY=VALUE", help="Every job with this label.")
@click.option("--mine", "--me", "mine", is_flag=True, help="Every active job of yours.")
@click.option("-y", "--yes", is_flag=True, help="Cancel what the filters select without asking.")
@json_option
@click.pass_obj
def cancel_command(
    settings: Settings,
    job_ids: tuple[int, ...],
    states: tuple[str, ...],
    user: str | None,
    labels: tuple[str, ...],
    mine: bool,
    yes: bool,
    json_mode: bool,
) -> int:
    """Cancel jobs by id, or every active job a filter selects (asks first, unless --yes).

    Queued jobs end at once; running ones stop when their cluster confirms.

    \b
      gpush cancel 42 43
      gpush cancel --mine                   every active job of yours
      gpush cancel --state queued --label sweep=lr --yes
    """
    filtered = bool(states or user or labels or mine)
    if job_ids and filtered:
        raise click.UsageError("give job ids or filters (--state, --user, --label, --mine), not both")
    if not job_ids and not filtered:
        raise click.UsageError("which jobs? give their ids, or filters: --mine, --state, --user, --label")
    client = settings.client()
    if filtered:
        return cancel_matching(
            client,
            output(json_mode),
            states=list(states),
            user=user,
            labels=label_filter(labels),
            mine=mine,
            confirm=None if yes else lambda question: click.confirm(question, default=False, err=True),
        )
    return cancel(client, output(json_mode), list(job_ids))


def cancel(client: GpushClient, out: Output, job_ids: list[int]) -> int:
    """Cancel every job given; go on past one that is missing and exit 3 at the end."""
    from rich.markup import escape

    results: list[dict[str, Any]] = []
    code = EXIT_OK
    for job_id in job_ids:
        try:
            result = client.cancel(job_id)
        except NotFound as exc:
            code = EXIT_NOT_FOUND
            results.append({"id": job_id, "outcome": "not_found", "error": exc.message})
            if not out.json_mode:
                # As every other error reads (broker.cli.main); the message is text, not markup.
                out.note(f"[red]gpush: error:[/] {escape(exc.message)}")
            continue
        job = result["job"]
        results.append({"id": job_id, "outcome": result["outcome"], "state": job.state.value})
        if not out.json_mode:
            out.line(_cancel_message(job_id, result["outcome"], job.state.value))
    if out.json_mode:
        out.json(results)
    return code


MAX_BULK_CANCEL = 10_000


def cancel_matching(
    client: GpushClient,
    out: Output,
    *,
    states: list[str],
    user: str | None,
    labels: dict[str, str] | None,
    mine: bool,
    confirm: Callable[[str], bool] | None,
) -> int:
    """Cancel every active job the filters select (the caller's own with ``mine``; a
    user's token sees only its tenant's jobs anyway). ``confirm(question)`` is asked first
    unless None (``--yes``); exit 1 when the answer is no."""
    if mine:
        user = client.whoami().user
    active = list(console.ACTIVE_STATES)
    wanted = [s for s in states if s in active] if states else active
    if states and not wanted:
        raise InvalidRequest(f"{', '.join(states)}: finished jobs cannot be cancelled; pick active states")
    jobs = []
    for job in client.iter_jobs(states=wanted, user=user, labels=labels, limit=1000):
        jobs.append(job)
        if len(jobs) > MAX_BULK_CANCEL:
            raise InvalidRequest(
                f"more than {MAX_BULK_CANCEL:,} jobs match: narrow the filters (--state, --label, --user)"
            )
    if not jobs:
        if out.json_mode:
            out.json([])
        else:
            out.note("no active job matches: nothing to cancel")
        return EXIT_OK
    if confirm is not None and not out.json_mode:
        shown = ", ".join(str(j.id) for j in jobs[:10]) + (f" and {len(jobs) - 10} more" if len(jobs) > 10 else "")
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.state.value] = counts.get(job.state.value, 0) + 1
        by_state = ", ".join(f"{n} {state}" for state, n in counts.items())
        if not confirm(f"cancel {len(jobs)} job(s) ({by_state}): {shown}?"):
            out.note("nothing cancelled")
            return EXIT_ERROR
    return cancel(client, out, [j.id for j in jobs])


def _cancel_message(job_id: int, outcome: str, state: str) -> str:
    return {
        "cancelled": f"job {job_id} cancelled",
        "cancel_requested": (
            f"job {job_id} is {state} on a cluster: cancel requested, it stops when the cluster confirms"
        ),
        "already_requested": f"job {job_id}: cancel already requested, waiting for the cluster",
        "already_finished": f"job {job_id} had already ended ({state}); nothing to cancel",
    }[outcome]


@click.command("scale", context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.argument("replicas", type=int)
@json_option
@click.pass_obj
def scale_command(settings: Settings, job_id: int, replicas: int, json_mode: bool) -> int:
    """Scale running elastic job JOB_ID to REPLICAS (within its elastic range and quota)."""
    job = settings.client().scale(job_id, replicas)
    if json_mode:
        output(json_mode).json(job)
    else:
        click.echo(f"job {job.id}: {replicas} replicas ({job.state.value})")
    return 0


@click.command("checkpoint", context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.option("--note", help="What was saved, and where (shown in the job's events).")
@json_option
@click.pass_obj
def checkpoint_command(settings: Settings, job_id: int, note: str | None, json_mode: bool) -> int:
    """Report that running job JOB_ID saved its state: were it preempted, it would lose
    only the work since. Jobs call it from their checkpoint hook (GPUSH_JOB_ID is set)."""
    event = settings.client().checkpoint(job_id, note)
    if json_mode:
        output(json_mode).json(event)
    else:
        click.echo(f"job {job_id}: checkpoint recorded at {event['at']}")
    return 0


# Registered on the root group by broker.cli.main.
COMMANDS = (cancel_command, scale_command, checkpoint_command)
