"""A Slurm cluster's settings (``gpush cluster add NAME --kind slurm --config KEY=VALUE``):
the pydantic model the Slurm adapter reads through :func:`adapters.settings.load_settings`,
and the checks that refuse a config before anything reaches Slurm."""

from __future__ import annotations

import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from adapters.settings import key_value_pairs
from broker.core.gpus import gpu_model


class SlurmSettings(BaseModel):
    """A Slurm cluster's config (``gpush cluster add NAME --kind slurm --config KEY=VALUE``)."""

    model_config = ConfigDict(extra="forbid")

    rest_url: str | None = Field(None, description="slurmrestd, e.g. http://slurm-head:6820 (REST backend)")
    rest_socket: str | None = Field(None, description="slurmrestd's unix socket instead of a URL")
    user: str | None = Field(None, description="the Slurm user jobs are submitted as (REST; default $USER)")
    token_env: str | None = Field(None, description="environment variable holding the JWT (REST)")
    token_file: str | None = Field(None, description="file holding the JWT (REST)")
    token: str | None = Field(None, description="the JWT itself (prefer token_env or token_file)")
    api_version: str | None = Field(None, description="force an OpenAPI version, e.g. v0.0.38")
    slurm_conf: str | None = Field(None, description="SLURM_CONF for the command-line backend")
    bin_dir: str | None = Field(None, description="where sbatch/squeue/... are (command-line backend)")
    jobcomp_file: str | None = Field(None, description="the jobcomp/filetxt log, for jobs that left squeue")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    # Whose jobs they are (adapters.slurm.identity; README: "Jobs as their users").
    run_as: Literal["service", "owner"] = Field(
        "service",
        description="service: every job as the cluster's user (REST) or the broker's own (CLI); "
        "owner: each job as its gpush user's Unix user",
    )
    unix_users: dict[str, str] = Field(default_factory=dict, description="gpush user -> Unix user (run_as=owner)")
    same_name_users: bool = Field(
        True, description="a gpush user not in unix_users runs as the Unix user of the same name (else refused)"
    )
    tenant_accounts: dict[str, str] = Field(default_factory=dict, description="tenant -> Slurm account (--account)")
    tenant_qos: dict[str, str] = Field(default_factory=dict, description="tenant -> Slurm QOS (--qos)")
    tenant_partitions: dict[str, str] = Field(default_factory=dict, description="tenant -> partition")
    jwt_key_file: str | None = Field(
        None,
        description="the site's jwt_hs256.key: the broker mints each user's token (REST, run_as=owner); "
        "without it the service token of root or SlurmUser names the user (proxy mode)",
    )
    token_lifetime: int = Field(600, ge=60, le=86400, description="seconds a minted token lives")
    switch_user: Literal["runuser", "sudo"] | None = Field(
        None, description="how the CLI backend runs sbatch as a user: runuser (broker as root) or sudo -n"
    )
    command_prefix: str | None = Field(
        None, description="a command the CLI commands run under, e.g. 'chroot /srv/slurm-24.11' (shell words)"
    )
    workdir: str = "/tmp"
    log_dir: str = Field(
        ".",
        description="where jobs write stdout and stderr (<log_dir>/<tag>-<gpush id>.out and .err): "
        "relative to workdir unless absolute, %u (the job's Slurm user) allowed; it must exist on the "
        "nodes, and the broker creates it where it can see it (a shared filesystem). Default: workdir "
        "itself, which exists wherever jobs run",
    )
    tag: str = Field("gpush", pattern=r"^[A-Za-z][A-Za-z0-9_.]{0,31}$")
    gpu_types: dict[str, str] = Field(default_factory=dict, description="GRES type -> GPU model")
    mps_per_gpu: int = Field(100, ge=1, description="gres/mps Count of one GPU in gres.conf")
    submit_threads: int = Field(8, ge=1, le=64)
    backlog_jobs: int = Field(
        0,
        ge=0,
        description="jobs the broker may leave pending in Slurm's queue beyond what fits now "
        "(Slurm starts jobs faster with a queue to choose from; they are committed to this cluster)",
    )
    min_job_age: int = Field(
        300,
        ge=0,
        description="slurm.conf's MinJobAge: a job that leaves squeue sooner after it was seen "
        "unfinished cannot have ended normally, so slurmctld lost it (a crash) and it runs again",
    )
    cache_seconds: float = Field(1.0, ge=0)
    # Topology (adapters.slurm.topology): read, never written.
    gres_conf: str | None = Field(
        None,
        description="the gres.conf the broker reads each node's GPU Links= (NVLink islands) and Cores= (sockets) "
        "from, re-read when it changes (default: mig_gres_conf; unset both: GPU topology unknown)",
    )
    topology_seconds: float = Field(
        300.0, ge=0, description="how long the network read from scontrol show topology is kept before read again"
    )
    # MIG layouts gpush changes (adapters.slurm.mig): where Slurm reads them, how it re-reads.
    mig_gres_conf: str | None = Field(
        None,
        description="the gres.conf whose lines for a node gpush rewrites when it re-cuts one of the node's "
        "GPUs (from the node agent's report); unset: this cluster takes no MIG layout from gpush",
    )
    mig_slurm_conf: str | None = Field(
        None, description="the slurm.conf whose NodeName line's Gres= gpush sets to match (default: slurm_conf)"
    )
    mig_caps_dir: str = Field(
        "/dev/nvidia-caps", description="where a node's MIG capability devices are ({node}: the node's name)"
    )
    mig_reload: str = Field(
        "scontrol reconfigure",
        description="the command that makes slurmctld and the node's slurmd read the rewritten files "
        "(a program and its arguments, {node}: the node; run without a shell): scontrol reconfigure from "
        "Slurm 23.11; before, a script of the site's that restarts slurmctld and the node's slurmd",
    )

    @field_validator("mig_gres_conf", "mig_slurm_conf", "gres_conf")
    @classmethod
    def _a_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} is a file's path; leave it out rather than empty")
        return value

    @field_validator("mig_reload")
    @classmethod
    def _a_command(cls, value: str) -> str:
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"mig_reload {value!r} is not a command line: {exc}") from None
        if not words:
            raise ValueError(
                "mig_reload is a command, e.g. 'scontrol reconfigure' or '/usr/local/sbin/slurm-reload {node}'"
            )
        shell = [w for w in words if w in ("&&", "||", ";", "|", ">", ">>", "<", "&")]
        if shell:
            raise ValueError(
                f"mig_reload runs one program without a shell, so {shell[0]!r} would be an argument: "
                "put the commands in a script and name it, e.g. '/usr/local/sbin/slurm-reload {node}'"
            )
        return value

    @model_validator(mode="after")
    def _mig_files(self) -> SlurmSettings:
        if self.mig_gres_conf and not (self.mig_slurm_conf or self.slurm_conf):
            raise ValueError(
                "mig_gres_conf needs the slurm.conf whose Gres= gpush sets too: give mig_slurm_conf "
                "(or slurm_conf, the command-line backend's)"
            )
        return self

    timeout: float = Field(30.0, gt=0)

    @field_validator("log_dir")
    @classmethod
    def _log_dir(cls, value: str) -> str:
        # Only %u: the broker expands the directory itself to create it, and another
        # pattern (%j, %N) would make one directory per job or per node that nobody creates.
        if not value.strip() or "\\" in value or not value.isprintable() or "%" in value.replace("%u", ""):
            raise ValueError(
                "log_dir is a directory, absolute or relative to workdir, with no pattern but %u "
                "(the job's user), e.g. gpush-logs or /shared/gpush-logs/%u"
            )
        return value

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "gpu_types", "a100=A100-SXM4-80GB", form="TYPE=MODEL")

    @field_validator("unix_users", "tenant_accounts", "tenant_qos", "tenant_partitions", mode="before")
    @classmethod
    def _maps(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "unix_users":
            return key_value_pairs(value, info.field_name, "alice=asmith", form="USER=UNIXNAME")
        return key_value_pairs(value, info.field_name, "vision=vision", form="TENANT=NAME")

    @field_validator("gpu_types")
    @classmethod
    def _known_models(cls, value: dict[str, str]) -> dict[str, str]:
        return {gres_type: gpu_model(model).name for gres_type, model in value.items()}
