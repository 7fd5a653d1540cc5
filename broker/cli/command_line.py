"""What the user typed, kept beside what click parsed, so that a command can refuse a
line click reads one way and its author plainly meant another.

``gpush submit`` takes its command as positional arguments and stops reading options at
the first of them (``allow_interspersed_args=False``), so that the command's own options
stay the command's. Two slips then parse without a word: ``--time-limit 2 hours -- python
x.py`` is a 2-minute job that runs ``hours -- python x.py``, and ``python x.py -- --lr 3``
hides which ``--`` ends gpush's options. Which of those the user wrote is in the raw
arguments only, which click keeps nowhere: the root group (``RecordingGroup``) records
them in the context's ``meta``, and ``refuse_ambiguous_submit`` reads them back.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

import click

from broker.core.errors import InvalidRequest

RAW_ARGS = "gpush.raw_args"  # key in click's Context.meta: the invoked command's own arguments

TIME_UNITS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), "s"),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), "m"),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), "h"),
    **dict.fromkeys(("d", "day", "days"), "d"),
}
SIZE_UNITS = {
    f"{letter}{tail}": letter.upper() for letter in "kmgt" for tail in ("", "b", "i", "ib")
}  # 16 G, 16 GB, 16 Gi, 16 GiB
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?\Z")


class RecordingGroup(click.Group):
    """A click group that keeps the arguments of the command it invokes in ``ctx.meta``
    (shared by every nested context) under ``RAW_ARGS``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        ctx.meta[RAW_ARGS] = list(rest)
        return rest


def refuse_ambiguous_submit(command: Sequence[str]) -> None:
    """For ``gpush submit``: raise :class:`InvalidRequest` (exit 2) when its line is
    ambiguous (see the module docstring), naming the fix. Nothing to check when the raw
    arguments were not recorded (the command was invoked outside the root group)."""
    ctx = click.get_current_context()
    raw = ctx.meta.get(RAW_ARGS)
    if raw is None:
        return
    names = {opt: param.name or "" for param in ctx.command.params for opt in (*param.opts, *param.secondary_opts)}
    why = ambiguity(raw, list(command), names)
    if why:
        raise InvalidRequest(why)


def ambiguity(raw: Sequence[str], command: Sequence[str], option_names: Mapping[str, str]) -> str | None:
    """Why ``gpush submit`` should not take this line, or None. ``raw`` is what the user
    typed after ``submit``, ``command`` the positional arguments click took from it (always
    its tail), ``option_names`` each option string to its parameter's name."""
    start = len(raw) - len(command)
    if not command or start < 0 or list(raw[start:]) != list(command):
        return None
    separated = start > 0 and raw[start - 1] == "--"
    if separated:
        return None  # everything after a leading -- is the command, as the user said
    unit = _unit_after_value(raw, start, option_names)
    if unit:
        return unit
    if "--" in command:
        before = command[: command.index("--")]
        return (
            f"the command is given both before and after --: {shlex.join(before)!r} comes before it. "
            "Put every gpush option first and the whole command after --: "
            f"gpush submit [OPTIONS] -- {shlex.join(before)} ..."
        )
    return None


def _unit_after_value(raw: Sequence[str], start: int, option_names: Mapping[str, str]) -> str | None:
    """``--time-limit 2 hours``: an option given a bare number, then a word that reads as
    its unit, which click took as the first word of the command."""
    word = raw[start]
    previous = raw[start - 1] if start >= 1 else ""
    if previous.startswith("-") and not _NUMBER.match(previous):
        # The value attached to its option: --time-limit=2 or -t2.
        long = previous.startswith("--")
        option, _, value = previous.partition("=") if long else (previous[:2], "", previous[2:])
        joined, before = ("=" if long else ""), raw[: start - 1]
    elif start >= 2 and raw[start - 2].startswith("-") and raw[start - 2] != "--":
        option, value, joined, before = raw[start - 2], previous, " ", raw[: start - 2]
    else:
        return None
    if not _NUMBER.match(value):
        return None
    name = option_names.get(option, "")
    unit = word.lower().rstrip(".")
    given = f"{option}{joined}{value} {word}"
    rest = list(raw[start + 1 :])
    if rest and not rest[0].startswith("-"):
        rest.insert(0, "--")  # the command, which came right after the unit
    if name == "time_limit" and unit in TIME_UNITS:
        fixed = f"{option}{joined}{_duration(value, TIME_UNITS[unit])}"
    elif name == "memory" and unit in SIZE_UNITS:
        fixed = f"{option}{joined}{value}{SIZE_UNITS[unit]}"
    elif name == "gpu_memory_gb" and unit in SIZE_UNITS:
        fixed = f"{option}{joined}{value}"  # in GB already
    elif unit in TIME_UNITS or unit in SIZE_UNITS:
        return (
            f"{given}: {option} takes one word, so {word!r} would start the command; "
            f"give {option} its value alone and put the command after --"
        )
    else:
        return None
    line = shlex.join(["gpush", "submit", *before, *fixed.split(" "), *rest])
    after = ", and the command after --" if rest else ""
    return f"{given}: an option's value is one word, so {word!r} would start the command. Write {fixed}{after}: {line}"


def _duration(number: str, suffix: str) -> str:
    """2 and h -> 2h; 1.5 and h -> 90m (durations take whole numbers)."""
    if "." not in number:
        return number + suffix
    seconds = float(number) * _SECONDS[suffix]
    return f"{seconds / 60:g}m" if seconds % 60 == 0 else f"{round(seconds)}s"
