"""``gpush`` commands on clusters and their GPUs: registering clusters (cluster), the
reconciled GPU inventory and its drift (inventory), and the per-backend configuration
gpush renders or applies: Kubernetes time-slicing (k8s) and Slurm gres.conf (slurm).
MIG layouts and the nodes lent between clusters are broker.cli.fleet's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from broker.cli import console, inventory_tables
from broker.cli.console import Output
from broker.cli.input_files import read_job_file
from broker.cli.settings import CONTEXT, Settings, format_option, json_option, output
from broker.core.errors import EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


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
def cluster_add_command(
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
        config["fleet_yaml"] = read_job_file(fleet, lambda: sys.stdin.read(), what="fleet file")
    if fleet_cluster:
        config["cluster"] = fleet_cluster
    if speed is not None:
        config["speed"] = speed
    return cluster_add(settings.client(), output(json_mode), name=name, kind=kind, config=config, replace=replace)


def cluster_add(
    client: GpushClient, out: Output, *, name: str, kind: str, config: dict[str, Any], replace: bool
) -> int:
    summary = client.add_cluster(name, kind, config, replace=replace)
    if out.json_mode:
        out.json(summary)
    else:
        out.line(f"cluster {name} ({kind}) registered: {_capacity_line(summary)}")
    return EXIT_OK


def _capacity_line(summary: dict[str, Any]) -> str:
    health = summary["health"]
    state = "healthy" if health["ok"] else f"UNHEALTHY ({health['detail']})"
    return f"{state}, {summary['nodes']} nodes, {summary['gpu_free']:.1f} of {summary['gpu_total']:.1f} GPUs free"


@cluster.command("list", context_settings=CONTEXT)
@format_option
@click.pass_obj
def cluster_list_command(settings: Settings, json_mode: bool, fmt: str) -> int:
    """Registered clusters with health and capacity."""
    return cluster_list(settings.client(), output(json_mode, fmt))


def cluster_list(client: GpushClient, out: Output) -> int:
    summaries = client.list_clusters()
    if out.json_mode:
        out.json(summaries)
        return EXIT_OK
    if out.fmt == "name":
        for c in summaries:
            out.line(c["name"])
        return EXIT_OK
    if not summaries:
        out.note("no clusters: an admin adds one with `gpush cluster add NAME --kind sim|slurm|k8s ...`")
        return EXIT_OK
    out.print(console.clusters_table(summaries, width=out.console.width))
    return EXIT_OK


@cluster.command("remove", context_settings=CONTEXT)
@click.argument("name")
@click.pass_obj
def cluster_remove_command(settings: Settings, name: str) -> int:
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
def timeslice_render_command(replicas: int, node_label: str | None, config_map: str) -> int:
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
def timeslice_apply_command(settings: Settings, cluster: str, replicas: int, node_label: str | None, json_mode) -> int:
    """Apply time-slicing to Kubernetes cluster CLUSTER through its API (admins)."""
    result = settings.client().apply_timeslice(cluster, replicas, node_label)
    if json_mode:
        output(json_mode).json(result)
    else:
        for change in result["changes"] or ["nothing to change: the cluster already has this configuration"]:
            click.echo(change)
    return 0


# -- inventory -------------------------------------------------------------------------


SEVERITIES = ("critical", "warning", "info")


@click.group("inventory", invoke_without_command=True, context_settings=CONTEXT)
@click.option("-M", "--cluster", help="Only this cluster.")
@click.option("--gpus", is_flag=True, help="A row per physical GPU too.")
@click.option(
    "--topology",
    is_flag=True,
    help="How close GPUs and nodes are: each node's network domain (block, rack, Slurm switch), "
    "NVLink islands, PCIe switches and sockets, and where each was read.",
)
@format_option
@click.pass_context
def inventory_group(
    ctx: click.Context, cluster: str | None, gpus: bool, topology: bool, json_mode: bool, fmt: str
) -> int | None:
    """The GPU inventory of every cluster, reconciled with the node agents (per cluster, node, GPU)."""
    if ctx.invoked_subcommand is not None:
        return None
    settings: Settings = ctx.obj
    return inventory(settings.client(), output(json_mode, fmt), cluster=cluster, gpus=gpus, topology=topology)


def inventory(client: GpushClient, out: Output, *, cluster: str | None, gpus: bool, topology: bool = False) -> int:
    """The reconciled inventory: per cluster and sharing mode, then per node (and GPU);
    with ``topology``, per node its network domain and how close its GPUs are."""
    view = client.inventory(cluster)
    if out.json_mode:
        out.json(view)
        return EXIT_OK
    if out.fmt == "name":
        for c in view["clusters"]:
            for n in c["nodes"]:
                out.line(f"{c['name']}/{n['name']}")
        return EXIT_OK
    if not view["clusters"] and not view.get("unscheduled"):
        out.note("no clusters and no agent reports: add a cluster (gpush cluster add) or run `gpush agent` on a node")
        return EXIT_OK
    if topology:
        for part in inventory_tables.topology_tables(view, width=out.console.width):
            out.print(part)
        for note in inventory_tables.topology_notes(view):
            out.print(note)
        if not any(n.get("gpu_topology") or n.get("topology") for c in view["clusters"] for n in c["nodes"]):
            out.note(
                "no topology known: run `gpush agent` on the nodes (NVML), give Slurm a topology.conf and "
                "gres.conf Links=, name a Kubernetes cluster's topology_levels, or give a simulated fleet's "
                "nodes gpu_topology: and block:"
            )
        return EXIT_OK
    out.print(inventory_tables.inventory_clusters_table(view, width=out.console.width))
    out.line("")
    out.print(inventory_tables.inventory_nodes_table(view, gpus=gpus, width=out.console.width))
    for note in inventory_tables.reservation_notes(view):
        out.print(note)
    counts = view.get("findings_by_severity", {})
    if any(counts.values()):
        summary = ", ".join(f"{counts[s]} {s}" for s in SEVERITIES if counts.get(s))
        out.note(f"drift: {summary}; `gpush inventory drift` says what is wrong and how to fix it")
    return EXIT_OK


@inventory_group.command("drift", context_settings=CONTEXT)
@click.option("-M", "--cluster", help="Only this cluster.")
@click.option(
    "--severity",
    type=click.Choice(SEVERITIES),
    default="info",
    show_default=True,
    help="Show findings this bad or worse.",
)
@click.option(
    "--fail-on",
    type=click.Choice(SEVERITIES[:2]),
    help="Exit 1 when a finding this bad or worse exists (monitoring, CI).",
)
@json_option
@click.pass_obj
def inventory_drift_command(
    settings: Settings, cluster: str | None, severity: str, fail_on: str | None, json_mode: bool
) -> int:
    """Where the clusters and the GPUs disagree, worst first: what is wrong, why it matters, the fix."""
    return drift(settings.client(), output(json_mode), cluster=cluster, severity=severity, fail_on=fail_on)


def drift(client: GpushClient, out: Output, *, cluster: str | None, severity: str, fail_on: str | None) -> int:
    """Drift findings at ``severity`` or worse, worst first. With ``fail_on``, exit 1 when
    a finding of that severity or worse exists (for monitoring scripts)."""
    keep = SEVERITIES[: SEVERITIES.index(severity) + 1]
    findings = [f for f in client.drift(cluster) if f["severity"] in keep]
    if out.json_mode:
        out.json(findings)
    elif not findings:
        out.note("no drift: the clusters and the GPUs agree" + ("" if severity == "info" else f" (at {severity})"))
    else:
        for i, finding in enumerate(findings):
            if i:
                out.line("")
            out.print(inventory_tables.finding_text(finding))
    if fail_on is not None:
        worst = SEVERITIES[: SEVERITIES.index(fail_on) + 1]
        if any(f["severity"] in worst for f in findings):
            return EXIT_ERROR
    return EXIT_OK


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
def slurm_gres_conf_command(settings: Settings, node: str, style: str, json_mode: bool) -> int:
    """The gres.conf lines and slurm.conf Gres= field that match what NODE's agent sees."""
    return gres_conf(settings.client(), output(json_mode), node=node, style=style)


def gres_conf(client: GpushClient, out: Output, *, node: str, style: str) -> int:
    """The gres.conf block and slurm.conf Gres= field matching what the node's agent sees."""
    conf = client.gres_conf(node, style)
    if out.json_mode:
        out.json(conf)
        return EXIT_OK
    out.line(f"# gres.conf for {node}, from what its agent sees (gpush slurm gres-conf {node})")
    out.line(conf["text"].rstrip("\n"))
    out.line("")
    out.line(f"# slurm.conf: on the NodeName={node} line")
    out.line(f"Gres={conf['gres']}")
    out.note(
        "then make Slurm read it: scontrol reconfigure from Slurm 23.11; on 22.05 restart slurmctld and the "
        "node's slurmd (a reconfigure keeps a node's old GRES counts there)"
    )
    return EXIT_OK


# Registered on the root group by broker.cli.main.
COMMANDS = (cluster, k8s, inventory_group, slurm)
