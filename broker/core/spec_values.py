"""The values of a job spec: how much it may hold, what text it may carry, and the
canonical form of its quantities.

This module owns :class:`SpecLimits` (one place, each limit overridable by a
``GPUSH_MAX_*`` variable) and the refusal of a value over one; the text no cluster can
take (NUL, a carriage return, a lone UTF-16 surrogate), numbers that are not finite and
bools sent for numbers; the names and free text the broker stores or looks up (bounded
by their columns, no control character in a name, no NUL in any text);
and the grammar of a spec's quantities: memory sizes (to a Slurm-style size), time
limits and other durations (to seconds, and Slurm's ``[D-]HH:MM:SS`` back), a preemption
grace, and a command (a shell string to ``["/bin/sh", "-c", ...]``, an argv list as
is). Each error names the value and what is allowed.

It imports no pydantic: the adapters and the replays read sizes and durations with it,
and :mod:`broker.core.schemas` builds the spec's fields on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

from broker.core import config

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


def over_limit(found: str, allowed: str, limit: str, remedy: str) -> ValueError:
    """The refusal of a value over limit ``limit``: what was sent, what is allowed (``{}``
    stands for the limit), what to do, and the setting that holds the limit."""
    value = getattr(spec_limits(), limit)
    return ValueError(
        f"{found}, but {allowed.format(f'{value:,}')}: {remedy} "
        f"(the broker's limit {SpecLimits.setting(limit)}; its admin may raise it)"
    )


# -- text and numbers no cluster can take ------------------------------------------------


def _text_problem(text: str) -> str | None:
    """What no cluster can take in ``text``, in words, or None."""
    if "\x00" in text:
        return "a NUL character (\\0), which no cluster or database takes: remove it"
    if "\r" in text:
        return "a carriage return (\\r), which sbatch refuses as a DOS line end: end lines with \\n only"
    return _unstorable(text)


def check_text(value: Any, where: str) -> None:
    """Refuse text no cluster can take anywhere in ``value`` (a string, list or mapping)."""
    if isinstance(value, str):
        if problem := _text_problem(value):
            raise ValueError(f"{where} holds {problem}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text(item, f"{where} item {index}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, f"{where} key {short_text(key)}")
            check_text(item, f"{where} {short_text(key)}")


# -- names and free text the broker stores or looks up ------------------------------------

# The columns names are kept in (broker.core.models): tenants, users and clusters are
# varchar(64); a node is varchar(253), the longest DNS name. PostgreSQL refuses a longer
# value (and any NUL in text) with an error, where SQLite stored it.
NAME_CHARS = 64
NODE_NAME_CHARS = 253
# Free text kept beside a change (a token's description, a policy's comment).
DESCRIPTION_CHARS = 512
COMMENT_CHARS = 2000
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def name_problem(text: str) -> str | None:
    """What makes ``text`` no name, in words, or None: a control character (NUL among
    them) or a lone surrogate, none of which any name gpush keeps can hold."""
    if found := _CONTROL.search(text):
        return f"a control character ({found.group()!r}), which no name holds: use printable characters"
    return _unstorable(text)


def free_text_problem(text: str) -> str | None:
    """What no database stores in free text (NUL, a lone surrogate), in words, or None."""
    if "\x00" in text:
        return "a NUL character (\\0), which the database does not store: remove it"
    return _unstorable(text)


def _unstorable(text: str) -> str | None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "a lone UTF-16 surrogate, which is no character and cannot be stored: send the text as UTF-8"
    return None


def short_text(value: Any, limit: int = 80) -> str:
    """``value`` for a message: its repr, cut to ``limit`` characters."""
    text = repr(value[: limit + 1] if isinstance(value, str) else value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def not_a_bool(value: Any) -> Any:
    """A number field's input as it is, unless it is a bool: pydantic's lax mode read
    JSON's true as 1 (``"gpus": true`` ran on one GPU) and false as 0 (a quota of none).
    Text that reads as a number (``"2"``, as YAML or a form may send it) is still taken."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is not a number: give a number, such as 1")
    return value


def finite_number(value: Any, what: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} {value!r} is not a finite number: give a number, or quote it if you mean the text")
    return value


# -- memory sizes --------------------------------------------------------------------------

_MEMORY_UNITS = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
# 16G, 16GB, 16GiB (Slurm and people) and 16Gi (Kubernetes).
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B|i)?\s*\Z", re.IGNORECASE)


def parse_memory_mib(value: Any) -> int:
    """``16G``, ``16GiB``, ``512M``, ``1.5T`` or a plain number of MiB -> MiB."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16G or 512M")
    if isinstance(value, (int, float)):
        mib = float(finite_number(value, "a memory size of"))
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


# -- durations: time limits, a preemption's grace ------------------------------------------

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


# The longest a preempted job may take to save its state: the job that preempts it waits that long.
MAX_GRACE_SECONDS = 3600
# A multi-node job's nodes: Slurm and an Indexed Job take far more, but a gang of more than
# a few hundred nodes is beyond any fleet gpush serves, and each is placed in one cycle.
MAX_NODES = 256


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
    raise ValueError(f"{short_text(text)} is not {what}: give seconds (90) or a duration (2m, 1m30s, 1h)")


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


# -- commands ------------------------------------------------------------------------------


def normalize_command(value: Any) -> Any:
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
        raise over_limit(
            f"the command has {len(argv):,} items",
            "a job may have at most {}",
            "command_items",
            "pass long lists in a file the program reads",
        )
    total = 0
    for index, item in enumerate(argv):
        if isinstance(item, str):
            if len(item) > limits.arg_chars:
                raise over_limit(
                    f"command item {index} is {len(item):,} characters",
                    "one item may have at most {}",
                    "arg_chars",
                    "put long text (a script, data) in a file or the image",
                )
            total += len(item)
    if total > limits.command_chars:
        raise over_limit(
            f"the command is {total:,} characters in all",
            "a job's command may have at most {}",
            "command_chars",
            "put long text (a script, data) in a file or the image",
        )


def check_argv(value: list[str] | None) -> list[str] | None:
    if value is not None and (not value or not value[0]):
        raise ValueError("the command needs at least a program to run")
    return value
