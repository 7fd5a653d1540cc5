"""``gpush`` commands that change the fleet itself, step by step: MIG layouts re-cut for
the queue (mig plan, apply, changes) and nodes lent between clusters (lending moves)."""

from __future__ import annotations

import textwrap
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from broker.cli import console
from broker.cli.console import Output
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.errors import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


@click.group(context_settings=CONTEXT)
def mig() -> None:
    """MIG layouts: plan them for the queue, change them, follow the changes."""


@mig.command("plan", context_settings=CONTEXT)
@click.option("--cluster", help="Plan this cluster's nodes and the jobs routed to it (default: every reported node).")
@click.option("--repartition-busy", is_flag=True, help="Also re-cut GPUs with work on some instances (kept in place).")
@click.option("--enable-mig", is_flag=True, help="Also propose MIG on MIG-capable GPUs that have it off.")
@click.option(
    "--show",
    type=click.Choice(["all", "summary", "mig-parted", "gres"]),
    default="all",
    show_default=True,
    help="What to print.",
)
@json_option
@click.pass_obj
def mig_plan_command(
    settings: Settings, cluster: str | None, repartition_busy: bool, enable_mig: bool, show: str, json_mode: bool
) -> int:
    """Per-GPU MIG layouts that place the most waiting MIG work, as mig-parted config and gres.conf."""
    return mig_plan(
        settings.client(),
        output(json_mode),
        cluster=cluster,
        repartition_busy=repartition_busy,
        enable_mig=enable_mig,
        show=show,
    )


def mig_plan(
    client: GpushClient, out: Output, *, cluster: str | None, repartition_busy: bool, enable_mig: bool, show: str
) -> int:
    """MIG layouts per GPU for the waiting MIG work: the summary, mig-parted config, gres.conf."""
    plan = client.mig_plan(cluster, repartition_busy=repartition_busy, enable_mig=enable_mig)
    if out.json_mode:
        out.json(plan)
        return EXIT_OK
    if not plan["nodes"]:
        where = f"cluster {cluster}" if cluster else "any node"
        out.note(f"no agent reports GPUs of {where}: run `gpush agent` on the GPU nodes, then plan again")
        return EXIT_NOT_FOUND
    if show in ("all", "summary"):
        for line in plan["summary"]:
            out.line(line)
        if plan["missing_agents"]:
            out.note(f"not planned (no agent reports them): {', '.join(plan['missing_agents'])}")
    if show in ("all", "mig-parted"):
        if show == "all":
            out.line("")
        out.line(plan["mig_parted"].rstrip("\n"))
    if show in ("all", "gres"):
        changed = {g["node"] for g in plan["gpus"] if g["action"] != "keep"}
        for node, text in plan["gres_conf"].items():
            if text and node in changed:
                out.line("")
                out.line(f"# gres.conf for {node} after the plan")
                out.line(text.rstrip("\n"))
    return EXIT_OK


@mig.command("apply", context_settings=CONTEXT)
@click.option("--cluster", help="Only this cluster's nodes.")
@click.option("--node", help="Only this node's GPUs.")
@click.option("--dry-run", is_flag=True, help="Say what would change; change nothing.")
@click.option(
    "--repartition-busy",
    is_flag=True,
    help="Also re-cut GPUs that run work on some instances: those instances stay as they are, the rest is re-cut.",
)
@json_option
@click.pass_obj
def mig_apply_command(
    settings: Settings, cluster: str | None, node: str | None, dry_run: bool, repartition_busy: bool, json_mode: bool
) -> int:
    """Change the MIG layouts `gpush mig plan` proposes, one recorded change per GPU.

    Each GPU's node is fenced, the instances that go are emptied (preemptible jobs
    preempted, the others waited for), the GPU is re-cut, the cluster is told, and new
    work lands once all agree; `gpush mig changes` follows each step. A step that runs
    out of time (the policy's mig.step_timeout, default 10m) rolls the GPU back.

    Who re-cuts the GPU: on Kubernetes the GPU Operator's MIG manager; elsewhere
    the node's agent, which must run as `gpush agent --allow-mig-changes`. Slurm
    takes the new layout when its cluster config names the gres.conf gpush may
    rewrite (mig_gres_conf; README: Which clusters take a new layout), and waits
    for the whole node to be empty. `gpush events` shows every step. Admins only.

    \b
      gpush mig apply --cluster slurm-a --dry-run
      gpush mig apply --cluster slurm-a --node mig-01"""
    return mig_apply(
        settings.client(),
        output(json_mode),
        cluster=cluster,
        node=node,
        dry_run=dry_run,
        repartition_busy=repartition_busy,
    )


def mig_apply(
    client: GpushClient,
    out: Output,
    *,
    cluster: str | None,
    node: str | None,
    dry_run: bool,
    repartition_busy: bool,
) -> int:
    """The plan's MIG changes, recorded (or, with ``dry_run``, only shown)."""
    result = client.mig_apply(cluster=cluster, node=node, dry_run=dry_run, repartition_busy=repartition_busy)
    if out.json_mode:
        out.json(result)
        return EXIT_OK
    gpus = result["gpus"]
    if not gpus:
        if not result.get("nodes"):
            missing = ", ".join(result.get("missing_agents") or []) or "none"
            out.note(
                "nothing to change: no node agent reports a GPU here, so gpush does not know the GPUs "
                f"(nodes without an agent: {missing}); run `gpush agent` on the nodes"
            )
        else:
            out.note("nothing to change: the MIG layouts serve the waiting work as well as any (gpush mig plan)")
        return EXIT_OK
    for g in gpus:
        layouts = f"{_layout(g['today'])} -> {_layout(g['planned'])}"
        if g["refused"]:
            out.line(f"{g['node']} GPU {g['gpu']}: not changed: {g['refused']}")
        elif dry_run:
            out.line(f"{g['node']} GPU {g['gpu']} ({g['cluster']}): would change {layouts}")
        else:
            out.line(f"{g['node']} GPU {g['gpu']} ({g['cluster']}): change {g['change']}: {layouts}")
    started = [g for g in gpus if g["change"] is not None]
    if dry_run:
        out.note("dry run: nothing changed (run it again without --dry-run)")
    elif started:
        out.note("each node is fenced, emptied, re-cut and confirmed in turn: `gpush mig changes` follows them")
    return EXIT_OK if started or dry_run else EXIT_ERROR


def _layout(slots: list[str]) -> str:
    """A GPU's instances for people: ``7 x 1g.5gb`` for a run of four or more of a profile,
    each with its slot otherwise (``3g.20gb@0, 2g.10gb@4``); ``--json`` has every slot."""
    if not slots:
        return "no instance"
    runs: list[list[str]] = []
    for slot in slots:
        if runs and runs[-1][0].partition("@")[0] == slot.partition("@")[0]:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return ", ".join(f"{len(r)} x {r[0].partition('@')[0]}" if len(r) >= 4 else ", ".join(r) for r in runs)


@mig.command("changes", context_settings=CONTEXT)
@click.argument("change_id", type=int, required=False)
@click.option("--all", "show_all", is_flag=True, help="Also the changes that ended.")
@click.option(
    "--clear",
    is_flag=True,
    help="With CHANGE_ID of a failed change: the GPU is fine again (you checked it), so its node takes work again.",
)
@json_option
@click.pass_obj
def mig_changes_command(settings: Settings, change_id: int | None, show_all: bool, clear: bool, json_mode: bool) -> int:
    """MIG layout changes under way (--all: every one), or one change's steps.

    Steps: planned, draining, emptying, changing (the GPU is re-cut), publishing,
    confirming; then done, rolled-back (a step ran out of time: the GPU is back on
    its old layout), cancelled (its work did not end in time: nothing changed) or
    failed (the rollback ran out too: the node stays fenced until --clear)."""
    if clear and change_id is None:
        raise click.UsageError("--clear needs the CHANGE_ID of a failed change")
    return mig_changes(settings.client(), output(json_mode), change_id=change_id, show_all=show_all, clear=clear)


def mig_changes(client: GpushClient, out: Output, *, change_id: int | None, show_all: bool, clear: bool = False) -> int:
    """The MIG changes under way, or one change with its steps (``clear``: a failed one cleared)."""
    if change_id is not None:
        change = client.mig_clear(change_id) if clear else client.mig_change(change_id)
        if out.json_mode:
            out.json(change)
            return EXIT_OK
        _print_change(out, change)
        _print_events(out, change["events"])
        return EXIT_OK
    changes = client.mig_changes(all=show_all)
    if out.json_mode:
        out.json(changes)
        return EXIT_OK
    if not changes:
        out.note("no MIG change yet" if show_all else "no MIG change under way (--all also lists those that ended)")
        return EXIT_OK
    for change in changes:
        _print_change(out, change)
        if change["events"]:
            last = change["events"][-1]
            for line in textwrap.wrap(
                f"last: {last['step']}: {last['note']}", 78, initial_indent="  ", subsequent_indent="    "
            ):
                out.line(line)
    return EXIT_OK


def _print_change(out: Output, change: dict[str, Any]) -> None:
    layouts = f"{_layout(change['from'])} -> {_layout(change['to'])}"
    back = " (rolling back)" if change["rolling_back"] and not change["ended_at"] else ""
    out.line(f"change {change['id']}  {change['cluster']}/{change['node']} GPU {change['gpu']}  {change['step']}{back}")
    for line in textwrap.wrap(layouts, 78, initial_indent="  ", subsequent_indent="    "):
        out.line(line)
    if change["deadline"] and not change["ended_at"]:
        at = console.local_time(datetime.fromisoformat(change["deadline"]))
        then = "cancelled, nothing changed" if change["step"] == "emptying" else "rolls back"
        if change["rolling_back"]:
            then = "fails, its node stays fenced"
        out.line(f"  this step runs out at {at}: then the change {then}")


def _print_events(out: Output, events: list[dict[str, Any]]) -> None:
    """A change's or a move's steps, one a line (wrapped at 80 columns under its note)."""
    for event in events:
        at = console.local_time(datetime.fromisoformat(event["at"]))
        head = f"  {at}  {event['step']:<11} "
        for line in textwrap.wrap(event["note"], 80, initial_indent=head, subsequent_indent=" " * len(head)):
            out.line(line)


@click.group(context_settings=CONTEXT)
def lending() -> None:
    """Nodes two clusters share, lent as their queues call for it (the policy's lending pools)."""


@lending.command("moves", context_settings=CONTEXT)
@click.option("--all", "show_all", is_flag=True, help="Also the moves that ended.")
@json_option
@click.pass_obj
def lending_moves_command(settings: Settings, show_all: bool, json_mode: bool) -> int:
    """The nodes moving between clusters now (--all: every move), each with its steps.

    \b
    Steps: draining (fenced where it was; its jobs there end, or are preempted
    if they may be), configuring (set up as the pool's setup says, fenced on
    both), joining (unfenced on the other side); then done, or called-off (the
    reason to move went away, or the setup failed: it stays where it was).
    Admins only."""
    return lending_moves(settings.client(), output(json_mode), show_all=show_all)


def lending_moves(client: GpushClient, out: Output, *, show_all: bool) -> int:
    """The node moves under way (or all), each with its steps."""
    moves = client.lending_moves(all=show_all)
    if out.json_mode:
        out.json(moves)
        return EXIT_OK
    if not moves:
        out.note("no node moved yet" if show_all else "no node is moving (--all also lists the moves that ended)")
        return EXIT_OK
    for move in moves:
        out.line(f"move {move['id']}  {move['node']}: {move['source']} -> {move['target']}  {move['step']}")
        for line in textwrap.wrap(move["reason"], 78, initial_indent="  ", subsequent_indent="    "):
            out.line(line)
        _print_events(out, move["events"])
    return EXIT_OK


# Registered on the root group by broker.cli.main.
COMMANDS = (mig, lending)
