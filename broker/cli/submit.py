"""``gpush submit``: queue a job (or each job of a job file) from flags and a job file,
or run the command as a Ray job and follow it to its end."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from broker.cli.console import Output
from broker.cli.input_files import read_job_file
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.errors import EXIT_ERROR, EXIT_OK, InvalidRequest, Unavailable
from broker.core.names import Isolation, Kind

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


@click.command("submit", context_settings={**CONTEXT, "allow_interspersed_args": False})
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
@click.option("-G", "--gpus", type=int, help="GPUs or GPU slices per replica, or per node with -N (default 1).")
@click.option(
    "-N",
    "--nodes",
    type=int,
    help="Nodes of a multi-node job, each with -G GPUs, -c CPUs and --memory; started on all at once or not at all "
    "(as sbatch -N; whole GPUs or MIG slices only).",
)
@click.option(
    "--ntasks-per-node",
    "tasks_per_node",
    type=int,
    help="Processes (ranks) per node (default 1), with or without -N: on Slurm srun starts that many copies of "
    "the command on each node; on Kubernetes the command runs once per node, and NPROC_PER_NODE tells its "
    "launcher (torchrun) how many to start.",
)
@click.option(
    "--topology",
    metavar="LEVEL[:required]",
    help="Keep the GPUs (nvlink, pcie, socket) or the nodes (block, rack, switch: the cluster's levels, "
    "`gpush inventory --topology`) within one domain of LEVEL: preferred (the fewest domains possible now), "
    "or with :required wait until one domain has room.",
)
@click.option(
    "--gpu-memory-gb",
    "gpu_memory_gb",
    type=float,
    help="GPU memory each GPU or slice needs, in GB (required unless exclusive).",
)
@click.option("--min-replicas", type=int, help="Elastic inference: fewest replicas.")
@click.option("--max-replicas", type=int, help="Elastic inference: most replicas.")
@click.option("-c", "--cpus", type=int, help="CPUs per replica.")
@click.option(
    "--memory",
    "--mem",
    help="Host memory per replica: 16G, 512M. A bare number is megabytes, as in sbatch: --memory 16 is 16 MB.",
)
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
def submit_command(
    settings: Settings, file, json_mode, command, env, labels, min_replicas, max_replicas, ray_address, **fields: Any
) -> int:
    """Queue a job and print its id. The command goes after --:

    \b
      gpush submit --kind training --gpus 2 -- python train.py --lr 3e-4
      gpush submit --kind training -N 2 -G 8 -- torchrun train.py
      gpush submit -f job.yaml --priority 10
      gpush submit --kind training --preemptible --checkpoint USR1@2m -- ./train.sh
      gpush submit --ray http://ray-head:8265 -- python serve_app.py
    """
    from broker.cli.command_line import refuse_ambiguous_submit
    from broker.intake.jobfile import parse_pairs

    refuse_ambiguous_submit(command)

    if ray_address:
        return submit_ray_job(
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
    if fields.get("topology") is not None:
        fields["topology"] = topology_ask(fields["topology"])
    file_text = read_job_file(file, lambda: sys.stdin.read()) if file else None
    out = output(json_mode)
    memory = fields.get("memory")
    if memory is not None and memory.strip().isdigit():
        out.note(f"gpush: --memory {memory.strip()} is {memory.strip()} MB (a bare number is megabytes, as in sbatch)")
    return submit(settings.client(), out, file=file, file_text=file_text, fields=fields)


def topology_ask(text: str) -> dict[str, str]:
    """``block`` or ``block:preferred`` -> {level: block, mode: preferred}; ``block:required``."""
    level, _, mode = text.strip().partition(":")
    if mode and mode not in ("required", "preferred"):
        raise InvalidRequest(
            f"--topology {text}: after the level comes :required or :preferred, not :{mode} "
            "(such as --topology block:required)"
        )
    return {"level": level, "mode": mode or "preferred"}


def submit(client: GpushClient, out: Output, *, file: str | None, file_text: str | None, fields: dict[str, Any]) -> int:
    """Submit the job(s) of ``file`` (if any) with ``fields`` laid over them; print the ids."""
    from broker.intake.jobfile import build_specs, load_documents

    docs = load_documents(file_text, source=file or "-") if file_text is not None else None
    specs = build_specs(docs, fields, source=file or "")
    if len(specs) == 1:
        job = client.submit(specs[0])
        if out.json_mode:
            out.json(job)
        else:
            out.line(str(job.id))
        never = never_runs(client, job.id)
        if never:
            out.note(
                f"gpush: job {job.id} can never run as asked, so it is held: {never}. It waits until the "
                f"policy or the clusters change (gpush policy explain {job.id}; gpush cancel {job.id} drops it)"
            )
        return EXIT_OK
    result = client.submit_batch(specs)
    if out.json_mode:
        out.json(result)
    else:
        for item in result["jobs"]:
            out.line(str(item["id"]))
    return EXIT_OK


def never_runs(client: GpushClient, job_id: int) -> str | None:
    """Why job ``job_id`` can never run where the active policy sends it, as sbatch says
    of an impossible request at once: no rule takes it, or no route of its rule could
    ever hold it with the clusters as they are. None when it may run, or when the broker
    cannot tell now (no policy, a cluster that does not answer: then it may)."""
    from broker.core.errors import GpushError

    try:
        explained = client.explain(job_id=job_id)
    except GpushError:
        return None
    routes, tried = explained.get("routes") or [], explained.get("placement") or []
    if not routes:
        return str(explained.get("message") or "no rule of the policy routes it")
    if len(tried) == len(routes) and all(not p.get("fits") and p.get("never") for p in tried):
        return "; ".join(f"{p['route']}: {p['reason']}" for p in tried)
    return None


def submit_ray_job(out: Output, address: str, command: list[str], *, submission_id: str | None = None) -> int:
    """Run ``command`` as a Ray job on the Ray cluster at ``address`` and follow it to its end."""
    import shlex

    from broker.ray.jobs import run_ray_job

    if not command:
        raise InvalidRequest("gpush submit --ray needs the job's entrypoint after --, such as -- python app.py")
    lines: list[str] = []
    try:
        status = run_ray_job(
            address,
            shlex.join(command),
            submission_id=submission_id,
            write=lines.append if out.json_mode else out.line,
        )
    except (RuntimeError, ConnectionError) as exc:  # Ray missing, or its job server unreachable
        raise Unavailable(
            f"{str(exc).rstrip('.')}: is the Ray head's dashboard at {address}? Check --ray / GPUSH_RAY_ADDRESS"
        ) from None
    if out.json_mode:
        out.json({"status": status, "logs": "\n".join(lines)})
    else:
        out.note(f"Ray job {status.lower()}")
    return EXIT_OK if status == "SUCCEEDED" else EXIT_ERROR


# Registered on the root group by broker.cli.main.
COMMANDS = (submit_command,)
