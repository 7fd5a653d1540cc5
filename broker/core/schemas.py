"""Pydantic schemas at the edge: the job spec users submit and what the API returns.

Validation happens here, before anything is written. Each error names the field,
the value and what is allowed. How much a spec and a batch may hold is
:class:`SpecLimits`, one place, each limit overridable by a ``GPUSH_MAX_*`` variable;
text no cluster can take (NUL, a carriage return, a lone UTF-16 surrogate) and
numbers that are not finite are refused here, not found later by a cluster.

Values are normalised (memory to a Slurm-style size, time limits to seconds, a shell
command string to ``["/bin/sh", "-c", ...]``) so that two specs that mean the same
thing hash the same for idempotent submission.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

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

from broker.core import config
from broker.core.names import Isolation, JobState, Kind

# Isolation a job gets when it does not say: training and batch keep whole GPUs (the
# safe default of every HPC site); inference is the workload that tolerates sharing.
DEFAULT_ISOLATION = {
    Kind.TRAINING: Isolation.EXCLUSIVE,
    Kind.INFERENCE: Isolation.NONE,
    Kind.BATCH: Isolation.EXCLUSIVE,
}


# -- how much a spec may hold ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpecLimits:
    """How much one job spec, and one batch of them, may hold (README, "Configuration").

    A 10 MB command or 100,000 labels was accepted, stored, and sent back in every list.
    The defaults are generous for real jobs and keep a spec well inside what both
    clusters take: Linux passes at most 128 KiB in one argument or variable
    (MAX_ARG_STRLEN), Kubernetes stores a Pod in at most 1.5 MB. Each limit is the
    variable ``GPUSH_MAX_<NAME>`` (:meth:`setting`) to override. Lengths that are
    another system's syntax (a Kubernetes label's 63, a name's 64) stay in their
    patterns: raising them would only move the refusal to the cluster.
    """

    command_items: int = 4096  # argv items; a shell command string is three
    arg_chars: int = 128 * 1024  # one argv item
    command_chars: int = 256 * 1024  # all argv items together
    env_vars: int = 1024
    env_name_chars: int = 256
    env_value_chars: int = 128 * 1024  # one value
    env_chars: int = 256 * 1024  # all names and values together
    labels: int = 128
    image_chars: int = 1024
    batch_jobs: int = 10_000  # jobs in one batch submission

    @staticmethod
    def setting(name: str) -> str:
        """The environment variable of limit ``name``: ``GPUSH_MAX_ENV_VARS``."""
        return f"GPUSH_MAX_{name.upper()}"


@functools.cache
def spec_limits() -> SpecLimits:
    """The limits in force: the defaults with the ``GPUSH_MAX_*`` overrides, read once per
    process (``spec_limits.cache_clear()`` reads them again)."""
    names = {field.name: SpecLimits.setting(field.name) for field in dataclasses.fields(SpecLimits)}
    return SpecLimits(**config.positive_int_settings(names))


def _over_limit(found: str, allowed: str, limit: str, remedy: str) -> ValueError:
    """The refusal of a value over limit ``limit``: what was sent, what is allowed (``{}``
    stands for the limit), what to do, and the setting that holds the limit."""
    value = getattr(spec_limits(), limit)
    return ValueError(
        f"{found}, but {allowed.format(f'{value:,}')}: {remedy} "
        f"(the broker's limit {SpecLimits.setting(limit)}; its admin may raise it)"
    )


def _text_problem(text: str) -> str | None:
    """What no cluster can take in ``text``, in words, or None."""
    if "\x00" in text:
        return "a NUL character (\\0), which no cluster or database takes: remove it"
    if "\r" in text:
        return "a carriage return (\\r), which sbatch refuses as a DOS line end: end lines with \\n only"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "a lone UTF-16 surrogate, which is no character and cannot be stored: send the text as UTF-8"
    return None


def _check_text(value: Any, where: str) -> None:
    """Refuse text no cluster can take anywhere in ``value`` (a string, list or mapping)."""
    if isinstance(value, str):
        if problem := _text_problem(value):
            raise ValueError(f"{where} holds {problem}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, f"{where} item {index}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, f"{where} key {_short(key)}")
            _check_text(item, f"{where} {_short(key)}")


def _short(value: Any, limit: int = 80) -> str:
    """``value`` for a message: its repr, cut to ``limit`` characters."""
    text = repr(value[: limit + 1] if isinstance(value, str) else value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _finite(value: Any, what: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} {value!r} is not a finite number: give a number, or quote it if you mean the text")
    return value


_MEMORY_UNITS = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
# 16G, 16GB, 16GiB (Slurm and people) and 16Gi (Kubernetes).
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B|i)?\s*\Z", re.IGNORECASE)


def parse_memory_mib(value: Any) -> int:
    """``16G``, ``16GiB``, ``512M``, ``1.5T`` or a plain number of MiB -> MiB."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16G or 512M")
    if isinstance(value, (int, float)):
        mib = float(_finite(value, "a memory size of"))
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


_DURATION_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?\Z")


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
        value = ["/bin/sh", "-c", value]
    if isinstance(value, list):
        _bound_command(value)
    return value


def _bound_command(argv: list[Any]) -> None:
    # Before the items are validated: 100,000 of them are refused at once, not read.
    limits = spec_limits()
    if len(argv) > limits.command_items:
        raise _over_limit(
            f"the command has {len(argv):,} items",
            "a job may have at most {}",
            "command_items",
            "pass long lists in a file the program reads",
        )
    total = 0
    for index, item in enumerate(argv):
        if isinstance(item, str):
            if len(item) > limits.arg_chars:
                raise _over_limit(
                    f"command item {index} is {len(item):,} characters",
                    "one item may have at most {}",
                    "arg_chars",
                    "put long text (a script, data) in a file or the image",
                )
            total += len(item)
    if total > limits.command_chars:
        raise _over_limit(
            f"the command is {total:,} characters in all",
            "a job's command may have at most {}",
            "command_chars",
            "put long text (a script, data) in a file or the image",
        )


def _check_argv(value: list[str] | None) -> list[str] | None:
    if value is not None and (not value or not value[0]):
        raise ValueError("the command needs at least a program to run")
    return value


# Python's `$` also matches before a final newline ("X\n" passed as a variable name and
# broke the Slurm script's export), so `re` patterns here end with `\Z`. The `pattern=`
# of pydantic fields (_NAME) runs on Rust's regex, where `$` is the end of the text and
# `\Z` is not known.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# Label keys and values as Kubernetes accepts them, so labels can travel to Pods.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"

Memory = Annotated[str, BeforeValidator(_normalize_memory)]
# Stored as Slurm's [D-]HH:MM:SS, so normalising a normalised spec changes nothing.
TimeLimit = Annotated[str, BeforeValidator(lambda v: format_duration(parse_time_limit(v)))]
Command = Annotated[list[str] | None, BeforeValidator(_normalize_command), AfterValidator(_check_argv)]
Principal = Annotated[str, Field(pattern=_NAME, description="letters, digits and _ . @ -, at most 64")]
# A node name as Slurm and Kubernetes spell them, or a glob of them (fnmatch: * ? [...]).
NodePattern = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9_.:@*?\[\]!-]{1,253}$", description="a node name, or a glob such as gpu-*")
]


class Elastic(BaseModel):
    """Replica range of an inference job that scales."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_replicas: int = Field(1, ge=0, le=10_000)
    max_replicas: int = Field(1, ge=1, le=10_000)

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is more than max_replicas ({self.max_replicas})")
        return self


# Signals a job may ask to be told of a preemption with (broker.core.adapter.PREEMPT_SIGNALS).
PreemptSignal = Literal["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"]
# The longest a preempted job may take to save its state: the job that preempts it waits that long.
MAX_GRACE_SECONDS = 3600


def parse_seconds(value: Any, what: str = "a duration") -> int:
    """Seconds from 90, "90", "90s", "2m", "1h30m" (a bare number is seconds, unlike a time
    limit's minutes)."""
    if isinstance(value, bool):
        raise ValueError("expected seconds (90) or a duration (2m, 1m30s)")
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    if (m := _DURATION_RE.match(text)) and any(m.groups()):
        d, h, mi, s = (int(g) if g else 0 for g in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + s
    raise ValueError(f"{_short(text)} is not {what}: give seconds (90) or a duration (2m, 1m30s, 1h)")


def parse_grace(value: Any) -> Any:
    """Seconds from 90, "90", "90s", "2m", "1m30s" (a bare number is seconds here, unlike a
    time limit: a grace is short), at most MAX_GRACE_SECONDS."""
    seconds = parse_seconds(value, "a grace period")
    if seconds > MAX_GRACE_SECONDS:
        raise ValueError(
            f"a grace of {seconds:,} s is longer than the most, {MAX_GRACE_SECONDS // 60} minutes: the job that "
            "preempts waits that long; save state more often, or ask for a shorter grace"
        )
    return seconds


def _checkpoint_text(value: Any) -> Any:
    """``USR1@2m`` (as the CLI's --checkpoint and sbatch --signal write it) as {signal, grace}."""
    if not isinstance(value, str):
        return value
    signal, at, grace = value.strip().partition("@")
    if not signal:
        raise ValueError(f"{_short(value)}: name the signal first: SIGNAL[@GRACE], such as USR1@2m or TERM")
    return {"signal": signal} | ({"grace": grace} if at and grace else {})


def _signal_name(value: Any) -> Any:
    # USR1, usr1, SIGUSR1 all name one signal; stored as SIGUSR1, as scancel and kill print it.
    if isinstance(value, str):
        text = value.strip().upper()
        return text if text.startswith("SIG") else "SIG" + text
    return value


class Checkpoint(BaseModel):
    """How a job wants to be told of a preemption: ``signal`` first, then ``grace`` seconds
    to save its state and exit before its cluster stops it. Kubernetes tells a container
    only with its stop signal (SIGTERM unless the image says otherwise)."""

    model_config = ConfigDict(extra="forbid")

    signal: Annotated[PreemptSignal, BeforeValidator(_signal_name)] = Field(
        "SIGTERM", description="SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2 (USR1 is read as SIGUSR1)"
    )
    grace: Annotated[int, BeforeValidator(parse_grace)] = Field(
        60, ge=0, le=MAX_GRACE_SECONDS, description="seconds to save state after the signal: 90, 2m, 1m30s"
    )


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
    gpus: int = Field(1, ge=1, le=1024, description="GPUs, or GPU slices, per replica")
    gpu_memory_gb: float | None = Field(
        None, gt=0, le=1024, validate_default=True, description="GPU memory each GPU or slice must have, in GB"
    )
    elastic: Elastic | None = Field(None, validate_default=True)
    cpus: int = Field(1, ge=1, le=4096)
    memory: Memory | None = Field(None, description="host memory per replica, such as 16G")
    time_limit: TimeLimit | None = Field(None, description="[D-]HH:MM:SS; accepts 90 (minutes), 2h, 1h30m, 1-00:00:00")
    command: Command = Field(None, description="argv list, or a string run by /bin/sh -c")
    image: str | None = Field(None, min_length=1, validate_default=True, description="at most GPUSH_MAX_IMAGE_CHARS")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    tenant: Principal | None = None
    user: Principal | None = None
    priority: int = Field(0, ge=-1000, le=1000)
    preemptible: bool | None = Field(
        None, description="may be stopped for work of higher standing and queued again; unset: the policy's default"
    )
    checkpoint: Annotated[Checkpoint | None, BeforeValidator(_checkpoint_text)] = Field(
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
        _check_text(value, str(info.field_name))
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
            raise _over_limit(
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
            else str(_finite(v, f"{info.field_name} {_short(k)}:"))
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
                raise _over_limit(
                    f"environment variable name {_short(key)} is {len(key):,} characters",
                    "a name may have at most {}",
                    "env_name_chars",
                    "use a shorter name",
                )
            if len(value) > limits.env_value_chars:
                raise _over_limit(
                    f"environment variable {_short(key)} is {len(value):,} characters",
                    "a value may have at most {}",
                    "env_value_chars",
                    "put long text in a file the program reads, or in the image",
                )
            total += len(key) + len(value)
        if total > limits.env_chars:
            raise _over_limit(
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
            if not _LABEL_KEY.match(key):
                raise ValueError(
                    f"label key {_short(key)} is not valid: [prefix/]name, name at most 63 of A-Z a-z 0-9 - _ ."
                )
            if not _LABEL_VALUE.match(value):
                raise ValueError(
                    f"label {key}={_short(value)}: a value is at most 63 of A-Z a-z 0-9 - _ . "
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
        if value is not None and len(value) > spec_limits().image_chars:
            raise _over_limit(
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
        without_key = {k: v for k, v in body.items() if k != "idempotency_key"}
        return hashlib.sha256(orjson.dumps(without_key, option=orjson.OPT_SORT_KEYS)).hexdigest()


class JobBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSpec] = Field(min_length=1, description="at most GPUSH_MAX_BATCH_JOBS jobs")

    @field_validator("jobs", mode="before")
    @classmethod
    def _bounded(cls, jobs: Any) -> Any:
        # Counted before any job is validated: an over-long batch costs nothing to refuse.
        if isinstance(jobs, list) and len(jobs) > spec_limits().batch_jobs:
            raise _over_limit(
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
    model_config = ConfigDict(extra="forbid")

    weight: float | None = Field(None, gt=0, description="fair-share weight (default 1)")
    gpu_quota: float | None = Field(None, ge=0, description="most GPU-equivalents held at once")
    clear_quota: bool = False


# Ids and versions are BIGINT columns: a larger number in a body is a 422 here, not an
# OverflowError in the driver.
MAX_ROW_ID = 2**63 - 1


class PolicyText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="the policy YAML")
    source: str = Field("policy", max_length=256, description="a name for messages, such as the file name")


class PolicyApply(PolicyText):
    comment: str = Field(min_length=1, max_length=2000, description="why: kept in the policy's history")
    base_version: int | None = Field(
        None,
        ge=1,
        le=MAX_ROW_ID,
        description="the active version this edit was made against; refused if another admin applied since",
    )


class PolicyRollback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, le=MAX_ROW_ID)
    comment: str = ""


class ExplainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: int | None = Field(None, ge=1, le=MAX_ROW_ID)
    spec: JobSpec | None = None
    version: int | None = Field(
        None, ge=1, le=MAX_ROW_ID, description="a stored policy version; default the active one"
    )
