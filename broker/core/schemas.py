"""Pydantic schemas at the edge: the job spec users submit and what the API returns.

Validation happens here, before anything is written. Each error names the field,
the value and what is allowed; a spec's limits, the text no cluster can take and
numbers that are not finite are refused here, not found later by a cluster. What each
value may be, and its canonical form, is :mod:`broker.core.spec_values`: its limits
(:class:`~broker.core.spec_values.SpecLimits`, each overridable by a ``GPUSH_MAX_*``
variable) and its quantities' grammar, which the fields here are built on.

Values are normalised (memory to a Slurm-style size, time limits to seconds, a shell
command string to ``["/bin/sh", "-c", ...]``) so that two specs that mean the same
thing hash the same for idempotent submission.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, ValidationError

from broker.core.job_parts import Checkpoint, Elastic, TopologyAsk, checkpoint_text, topology_text
from broker.core.job_shape import GangOut
from broker.core.names import Isolation, JobState, Kind
from broker.core.spec_values import (
    COMMENT_CHARS,
    DESCRIPTION_CHARS,
    MAX_NODES,
    NAME_CHARS,
    NODE_NAME_CHARS,
    check_argv,
    check_text,
    finite_number,
    format_duration,
    format_memory,
    free_text_problem,
    name_problem,
    normalize_command,
    not_a_bool,
    over_limit,
    parse_memory_mib,
    parse_time_limit,
    short_text,
    spec_limits,
)

# Isolation a job gets when it does not say: training and batch keep whole GPUs (the
# safe default of every HPC site); inference is the workload that tolerates sharing.
DEFAULT_ISOLATION = {
    Kind.TRAINING: Isolation.EXCLUSIVE,
    Kind.INFERENCE: Isolation.NONE,
    Kind.BATCH: Isolation.EXCLUSIVE,
}


def _normalize_memory(value: Any) -> str:
    return format_memory(parse_memory_mib(value))


# Python's `$` also matches before a final newline ("X\n" passed as a variable name and
# broke the Slurm script's export), so `re` patterns here end with `\Z`. The `pattern=`
# of pydantic fields (_NAME) runs on Rust's regex, where `$` is the end of the text and
# `\Z` is not known.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# Label keys and values as Kubernetes accepts them, so labels can travel to Pods.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"

# Every number a request body holds: text that reads as one is taken ("2"), a bool is not.
Int = Annotated[int, BeforeValidator(not_a_bool)]
Float = Annotated[float, BeforeValidator(not_a_bool)]

# Ids are BIGINT columns (broker.core.models.BigId) and policy versions INTEGER ones,
# 32-bit on PostgreSQL: a larger number is a 422 at the edge, not "integer out of range"
# (a 500) in the driver.
MAX_ROW_ID = 2**63 - 1
MAX_POLICY_VERSION = 2**31 - 1

# A tenant's weight and GPU quota: finite (1e400 reads as infinity, which stored made every
# share NaN and starved the tenant) and at most a million, beyond any fleet.
MAX_TENANT_WEIGHT = 1_000_000
MAX_GPU_QUOTA = 1_000_000


def label_problem(key: str, value: str) -> str | None:
    """What makes ``key=value`` no label (at submit and in a filter), in words, or None."""
    if not _LABEL_KEY.match(key):
        return f"label key {short_text(key)} is not valid: [prefix/]name, name at most 63 of A-Z a-z 0-9 - _ ."
    if not _LABEL_VALUE.match(value):
        return (
            f"label {key}={short_text(value)}: a value is at most 63 of A-Z a-z 0-9 - _ . "
            "and starts and ends alphanumeric"
        )
    return None


def _checked(problem_of):
    def check(value: str) -> str:
        if problem := problem_of(value):
            raise ValueError(f"{short_text(value, 40)} holds {problem}")
        return value

    return check


def _name(max_chars: int) -> Any:
    return Annotated[str, StringConstraints(min_length=1, max_length=max_chars), AfterValidator(_checked(name_problem))]


# The one type of every name the broker stores or looks up (a tenant, user, cluster or
# node; in a path, a query or a body): bounded by its column, no control character. A
# name's own grammar (Principal, a cluster's DNS label) narrows it where one is stored;
# lookups take any Name, so a name that is merely unknown is a 404 or an empty list.
# Measured: a NUL in `?user=` or a 5,000-character tenant was a 500 on PostgreSQL.
Name = _name(NAME_CHARS)
NodeName = _name(NODE_NAME_CHARS)


def free_text(max_chars: int) -> Any:
    """Free text the broker stores (a description, a comment): at most ``max_chars``, no NUL."""
    return Annotated[str, StringConstraints(max_length=max_chars), AfterValidator(_checked(free_text_problem))]


Description = free_text(DESCRIPTION_CHARS)
Comment = free_text(COMMENT_CHARS)

Memory = Annotated[str, BeforeValidator(_normalize_memory)]
# Stored as Slurm's [D-]HH:MM:SS, so normalising a normalised spec changes nothing.
TimeLimit = Annotated[str, BeforeValidator(lambda v: format_duration(parse_time_limit(v)))]
Command = Annotated[list[str] | None, BeforeValidator(normalize_command), AfterValidator(check_argv)]
Principal = Annotated[str, Field(pattern=_NAME, description="letters, digits and _ . @ -, at most 64")]
# A node name as Slurm and Kubernetes spell them, or a glob of them (fnmatch: * ? [...]).
NodePattern = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9_.:@*?\[\]!-]{1,253}$", description="a node name, or a glob such as gpu-*")
]


class JobSpec(BaseModel):
    """What a user asks for, independent of where it lands (DESIGN.md, "The job")."""

    # No str_strip_whitespace: argv elements and env values must reach the program
    # byte for byte; name-like fields refuse whitespace through their patterns.
    # allow_inf_nan=False: NaN, Infinity and 1e400 (read as inf) are no size or count.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str | None = Field(None, pattern=_NAME, description="a name to recognise the job by")
    kind: Kind
    isolation: Isolation | None = Field(
        None, validate_default=True, description="exclusive | hardware | process | none; default by kind"
    )
    gpus: Int = Field(1, ge=1, le=1024, description="GPUs, or GPU slices, per replica")
    gpu_memory_gb: Float | None = Field(
        None, gt=0, le=1024, validate_default=True, description="GPU memory each GPU or slice must have, in GB"
    )
    elastic: Elastic | None = Field(None, validate_default=True)
    nodes: Int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        description="nodes of a multi-node job (sbatch -N), each with gpus, cpus and memory; placed all or nothing",
    )
    tasks_per_node: Int = Field(1, ge=1, le=1024, description="processes (ranks) per node (sbatch --ntasks-per-node)")
    topology: Annotated[TopologyAsk | None, BeforeValidator(topology_text)] = Field(
        None,
        description="{level, mode} or LEVEL[:required]: keep the GPUs (nvlink, pcie, socket) or nodes (block, rack, "
        "...) close",
    )
    cpus: Int = Field(1, ge=1, le=4096, description="CPUs per replica, or per node of a multi-node job")
    memory: Memory | None = Field(
        None, description="host memory per replica (per node of a multi-node job), such as 16G"
    )
    time_limit: TimeLimit | None = Field(None, description="[D-]HH:MM:SS; accepts 90 (minutes), 2h, 1h30m, 1-00:00:00")
    command: Command = Field(None, description="argv list, or a string run by /bin/sh -c")
    image: str | None = Field(None, min_length=1, validate_default=True, description="at most GPUSH_MAX_IMAGE_CHARS")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    tenant: Principal | None = None
    user: Principal | None = None
    priority: Int = Field(0, ge=-1000, le=1000)
    preemptible: bool | None = Field(
        None, description="may be stopped for work of higher standing and queued again; unset: the policy's default"
    )
    checkpoint: Annotated[Checkpoint | None, BeforeValidator(checkpoint_text)] = Field(
        None,
        description="on preemption: {signal: SIGUSR1, grace: 2m} or USR1@2m; unset: SIGTERM and the policy's grace",
    )
    cluster: str | None = Field(
        None,
        pattern=_NAME,
        max_length=63,
        description="run only on this cluster (gpush submit --cluster); the policy must still route the job there",
    )
    idempotency_key: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")

    @field_validator("*", mode="after")
    @classmethod
    def _text_clusters_take(cls, value: Any, info: ValidationInfo) -> Any:
        # Every string of a spec goes to sbatch or a Pod, and to the database. Accepted,
        # a NUL or a CR failed later as "cluster unreachable", retried every cycle for
        # ever, and a lone surrogate could not even be stored: refuse them here.
        check_text(value, str(info.field_name))
        return value

    @field_validator("env", "labels", mode="before")
    @classmethod
    def _scalars_as_strings(cls, mapping: Any, info: ValidationInfo) -> Any:
        # YAML reads `OMP_NUM_THREADS: 4` as a number and `debug: true` as a bool;
        # the user meant the text, as a shell would pass it.
        if not isinstance(mapping, dict):
            return mapping
        # Counted before the items are validated: 100,000 are refused at once, not read.
        limit = "env_vars" if info.field_name == "env" else "labels"
        if len(mapping) > getattr(spec_limits(), limit):
            raise over_limit(
                f"{len(mapping):,} {'environment variables' if limit == 'env_vars' else 'labels'}",
                "a job may have at most {}",
                limit,
                "pass the rest in a file the program reads, or in the image"
                if limit == "env_vars"
                else "keep labels for what you select jobs by",
            )
        return {
            k: ("true" if v else "false")
            if isinstance(v, bool)
            else str(finite_number(v, f"{info.field_name} {short_text(k)}:"))
            if isinstance(v, int | float)
            else v
            for k, v in mapping.items()
        }

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        limits = spec_limits()
        total = 0
        for key, value in env.items():
            if len(key) > limits.env_name_chars:
                raise over_limit(
                    f"environment variable name {short_text(key)} is {len(key):,} characters",
                    "a name may have at most {}",
                    "env_name_chars",
                    "use a shorter name",
                )
            if len(value) > limits.env_value_chars:
                raise over_limit(
                    f"environment variable {short_text(key)} is {len(value):,} characters",
                    "a value may have at most {}",
                    "env_value_chars",
                    "put long text in a file the program reads, or in the image",
                )
            total += len(key) + len(value)
        if total > limits.env_chars:
            raise over_limit(
                f"the environment is {total:,} characters in all",
                "a job's environment may have at most {}",
                "env_chars",
                "put long text in a file the program reads, or in the image",
            )
        for key in env:
            if not _ENV_NAME.match(key):
                raise ValueError(
                    f"{key!r} is not an environment variable name: use letters, digits and _, not starting with a digit"
                )
        return env

    @field_validator("labels")
    @classmethod
    def _label_syntax(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if problem := label_problem(key, value):
                raise ValueError(problem)
        return labels

    # Cross-field rules are field validators (validate_default=True) rather than one
    # model validator, so each error names the field it is about. Fields validate in
    # declaration order: kind, isolation, gpu_memory_gb, elastic, command, image.

    @field_validator("isolation", mode="after")
    @classmethod
    def _default_isolation(cls, value: Isolation | None, info: ValidationInfo) -> Isolation | None:
        kind = info.data.get("kind")
        return value if value is not None or kind is None else DEFAULT_ISOLATION[kind]

    @field_validator("gpu_memory_gb", mode="after")
    @classmethod
    def _memory_for_sharing(cls, value: float | None, info: ValidationInfo) -> float | None:
        isolation = info.data.get("isolation")
        if value is None and isolation not in (None, Isolation.EXCLUSIVE):
            raise ValueError(
                f"isolation {isolation.value} shares a GPU, so gpu_memory_gb is required: it picks "
                "the MIG slice or MPS share, or caps a time-sliced job's memory"
            )
        return value

    @field_validator("elastic", mode="after")
    @classmethod
    def _elastic_is_inference(cls, value: Elastic | None, info: ValidationInfo) -> Elastic | None:
        kind = info.data.get("kind")
        if value is not None and kind not in (None, Kind.INFERENCE):
            raise ValueError(f"elastic replicas are for kind inference, not {kind.value}")
        return value

    @field_validator("nodes", mode="after")
    @classmethod
    def _nodes_can_gang(cls, value: int, info: ValidationInfo) -> int:
        # Refused before anything is stored: a gang placed with these would never start whole.
        if value == 1:
            return value
        isolation = info.data.get("isolation")
        if isolation in (Isolation.PROCESS, Isolation.NONE):  # a GPU shared on one node only
            how = "MPS" if isolation is Isolation.PROCESS else "time-slicing"
            raise ValueError(
                f"nodes {value} with isolation {isolation.value}: {how} shares a GPU on one node and cannot "
                "span nodes; use isolation exclusive (whole GPUs) or hardware (MIG slices) per node, or nodes 1"
            )
        if info.data.get("elastic") is not None:
            raise ValueError(
                f"nodes {value} with elastic replicas: an elastic service scales by replicas of one node each; "
                "drop elastic for a multi-node job, or use nodes 1"
            )
        return value

    @model_validator(mode="after")
    def _something_to_run(self) -> JobSpec:
        # Said of the command (not of the image, the last field read): what a user left out.
        if self.command is None and self.image is None:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    {
                        "type": PydanticCustomError(
                            "missing_command", "missing: give the job a command (after --), an image, or both"
                        ),
                        "loc": ("command",),
                        "input": None,
                    }
                ],
            )
        return self

    @field_validator("image", mode="after")
    @classmethod
    def _image_within_limit(cls, value: str | None) -> str | None:
        if value is not None and len(value) > spec_limits().image_chars:
            raise over_limit(
                f"the image is {len(value):,} characters",
                "an image reference may have at most {}",
                "image_chars",
                "name the image by registry, path and tag or digest",
            )
        return value

    def fingerprint(self, *, tenant: str | None = None, user: str | None = None) -> str:
        """sha256 of the spec without its idempotency key: equal for equal requests.

        ``tenant`` and ``user`` are the owner the broker resolved, so a job that
        names its own tenant and one that leaves it to the token hash the same.
        """
        body = self.model_dump(mode="json")
        body["tenant"] = tenant or body["tenant"]
        body["user"] = user or body["user"]
        return self.fingerprint_of(body)

    @staticmethod
    def fingerprint_of(body: dict[str, Any]) -> str:
        """The fingerprint of a spec already dumped to JSON types."""
        # A one-node job hashes as it did before multi-node jobs existed, so a retry of a
        # submission made before the upgrade still finds its job.
        without_key = {
            k: v
            for k, v in body.items()
            if k != "idempotency_key"
            and not (k in ("nodes", "tasks_per_node") and v == 1)
            and not (k == "topology" and v is None)
        }
        return hashlib.sha256(orjson.dumps(without_key, option=orjson.OPT_SORT_KEYS)).hexdigest()


class JobBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSpec] = Field(min_length=1, description="at most GPUSH_MAX_BATCH_JOBS jobs")

    @field_validator("jobs", mode="before")
    @classmethod
    def _bounded(cls, jobs: Any) -> Any:
        # Counted before any job is validated: an over-long batch costs nothing to refuse.
        if isinstance(jobs, list) and len(jobs) > spec_limits().batch_jobs:
            raise over_limit(
                f"the batch has {len(jobs):,} jobs",
                "one batch may have at most {}",
                "batch_jobs",
                "submit them in several batches",
            )
        return jobs


class JobOut(BaseModel):
    id: int
    name: str | None
    state: JobState
    state_reason: str | None
    tenant: str
    user: str
    kind: Kind
    isolation: Isolation
    priority: int
    cancel_requested_at: datetime | None
    created_at: datetime
    updated_at: datetime
    spec: dict[str, Any]
    cluster: str | None = Field(None, description="where the scheduler placed it")
    placement: dict[str, Any] | None = Field(None, description="cluster, sharing, node, MIG profile, units")
    backend_id: str | None = Field(None, description="the cluster's id for it (Slurm job id, Pod name)")
    gpu_equivalents: float | None = Field(None, description="physical GPU-equivalents it holds")
    gpu_request: str | None = Field(
        None, description='what it asked, in words, as `gpush list` shows it: "2", "2x8 A100"'
    )
    gang: GangOut | None = Field(None, description="a multi-node job's nodes and ranks; null for one node")


class JobPage(BaseModel):
    jobs: list[JobOut]
    next_cursor: str | None = Field(None, description="pass as cursor= for the next (older) page")


class JobEventOut(BaseModel):
    id: int
    job_id: int
    at: datetime
    type: str
    from_state: JobState | None
    to_state: JobState
    reason: str | None
    actor: str | None


class Role(StrEnum):
    USER = "user"
    ADMIN = "admin"
    # A node agent (gpush agent): may post its node's GPU report, nothing else.
    AGENT = "agent"


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: Principal
    tenant: Principal
    role: Role = Role.USER
    description: Description | None = None
    nodes: list[NodePattern] | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="agent tokens (required): the nodes it may report for, names or globs; ['*'] for any node",
    )


class TokenOut(BaseModel):
    id: int
    prefix: str
    user: str
    tenant: str
    role: Role
    description: str | None
    created_at: datetime
    revoked_at: datetime | None
    nodes: list[str] | None = Field(None, description="the nodes an agent token may report for; null: any node")


class TokenCreated(TokenOut):
    token: str = Field(description="the secret; shown once, store it now")


class Whoami(BaseModel):
    user: str
    tenant: str
    role: Role


class ClusterCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]{0,62}[a-z0-9])?$", description="lower-case DNS label, such as slurm-a"
    )
    kind: str = Field(description="sim | slurm | k8s")
    config: dict[str, Any] = Field(default_factory=dict, description="what the adapter needs (URL, fleet, ...)")
    replace: bool = False


class TenantSet(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    weight: Float | None = Field(
        None, gt=0, le=MAX_TENANT_WEIGHT, description="fair-share weight (default 1), at most 1,000,000"
    )
    gpu_quota: Float | None = Field(
        None, ge=0, le=MAX_GPU_QUOTA, description="most GPU-equivalents held at once, at most 1,000,000"
    )
    clear_quota: bool = False


class PolicyText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: Annotated[str, AfterValidator(_checked(free_text_problem))] = Field(description="the policy YAML")
    source: Annotated[str, StringConstraints(max_length=256), AfterValidator(_checked(free_text_problem))] = Field(
        "policy", description="a name for messages, such as the file name"
    )


class PolicyApply(PolicyText):
    comment: Comment = Field(min_length=1, description="why: kept in the policy's history")
    base_version: Int | None = Field(
        None,
        ge=1,
        le=MAX_POLICY_VERSION,
        description="the active version this edit was made against; refused if another admin applied since",
    )


class PolicyRollback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Int = Field(ge=1, le=MAX_POLICY_VERSION)
    comment: Comment = ""


class ExplainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: Int | None = Field(None, ge=1, le=MAX_ROW_ID)
    spec: JobSpec | None = None
    version: Int | None = Field(
        None, ge=1, le=MAX_POLICY_VERSION, description="a stored policy version; default the active one"
    )
