"""A gpush job rendered as a Slurm batch job, with no way for a shell to misread it.

What callers may assume:

- **No shell injection.** The batch script is ``#!/bin/sh``, ``export NAME='value'``
  for each variable and ``exec 'argv0' 'argv1' ...``: every value is single-quoted
  with :func:`shlex.quote`, so quotes, ``$()``, backquotes, ``;`` and newlines reach
  the program byte for byte. sbatch options are passed as argv (never through a
  shell) and the script on stdin; the REST backend sends the same script as JSON.
- **Always typed GRES.** slurm/mig → ``gpu:<profile>:<n>``; slurm/exclusive →
  ``gpu:<type>:<n>`` with the node's GRES type for the placement's GPU model;
  slurm/mps → ``mps:<count>``, the share of one GPU in the node's MPS units. An untyped
  ``gpu:<n>`` may land on any type, a MIG slice included, so it is never sent.
- **Tagged.** The job's name is ``<tag>-<gpush id>`` and its comment
  ``<tag>:job-<gpush id> ...``: both survive in squeue, the name also in the job
  completion log (which has no comment), so the adapter finds its jobs after a crash.
- **The job's environment** is broker.jobenv.environment's, the same as on Kubernetes:
  the job's variables, gpush's ``GPUSH_*`` (job id, GPU memory budget: its share of the
  GPU under MPS), and a job that sets ``CUDA_VISIBLE_DEVICES`` refused (Slurm sets it
  for the GRES it gives; the script's export would override it).
- **Output files** (:func:`log_paths`): ``--output`` ``<log_dir>/<tag>-<gpush id>.out`` and
  ``--error`` ``<log_dir>/<tag>-<gpush id>.err``, ``log_dir`` relative to the working
  directory unless absolute, with Slurm's ``%u`` (the job's user) allowed in it. Named
  by the gpush id alone, so they are found again from the id (after a broker restart,
  once Slurm has forgotten the job); a run Slurm starts again begins them afresh.
  Slurm creates no directory for them: a job whose directory is missing on its node
  fails at launch (``JobLaunchFailure``; the adapter creates it first where it can).
- **Where it runs**: ``--nodelist`` names the nodes gpush placed the job on, a one-node
  job's one node too, so that Slurm and gpush agree: left to choose, Slurm put 19 of 45
  one-node jobs on other nodes than gpush's (integration/bench/gangs_slurm.py), nodes
  gpush had reserved for a gang among them. A gang gpush placed under one leaf switch
  (topology/tree) also gets ``--switches=1``, one in one block (topology/block, Slurm 24.11
  on) ``--segment=<its nodes>``, so that Slurm holds it to that domain too; a gang across
  domains gets neither (adapters.slurm.topology).
- **Its GPUs on a node**: Slurm picks them. On 24.11 and later a one-node job of several
  whole GPUs on a node whose gres.conf has NVLink islands asks ``--gpus=<type>:<n>``
  rather than ``--gres``: those versions place a per-node ``--gres`` request on the lowest
  free indexes and follow ``Links=`` only for ``--gpus`` (measured on 24.11 and 26.05);
  22.05 follows ``Links=`` for ``--gres`` too.
- **Multi-node jobs** (:func:`launch_environment`): a gang is one batch job with
  ``--nodes=N --ntasks-per-node=T --nodelist=<gpush's nodes>``, the GRES, ``--mem`` and
  CPUs per node (``cpus`` split over the node's tasks), and its command run through
  ``srun`` as N x T tasks (one per node with ``tasks_per_node`` 1, as torchrun wants).
  Each task sees ``MASTER_ADDR`` (the address of Slurm's first node of the job, which
  runs the batch script: ``SLURM_NODEID`` 0), ``MASTER_PORT``, ``WORLD_SIZE`` (N x T),
  ``NNODES``, ``LOCAL_WORLD_SIZE`` (T), and its own ``NODE_RANK``, ``RANK`` and
  ``LOCAL_RANK`` (Slurm's ``SLURM_NODEID``, ``SLURM_PROCID``, ``SLURM_LOCALID``). A job
  that sets one of these itself keeps its value.
- **The job never sees the broker's environment**: only what the script exports, with
  a plain ``PATH`` unless the job sets its own (the REST backend sends exactly that
  environment; the command-line backend runs sbatch with only ``PATH`` and
  ``SLURM_CONF``, see :meth:`adapters.slurm.records.Submission.sbatch_args`).
"""

from __future__ import annotations

import math
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from adapters.slurm.records import Submission
from broker.core.adapter import Placement, Rejected, Sharing
from broker.core.schemas import JobSpec
from broker.core.spec_values import parse_memory_mib, parse_time_limit
from broker.jobenv.environment import job_environment

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# Variables the shell running the script owns: bash's read-only ones (an export of one
# fails, and ends the script where /bin/sh is bash in POSIX mode, as on RHEL), those it
# recomputes or unsets when the job's program starts, and dash's OPTIND (an export that
# is not a number ends the script). A job's value for one would never reach its program.
SHELL_VARIABLES = frozenset(
    {
        "_",
        "BASHOPTS",
        "BASHPID",
        "BASH_ALIASES",
        "BASH_ARGC",
        "BASH_ARGV",
        "BASH_ARGV0",
        "BASH_CMDS",
        "BASH_COMMAND",
        "BASH_LINENO",
        "BASH_SOURCE",
        "BASH_SUBSHELL",
        "BASH_VERSINFO",
        "DIRSTACK",
        "EPOCHREALTIME",
        "EPOCHSECONDS",
        "EUID",
        "FUNCNAME",
        "GROUPS",
        "HISTCMD",
        "LINENO",
        "OPTIND",
        "PIPESTATUS",
        "PPID",
        "RANDOM",
        "SECONDS",
        "SHELLOPTS",
        "SHLVL",
        "SRANDOM",
        "UID",
    }
)


# Slurm's filename patterns (sbatch(1), "filename pattern"), as a batch job's output
# files expand them: %j job id, %x name, %u user, %N node, ...; %5j zero-pads numbers.
_FILENAME_PATTERN = re.compile(r"%(\d*)([%AaJjNnstux])")


def log_directory(workdir: str, log_dir: str) -> str:
    """``log_dir`` as an absolute directory (relative ones are in ``workdir``), ``%u`` kept."""
    return posixpath.normpath(posixpath.join(workdir, log_dir))


def log_paths(workdir: str, log_dir: str, tag: str, job_id: int) -> tuple[str, str]:
    """The ``--output`` and ``--error`` of gpush job ``job_id``: absolute, ``%u`` kept for Slurm."""
    directory, name = log_directory(workdir, log_dir), tag_name(tag, job_id)
    return f"{directory}/{name}.out", f"{directory}/{name}.err"


def expand_filename(pattern: str, *, job_id: str, name: str = "", user: str = "", node: str = "") -> str:
    """A batch job's output file pattern as Slurm expands it (22.05 reports the pattern
    as submitted: ``/logs/%x-%j.out``; 24.11 the path)."""
    if "\\" in pattern:  # a backslash anywhere turns expansion off; Slurm drops the backslashes
        return pattern.replace("\\", "")

    def one(match: re.Match[str]) -> str:
        width, key = match.groups()
        value = {
            "%": "%",
            "A": job_id,  # an array's master id: the job's own id when not an array
            "a": "4294967294",  # the array index of a job that is not in an array (NO_VAL)
            "J": job_id,  # job.step, but the batch step's files get the job id alone
            "j": job_id,
            "N": node.split(",")[0],  # the host name of the node, which gpush takes to be its name
            "n": "0",
            "s": "batch",
            "t": "0",
            "u": user,
            "x": name,
        }[key]
        return value.zfill(min(int(width), 10)) if width and value.isdigit() else value

    return _FILENAME_PATTERN.sub(one, pattern)


def tag_name(tag: str, job_id: int) -> str:
    return f"{tag}-{job_id}"


def job_id_of(tag: str, name: str, comment: str = "") -> int | None:
    """The gpush job id a Slurm job carries in its name or comment, or None."""
    match = re.fullmatch(rf"{re.escape(tag)}-(\d+)", name or "")
    if match is None:
        match = re.match(rf"{re.escape(tag)}:job-(\d+)\b", comment or "")
    return int(match.group(1)) if match else None


def gres_for(placement: Placement, *, gres_type: str | None, mps_per_gpu: int) -> str:
    """The typed ``--gres`` of a placement (see the module docstring)."""
    sharing = placement.sharing
    if sharing == Sharing.SLURM_MIG:
        if not placement.mig_profile:
            raise Rejected("a slurm/mig placement without a MIG profile: the broker must name one")
        return f"gpu:{placement.mig_profile}:{placement.units}"
    if sharing == Sharing.SLURM_MPS:
        # placement.units is percent of one GPU; the node may count MPS in other units.
        return f"mps:{max(1, math.ceil(placement.units * mps_per_gpu / 100))}"
    if sharing == Sharing.SLURM_EXCLUSIVE:
        if not gres_type:
            raise Rejected(
                f"no GRES type of this cluster is known for GPU model {placement.gpu_model or '?'}: "
                "set the cluster's gpu_types (GRES type=model) so whole GPUs are asked for by type"
            )
        return f"gpu:{gres_type}:{placement.units}"
    raise Rejected(f"{sharing.value} is not a Slurm sharing mode")


def script(job_id: int, argv: list[str], env: Mapping[str, str], launch: Launch | None = None) -> str:
    lines = ["#!/bin/sh", f"# gpush job {job_id}, rendered by the gpush Slurm adapter: every value is quoted."]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    if launch is None:
        lines.append("exec " + " ".join(shlex.quote(arg) for arg in argv))
    else:
        lines += launch.lines(argv)
    return "\n".join(lines) + "\n"


# The rendezvous port of a multi-node job: one per gpush job, so that two gangs whose
# first node is the same do not meet on one port; under Linux's ephemeral ports (32768 on).
RENDEZVOUS_PORTS = (20000, 10000)
# What each task of a multi-node job is told, from Slurm's variables of that task.
TASK_VARIABLES = {"NODE_RANK": "SLURM_NODEID", "RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID"}


@dataclass(frozen=True)
class Launch:
    """How a multi-node job's batch script starts its tasks: ``srun`` over every node.

    ``addresses``: where Slurm reaches each node gpush chose (NodeAddr); the first node
    of the job, which runs the batch script, is the rendezvous (``MASTER_ADDR``), by its
    address where known, else by its name. ``own``: variables the job set itself (kept)."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    addresses: Mapping[str, str]
    own: frozenset[str] = frozenset()

    def lines(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        if "MASTER_ADDR" not in self.own:
            out.append('case "$SLURMD_NODENAME" in')
            out += [f"{shlex.quote(node)}) MASTER_ADDR={shlex.quote(addr)} ;;" for node, addr in self.addresses.items()]
            out += ['*) MASTER_ADDR="$SLURMD_NODENAME" ;;', "esac", "export MASTER_ADDR"]
        per_task = [f'{name}="${slurm}"' for name, slurm in TASK_VARIABLES.items() if name not in self.own]
        program = (f"export {' '.join(per_task)}; " if per_task else "") + 'exec "$@"'
        srun = [
            "srun",
            "--kill-on-bad-exit=1",
            f"--nodes={self.nodes}",
            f"--ntasks={self.nodes * self.tasks_per_node}",
            f"--ntasks-per-node={self.tasks_per_node}",
            f"--cpus-per-task={self.cpus_per_task}",
            "/bin/sh",
            "-c",
            program,
            "gpush-task",
            *argv,
        ]
        out.append("exec " + " ".join(shlex.quote(arg) for arg in srun))
        return out


def launch_environment(job_id: int, nodes: int, tasks_per_node: int) -> dict[str, str]:
    """What every task of a multi-node job shares (the per-task ranks come from srun)."""
    first, span = RENDEZVOUS_PORTS
    return {
        "MASTER_PORT": str(first + job_id % span),
        "WORLD_SIZE": str(nodes * tasks_per_node),
        "NNODES": str(nodes),
        "LOCAL_WORLD_SIZE": str(tasks_per_node),
    }


def render(
    job_id: int,
    spec: JobSpec,
    placement: Placement,
    *,
    tag: str,
    gres_type: str | None,
    mps_per_gpu: int = 100,
    gpu_memory_gb: float | None = None,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    workdir: str = "/tmp",
    log_dir: str = "gpush-logs",
    user: str | None = None,
    node_addresses: Mapping[str, str] | None = None,
    closeness: Mapping[str, int] | None = None,
    gpus_per_job: bool = False,
) -> Submission:
    """``node_addresses``: NodeAddr of the placement's nodes, for a multi-node job's rendezvous;
    ``closeness``: ``{"switches": 1}`` or ``{"segment": n}`` for a gang gpush placed in one leaf
    switch or block (adapters.slurm.topology.Network.sbatch_closeness), only with several nodes;
    ``gpus_per_job``: ask a one-node job's whole GPUs with ``--gpus`` (see Submission)."""
    if not spec.command:
        raise Rejected("Slurm runs a command: the job has none (give `command`, or `--` and the command)")
    if placement.replicas > 1:
        raise Rejected(
            f"the Slurm adapter runs one replica per job; this placement has {placement.replicas} "
            "(route elastic inference to Kubernetes, or submit one job per replica)"
        )
    if owned := sorted(SHELL_VARIABLES.intersection(spec.env)):
        raise Rejected(
            f"the job sets {', '.join(owned)}: the shell of Slurm's batch script owns "
            f"{'this variable' if len(owned) == 1 else 'these variables'}, so the program would never see the "
            "job's value; use another name"
        )
    env = job_environment(job_id, spec, placement, device_memory_gb=gpu_memory_gb, path=DEFAULT_PATH)
    nodes, tasks = max(spec.nodes, len(placement.nodes), 1), spec.tasks_per_node
    launch = None
    if nodes > 1 or tasks > 1:
        env = {**launch_environment(job_id, nodes, tasks), **env}  # the job's own values win
        # cpus is per node: split over its tasks (each task has one CPU at least).
        launch = Launch(
            nodes=nodes,
            tasks_per_node=tasks,
            cpus_per_task=max(1, spec.cpus // tasks),
            addresses={
                n: a for n, a in (node_addresses or {}).items() if n in (placement.nodes or (placement.node,)) and a
            },
            own=frozenset(spec.env),
        )
    output, error = log_paths(workdir, log_dir, tag, job_id)
    comment = f"{tag}:job-{job_id} tenant={spec.tenant or '-'} user={spec.user or '-'}"
    if spec.name:
        comment += f" name={spec.name}"
    return Submission(
        name=tag_name(tag, job_id),
        comment=comment,
        script=script(job_id, spec.command, env, launch),
        gres=gres_for(placement, gres_type=gres_type, mps_per_gpu=mps_per_gpu),
        cpus_per_task=launch.cpus_per_task if launch else spec.cpus,
        memory_mb=parse_memory_mib(spec.memory) if spec.memory else None,
        time_limit_minutes=math.ceil(parse_time_limit(spec.time_limit) / 60) if spec.time_limit else None,
        partition=placement.partition or partition,
        account=account,
        qos=qos,
        workdir=workdir,
        output=output,
        error=error,
        environment=env,
        user=user,
        nodes=nodes,
        tasks_per_node=tasks,
        nodelist=placement.nodes or ((placement.node,) if placement.node else ()),
        switches=(closeness or {}).get("switches") if nodes > 1 else None,
        segment=(closeness or {}).get("segment") if nodes > 1 else None,
        gpus_per_job=gpus_per_job and nodes == 1 and placement.sharing == Sharing.SLURM_EXCLUSIVE,
    )
