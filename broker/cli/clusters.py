"""``gpush`` commands on clusters and their GPUs: registering clusters (cluster), the
reconciled GPU inventory and its drift (inventory), and the per-backend configuration
gpush renders or applies: Kubernetes time-slicing (k8s), Slurm gres.conf (slurm) and
MIG layouts (mig)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from broker.cli import commands
from broker.cli.settings import CONTEXT, Settings, format_option, json_option, output


@click.group(context_settings=CONTEXT)
def cluster() -> None:
    """Clusters gpush places jobs on: add, list, remove."""


@cluster.command("add", context_settings=CONTEXT)
@click.argument("name")
@click.option("--kind", type=click.Choice(["sim", "slurm", "k8s"]), required=True, help="Which adapter talks to it.")
@click.option("--fleet", "fleet", metavar="FILE", help="sim: the fleet file (its text is stored with the cluster).")
@click.option("--fleet-cluster", help="sim: which cluster of the fleet file (default: NAME).")
@click.option("--speed", type=float, help="sim: virtual seconds per wall-clock second (default 1).")
@click.option("--kubeconfig", metavar="FILE", help="k8s: the kubeconfig file (default: in-cluster or ~/.kube/config).")
@click.option("--context", "kube_context", metavar="NAME", help="k8s: the kubeconfig context to use.")
@click.option("--namespace", metavar="NAME", help="k8s: the namespace gpush's jobs run in (default gpush).")
@click.option("--config", "pairs", multiple=True, metavar="KEY=VALUE", help="Adapter setting, repeatable.")
@click.option("--replace", is_flag=True, help="Change the configuration of a registered cluster.")
@json_option
@click.pass_obj
def cluster_add(
    settings: Settings, name, kind, fleet, fleet_cluster, speed, kubeconfig, kube_context, namespace, pairs, replace,
    json_mode,
) -> int:  # fmt: skip
    """Register cluster NAME (admins). The cluster must answer.

    \b
      gpush cluster add slurm-a --kind sim --fleet examples/fleet.yaml
      gpush cluster add slurm-prod --kind slurm --config rest_url=http://slurm:6820 --config token_env=SLURM_JWT
      gpush cluster add k8s-a --kind k8s --kubeconfig ~/.kube/config --context prod --namespace gpush
    """
    from broker.intake.jobfile import parse_pairs

    config: dict[str, Any] = parse_pairs(pairs, option="--config")
    for key, value in (("kubeconfig", kubeconfig), ("context", kube_context), ("namespace", namespace)):
        if value:
            if kind != "k8s":
                raise click.UsageError(f"--{key} is a Kubernetes setting: use it with --kind k8s")
            config[key] = str(Path(value).expanduser().resolve()) if key == "kubeconfig" else value
    if fleet:
        config["fleet_yaml"] = commands.read_job_file(fleet, lambda: sys.stdin.read(), what="fleet file")
    if fleet_cluster:
        config["cluster"] = fleet_cluster
    if speed is not None:
        config["speed"] = speed
    return commands.cluster_add(
        settings.client(), output(json_mode), name=name, kind=kind, config=config, replace=replace
    )


@cluster.command("list", context_settings=CONTEXT)
@format_option
@click.pass_obj
def cluster_list(settings: Settings, json_mode: bool, fmt: str) -> int:
    """Registered clusters with health and capacity."""
    return commands.cluster_list(settings.client(), output(json_mode, fmt))


@cluster.command("remove", context_settings=CONTEXT)
@click.argument("name")
@click.pass_obj
def cluster_remove(settings: Settings, name: str) -> int:
    """Forget cluster NAME (admins). Jobs on it are not touched."""
    settings.client().remove_cluster(name)
    click.echo(f"cluster {name} removed")
    return 0


@click.group(context_settings=CONTEXT)
def k8s() -> None:
    """Kubernetes clusters: the GPU Operator's time-slicing configuration."""


@k8s.group("timeslice", context_settings=CONTEXT)
def timeslice() -> None:
    """Time-slicing: render the device plugin's ConfigMap and the ClusterPolicy for kubectl, or apply them."""


_REPLICAS = click.option("--replicas", type=click.IntRange(1, 64), required=True, help="Time-slices per GPU.")
_NODE_LABEL = click.option("--node-label", metavar="KEY=VALUE", help="Only the nodes with this label (default: all).")


@timeslice.command("render", context_settings=CONTEXT)
@_REPLICAS
@_NODE_LABEL
@click.option(
    "--config-map",
    default="gpu-operator/time-slicing-config",
    show_default=True,
    metavar="NAMESPACE/NAME",
    help="Where the device plugin reads its config.",
)
def timeslice_render(replicas: int, node_label: str | None, config_map: str) -> int:
    """Print the ConfigMap and the ClusterPolicy for `kubectl apply -f -` (with --node-label,
    the `kubectl label nodes` command to run after, in a comment)."""
    from adapters.k8s.timeslice import render_timeslice

    try:
        plan = render_timeslice(replicas, node_label=node_label, config_map=config_map)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(plan.to_yaml(), nl=False)
    return 0


@timeslice.command("apply", context_settings=CONTEXT)
@click.argument("cluster")
@_REPLICAS
@_NODE_LABEL
@json_option
@click.pass_obj
def timeslice_apply(settings: Settings, cluster: str, replicas: int, node_label: str | None, json_mode) -> int:
    """Apply time-slicing to Kubernetes cluster CLUSTER through its API (admins)."""
    result = settings.client().apply_timeslice(cluster, replicas, node_label)
    if json_mode:
        output(json_mode).json(result)
    else:
        for change in result["changes"] or ["nothing to change: the cluster already has this configuration"]:
            click.echo(change)
    return 0


# -- inventory -------------------------------------------------------------------------


@click.group("inventory", invoke_without_command=True, context_settings=CONTEXT)
@click.option("-M", "--cluster", help="Only this cluster.")
@click.option("--gpus", is_flag=True, help="A row per physical GPU too.")
@format_option
@click.pass_context
def inventory(ctx: click.Context, cluster: str | None, gpus: bool, json_mode: bool, fmt: str) -> int | None:
    """The GPU inventory of every cluster, reconciled with the node agents (per cluster, node, GPU)."""
    if ctx.invoked_subcommand is not None:
        return None
    settings: Settings = ctx.obj
    return commands.inventory(settings.client(), output(json_mode, fmt), cluster=cluster, gpus=gpus)


@inventory.command("drift", context_settings=CONTEXT)
@click.option("--cluster", help="Only this cluster.")
@click.option(
    "--severity",
    type=click.Choice(commands.SEVERITIES),
    default="info",
    show_default=True,
    help="Show findings this bad or worse.",
)
@click.option(
    "--fail-on",
    type=click.Choice(commands.SEVERITIES[:2]),
    help="Exit 1 when a finding this bad or worse exists (monitoring, CI).",
)
@json_option
@click.pass_obj
def inventory_drift(
    settings: Settings, cluster: str | None, severity: str, fail_on: str | None, json_mode: bool
) -> int:
    """Where the clusters and the GPUs disagree, worst first: what is wrong, why it matters, the fix."""
    return commands.drift(settings.client(), output(json_mode), cluster=cluster, severity=severity, fail_on=fail_on)


@click.group(context_settings=CONTEXT)
def slurm() -> None:
    """Slurm helpers."""


@slurm.command("gres-conf", context_settings=CONTEXT)
@click.argument("node")
@click.option(
    "--style",
    type=click.Choice(["multiple-files", "file", "nvml"]),
    default="multiple-files",
    show_default=True,
    help="MIG device files: MultipleFiles= (Slurm 23.02+), File= (older), or AutoDetect=nvml.",
)
@json_option
@click.pass_obj
def slurm_gres_conf(settings: Settings, node: str, style: str, json_mode: bool) -> int:
    """The gres.conf lines and slurm.conf Gres= field that match what NODE's agent sees."""
    return commands.gres_conf(settings.client(), output(json_mode), node=node, style=style)


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
def mig_plan(
    settings: Settings, cluster: str | None, repartition_busy: bool, enable_mig: bool, show: str, json_mode: bool
) -> int:
    """Per-GPU MIG layouts that place the most waiting MIG work, as mig-parted config and gres.conf."""
    return commands.mig_plan(
        settings.client(),
        output(json_mode),
        cluster=cluster,
        repartition_busy=repartition_busy,
        enable_mig=enable_mig,
        show=show,
    )


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
def mig_apply(
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
    return commands.mig_apply(
        settings.client(),
        output(json_mode),
        cluster=cluster,
        node=node,
        dry_run=dry_run,
        repartition_busy=repartition_busy,
    )


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
def mig_changes(settings: Settings, change_id: int | None, show_all: bool, clear: bool, json_mode: bool) -> int:
    """MIG layout changes under way (--all: every one), or one change's steps.

    Steps: planned, draining, emptying, changing (the GPU is re-cut), publishing,
    confirming; then done, rolled-back (a step ran out of time: the GPU is back on
    its old layout), cancelled (its work did not end in time: nothing changed) or
    failed (the rollback ran out too: the node stays fenced until --clear)."""
    if clear and change_id is None:
        raise click.UsageError("--clear needs the CHANGE_ID of a failed change")
    return commands.mig_changes(
        settings.client(), output(json_mode), change_id=change_id, show_all=show_all, clear=clear
    )


@click.group(context_settings=CONTEXT)
def lending() -> None:
    """Nodes two clusters share, lent as their queues call for it (the policy's lending pools)."""


@lending.command("moves", context_settings=CONTEXT)
@click.option("--all", "show_all", is_flag=True, help="Also the moves that ended.")
@json_option
@click.pass_obj
def lending_moves(settings: Settings, show_all: bool, json_mode: bool) -> int:
    """The nodes moving between clusters now (--all: every move), each with its steps.

    \b
    Steps: draining (fenced where it was; its jobs there end, or are preempted
    if they may be), configuring (set up as the pool's setup says, fenced on
    both), joining (unfenced on the other side); then done, or called-off (the
    reason to move went away, or the setup failed: it stays where it was).
    Admins only."""
    return commands.lending_moves(settings.client(), output(json_mode), show_all=show_all)


# Registered on the root group by broker.cli.main.
COMMANDS = (cluster, k8s, inventory, slurm, mig, lending)
