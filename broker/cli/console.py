"""How the CLI shows things: rich tables for people, plain JSON for scripts.

An :class:`Output` writes to injected streams, so commands can be driven and read
by tests without a terminal.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from broker.core.clock import utcnow

STATE_STYLE = {
    "queued": "cyan",
    "held": "yellow",
    "routed": "blue",
    "submitting": "blue",
    "submitted": "blue",
    "running": "green",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "dim",
    "requeued": "magenta",
}


FORMATS = ("table", "wide", "json", "yaml", "name")


class Output:
    """Where a command writes, and how: ``fmt`` is ``-o``'s choice (table, wide, json,
    yaml, name); ``json_mode`` is true for json and yaml, whose :meth:`json` writes the
    value as JSON or YAML and nothing else. Tables fit the terminal's width; piped, the
    width of ``COLUMNS`` if set, else wide enough to cut nothing."""

    def __init__(
        self,
        *,
        json_mode: bool = False,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        fmt: str = "table",
        width: int | None = None,
    ):
        if json_mode and fmt not in ("json", "yaml"):
            fmt = "json"
        if fmt == "wide":
            width = width or 1000  # every column whole; the terminal wraps what it must
        self.fmt = fmt
        self.json_mode = fmt in ("json", "yaml")
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.console = Console(file=self.stdout, soft_wrap=False, highlight=False, width=width)
        if width is None and not self.console.is_terminal:
            columns = os.environ.get("COLUMNS", "")
            # Piped or captured: no terminal width to respect, so do not truncate.
            shown = int(columns) if columns.isdigit() and int(columns) >= 40 else 240
            self.console = Console(file=self.stdout, soft_wrap=False, highlight=False, width=shown)
        self.err_console = Console(file=self.stderr, highlight=False)

    @property
    def wide(self) -> bool:
        return self.fmt == "wide"

    def json(self, value: Any) -> None:
        if self.fmt == "yaml":
            import yaml

            self.stdout.write(yaml.safe_dump(_plain(value), sort_keys=False, allow_unicode=True))
            return
        self.stdout.write(json.dumps(_plain(value), indent=2, sort_keys=False) + "\n")

    def line(self, text: str) -> None:
        self.stdout.write(text + "\n")

    def raw(self, text: str) -> None:
        """Text as it is (a job's output, a log), flushed at once for ``-f``."""
        self.stdout.write(text)
        self.stdout.flush()

    def note(self, text: str) -> None:
        """A remark for people, on stderr so that stdout stays parseable."""
        self.err_console.print(text)

    def print(self, renderable: Any) -> None:
        if self.console.is_terminal:
            self.console.print(renderable)
            return
        # Piped: no colour codes, and no padding after the last column (a table's rows are
        # padded to its widest, which makes every line as long as the longest reason).
        with self.console.capture() as captured:
            self.console.print(renderable)
        self.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):  # a pydantic model (not imported here: the CLI starts fast)
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def local_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def age(value: datetime, now: datetime | None = None) -> str:
    seconds = int(((now or utcnow()) - value).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def styled_state(state: str) -> str:
    style = STATE_STYLE.get(state, "")
    return f"[{style}]{state}[/]" if style else state


def gpu_ranges(group: list[int]) -> str:
    """``0-3`` for 0,1,2,3; ``0,2`` for 0,2; ``0-1,4`` for 0,1,4."""
    parts: list[str] = []
    for i in sorted(group):
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)


def where(placement: dict[str, Any] | None, *, short: bool = False) -> str:
    """A placement in a few words: "slurm-a mig 1g.5gb mig-01" (``short``: "slurm-a/mig-01 1g.5gb")."""
    if not placement:
        return "-"
    mode = placement["sharing"].split("/", 1)[1]
    if short:
        detail = placement.get("mig_profile") or mode
        if placement.get("nodes"):
            nodes = placement["nodes"]
            return f"{placement['cluster']}/{nodes[0]}+{len(nodes) - 1} {detail}"
        return (
            f"{placement['cluster']}/{placement['node']} {detail}"
            if placement.get("node")
            else f"{placement['cluster']} {detail}"
        )
    parts = [placement["cluster"], mode]
    if placement.get("mig_profile"):
        parts.append(placement["mig_profile"])
    elif mode == "mps":
        parts.append(f"{placement['units']}%")
    elif placement.get("units", 1) > 1 or placement.get("replicas", 1) > 1:
        parts.append(
            f"{placement['units']}x{placement.get('replicas', 1)}"
            if placement.get("replicas", 1) > 1
            else f"x{placement['units']}"
        )
    if placement.get("nodes"):
        parts.append(",".join(placement["nodes"]))
    elif placement.get("node"):
        parts.append(placement["node"])
        if placement.get("gpus"):  # the GPUs gpush chose there (one NVLink island where one fits)
            parts.append(f"GPU{'s' * (len(set(placement['gpus'])) > 1)} {gpu_ranges(sorted(set(placement['gpus'])))}")
    return " ".join(parts)


ACTIVE_STATES = ("queued", "held", "routed", "submitting", "submitted", "running", "requeued")
FINAL_STATES = ("succeeded", "failed", "cancelled")
_PLACED = ("submitting", "submitted", "running")


@dataclass(frozen=True)
class Col:
    """A column of a table that must fit the terminal: it never gets narrower than
    ``min`` (nor wider than ``max``). When the row is too wide, columns with a ``soft``
    width give way first, down to it; then columns with the higher ``give`` give way
    first, each down to its ``min``; then, only if every column is at its ``min`` and the
    row is still too wide, those with a ``least`` width, down to it. Cut text ends in an
    ellipsis."""

    header: str
    min: int = 0
    max: int | None = None
    give: int = 0  # 0: keeps its natural width
    soft: int | None = None
    least: int | None = None


def fitted_table(columns: list[Col], rows: list[list[str]], width: int) -> Table:
    """A borderless table of ``rows`` (rich markup) whose columns fit ``width``."""
    return table_of(columns, fitted_widths(columns, rows, width), rows)


def fitted_widths(columns: list[Col], rows: list[list[str]], width: int) -> list[int]:
    """The widths of ``columns`` that fit ``rows`` into ``width`` (see :class:`Col`)."""
    natural = [max([len(c.header)] + [Text.from_markup(r[i]).cell_len for r in rows]) for i, c in enumerate(columns)]
    widths = [min(n, c.max) if c.max else n for n, c in zip(natural, columns, strict=True)]
    widths = [max(w, c.min, len(c.header) if not c.give else 0) for w, c in zip(widths, columns, strict=True)]
    gap = 2
    over = sum(widths) + gap * (len(columns) - 1) - width
    order = sorted((i for i, c in enumerate(columns) if c.give), key=lambda i: -columns[i].give)
    for floors in ([c.soft for c in columns], [max(c.min, 1) for c in columns], [c.least for c in columns]):
        for i in order:
            if over <= 0 or floors[i] is None:
                continue
            cut = min(over, widths[i] - floors[i])
            if cut > 0:
                widths[i] -= cut
                over -= cut
    return widths


def table_of(columns: list[Col], widths: list[int], rows: list[list[str]], *, header: bool = True) -> Table:
    """A borderless table of ``rows`` with these column ``widths`` (tables of one width line up)."""
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1), show_header=header)
    for c, w in zip(columns, widths, strict=True):
        table.add_column(c.header, width=w, no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*row)
    return table


def jobs_table(jobs: list[Any], *, wide: bool = False, width: int = 80) -> Table:
    """Jobs, one a row. The default fits ``width`` (an 80-column terminal at least): ID,
    STATE and AGE always show whole; NAME, then GPUS, then the last column give way, cut
    with an ellipsis. The last column says where a placed job is and why any other waits
    or ended (as squeue's NODELIST(REASON)). ``wide`` shows every field, with WHERE and
    REASON apart, and cuts nothing."""
    if wide:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("ID", "NAME", "STATE", "KIND", "ISOLATION", "GPUS", "TENANT", "USER", "AGE", "WHERE", "REASON"):
            table.add_column(column, no_wrap=column != "REASON", overflow="fold")
    rows = []
    for job in jobs:
        state = job.state.value
        cancelling = bool(job.cancel_requested_at) and state in ACTIVE_STATES
        reason = escape(job.state_reason or "")
        if wide:
            table.add_row(
                str(job.id),
                escape(job.name or "-"),
                styled_state(state) + (" [yellow](cancelling)[/]" if cancelling else ""),
                job.kind.value,
                job.isolation.value,
                escape(job.gpu_request or "-"),
                escape(job.tenant),
                escape(job.user),
                age(job.created_at),
                where(job.placement),
                reason,
            )
            continue
        if cancelling:
            detail = "cancelling; " + (where(job.placement, short=True) if job.placement else reason)
        elif state in _PLACED and job.placement:
            detail = where(job.placement, short=True)
        else:
            detail = reason or "-"
        rows.append(
            [
                str(job.id),
                escape(job.name or "-"),
                styled_state(state),
                escape(job.gpu_request or "-"),
                age(job.created_at),
                detail,
            ]
        )
    if wide:
        return table
    columns = [
        Col("ID"),
        Col("NAME", min=10, max=24, give=3),
        Col("STATE"),
        Col("GPUS", min=8, max=16, give=2),
        Col("AGE"),
        Col("WHERE/REASON", min=16, give=1, soft=36),
    ]
    return fitted_table(columns, rows, width)


NOTE_MIN = 30


def noted_table(headers: list[str], rows: list[list[str]], notes: list[str], width: int | None) -> Any:
    """Rows of short fields (rich markup), each with a long note (plain text, a reason):
    a table whose last column wraps at word boundaries while it gets ``NOTE_MIN`` columns
    or more of ``width``; narrower, the short fields stay a table and each note goes
    under its row, indented and wrapped at words (as ``kubectl describe`` does)."""
    import textwrap

    from rich.console import Group

    cells = [[Text.from_markup(c) for c in row] for row in rows]
    widths = [max([len(h)] + [r[i].cell_len for r in cells]) for i, h in enumerate(headers[:-1])]
    if width is None or width - (sum(widths) + 2 * len(widths)) >= NOTE_MIN:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for header in headers[:-1]:
            table.add_column(header, no_wrap=True)
        table.add_column(headers[-1], overflow="fold", min_width=NOTE_MIN)
        for row, note in zip(cells, notes, strict=True):
            table.add_row(*row, Text(note))
        return table

    def line(parts: list[Text]) -> Text:
        out = Text()
        for i, part in enumerate(parts):
            out.append_text(part)
            if i < len(parts) - 1:
                out.append(" " * (widths[i] - part.cell_len + 2))
        return out

    lines = [line([Text(h, style="bold") for h in headers[:-1]])]
    for row, note in zip(cells, notes, strict=True):
        lines.append(line(row))
        wrapped = textwrap.wrap(note, max(width - 4, 20), break_on_hyphens=False)
        lines.extend(Text("    " + part) for part in wrapped)
    return Group(*lines)


def events_table(events: list[Any], width: int | None = None) -> Any:
    """A job's state changes; below ``NOTE_MIN`` columns for the reason, each reason goes
    under its row (:func:`noted_table`)."""
    rows, notes = [], []
    for e in events:
        to = styled_state(e.to_state.value) if e.type == "transition" else f"[yellow]{e.type}[/]"
        rows.append([local_time(e.at), e.from_state.value if e.from_state else "-", to, escape(e.actor or "-")])
        notes.append(e.reason or "")
    return noted_table(["TIME", "FROM", "TO", "BY", "REASON"], rows, notes, width)


def fleet_events_table(events: list[dict[str, Any]], width: int | None = None) -> Any:
    """``gpush events`` with no job: each step of the MIG changes and node moves (the note
    under its row when narrow, :func:`noted_table`)."""
    rows, notes = [], []
    for e in events:
        at = local_time(datetime.fromisoformat(e["at"]))
        if e["kind"] == "mig-change":  # where: "slurm-a GPU 0"
            what = f"MIG {e['id']} GPU {e['where'].rsplit(' ', 1)[-1]}"
        else:
            what = f"move {e['id']}"
        notes.append(e["note"] if e["kind"] == "mig-change" else f"{e['where']}: {e['note']}")
        rows.append([at, what, escape(e["node"]), escape(e["step"])])
    return noted_table(["TIME", "WHAT", "NODE", "STEP", "NOTE"], rows, notes, width)


def tokens_table(tokens: list[Any]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("ID", "PREFIX", "USER", "TENANT", "ROLE", "NODES", "CREATED", "REVOKED", "DESCRIPTION"):
        table.add_column(column, no_wrap=column not in ("NODES", "DESCRIPTION"), overflow="fold")
    for t in tokens:
        table.add_row(
            str(t.id),
            t.prefix + "…",
            t.user,
            t.tenant,
            t.role.value,
            ", ".join(t.nodes) if t.nodes is not None else "-",
            local_time(t.created_at),
            local_time(t.revoked_at) if t.revoked_at else "-",
            t.description or "",
        )
    return table


def clusters_table(summaries: list[dict[str, Any]], *, width: int = 80) -> Table:
    rows = []
    for c in summaries:
        health = "[green]ok[/]" if c["health"]["ok"] else f"[red]down[/] {escape(c['health']['detail'])}"
        sharing = ", ".join(
            f"{mode} {row['gpu_free']:.1f}/{row['gpu_total']:.1f}" for mode, row in sorted(c["capacity"].items())
        )
        gpus = f"{c['gpu_free']:.1f}/{c['gpu_total']:.1f}"
        nodes = str(c["nodes"])
        if c.get("nodes_unavailable"):  # drained, cordoned or fenced: their GPUs count as taken
            nodes += f" ({c['nodes_unavailable']} closed)"
            gpus += f" ({c['gpu_unavailable']:.1f} closed)"
        rows.append([escape(c["name"]), c["kind"], health, nodes, gpus, sharing or "-"])
    columns = [
        Col("NAME", min=8, give=2),
        Col("KIND"),
        Col("HEALTH", min=6, give=3, soft=24),
        Col("NODES"),
        Col("GPUS FREE/ALL"),
        Col("FREE/ALL BY SHARING (GPU)", min=20, give=1),
    ]
    return fitted_table(columns, rows, width)


def tenants_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("TENANT", "WEIGHT", "FAIR SHARE", "GPU QUOTA", "GPU USED", "OF IN USE", "RUNNING", "QUEUED"):
        table.add_column(column, no_wrap=True)
    for t in rows:
        quota = "-" if t["gpu_quota"] is None else f"{t['gpu_quota']:g}"
        table.add_row(
            t["name"],
            f"{t['weight']:g}",
            f"{t['fair_share']:.0%}",
            quota,
            f"{t['gpu_used']:.2f}",
            f"{t['gpu_share']:.0%}",
            str(t["jobs_running"]),
            str(t["jobs_queued"]),
        )
    return table


def usage_table(answer: dict[str, Any]) -> Table:
    """GPU-hours per group, the total last (:func:`usage_window` says over what time)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    groups = answer["by"]
    for column in (*(g.upper() for g in groups), "GPU-HOURS", "JOBS", "RUN HOURS"):
        table.add_column(
            column, no_wrap=True, justify="right" if column in ("GPU-HOURS", "JOBS", "RUN HOURS") else "left"
        )
    for row in answer["rows"]:
        table.add_row(
            *(str(row[g]) for g in groups), f"{row['gpu_hours']:.2f}", str(row["jobs"]), f"{row['run_hours']:.2f}"
        )
    total = answer["total"]
    table.add_row(
        "total",
        *([""] * (len(groups) - 1)),
        f"{total['gpu_hours']:.2f}",
        str(total["jobs"]),
        f"{total['run_hours']:.2f}",
        style="bold",
    )
    return table


def usage_window(answer: dict[str, Any]) -> str:
    since = answer["since"][:16].replace("T", " ") if answer["since"] else "the first job"
    return f"GPU-hours in physical GPU-equivalents, {since} to {answer['until'][:16].replace('T', ' ')} UTC"


_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_AGE_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_when(value: str | None, now: datetime, option: str) -> str | None:
    """A window's end as ISO 8601 (UTC): a date, a date and time, ``now``, or an age
    before ``now`` (``7d``, ``24h``, ``90m``). None stays None."""
    if value is None:
        return None
    text = value.strip()
    if text == "now":
        return now.isoformat()
    age = _AGE.match(text)
    if age:
        return (now - timedelta(seconds=float(age.group(1)) * _AGE_SECONDS[age.group(2)])).isoformat()
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: give a date (2026-12-01), a date and time (2026-12-01T08:00, UTC unless it says) "
            "or an age (7d, 24h, 90m)",
            param_hint=option,
        ) from None
    return (when.replace(tzinfo=UTC) if when.tzinfo is None else when).isoformat()


def policy_history_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("VERSION", "ACTIVE", "AUTHOR", "TIME", "COMMENT"):
        table.add_column(column, no_wrap=column != "COMMENT", overflow="fold")
    for r in rows:
        when = local_time(datetime.fromisoformat(r["created_at"]))
        table.add_row(str(r["version"]), "*" if r["active"] else "", r["author"], when, r["comment"])
    return table


# -- inventory ---------------------------------------------------------------------


def eq_text(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") if value else "0"
