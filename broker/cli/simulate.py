"""``gpush simulate``: replay a workload or trace on a simulated fleet, offline, in
virtual time."""

from __future__ import annotations

import textwrap
from pathlib import Path

import click

from broker.cli.console import Output
from broker.cli.settings import CONTEXT, json_option, output
from broker.core.errors import EXIT_OK


@click.command("simulate", context_settings=CONTEXT)
@click.option("--fleet", metavar="FILE", help="Fleet file (examples/fleet.yaml). Not with --trace.")
@click.option(
    "--workload",
    metavar="FILE",
    help="Workload file: jobs with at: and duration:, and tenants' weights and quotas (examples/workload.yaml).",
)
@click.option(
    "--trace",
    nargs=2,
    metavar="FORMAT DIR",
    help="Replay a cluster trace instead: `--trace openb DIR` (the Alibaba 2023 format; its nodes are the fleet).",
)
@click.option("--policy", metavar="FILE", help="Routing policy to replay under (default: policies/default.yaml).")
@click.option(
    "--compare",
    metavar="FILE",
    help="A second policy to compare (default: every job on whole GPUs, as Slurm and Kubernetes give them without "
    "sharing; on a trace those are placed by best-fit, and the run is called 'whole GPUs (best-fit)').",
)
@click.option("--report", "report", metavar="DIR", required=True, help="Where report.md, results.json and PNGs go.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampled experiments.")
@click.option(
    "--placement",
    type=click.Choice(["fgd", "best-fit"]),
    help="With --trace: placement on its GPU-sharing nodes, fragmentation-aware (fgd, the default) or best-fit; "
    "the report calls the run 'gpush (fgd)' or 'gpush (best-fit)'. A --fleet replay places as the broker does "
    "(best-fit for whole GPUs and MIG, fgd per GPU for MPS and time-slicing), so it takes no --placement.",
)
@click.option(
    "--preemption",
    is_flag=True,
    help="With --fleet: jobs of higher priority preempt the workload's preemptible jobs (preemptible: true, "
    "checkpoint_every:), losing the least work; compared with the same replay without preemption.",
)
@click.option(
    "--reservations",
    is_flag=True,
    help="With --fleet: compare with the same replay without gang reservations (multi-node jobs' waits per size "
    "class, the GPU-hours backfilled onto reserved nodes).",
)
@click.option(
    "--layouts",
    is_flag=True,
    help="With --fleet: replay three ways, static layouts, MIG layouts re-planned for the queue, and that plus "
    "the nodes both clusters list lent between them as their queues call for it; the report compares them.",
)
@json_option
def simulate_command(
    fleet, workload, trace, policy, compare, report, seed, placement, preemption, reservations, layouts, json_mode
) -> int:
    """Replay a workload or trace on a simulated fleet, in virtual time: what would this policy do?

    \b
      gpush simulate --fleet examples/fleet.yaml --workload examples/workload.yaml --report out/
      gpush simulate --trace openb data/traces/alibaba-openb-2023 --report out/openb

    The summary puts the two runs side by side and says which way each measure is good
    (GPU allocation: lower for the same need). A run that takes longer than a couple of
    seconds (the openb trace: 10-25 s) shows its progress on stderr; --json prints
    only the JSON on stdout.
    """
    trace_dir = None
    if trace:
        kind, trace_dir = trace
        if kind != "openb":
            raise click.UsageError(f"--trace {kind}: gpush reads the openb format (the Alibaba 2023 GPU trace)")
        if fleet or workload:
            raise click.UsageError("--trace brings its own nodes and pods: leave out --fleet and --workload")
    elif not (fleet and workload):
        raise click.UsageError("give --fleet and --workload, or --trace openb DIR")
    elif placement is not None:
        raise click.UsageError(
            "--placement is for --trace: a --fleet replay places as the broker does (best-fit for whole GPUs and "
            "MIG, fgd per GPU for MPS and time-slicing); leave it out"
        )
    if preemption and trace_dir:
        raise click.UsageError("--preemption replays a --fleet workload: a trace's pods say nothing of preemption")
    if reservations and (trace_dir or compare or preemption):
        raise click.UsageError(
            "--reservations compares a --fleet workload with and without gang reservations: leave out --trace, "
            "--compare and --preemption"
        )
    if layouts and (trace_dir or compare or preemption or reservations):
        raise click.UsageError(
            "--layouts compares three runs of a --fleet workload: leave out --trace, --compare and --preemption"
        )
    if policy is None and not trace_dir:
        from policies import shipped

        policy = shipped("default.yaml")
    return simulate(
        output(json_mode),
        fleet=fleet,
        workload=workload,
        trace=trace_dir,
        policy=policy,
        compare=compare,
        report=report,
        seed=seed,
        placement=placement or "fgd",
        preemption=preemption,
        reservations=reservations,
        layouts=layouts,
    )


def simulate(
    out: Output,
    *,
    fleet: str | None,
    workload: str | None,
    trace: str | None,
    policy: str | None,
    compare: str | None,
    report: str,
    seed: int,
    placement: str,
    preemption: bool = False,
    reservations: bool = False,
    layouts: bool = False,
) -> int:
    """Replay a workload or a trace in virtual time and write the report (no broker needed).
    A run longer than a couple of seconds shows its progress on stderr (stdout keeps the
    summary, or only the JSON)."""
    from broker.simulation.progress import Progress
    from broker.simulation.report import run_simulation
    from broker.simulation.report_text import summary_lines

    if layouts:
        return _simulate_layouts(out, fleet=fleet, workload=workload, policy=policy, report=report)

    with Progress(out.stderr) as progress:
        result = run_simulation(
            fleet,
            workload,
            trace,
            policy,
            compare,
            report,
            seed,
            placement=placement,
            progress=progress,
            preemption=preemption,
            reservations=reservations,
        )
    if out.json_mode:
        out.json(result)
        return EXIT_OK
    for line in summary_lines(result):
        out.line(line)
    out.line(f"report: {Path(report) / 'report.md'} (with results.json and PNG plots)")
    return EXIT_OK


def _simulate_layouts(out: Output, *, fleet: str, workload: str, policy: str, report: str) -> int:
    """``gpush simulate --layouts``: static layouts, dynamic MIG, and lending, compared."""
    from broker.simulation import layouts as layout_runs
    from broker.simulation.fleet import load_fleet_file
    from broker.simulation.progress import Progress
    from broker.simulation.report import load_policy_file
    from broker.simulation.workload import load_workload

    loaded = load_workload(workload)
    with Progress(out.stderr) as progress:

        def started(label: str):
            progress.step(f"replaying {label}", len(loaded.arrivals), "jobs")
            return progress.update

        runs = layout_runs.replay_layouts(
            load_fleet_file(fleet), load_policy_file(policy), loaded.arrivals, tenants=loaded.tenants, progress=started
        )
        inputs = {"fleet": fleet, "workload": workload, "policy": policy, "jobs": len(loaded.arrivals)}
        files = layout_runs.write_report(Path(report), runs, inputs)
    if out.json_mode:
        out.json({"runs": [r.summary() for r in runs], "verdict": layout_runs.verdict(runs), "files": files})
        return EXIT_OK
    for line in layout_runs.table(runs):
        out.line(line)
    out.line("")
    for line in textwrap.wrap(layout_runs.verdict(runs), 80):
        out.line(line)
    note = layout_runs.no_lending_note(runs)
    if note:
        out.note(f"note: {note}")
    out.line(f"report: {Path(report) / 'report.md'} (with results.json and PNG plots)")
    return EXIT_OK


# Registered on the root group by broker.cli.main.
COMMANDS = (simulate_command,)
