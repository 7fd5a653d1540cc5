"""The simulation report in words: the terminal's summary and ``report.md``.

This module owns :func:`summary_lines` (what ``gpush simulate`` and ``make demo`` print)
and :func:`report_markdown` (``report.md``): the two runs side by side, which way each
measure is good, the comparison in one sentence, and the measures a reader may not know
(``*_NOTE`` of :mod:`broker.simulation.results`), from the summaries
:func:`broker.simulation.report.run_simulation` gathers; and how both write a duration
and a share. The plots are :mod:`broker.simulation.plots`.
"""

from __future__ import annotations

import textwrap
from typing import Any

from broker.simulation.plots import CAPTIONS, shows_tenants
from broker.simulation.results import (
    ALLOCATION_NOTE,
    FRAGMENTATION_NOTE,
    PERCENTILES,
    STRANDED_NOTE,
    ReplayResult,
)


def duration_text(seconds: float | None) -> str:
    """A duration for a reader: 45s, 2.5m, 3.1h, 2.0d; ``-`` for none."""
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m" if seconds % 60 < 1 else f"{seconds / 60:.1f}m"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def percent(value: float | None) -> str:
    """A share as a percentage, with the digits a small one needs to be told apart
    (0.21% against 0.26%, where one decimal would say 0.2% and 0.3%)."""
    if value is None:
        return "-"
    percent = 100 * value
    digits = 1 if percent >= 1 or percent == 0 else 2 if percent >= 0.1 else 3
    return f"{percent:.{digits}f}%"


# Below this peak allocation a replay says little about placement (openb's own times: 1%).
LIGHT_LOAD = 0.1
# Two runs hold "the same need" when their needs' means are this close (relative).
SAME_NEED = 0.02


def _same_need(a: dict[str, Any], b: dict[str, Any]) -> bool:
    high = max(a["demand_mean"], b["demand_mean"])
    return high > 0 and abs(a["demand_mean"] - b["demand_mean"]) <= SAME_NEED * high


def _in_short(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The two runs compared in one sentence: GPU held, the need beside it, waits, jobs placed."""
    parts = []
    if _same_need(a, b) and b["allocation_mean"] > 0 and abs(a["allocation_mean"] - b["allocation_mean"]) > 1e-4:
        less = 1 - a["allocation_mean"] / b["allocation_mean"]
        parts.append(
            f"{a['label']} held {abs(less):.0%} {'less' if less > 0 else 'more'} GPU than {b['label']} "
            f"for the same need ({percent(a['allocation_mean'])} against {percent(b['allocation_mean'])})"
        )
    elif abs(a["allocation_mean"] - b["allocation_mean"]) > 1e-4:
        parts.append(
            f"{a['label']} held {percent(a['allocation_mean'])} of the GPUs, {b['label']} "
            f"{percent(b['allocation_mean'])} (needs differ: {percent(a['demand_mean'])} against "
            f"{percent(b['demand_mean'])})"
        )
    wait_a, wait_b = a["waits"]["all"]["p95"], b["waits"]["all"]["p95"]
    if (wait_a or 0) != (wait_b or 0):
        parts.append(f"queue wait p95 {duration_text(wait_a)} against {duration_text(wait_b)}")
    if a["placed"] != b["placed"]:
        parts.append(f"{a['placed']} jobs placed against {b['placed']}")
    return "; ".join(parts) if parts else "the two runs did the same on every measure above"


def _preemption_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Protected work's waits, preemptions and the work they cost, when a run preempted."""
    if not (a.get("preemption") or b.get("preemption")):
        return []

    def waits(run: dict[str, Any]) -> str:
        w = run["protected_waits"]
        return "-" if not w["jobs"] else f"{duration_text(w['p50'])} / {duration_text(w['p99'])}"

    def lost(run: dict[str, Any]) -> tuple[str, str]:
        p = run.get("preemption")
        return ("0", "0.00") if not p else (str(p["requeues"]), f"{p['gpu_hours_lost']:.2f}")

    return [
        ("protected work (priority > 0) wait p50/p99", waits(a), waits(b), "shorter"),
        ("preemptions (jobs requeued)", lost(a)[0], lost(b)[0], "fewer"),
        ("GPU-hours of work lost to preemption", lost(a)[1], lost(b)[1], "fewer"),
    ]


def _gang_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Multi-node jobs' waits per size class, and the small work backfilled onto the nodes
    reserved for them, when the workload has any."""
    classes = list(dict.fromkeys([*a.get("gang_waits", {}), *b.get("gang_waits", {})]))
    if not classes:
        return []

    def waits(run: dict[str, Any], label: str) -> str:
        w = run.get("gang_waits", {}).get(label)
        if not w:
            return "-"
        text = f"{duration_text(w['p50'])} / {duration_text(w['p95'])}"
        return text + (f" ({w['never_started']} never)" if w["never_started"] else "")

    rows = [(f"gangs of {label}: wait p50/p95", waits(a, label), waits(b, label), "shorter") for label in classes]
    rows.append(
        (
            "GPU-hours backfilled on reserved nodes",
            f"{a.get('backfilled_gpu_hours', 0.0):.1f}",
            f"{b.get('backfilled_gpu_hours', 0.0):.1f}",
            "(small work run meanwhile)",
        )
    )
    return rows


def summary_lines(result: dict[str, Any], width: int = 100) -> list[str]:
    """What ``gpush simulate`` and ``make demo`` print: the two runs side by side, which
    way each measure is good, the held jobs of each run, the comparison in one sentence,
    and what the less obvious measures mean (wrapped at ``width``)."""
    a, b = result["primary"], result["comparison"]
    inputs = result["inputs"]
    source = inputs.get("workload") or f"openb trace {inputs.get('trace_pods', '')}"
    total = a["total_gpus"]
    rows: list[tuple[str, str, str, str]] = [
        ("", a["label"], b["label"], "good when"),
        ("jobs placed / held", f"{a['placed']} / {a['held']}", f"{b['placed']} / {b['held']}", "more placed"),
        (
            "GPU allocation (held), mean",
            percent(a["allocation_mean"]),
            percent(b["allocation_mean"]),
            "lower, for the same need",
        ),
        ("GPU the running jobs need, mean", percent(a["demand_mean"]), percent(b["demand_mean"]), "(the work)"),
        (
            "stranded GPU while jobs wait, mean",
            f"{a['stranded_mean_gpus']:.2f}",
            f"{b['stranded_mean_gpus']:.2f}",
            "lower",
        ),
        ("queue wait p50/p95/p99", _waits_text(a), _waits_text(b), "shorter"),
        *_preemption_rows(a, b),
        *_gang_rows(a, b),
        ("all jobs done after", duration_text(a["makespan"]), duration_text(b["makespan"]), "sooner"),
    ]
    if shows_tenants(a["tenants"]):
        rows.append(("GPU share / weight share", "", "", "share near weight"))
        for name, t in a["tenants"].items():
            other = b["tenants"].get(name) or {}
            weight = percent(t["weight_share"])
            rows.append(
                (
                    f"  {name}",
                    f"{percent(t['gpu_share_mean'])} / {weight}",
                    f"{percent(other.get('gpu_share_mean'))} / {weight}",
                    "",
                )
            )
            if t["time_at_quota"] or other.get("time_at_quota"):
                rows.append(
                    (
                        f"  {name} at quota",
                        duration_text(t["time_at_quota"]),
                        duration_text(other.get("time_at_quota")),
                        "",
                    )
                )
    first = max(len(r[0]) for r in rows) + 2
    columns = [max(len(r[i]) for r in rows) for i in (1, 2)]
    lines = [f"simulated {inputs.get('jobs')} jobs from {source} on {inputs.get('fleet_description')}"]
    for name, left, right, good in rows:
        lines.append(f"  {name:<{first}}{left:>{columns[0]}}  {right:>{columns[1]}}   {good}".rstrip())
    inflation = result.get("inflation")
    if inflation:
        medians = inflation["medians"]
        parts = ", ".join(f"{name} {percent(m['at_full'])}" for name, m in medians.items())
        lines += textwrap.wrap(
            f"inflation (FGD paper), GPU demand placed at 100% arrived (higher is better): {parts}",
            width,
            initial_indent="  ",
            subsequent_indent=" " * 4,
            break_on_hyphens=False,
        )
    lines += _held_lines(a, b)
    indent = " " * 4
    peak = max(a["allocation_peak"], b["allocation_peak"])
    if peak < LIGHT_LOAD:
        lines += textwrap.wrap(
            f"a light load: at most {percent(peak)} of the GPUs were held at once, so allocation says little "
            "about placement here" + ("; the inflation experiment is the test of that." if inflation else "."),
            width,
            initial_indent="  ",
            subsequent_indent=indent,
            break_on_hyphens=False,
        )
    lines += textwrap.wrap(
        f"in short: {_in_short(a, b)}.", width, initial_indent="  ", subsequent_indent=indent, break_on_hyphens=False
    )
    for note in (ALLOCATION_NOTE.format(gpus=f"{total:g}"), STRANDED_NOTE):
        lines += textwrap.wrap(note, width, initial_indent="  ", subsequent_indent=indent, break_on_hyphens=False)
    return lines


def _waits_text(s: dict[str, Any]) -> str:
    w = s["waits"]["all"]
    return "/".join(duration_text(w[f"p{p}"]) for p in PERCENTILES)


def _held_lines(a: dict[str, Any], b: dict[str, Any], most: int = 3) -> list[str]:
    """Each run's most common held reasons; once for both when they are the same."""

    def why(reason: str) -> str:
        return reason.removeprefix("held: ")  # the line says held already

    if a["held_reasons"] == b["held_reasons"]:
        return [
            f"  held ({count}), both runs: {why(reason)}" for reason, count in list(a["held_reasons"].items())[:most]
        ]
    lines = []
    for run in (a, b):
        reasons = list(run["held_reasons"].items())
        lines += [f"  held ({count}), {run['label']}: {why(reason)}" for reason, count in reasons[:most]]
        if len(reasons) > most:
            lines.append(f"  held, {run['label']}: {len(reasons) - most} more reason(s) in report.md")
    return lines


def report_markdown(results: dict[str, Any], primary: ReplayResult, comparison: ReplayResult, images: list[str]) -> str:
    """``report.md``: the inputs, the two runs side by side, waits per kind, tenants, held jobs,
    the inflation experiment, the plots with their captions, and the notes."""
    a, b = results["primary"], results["comparison"]
    inputs = results["inputs"]
    lines = ["# gpush simulation report", ""]
    lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in inputs.items() if v is not None]
    lines += [
        "",
        "## Summary",
        "",
        f"In short: {_in_short(a, b)}.",
        "",
        f"| | {a['label']} | {b['label']} | good when |",
        "| --- | --- | --- | --- |",
    ]

    def add(name: str, left: Any, right: Any, good: str = "") -> None:
        lines.append(f"| {name} | {left} | {right} | {good} |")

    add("placement", a["placement"], b["placement"])
    add("jobs", a["jobs"], b["jobs"])
    add("placed (started)", a["placed"], b["placed"], "more")
    add("succeeded / failed", f"{a['succeeded']} / {a['failed']}", f"{b['succeeded']} / {b['failed']}", "none failed")
    add("held", a["held"], b["held"], "fewer")
    add("still waiting at the end", a["still_waiting"], b["still_waiting"], "fewer")
    lower = "lower, for the same need"
    add(
        f"GPU allocation (held), time-weighted mean, % of {a['total_gpus']:g} GPUs",
        percent(a["allocation_mean"]),
        percent(b["allocation_mean"]),
        lower,
    )
    add("GPU allocation (held), peak", percent(a["allocation_peak"]), percent(b["allocation_peak"]), lower)
    add("GPU the running jobs need, mean", percent(a["demand_mean"]), percent(b["demand_mean"]), "(the work)")
    for tier in sorted(set(a["tier_allocation_mean"]) | set(b["tier_allocation_mean"])):
        add(
            f"{tier} tier allocation, mean",
            percent(a["tier_allocation_mean"].get(tier)),
            percent(b["tier_allocation_mean"].get(tier)),
            lower,
        )
    add(
        "jobs waiting, mean / peak",
        f"{a['queue_mean']:.2f} / {a['queue_peak']}",
        f"{b['queue_mean']:.2f} / {b['queue_peak']}",
        "lower",
    )
    add(
        "stranded GPU while jobs wait, mean (GPU-equivalents)",
        f"{a['stranded_mean_gpus']:.2f}",
        f"{b['stranded_mean_gpus']:.2f}",
        "lower",
    )
    add(
        "FGD fragmentation, mean (GPU-equivalents)",
        *("-" if r["fragmentation_mean_gpus"] is None else f"{r['fragmentation_mean_gpus']:.2f}" for r in (a, b)),
        "lower",
    )
    add("GPU-hours held", f"{a['gpu_hours']:.1f}", f"{b['gpu_hours']:.1f}", lower)
    add("all jobs done after", duration_text(a["makespan"]), duration_text(b["makespan"]), "sooner")
    add("replay wall time", f"{a['wall_seconds']:.2f}s", f"{b['wall_seconds']:.2f}s")
    lines += ["", "How to read it:", ""]
    lines += [f"- {note}" for note in (ALLOCATION_NOTE.format(gpus=f"{a['total_gpus']:g}"), STRANDED_NOTE)]
    if a["fragmentation_mean_gpus"] is not None or b["fragmentation_mean_gpus"] is not None:
        lines.append(f"- {FRAGMENTATION_NOTE}")
    lines.append("- queue wait: from a job's arrival to its start; p50/p95/p99: half, 95% and 99% of jobs waited less.")

    lines += ["", "## Queue wait per kind (arrival to start; shorter is better)", ""]
    lines += ["| kind | run | jobs | p50 | p95 | p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for run in (a, b):
        for kind, w in run["waits"].items():
            cells = " | ".join(duration_text(w[f"p{p}"]) for p in PERCENTILES)
            lines.append(f"| {kind} | {run['label']} | {w['jobs']} | {cells} |")

    gangs = _gang_rows(a, b)
    if gangs:
        lines += [
            "",
            "## Multi-node jobs (arrival to start, per size class; shorter is better)",
            "",
            "A gang that waited the policy's `scheduling.gang_reservation_after` gets the nodes it will use "
            "reserved; they take only work that ends before the gang can start (backfilled).",
            "",
            f"| | {a['label']} | {b['label']} |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {name} | {left} | {right} |" for name, left, right, _good in gangs]

    shown = [run for run in (a, b) if shows_tenants(run["tenants"])]
    if shown:
        lines += [
            "",
            "## Tenants",
            "",
            "Jobs are tried as the scheduler takes them: priority, then the tenant furthest below its weighted "
            "share of the GPU-equivalents in use, then arrival. Share of GPU in use: the tenant's share of the "
            "GPU-equivalents all tenants hold, time-weighted over the time any are held; while all tenants "
            "contend it converges to its weight's share. At quota: the time it had jobs waiting at its quota.",
        ]
    for run in shown:
        lines += [
            "",
            f"### {run['label']}",
            "",
            "| tenant | weight (share) | quota | jobs placed / held | share of GPU in use | peak GPU held "
            "| GPU-hours | wait p50 | wait p95 | at quota |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, t in run["tenants"].items():
            quota = "-" if t["gpu_quota"] is None else f"{t['gpu_quota']:g}"
            at_quota = duration_text(t["time_at_quota"]) if t["time_at_quota"] else "-"
            if t["jobs_waited_at_quota"]:
                at_quota += f" ({t['jobs_waited_at_quota']} jobs)"
            lines.append(
                f"| {name} | {t['weight']:g} ({percent(t['weight_share'])}) | {quota} "
                f"| {t['placed']} / {t['held']} of {t['jobs']} | {percent(t['gpu_share_mean'])} "
                f"| {t['gpu_peak']:.2f} | {t['gpu_hours']:.1f} | {duration_text(t['wait_p50'])} "
                f"| {duration_text(t['wait_p95'])} | {at_quota} |"
            )

    for run in (a, b):
        if run["held_reasons"]:
            lines += ["", f"## Held jobs: {run['label']}", "", "| jobs | reason |", "| --- | --- |"]
            lines += [f"| {count} | {reason} |" for reason, count in run["held_reasons"].items()]

    inflation = results.get("inflation")
    if inflation:
        lines += [
            "",
            "## Inflation (FGD paper, seed " + str(inputs.get("seed")) + ")",
            "",
            f"Tasks in a random order, then drawn with replacement until the arrived GPU demand is "
            f"{inflation['ratio']:.0%} of the {inflation['capacity_gpus']:g} GPUs; nothing leaves. "
            "Allocation: GPU demand placed over capacity; higher is better.",
            "",
            "| placement | at 100% arrived | at the first failure | at the end |",
            "| --- | --- | --- | --- |",
        ]
        for name, m in inflation["medians"].items():
            lines.append(
                f"| {name} | {percent(m['at_full'])} | {percent(m['at_first_failure'])} | {percent(m['at_end'])} |"
            )

    if images:
        lines += ["", "## Plots"]
        for name in images:
            lines += ["", f"![{name}]({name})", "", f"*{CAPTIONS[name]}*"]
    explained = {STRANDED_NOTE, FRAGMENTATION_NOTE}  # in "How to read it"
    notes = results["notes"] + [n for n in (*a["notes"], *b["notes"]) if n not in results["notes"]]
    notes = [n for n in notes if n not in explained]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"
