"""``gpush`` commands on jobs: submit, status, list, events, cancel, scale, and whoami."""

from __future__ import annotations

import sys
from typing import Any

import click

from broker.cli import commands
from broker.cli.settings import CONTEXT, Settings, format_option, json_option, output
from broker.core.names import Isolation, JobState, Kind


@click.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option(
    "-f",
    "--file",
    "file",
    metavar="FILE",
    help="Job YAML (one job, or several as --- documents or a list); - reads stdin. Flags override its fields.",
)
@click.option("-n", "-J", "--name", help="A name for the job.")
@click.option("-k", "--kind", type=click.Choice([k.value for k in Kind]), help="training, inference or batch.")
@click.option(
    "-i",
    "--isolation",
    type=click.Choice([i.value for i in Isolation]),
    help="exclusive (whole GPUs), hardware (MIG), process (MPS), none (time-slicing). Default: by kind.",
)
@click.option("-G", "--gpus", type=int, help="GPUs or GPU slices per replica (default 1).")
@click.option(
    "--gpu-memory-gb",
    "gpu_memory_gb",
    type=float,
    help="GPU memory each GPU or slice needs, in GB (required unless exclusive).",
)
@click.option("--min-replicas", type=int, help="Elastic inference: fewest replicas.")
@click.option("--max-replicas", type=int, help="Elastic inference: most replicas.")
@click.option("-c", "--cpus", type=int, help="CPUs per replica.")
@click.option("--memory", "--mem", help="Host memory per replica: 16G, 512M.")
@click.option("-t", "--time-limit", "--time", help="90 (minutes), 2h, 1h30m, HH:MM:SS or D-HH:MM:SS.")
@click.option("--image", help="Container image (Kubernetes; Slurm with a container runtime).")
@click.option("-e", "--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable, repeatable.")
@click.option("-l", "--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label, repeatable.")
@click.option("--tenant", help="Tenant (admins only; default: your token's).")
@click.option("--user", help="User (admins only; default: your token's).")
@click.option("-p", "--priority", type=int, help="-1000 to 1000; higher runs first (default 0).")
@click.option(
    "--preemptible/--not-preemptible",
    default=None,
    help="May be stopped for work of higher standing and queued again (default: the policy's, by tenant and kind).",
)
@click.option(
    "--checkpoint",
    metavar="SIGNAL[@GRACE]",
    help="On preemption, send SIGNAL and allow GRACE to save state, as sbatch --signal: USR1@2m, TERM@90 "
    "(default TERM and the policy's grace).",
)
@click.option(
    "-M",
    "--cluster",
    metavar="CLUSTER",
    help="Run only on this cluster (the policy must still route this kind of job there; see `gpush cluster list`).",
)
@click.option("--idempotency-key", help="Retry-safe key: the same key and spec return the same job.")
@click.option(
    "--ray",
    "ray_address",
    envvar="GPUSH_RAY_ADDRESS",
    show_envvar=True,
    metavar="URL",
    help="Run the command as a Ray job on this Ray cluster (its dashboard, http://head:8265), whose workers "
    "come from gpush, and follow it to its end (exit 0 if it succeeded).",
)
@json_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def submit(
    settings: Settings, file, json_mode, command, env, labels, min_replicas, max_replicas, ray_address, **fields: Any
) -> int:
    """Queue a job and print its id. The command goes after --:

    \b
      gpush submit --kind training --gpus 2 -- python train.py --lr 3e-4
      gpush submit -f job.yaml --priority 10
      gpush submit --kind training --preemptible --checkpoint USR1@2m -- ./train.sh
      gpush submit --ray http://ray-head:8265 -- python serve_app.py
    """
    from broker.cli.command_line import refuse_ambiguous_submit
    from broker.intake.jobfile import parse_pairs

    refuse_ambiguous_submit(command)

    if ray_address:
        return commands.submit_ray_job(
            output(json_mode), ray_address, list(command), submission_id=fields.get("idempotency_key")
        )

    fields["env"] = parse_pairs(env, option="--env")
    fields["labels"] = parse_pairs(labels, option="--label")
    if min_replicas is not None or max_replicas is not None:
        fields["elastic"] = {
            k: v for k, v in (("min_replicas", min_replicas), ("max_replicas", max_replicas)) if v is not None
        }
    if command:
        fields["command"] = list(command)
    file_text = commands.read_job_file(file, lambda: sys.stdin.read()) if file else None
    return commands.submit(settings.client(), output(json_mode), file=file, file_text=file_text, fields=fields)


@click.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.option("-w", "--watch", is_flag=True, help="Redraw when it changes, until the job ends (Ctrl-C stops).")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between looks.")
@format_option
@click.pass_obj
def status(settings: Settings, job_id: int, watch: bool, interval: float, fmt: str, json_mode: bool) -> int:
    """Show a job: its spec, state, reason, where it runs, where its output is, and its latest events."""
    return commands.status(settings.client(), output(json_mode, fmt), job_id, watch=interval if watch else None)


def _label_filter(values: tuple[str, ...]) -> dict[str, str] | None:
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
@click.option("--cursor", help="Next page: the cursor the previous page printed.")
@click.option("--all-pages", "all_pages", is_flag=True, help="Every page, not only the first.")
@click.option("-w", "--watch", is_flag=True, help="Redraw when something changes (Ctrl-C stops), as squeue -i.")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between looks.")
@format_option
@click.pass_obj
def list_(settings: Settings, json_mode: bool, fmt: str, watch: bool, interval: float, **filters: Any) -> int:
    """List jobs, newest first: the active ones unless --all or --state says otherwise.

    \b
      gpush list                 your queue now, fitted to the terminal
      gpush list -A --me         every job of yours, finished ones too
      gpush list -o wide         every column
      gpush list -w              redraw as it changes
      gpush list -o name | xargs gpush cancel --yes
    """
    filters["states"] = list(filters["states"])
    filters["labels"] = _label_filter(filters["labels"])
    return commands.list_jobs(settings.client(), output(json_mode, fmt), watch=interval if watch else None, **filters)


@click.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.option("-f", "--follow", is_flag=True, help="Keep printing its output until the job ends.")
@click.option("-n", "--tail", type=click.IntRange(0, 100_000), help="Only the last N lines.")
@click.option("-r", "--replica", type=click.IntRange(0), help="Replica K of an elastic job (default: the first, 0).")
@click.option("--stderr", "stream", flag_value="stderr", help="The error stream (Slurm keeps it apart).")
@click.option("--stdout", "stream", flag_value="stdout", default=True, hidden=True)
@json_option
@click.pass_obj
def logs(
    settings: Settings, job_id: int, follow: bool, tail: int | None, replica: int | None, stream: str, json_mode: bool
) -> int:
    """Print what job JOB_ID printed, read from its cluster (Slurm's output file, the pod log).

    \b
      gpush logs 42            everything so far
      gpush logs 42 -f         and what it adds, until it ends
      gpush logs 42 -n 20      the last 20 lines
      gpush logs 42 --stderr   Slurm: the error file
    """
    return commands.logs(
        settings.client(), output(json_mode), job_id, follow=follow, tail=tail, replica=replica, stream=stream
    )


@click.command(context_settings=CONTEXT)
@click.argument("job_id", type=int, required=False)
@click.option("-n", "--limit", type=click.IntRange(1, 1000), help="Fleet events: the newest N (default 50).")
@click.option(
    "--since", metavar="TIME", help="Fleet events since TIME: a date or time (2026-12-06T10:00) or an age (2h)."
)
@click.option("--node", help="Fleet events of this node.")
@json_option
@click.pass_obj
def events(
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
        return commands.fleet_events(settings.client(), output(json_mode), limit=limit or 50, since=since, node=node)
    if since or node or limit:
        raise click.UsageError("--since, --node and -n are for the fleet's events: leave out the job id")
    return commands.events(settings.client(), output(json_mode), job_id)


@click.command(context_settings=CONTEXT)
@click.argument("job_ids", type=int, nargs=-1)
@state_option("Every active job in this state (repeatable), instead of ids.")
@click.option("-u", "--user", help="Every job of this user (admins); with no ids.")
@click.option("-l", "--label", "labels", multiple=True, metavar="KEY=VALUE", help="Every job with this label.")
@click.option("--mine", "--me", "mine", is_flag=True, help="Every active job of yours.")
@click.option("-y", "--yes", is_flag=True, help="Cancel what the filters select without asking.")
@json_option
@click.pass_obj
def cancel(
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
        return commands.cancel_matching(
            client,
            output(json_mode),
            states=list(states),
            user=user,
            labels=_label_filter(labels),
            mine=mine,
            confirm=None if yes else lambda question: click.confirm(question, default=False, err=True),
        )
    return commands.cancel(client, output(json_mode), list(job_ids))


@click.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.argument("replicas", type=int)
@json_option
@click.pass_obj
def scale(settings: Settings, job_id: int, replicas: int, json_mode: bool) -> int:
    """Scale running elastic job JOB_ID to REPLICAS (within its elastic range and quota)."""
    job = settings.client().scale(job_id, replicas)
    if json_mode:
        output(json_mode).json(job)
    else:
        click.echo(f"job {job.id}: {replicas} replicas ({job.state.value})")
    return 0


@click.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.option("--note", help="What was saved, and where (shown in the job's events).")
@json_option
@click.pass_obj
def checkpoint(settings: Settings, job_id: int, note: str | None, json_mode: bool) -> int:
    """Report that running job JOB_ID saved its state: were it preempted, it would lose
    only the work since. Jobs call it from their checkpoint hook (GPUSH_JOB_ID is set)."""
    event = settings.client().checkpoint(job_id, note)
    if json_mode:
        output(json_mode).json(event)
    else:
        click.echo(f"job {job_id}: checkpoint recorded at {event['at']}")
    return 0


@click.command(context_settings=CONTEXT)
@json_option
@click.pass_obj
def whoami(settings: Settings, json_mode: bool) -> int:
    """Show the user, tenant and role of the token in use."""
    return commands.whoami(settings.client(), output(json_mode))


@click.command(context_settings=CONTEXT)
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
def usage(
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
    return commands.usage(
        settings.client(), output(json_mode), since=since, until=until, by=by, tenant=tenant, csv_mode=csv_mode
    )


# Registered on the root group by broker.cli.main.
COMMANDS = (submit, status, list_, logs, events, cancel, scale, checkpoint, whoami, usage)
