"""``gpush simulate``: replay a workload or trace on a simulated fleet, offline, in
virtual time."""

from __future__ import annotations

import click

from broker.cli import commands
from broker.cli.settings import CONTEXT, json_option, output


@click.command(context_settings=CONTEXT)
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
    "--layouts",
    is_flag=True,
    help="With --fleet: replay three ways, static layouts, MIG layouts re-planned for the queue, and that plus "
    "the nodes both clusters list lent between them as their queues call for it; the report compares them.",
)
@json_option
def simulate(fleet, workload, trace, policy, compare, report, seed, placement, preemption, layouts, json_mode) -> int:
    """Replay a workload or trace on a simulated fleet, in virtual time: what would this policy do?

    \b
      gpush simulate --fleet examples/fleet.yaml --workload examples/workload.yaml --report out/
      gpush simulate --trace openb ../shared/traces/alibaba-openb-2023 --report out/openb

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
    if layouts and (trace_dir or compare or preemption):
        raise click.UsageError(
            "--layouts compares three runs of a --fleet workload: leave out --trace, --compare and --preemption"
        )
    if policy is None and not trace_dir:
        from policies import shipped

        policy = shipped("default.yaml")
    return commands.simulate(
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
        layouts=layouts,
    )


# Registered on the root group by broker.cli.main.
COMMANDS = (simulate,)
