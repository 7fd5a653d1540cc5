"""Pydantic schemas at the edge: the job spec users submit and what the API returns.

Validation happens here, before anything is written. Each error names the field,
the value and what is allowed. Values are normalised (memory to a Slurm-style size,
time limits to seconds, a shell command string to ``["/bin/sh", "-c", ...]``) so
that two specs that mean the same thing hash the same for idempotent submission.
"""

from __future__ import annotations

import hashlib
import math
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
    ValidationInfo,
    field_validator,
    model_validator,
)

from broker.core.states import JobState


class Kind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"
    BATCH = "batch"


class Isolation(StrEnum):
    """How much a job must be kept apart from others on a GPU (DESIGN.md, "The job")."""

    EXCLUSIVE = "exclusive"  # whole GPUs
    HARDWARE = "hardware"  # MIG: memory and fault isolation
    PROCESS = "process"  # MPS: shared memory, low interference
    NONE = "none"  # time-slicing: no memory isolation


# Isolation a job gets when it does not say: training and batch keep whole GPUs (the
# safe default of every HPC site); inference is the workload that tolerates sharing.
DEFAULT_ISOLATION = {
    Kind.TRAINING: Isolation.EXCLUSIVE,
    Kind.INFERENCE: Isolation.NONE,
    Kind.BATCH: Isolation.EXCLUSIVE,
}

_MEMORY_UNITS = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
# 16G, 16GB, 16GiB (Slurm and people) and 16Gi (Kubernetes).
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B|i)?\s*$", re.IGNORECASE)


def parse_memory_mib(value: Any) -> int:
    """``16G``, ``16GiB``, ``512M``, ``1.5T`` or a plain number of MiB -> MiB."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16G or 512M")
    if isinstance(value, (int, float)):
        mib = float(value)
    else:
        match = _MEMORY_RE.match(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a size: use a number with K, M, G or T, such as 16G or 512M")
        mib = float(match.group(1)) * _MEMORY_UNITS[match.group(2).upper()]
    if mib < 1:
        raise ValueError(f"{value!r} is less than 1 MiB")
    if mib > 64 * 1024 * 1024:
        raise ValueError(f"{value!r} is more than 64 TiB, which no node has")
    return math.ceil(mib)  # a fraction of a MiB rounds up: never less than asked


def format_memory(mib: int) -> str:
    for unit, size in (("T", 1024 * 1024), ("G", 1024)):
        if mib % size == 0:
            return f"{mib // size}{unit}"
    return f"{mib}M"


def _normalize_memory(value: Any) -> str:
    return format_memory(parse_memory_mib(value))


_DURATION_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_time_limit(value: Any) -> int:
    """Seconds from a number of minutes (Slurm's default unit), ``1h30m``, or Slurm's
    ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 2h, 90m or 1-00:00:00")
    if isinstance(value, int):
        seconds = value * 60
    else:
        text = str(value).strip().lower()
        seconds = None
        if text.isdigit():
            seconds = int(text) * 60
        elif (m := _DURATION_RE.match(text)) and any(m.groups()):
            d, h, mi, s = (int(g) if g else 0 for g in m.groups())
            seconds = ((d * 24 + h) * 60 + mi) * 60 + s
        else:
            days = 0
            rest = text
            if "-" in text:
                day_text, rest = text.split("-", 1)
                if not day_text.isdigit():
                    rest = ""
                else:
                    days = int(day_text)
            parts = rest.split(":") if rest else []
            if parts and all(p.isdigit() for p in parts) and len(parts) <= 3:
                nums = [int(p) for p in parts]
                if "-" in text:  # D-HH, D-HH:MM, D-HH:MM:SS
                    nums += [0] * (3 - len(nums))
                    h, mi, s = nums
                elif len(nums) == 2:  # MM:SS
                    h, mi, s = 0, nums[0], nums[1]
                else:  # HH:MM:SS
                    h, mi, s = nums if len(nums) == 3 else (0, nums[0], 0)
                seconds = ((days * 24 + h) * 60 + mi) * 60 + s
        if seconds is None:
            raise ValueError(f"{value!r} is not a duration: use minutes (90), 1h30m, or Slurm's HH:MM:SS or D-HH:MM:SS")
    if seconds <= 0:
        raise ValueError(f"{value!r} must be longer than zero")
    if seconds > 365 * 24 * 3600:
        raise ValueError(f"{value!r} is longer than a year")
    return seconds


def format_duration(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    text = f"{h:02d}:{m:02d}:{s:02d}"
    return f"{days}-{text}" if days else text


def _normalize_command(value: Any) -> Any:
    # A string is a shell command, as with `sbatch --wrap`; a list is argv, passed as is.
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("the command is empty")
        return ["/bin/sh", "-c", value]
    return value


def _check_argv(value: list[str] | None) -> list[str] | None:
    if value is not None and (not value or not value[0]):
        raise ValueError("the command needs at least a program to run")
    return value


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Label keys and values as Kubernetes accepts them, so labels can travel to Pods.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"

Memory = Annotated[str, BeforeValidator(_normalize_memory)]
# Stored as Slurm's [D-]HH:MM:SS, so normalising a normalised spec changes nothing.
TimeLimit = Annotated[str, BeforeValidator(lambda v: format_duration(parse_time_limit(v)))]
Command = Annotated[list[str] | None, BeforeValidator(_normalize_command), AfterValidator(_check_argv)]
Principal = Annotated[str, Field(pattern=_NAME, description="letters, digits and _ . @ -, at most 64")]


class Elastic(BaseModel):
    """Replica range of an inference job that scales."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, le=10_000)
    max_replicas: int = Field(1, ge=1, le=10_000)

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is more than max_replicas ({self.max_replicas})")
        return self


class JobSpec(BaseModel):
    """What a user asks for, independent of where it lands (DESIGN.md, "The job")."""

    # No str_strip_whitespace: argv elements and env values must reach the program
    # byte for byte; name-like fields refuse whitespace through their patterns.
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=_NAME, description="a name to recognise the job by")
    kind: Kind
    isolation: Isolation | None = Field(
        None, validate_default=True, description="exclusive | hardware | process | none; default by kind"
    )
    gpus: int = Field(1, ge=1, le=1024, description="GPUs, or GPU slices, per replica")
    gpu_memory_gb: float | None = Field(
        None, gt=0, le=1024, validate_default=True, description="GPU memory each GPU or slice must have, in GB"
    )
    elastic: Elastic | None = Field(None, validate_default=True)
    cpus: int = Field(1, ge=1, le=4096)
    memory: Memory | None = Field(None, description="host memory per replica, such as 16G")
    time_limit: TimeLimit | None = Field(None, description="[D-]HH:MM:SS; accepts 90 (minutes), 2h, 1h30m, 1-00:00:00")
    command: Command = Field(None, description="argv list, or a string run by /bin/sh -c")
    image: str | None = Field(None, min_length=1, max_length=512, validate_default=True)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    tenant: Principal | None = None
    user: Principal | None = None
    priority: int = Field(0, ge=-1000, le=1000)
    idempotency_key: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")

    @field_validator("env", "labels", mode="before")
    @classmethod
    def _scalars_as_strings(cls, mapping: Any) -> Any:
        # YAML reads `OMP_NUM_THREADS: 4` as a number and `debug: true` as a bool;
        # the user meant the text, as a shell would pass it.
        if not isinstance(mapping, dict):
            return mapping
        return {
            k: ("true" if v else "false") if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v
            for k, v in mapping.items()
        }

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
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
            if not _LABEL_KEY.match(key):
                raise ValueError(f"label key {key!r} is not valid: [prefix/]name, name at most 63 of A-Z a-z 0-9 - _ .")
            if not _LABEL_VALUE.match(value):
                raise ValueError(
                    f"label {key}={value!r}: a value is at most 63 of A-Z a-z 0-9 - _ . "
                    "and starts and ends alphanumeric"
                )
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

    @field_validator("image", mode="after")
    @classmethod
    def _something_to_run(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("command") is None and "command" in info.data:
            raise ValueError("a job needs a command, an image, or both")
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
        without_key = {k: v for k, v in body.items() if k != "idempotency_key"}
        return hashlib.sha256(orjson.dumps(without_key, option=orjson.OPT_SORT_KEYS)).hexdigest()


class JobBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSpec] = Field(min_length=1, max_length=50_000)


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
    description: str | None = Field(None, max_length=512)


class TokenOut(BaseModel):
    id: int
    prefix: str
    user: str
    tenant: str
    role: Role
    description: str | None
    created_at: datetime
    revoked_at: datetime | None


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
    model_config = ConfigDict(extra="forbid")

    weight: float | None = Field(None, gt=0, description="fair-share weight (default 1)")
    gpu_quota: float | None = Field(None, ge=0, description="most GPU-equivalents held at once")
    clear_quota: bool = False


class PolicyText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="the policy YAML")
    source: str = Field("policy", max_length=256, description="a name for messages, such as the file name")


class PolicyApply(PolicyText):
    comment: str = Field(min_length=1, max_length=2000, description="why: kept in the policy's history")
    base_version: int | None = Field(
        None, description="the active version this edit was made against; refused if another admin applied since"
    )


class PolicyRollback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    comment: str = ""


class ExplainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: int | None = None
    spec: JobSpec | None = None
    version: int | None = Field(None, description="a stored policy version; default the active one")
