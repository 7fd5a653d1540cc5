"""The ``gpush`` command line: argument parsing only; the work is in broker.cli.commands.

Exit codes (stable, for scripts): 0 ok, 1 any other error, 2 usage error or invalid
job, 3 not found, 4 not allowed (no token, bad token, or not permitted).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from broker.cli import commands
from broker.cli.console import Output
from broker.client.sdk import GpushClient
from broker.core.config import DEFAULT_PORT, database_url
from broker.core.errors import EXIT_ERROR, EXIT_USAGE, GpushError
from broker.core.schemas import Isolation, Kind
from broker.core.states import JobState

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@dataclass
class Settings:
    url: str | None
    token: str | None
    database_url: str | None
    _client: GpushClient | None = field(default=None, repr=False)

    def client(self) -> GpushClient:
        if self._client is None:
            if self.url:
                self._client = GpushClient(self.url, self.token)
            else:
                self._client = GpushClient.embedded(self.database_url, self.token)
        return self._client

    def resolved_database_url(self) -> str:
        return database_url(self.database_url)


def json_option(f):
    return click.option("--json", "json_mode", is_flag=True, help="Print only JSON, for scripts.")(f)


@click.group(context_settings=CONTEXT)
@click.option(
    "--url",
    envvar="GPUSH_URL",
    show_envvar=True,
    metavar="URL",
    help="Broker to talk to (http://host:8642). Unset: run the broker in-process on the local database.",
)
@click.option(
    "--token",
    envvar="GPUSH_TOKEN",
    show_envvar=True,
    metavar="TOKEN",
    help="API token. Unset in-process: the local admin token from the config directory.",
)
@click.option(
    "--database-url",
    envvar="GPUSH_DATABASE_URL",
    show_envvar=True,
    metavar="URL",
    help="postgresql+psycopg://user@host/db or sqlite:///path. Default: SQLite in the user data directory.",
)
@click.version_option(package_name="gpush")
@click.pass_context
def cli(ctx: click.Context, url: str | None, token: str | None, database_url: str | None) -> None:
    """gpush: one global queue of GPU jobs above Slurm and Kubernetes.

    With no --url, commands run the broker in this process on the embedded
    database (SQLite in your data directory), so a first look needs no server.

    Exit codes: 0 ok, 1 other error, 2 usage error or invalid job, 3 not found,
    4 not allowed.
    """
    ctx.obj = Settings(url=url, token=token, database_url=database_url)
    ctx.call_on_close(lambda: ctx.obj._client and ctx.obj._client.close())


def _out(json_mode: bool = False) -> Output:
    return Output(json_mode=json_mode)


# -- jobs -------------------------------------------------------------------------


@cli.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option(
    "-f",
    "--file",
    "file",
    metavar="FILE",
    help="Job YAML (one job, or several as --- documents or a list); - reads stdin. Flags override its fields.",
)
@click.option("--name", help="A name for the job.")
@click.option("--kind", type=click.Choice([k.value for k in Kind]), help="training, inference or batch.")
@click.option(
    "--isolation",
    type=click.Choice([i.value for i in Isolation]),
    help="exclusive (whole GPUs), hardware (MIG), process (MPS), none (time-slicing). Default: by kind.",
)
@click.option("--gpus", type=int, help="GPUs or GPU slices per replica (default 1).")
@click.option(
    "--gpu-memory-gb",
    "gpu_memory_gb",
    type=float,
    help="GPU memory each GPU or slice needs, in GB (required unless exclusive).",
)
@click.option("--min-replicas", type=int, help="Elastic inference: fewest replicas.")
@click.option("--max-replicas", type=int, help="Elastic inference: most replicas.")
@click.option("--cpus", type=int, help="CPUs per replica.")
@click.option("--memory", help="Host memory per replica: 16G, 512M.")
@click.option("--time-limit", help="90 (minutes), 2h, 1h30m, HH:MM:SS or D-HH:MM:SS.")
@click.option("--image", help="Container image (Kubernetes; Slurm with a container runtime).")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable, repeatable.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Label, repeatable.")
@click.option("--tenant", help="Tenant (admins only; default: your token's).")
@click.option("--user", help="User (admins only; default: your token's).")
@click.option("--priority", type=int, help="-1000 to 1000; higher runs first (default 0).")
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
      gpush submit --ray http://ray-head:8265 -- python serve_app.py
    """
    from broker.intake.jobfile import parse_pairs

    if ray_address:
        return commands.submit_ray_job(
            _out(json_mode), ray_address, list(command), submission_id=fields.get("idempotency_key")
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
    return commands.submit(settings.client(), _out(json_mode), file=file, file_text=file_text, fields=fields)


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@json_option
@click.pass_obj
def status(settings: Settings, job_id: int, json_mode: bool) -> int:
    """Show a job: its spec, state, reason and latest events."""
    return commands.status(settings.client(), _out(json_mode), job_id)


@cli.command("list", context_settings=CONTEXT)
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in JobState]),
    help="Only jobs in this state; repeatable.",
)
@click.option("--tenant", help="Only this tenant's jobs (admins).")
@click.option("--user", help="Only this user's jobs.")
@click.option("--kind", type=click.Choice([k.value for k in Kind]))
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Only jobs with this label; repeatable.")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True, help="Jobs per page.")
@click.option("--cursor", help="Next page: the cursor the previous page printed.")
@click.option("--all", "all_pages", is_flag=True, help="Every page.")
@json_option
@click.pass_obj
def list_(settings: Settings, json_mode: bool, **filters: Any) -> int:
    """List jobs, newest first."""
    from broker.intake.jobfile import parse_pairs

    filters["states"] = list(filters["states"])
    filters["labels"] = parse_pairs(filters["labels"], option="--label") or None
    return commands.list_jobs(settings.client(), _out(json_mode), **filters)


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@json_option
@click.pass_obj
def events(settings: Settings, job_id: int, json_mode: bool) -> int:
    """Every state change of a job, with time and reason."""
    return commands.events(settings.client(), _out(json_mode), job_id)


@cli.command(context_settings=CONTEXT)
@click.argument("job_ids", type=int, nargs=-1, required=True)
@json_option
@click.pass_obj
def cancel(settings: Settings, job_ids: tuple[int, ...], json_mode: bool) -> int:
    """Cancel jobs: queued ones end at once; running ones stop when their cluster confirms."""
    return commands.cancel(settings.client(), _out(json_mode), list(job_ids))


@cli.command(context_settings=CONTEXT)
@click.argument("job_id", type=int)
@click.argument("replicas", type=int)
@json_option
@click.pass_obj
def scale(settings: Settings, job_id: int, replicas: int, json_mode: bool) -> int:
    """Scale running elastic job JOB_ID to REPLICAS (within its elastic range and quota)."""
    job = settings.client().scale(job_id, replicas)
    if json_mode:
        _out(json_mode).json(job)
    else:
        click.echo(f"job {job.id}: {replicas} replicas ({job.state.value})")
    return 0


@cli.command(context_settings=CONTEXT)
@json_option
@click.pass_obj
def whoami(settings: Settings, json_mode: bool) -> int:
    """Show the user, tenant and role of the token in use."""
    return commands.whoami(settings.client(), _out(json_mode))


# -- server and database ----------------------------------------------------------


@cli.command(context_settings=CONTEXT)
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
@click.pass_obj
def server(
    settings: Settings,
    host: str,
    port: int,
    workers: int | None,
    log_level: str,
    scheduler: bool,
    cycle_interval: float,
) -> int:
    """Run the broker: the REST API on HOST:PORT over the configured database."""
    import os

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


@cli.group("scheduler", context_settings=CONTEXT)
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
        settings.resolved_database_url(), _out(json_mode), cycles=cycles, interval=interval, metrics_port=metrics_port
    )


@cli.group(context_settings=CONTEXT)
def db() -> None:
    """Database schema: upgrade it, show its version."""


@db.command("upgrade", context_settings=CONTEXT)
@json_option
@click.pass_obj
def db_upgrade(settings: Settings, json_mode: bool) -> int:
    """Apply every migration up to the head revision (safe to re-run)."""
    return commands.db_upgrade(settings.resolved_database_url(), _out(json_mode))


@db.command("current", context_settings=CONTEXT)
@json_option
@click.pass_obj
def db_current(settings: Settings, json_mode: bool) -> int:
    """Show the schema revision of the database and whether it is at head."""
    return commands.db_current(settings.resolved_database_url(), _out(json_mode))


# -- admin ------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT)
def admin() -> None:
    """Administration (needs an admin token)."""


@admin.group(context_settings=CONTEXT)
def token() -> None:
    """API tokens: create, list, revoke."""


@token.command("create", context_settings=CONTEXT)
@click.option("--user", required=True, help="Who the token is for.")
@click.option("--tenant", required=True, help="The tenant whose jobs the token sees.")
@click.option(
    "--role",
    type=click.Choice(["user", "admin", "agent"]),
    default="user",
    show_default=True,
    help="agent: a node agent's token (gpush agent), which may only report its node's GPUs.",
)
@click.option("--description", help="A note, such as what the token is for.")
@json_option
@click.pass_obj
def token_create(settings: Settings, json_mode: bool, **fields: Any) -> int:
    """Create a token and print it (shown once)."""
    return commands.token_create(settings.client(), _out(json_mode), **fields)


@token.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def token_list(settings: Settings, json_mode: bool) -> int:
    """List tokens (their prefixes; secrets are never stored)."""
    return commands.token_list(settings.client(), _out(json_mode))


@token.command("revoke", context_settings=CONTEXT)
@click.argument("token_ids", type=int, nargs=-1, required=True)
@json_option
@click.pass_obj
def token_revoke(settings: Settings, token_ids: tuple[int, ...], json_mode: bool) -> int:
    """Revoke tokens by id (effective on every broker within 5 seconds)."""
    return commands.token_revoke(settings.client(), _out(json_mode), list(token_ids))


# -- routing policy -----------------------------------------------------------------


@cli.group(context_settings=CONTEXT)
def policy() -> None:
    """The routing policy: validate, apply, show, history, diff, rollback, explain, schema."""


def _policy_file(path: str) -> str:
    return commands.read_job_file(path, lambda: sys.stdin.read())


@policy.command("validate", context_settings=CONTEXT)
@click.argument("file")
@json_option
@click.pass_obj
def policy_validate(settings: Settings, file: str, json_mode: bool) -> int:
    """Check FILE against the registered clusters (exit 2 if it would be refused)."""
    return commands.policy_validate(settings.client(), _out(json_mode), text=_policy_file(file), source=file)


@policy.command("apply", context_settings=CONTEXT)
@click.argument("file")
@click.option("-m", "--message", "comment", required=True, help="Why: kept in the policy's history.")
@click.option("--base", type=int, help="The version you edited against (default: the active one, read now).")
@json_option
@click.pass_obj
def policy_apply(settings: Settings, file: str, comment: str, base: int | None, json_mode: bool) -> int:
    """Validate FILE and make it the active policy (admins). Refused: the active one stays."""
    return commands.policy_apply(
        settings.client(), _out(json_mode), text=_policy_file(file), source=file, comment=comment, base=base
    )


@policy.command("show", context_settings=CONTEXT)
@click.option("--version", type=int, help="A stored version (default: the active one).")
@json_option
@click.pass_obj
def policy_show(settings: Settings, version: int | None, json_mode: bool) -> int:
    """Print the active policy (or a version) as YAML."""
    return commands.policy_show(settings.client(), _out(json_mode), version=version)


@policy.command("history", context_settings=CONTEXT)
@json_option
@click.pass_obj
def policy_history(settings: Settings, json_mode: bool) -> int:
    """Every version: who, when, why; * marks the active one."""
    return commands.policy_history(settings.client(), _out(json_mode))


@policy.command("diff", context_settings=CONTEXT)
@click.argument("a", type=int)
@click.argument("b", type=int)
@json_option
@click.pass_obj
def policy_diff(settings: Settings, a: int, b: int, json_mode: bool) -> int:
    """Unified diff from version A to version B."""
    return commands.policy_diff(settings.client(), _out(json_mode), a, b)


@policy.command("rollback", context_settings=CONTEXT)
@click.argument("version", type=int)
@click.option("-m", "--message", "comment", default="", help="Why.")
@json_option
@click.pass_obj
def policy_rollback(settings: Settings, version: int, comment: str, json_mode: bool) -> int:
    """Make VERSION's text active again, as a new version (admins)."""
    return commands.policy_rollback(settings.client(), _out(json_mode), version=version, comment=comment)


@policy.command("explain", context_settings=CONTEXT)
@click.argument("job_id", type=int, required=False)
@click.option("-f", "--file", "file", metavar="FILE", help="Explain a job file instead of a queued job.")
@click.option("--version", type=int, help="Against a stored version (default: the active one).")
@json_option
@click.pass_obj
def policy_explain(
    settings: Settings, job_id: int | None, file: str | None, version: int | None, json_mode: bool
) -> int:
    """Every rule tried for a job, in order, and why; then where it would be placed now."""
    from broker.intake.jobfile import build_specs, load_documents

    if (job_id is None) == (file is None):
        raise click.UsageError("give a JOB_ID or -f FILE")
    spec = None
    if file:
        spec = build_specs(load_documents(_policy_file(file), source=file), {}, source=file)[0]
    return commands.policy_explain(settings.client(), _out(json_mode), job_id=job_id, spec=spec, version=version)


@policy.command("schema", context_settings=CONTEXT)
@click.pass_obj
def policy_schema(settings: Settings) -> int:
    """Print the JSON Schema of policy files (for editor completion)."""
    import json

    from broker.routing.policy import policy_json_schema

    click.echo(json.dumps(policy_json_schema(), indent=2))
    return 0


# -- simulation ---------------------------------------------------------------------


@cli.command(context_settings=CONTEXT)
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
@click.option("--compare", metavar="FILE", help="A second policy to compare (default: every job on whole GPUs).")
@click.option("--report", "report", metavar="DIR", required=True, help="Where report.md, results.json and PNGs go.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampled experiments.")
@click.option(
    "--placement",
    type=click.Choice(["fgd", "best-fit"]),
    default="fgd",
    show_default=True,
    help="Placement on shared GPUs: fragmentation-aware (FGD) or best fit.",
)
@json_option
def simulate(fleet, workload, trace, policy, compare, report, seed, placement, json_mode) -> int:
    """Replay a workload or trace on a simulated fleet, in virtual time: what would this policy do?

    \b
      gpush simulate --fleet examples/fleet.yaml --workload examples/workload.yaml --report out/
      gpush simulate --trace openb ../shared/traces/alibaba-openb-2023 --report out/openb
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
    if policy is None and not trace_dir:
        from policies import shipped

        policy = shipped("default.yaml")
    return commands.simulate(
        _out(json_mode),
        fleet=fleet,
        workload=workload,
        trace=trace_dir,
        policy=policy,
        compare=compare,
        report=report,
        seed=seed,
        placement=placement,
    )


# -- clusters and tenants -----------------------------------------------------------


@cli.group(context_settings=CONTEXT)
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
        config["fleet_yaml"] = commands.read_job_file(fleet, lambda: sys.stdin.read())
    if fleet_cluster:
        config["cluster"] = fleet_cluster
    if speed is not None:
        config["speed"] = speed
    return commands.cluster_add(
        settings.client(), _out(json_mode), name=name, kind=kind, config=config, replace=replace
    )


@cluster.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def cluster_list(settings: Settings, json_mode: bool) -> int:
    """Registered clusters with health and capacity."""
    return commands.cluster_list(settings.client(), _out(json_mode))


@cluster.command("remove", context_settings=CONTEXT)
@click.argument("name")
@click.pass_obj
def cluster_remove(settings: Settings, name: str) -> int:
    """Forget cluster NAME (admins). Jobs on it are not touched."""
    settings.client().remove_cluster(name)
    click.echo(f"cluster {name} removed")
    return 0


@cli.group(context_settings=CONTEXT)
def k8s() -> None:
    """Kubernetes clusters: the GPU Operator's time-slicing configuration."""


@k8s.group("timeslice", context_settings=CONTEXT)
def timeslice() -> None:
    """Time-slicing: render the device-plugin ConfigMap and ClusterPolicy patch, or apply them."""


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
    """Print the ConfigMap, the ClusterPolicy patch and the node labels (kubectl can apply them)."""
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
        _out(json_mode).json(result)
    else:
        for change in result["changes"] or ["nothing to change: the cluster already has this configuration"]:
            click.echo(change)
    return 0


@cli.group(context_settings=CONTEXT)
def tenant() -> None:
    """Tenants: fair-share weights and GPU quotas."""


@tenant.command("set", context_settings=CONTEXT)
@click.argument("name")
@click.option("--weight", type=float, help="Fair-share weight (default 1): shares under contention are proportional.")
@click.option("--gpu-quota", type=float, help="Most physical GPU-equivalents the tenant holds at once.")
@click.option("--no-quota", "clear_quota", is_flag=True, help="Remove the tenant's quota.")
@json_option
@click.pass_obj
def tenant_set(settings: Settings, name: str, weight, gpu_quota, clear_quota, json_mode) -> int:
    """Set tenant NAME's weight and quota (admins)."""
    return commands.tenant_set(
        settings.client(), _out(json_mode), name, weight=weight, gpu_quota=gpu_quota, clear_quota=clear_quota
    )


@tenant.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def tenant_list(settings: Settings, json_mode: bool) -> int:
    """Tenants with weight, quota and GPU-equivalents in use."""
    return commands.tenant_list(settings.client(), _out(json_mode))


# -- inventory -------------------------------------------------------------------------


@cli.group("inventory", invoke_without_command=True, context_settings=CONTEXT)
@click.option("--cluster", help="Only this cluster.")
@click.option("--gpus", is_flag=True, help="A row per physical GPU too.")
@json_option
@click.pass_context
def inventory(ctx: click.Context, cluster: str | None, gpus: bool, json_mode: bool) -> int | None:
    """The GPU inventory of every cluster, reconciled with the node agents (per cluster, node, GPU)."""
    if ctx.invoked_subcommand is not None:
        return None
    settings: Settings = ctx.obj
    return commands.inventory(settings.client(), _out(json_mode), cluster=cluster, gpus=gpus)


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
    return commands.drift(settings.client(), _out(json_mode), cluster=cluster, severity=severity, fail_on=fail_on)


@cli.group(context_settings=CONTEXT)
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
    return commands.gres_conf(settings.client(), _out(json_mode), node=node, style=style)


@cli.group(context_settings=CONTEXT)
def mig() -> None:
    """MIG layouts."""


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
        _out(json_mode),
        cluster=cluster,
        repartition_busy=repartition_busy,
        enable_mig=enable_mig,
        show=show,
    )


@cli.command(context_settings=CONTEXT)
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
@click.pass_obj
def agent(settings: Settings, node: str | None, interval: float, once: bool, recording: str | None) -> int:
    """Report this node's GPUs (NVML) to the broker every --interval seconds, with an agent token."""
    return commands.agent(settings, _out(), node=node, interval=interval, once=once, recording=recording)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI and turn every outcome into a stable exit code."""
    try:
        code = cli.main(args=argv, prog_name="gpush", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code  # usage errors: 2
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        code = EXIT_ERROR
    except GpushError as exc:
        click.echo(f"gpush: error: {exc.message}", err=True)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["cli", "main", "EXIT_USAGE"]
