"""The simulation report's PNG plots (matplotlib, drawn off-screen).

What every figure keeps to, so that a reader need not guess:

- a title, axes labelled with their units, and a one-line caption at the foot
  (:data:`CAPTIONS`) that says what good looks like;
- one colour per run in every figure, by its name (:func:`run_colours`: the replays
  and the inflation experiment's variants of the same name share it); series of one
  run differ by line style;
- nothing hidden: lines drawn later are thinner and on top, a series equal to one
  already drawn is dashed over it and its legend entry says which it equals, legends
  sit outside the axes, and a plot with nothing to show (no job ever waited) says so
  in words instead of drawing empty bars;
- y from 0 with room above the peak, and a symmetric-log scale where the values span
  orders of magnitude.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.simulation.results import KINDS, PERCENTILES, ReplayResult

# Matplotlib's default cycle, so the first run is blue and the second orange as before.
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")

# What good looks like, one line per figure (the figure's caption and report.md's).
CAPTIONS = {
    "allocation.png": "Good: the held line close to the needed line (little held beyond what jobs need), and for "
    "the same need, lower than the other run's.",
    "tiers.png": "Good: for the same work, lower; a tier pinned at 100% while jobs wait is the bottleneck.",
    "queue.png": "Good: low and brief; 0 means every job that arrived has started.",
    "fragmentation.png": "Good: low: little free GPU that the jobs waiting for capacity (stranded) or a typical "
    "job (fragmentation) cannot use.",
    "waits.png": "Good: short bars; jobs start soon after they arrive (p95 and p99: the slowest 5% and 1%).",
    "jobs.png": "Good: every job placed and succeeded; a held job can never fit where the policy routes it "
    "(report.md says why).",
    "inflation.png": "Good: the curve stays on the diagonal longer and ends higher: more of the arriving demand "
    "placed before the first refusal.",
}

# Values this many times the typical one: a linear axis would flatten the rest.
ORDERS_OF_MAGNITUDE = 100.0
# A timeline with more samples than this (a trace's months) is drawn as time-weighted
# means over BINS equal spans: every event as a step is a solid band in which one run's
# line covers the other's.
MAX_STEPS = 1500
BINS = 500
# Legend entries wrap at this many characters, so the legend does not squeeze the plot.
LEGEND_WIDTH = 42


def shows_tenants(tenants: dict[str, dict[str, Any]]) -> bool:
    """Per-tenant figures say something when tenants share or a quota caps one."""
    return len(tenants) > 1 or any(t["gpu_quota"] is not None for t in tenants.values())


def run_colours(names: Iterable[str]) -> dict[str, str]:
    """One colour per run name, in the order the names first come."""
    colours: dict[str, str] = {}
    for name in names:
        if name not in colours:
            colours[name] = PALETTE[len(colours) % len(PALETTE)]
    return colours


def time_unit(ends: Iterable[float]) -> tuple[float, str]:
    """One time unit for every run of a figure, from the latest end: (seconds per unit, name)."""
    span = max(ends, default=0.0)
    if span > 3 * 86400:
        return 86400.0, "days"
    if span > 3 * 3600:
        return 3600.0, "hours"
    return 60.0, "minutes"


@dataclass
class _Series:
    """One line of a figure over time: a step function, each value holding until the next time."""

    label: str
    colour: str
    style: Any  # a matplotlib line style
    x: Any  # numpy arrays
    y: Any


def same_steps(x1: Sequence[float], y1: Sequence[float], x2: Sequence[float], y2: Sequence[float]) -> bool:
    """Whether two step functions (``y[i]`` from ``x[i]`` until the next ``x``) are equal
    everywhere, within rounding (before its first time a function is 0)."""
    import numpy as np

    x1, y1, x2, y2 = (np.asarray(v, dtype=float) for v in (x1, y1, x2, y2))
    if not len(x1) or not len(x2):
        return len(x1) == len(x2)
    xs = np.union1d(x1, x2)

    def at(x, y):
        index = np.searchsorted(x, xs, side="right") - 1
        return np.where(index >= 0, y[np.clip(index, 0, None)], 0.0)

    a, b = at(x1, y1), at(x2, y2)
    scale = max(float(np.abs(a).max()), float(np.abs(b).max()), 1.0)
    return bool(np.allclose(a, b, rtol=0, atol=1e-6 * scale))


def time_weighted_bins(x: Sequence[float], y: Sequence[float], edges: Sequence[float]) -> Any:
    """The step function (``y[i]`` from ``x[i]`` to the next ``x``; 0 before the first, the
    last value to the last edge) as its time-weighted mean over each span between ``edges``."""
    import numpy as np

    x, y, edges = (np.asarray(v, dtype=float) for v in (x, y, edges))
    if not len(x):
        return np.zeros(len(edges) - 1)
    end = max(float(edges[-1]), float(x[-1]))
    area = np.concatenate([[0.0], np.cumsum(y * np.diff(np.append(x, end)))])
    index = np.searchsorted(x, edges, side="right") - 1
    at = np.clip(index, 0, None)
    cumulative = np.where(index >= 0, area[at] + y[at] * (edges - x[at]), 0.0)
    return np.diff(cumulative) / np.diff(edges)


def _merge_equal(series: list[_Series], joiner: str) -> list[_Series]:
    """Series of one run that are equal become one, labelled with both names."""
    merged: list[_Series] = []
    for s in series:
        twin = next((m for m in merged if same_steps(m.x, m.y, s.x, s.y)), None)
        if twin is None:
            merged.append(s)
        else:
            twin.label += f"{joiner}{s.label.rsplit(': ', 1)[-1]}"
    return merged


def _draw_steps(ax, series: list[_Series]) -> None:
    """Draw step lines so that none hides another: each later one thinner and on top, one
    equal to a line already drawn dashed, its legend entry naming the line it equals."""
    thin = 0.6 if max((len(s.x) for s in series), default=0) > 2000 else 1.0
    drawn: list[_Series] = []
    for i, s in enumerate(series):
        twin = next((d for d in drawn if same_steps(d.x, d.y, s.x, s.y)), None)
        label, style = s.label, s.style
        if not len(s.y) or not s.y.any():
            label += " (0 throughout: on the x axis)"
        if twin is not None:
            label += f" (same as {twin.label})"
            style = (0, (4, 3)) if style in ("-", "solid") else style
        width = max(2.8 - 0.7 * i, 0.9) * thin
        ax.step(s.x, s.y, where="post", color=s.colour, linestyle=style, linewidth=width, label=label, zorder=2 + i)
        drawn.append(s)


def _y_from_zero(ax, values: Iterable[float], *, cap: float | None = None, integer: bool = False) -> str:
    """Y from 0 with room above the peak (at most ``cap`` plus a margin, for percentages);
    symmetric-log where the peak is orders of magnitude above the typical value.
    Returns "log" or "linear"."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    v = np.asarray([x for x in values if x == x], dtype=float)  # NaN out
    positive = v[v > 0]
    peak = float(positive.max()) if len(positive) else 0.0
    if integer:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if peak <= 0:
        ax.set_ylim(0, 1)
        return "linear"
    typical = float(np.median(positive))
    if peak / typical >= ORDERS_OF_MAGNITUDE:
        floor = 10 ** np.floor(np.log10(float(positive.min())))
        ax.set_yscale("symlog", linthresh=floor, linscale=0.5)
        ax.set_ylim(0, peak * 2)
        return "log"
    top = peak * 1.12
    if cap is not None and peak <= cap:
        top = min(top, cap * 1.04)
    ax.set_ylim(0, top)
    return "linear"


def _nothing_to_show(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=11,
        wrap=True,
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "grey"},
    )


def _duration_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 3 * 86400:
        return 86400.0, "days"
    if seconds >= 3 * 3600:
        return 3600.0, "hours"
    if seconds >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def figures(
    primary: ReplayResult, comparison: ReplayResult, inflation_results: dict[str, Any] | None
) -> dict[str, Any]:
    """The report's figures by file name (matplotlib Figures, not yet saved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import PercentFormatter

    runs = (primary, comparison)
    names = [r.label for r in runs]
    if inflation_results:
        names += list(inflation_results["runs"])
    colour = run_colours(names)
    end = max((r.timeline.t[-1] for r in runs if r.timeline.t), default=0.0)
    scale, unit = time_unit([end])
    edges = None
    time_label = f"virtual time since the replay began ({unit})"
    if max(len(r.timeline.t) for r in runs) > MAX_STEPS and end > 0:
        edges = np.linspace(0.0, end, BINS + 1)
        per_bin, bin_unit = _duration_unit(end / BINS)
        time_label = (
            f"virtual time since the replay began ({unit}; each step: the time-weighted mean of "
            f"{end / BINS / per_bin:.3g} {bin_unit})"
        )
    made: dict[str, Any] = {}

    def figure(name: str, title: str, size=(10, 4.6), **kw):
        fig, axes = plt.subplots(figsize=size, layout="constrained", **kw)
        # Over the axes, not the figure: a figure title would run into the legend beside them.
        if kw.get("ncols", 1) == 1:
            axes.set_title(title, fontsize=12)
        else:
            fig.suptitle(title, fontsize=12)
        # The caption: at the foot, where constrained layout keeps room for it.
        fig.supxlabel(CAPTIONS[name], fontsize=9, style="italic", color="dimgray")
        made[name] = fig
        return fig, axes

    def legend(fig, ax, extra: Sequence[Any] = ()) -> None:
        handles, labels = ax.get_legend_handles_labels()
        handles += [h for h, _ in extra]
        labels += [text for _, text in extra]
        labels = ["\n".join(textwrap.wrap(text, LEGEND_WIDTH, break_on_hyphens=False)) for text in labels]
        if handles:
            fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)

    def time_x(ax) -> None:
        ax.set_xlabel(time_label)
        ax.set_xlim(0, max(end / scale, 1e-9) * 1.02)
        ax.grid(alpha=0.3)

    def over_time(run: ReplayResult, what: str, values: Sequence[float], style: Any = "-") -> _Series:
        x, y = np.asarray(run.timeline.t, dtype=float), np.asarray(values, dtype=float)
        if edges is not None:
            means = time_weighted_bins(x, y, edges)
            x, y = edges, np.append(means, means[-1:])  # the last span drawn to the end
        return _Series(f"{run.label}: {what}", colour[run.label], style, x / scale, y)

    def percent(values: Sequence[float], total: float | None) -> list[float]:
        return [100 * v / (total or 1.0) for v in values]

    # -- allocation: held and needed, % of the fleet ----------------------------------------
    total = primary.total_gpus
    series: list[_Series] = []
    for run in runs:
        own = [
            over_time(run, "held", percent(run.timeline.allocated, run.total_gpus)),
            over_time(run, "needed", percent(run.timeline.demand, run.total_gpus), "--"),
        ]
        series += _merge_equal(own, " = ")
    fig, ax = figure("allocation.png", "GPU held and GPU the running jobs need")
    _draw_steps(ax, series)
    _y_from_zero(ax, (v for s in series for v in s.y), cap=100)
    ax.set_ylabel(f"% of the fleet's {total:g} GPUs")
    ax.yaxis.set_major_formatter(PercentFormatter(100, decimals=None))
    if all(r.total_gpus == total for r in runs) and total:
        right = ax.secondary_yaxis("right", functions=(lambda p: p * total / 100, lambda g: g * 100 / total))
        right.set_ylabel("GPUs (GPU-equivalents)")
    time_x(ax)
    legend(fig, ax)

    # -- tiers -------------------------------------------------------------------------------
    tier_names = sorted({tier for r in runs for tier in r.timeline.tiers})
    tier_style = dict(zip(tier_names, ("-", "--", "-.", ":"), strict=False))
    series = [
        over_time(run, f"{tier} tier", percent(values, run.tier_gpus.get(tier)), tier_style.get(tier, "-"))
        for run in runs
        for tier, values in sorted(run.timeline.tiers.items())
    ]
    fig, ax = figure("tiers.png", "GPU held per tier (" + ", ".join(tier_names) + ")")
    _draw_steps(ax, series)
    _y_from_zero(ax, (v for s in series for v in s.y), cap=100)
    ax.set_ylabel("% of the tier's GPUs held")
    ax.yaxis.set_major_formatter(PercentFormatter(100, decimals=None))
    time_x(ax)
    legend(fig, ax)

    # -- queue -------------------------------------------------------------------------------
    series = [over_time(run, "jobs waiting", run.timeline.queue) for run in runs]
    fig, ax = figure("queue.png", "Jobs waiting to start (in gpush's queue or a cluster's)")
    if any(float(s.y.max(initial=0)) > 0 for s in series):
        _draw_steps(ax, series)
        _y_from_zero(ax, (v for s in series for v in s.y), integer=True)
    else:
        _y_from_zero(ax, (), integer=True)
        ax.set_yticks([0])
        _nothing_to_show(ax, "No job waited in any run: every job started as it arrived.")
    ax.set_ylabel("jobs waiting (count)")
    time_x(ax)
    legend(fig, ax)

    # -- stranded and fragmentation ----------------------------------------------------------
    series = []
    for run in runs:
        series.append(over_time(run, "stranded", run.timeline.stranded))
        if run.measures_fragmentation:
            series.append(over_time(run, "fragmentation (FGD)", run.timeline.fragmentation, "--"))
    shown = [s for s in series if float(s.y.max(initial=0)) > 0]
    zero = [s for s in series if s not in shown]
    title = "Free GPU that no job waiting for capacity fits (stranded)"
    if any(r.measures_fragmentation for r in runs):
        title += ", and FGD fragmentation"
    fig, ax = figure("fragmentation.png", title)
    # A series at 0 throughout would lie on the x axis under the others: the legend says it.
    extra = [(Line2D([], [], color=s.colour, linestyle=s.style), f"{s.label}: 0 throughout") for s in zero]
    if shown:
        _draw_steps(ax, shown)
        _y_from_zero(ax, (v for s in shown for v in s.y))
    else:
        _y_from_zero(ax, ())
        ax.set_yticks([0])
        _nothing_to_show(ax, "Nothing stranded in any run: no GPU stood free while a job waited for capacity.")
    ax.set_ylabel("GPU-equivalents (1 = one whole GPU)")
    time_x(ax)
    legend(fig, ax, extra)

    # -- queue wait per kind -----------------------------------------------------------------
    waits = {run.label: run.waits() for run in runs}
    kinds = [k for k in (*KINDS, "all") if any(k in w for w in waits.values())]

    def wait(label: str, kind: str, p: int) -> float:
        return float((waits[label].get(kind) or {}).get(f"p{p}") or 0.0)

    nonzero = [p for p in PERCENTILES if any(wait(r.label, k, p) for r in runs for k in kinds)]
    fig, ax = figure("waits.png", "Queue wait per kind of job (arrival to start)")
    peak_wait = max((wait(r.label, k, p) for r in runs for k in kinds for p in PERCENTILES), default=0.0)
    per, wait_unit = _duration_unit(peak_wait)
    ax.set_ylabel(f"queue wait ({wait_unit})")
    ax.set_xlabel("kind of job (count of jobs that started)")
    counts = {k: max((waits[r.label].get(k) or {}).get("jobs", 0) for r in runs) for k in kinds}
    if not nonzero:
        ax.set_xticks(range(len(kinds)), [f"{k}\n({counts[k]} jobs)" for k in kinds])
        ax.set_xlim(-0.5, len(kinds) - 0.5)
        _y_from_zero(ax, ())
        ax.set_yticks([0])
        _nothing_to_show(ax, "No job waited in any run: p50, p95 and p99 are 0 s for every kind.")
    else:
        hatches = {50: "", 95: "//", 99: "xx"}
        alphas = {50: 0.45, 95: 0.7, 99: 1.0}
        width = 0.8 / (len(runs) * len(nonzero))
        values_drawn = []
        for i, run in enumerate(runs):
            for j, p in enumerate(nonzero):
                offset = (i * len(nonzero) + j) * width - 0.4 + width / 2
                values = [wait(run.label, k, p) / per for k in kinds]
                values_drawn += values
                bars = ax.bar(
                    [x + offset for x in range(len(kinds))],
                    values,
                    width,
                    color=colour[run.label],
                    alpha=alphas[p],
                    hatch=hatches[p],
                    edgecolor="black",
                    linewidth=0.4,
                )
                # A bar of 0 is no bar: say 0 where it would stand.
                ax.bar_label(bars, labels=["0" if v == 0 else "" for v in values], fontsize=7, padding=1)
        ax.set_xticks(range(len(kinds)), [f"{k}\n({counts[k]} jobs)" for k in kinds])
        scale_kind = _y_from_zero(ax, values_drawn)
        if scale_kind == "log":
            ax.set_ylabel(f"queue wait ({wait_unit}, log scale)")
    ax.grid(axis="y", alpha=0.3)
    extra = []
    if nonzero:
        extra += [(Patch(facecolor=colour[r.label], edgecolor="black"), r.label) for r in runs]
        extra += [
            (Patch(facecolor="lightgrey", alpha=alphas[p], hatch=hatches[p], edgecolor="black"), f"p{p}")
            for p in nonzero
        ]
        extra += [
            (Patch(color="none"), f"p{p}: 0 s for every kind in every run (not drawn)")
            for p in PERCENTILES
            if p not in nonzero
        ]
    legend(fig, ax, extra)

    # -- jobs placed and held ----------------------------------------------------------------
    fig, ax = figure("jobs.png", "Jobs placed, finished and held", size=(10, 4.2))
    columns = ("placed", "succeeded", "failed", "held", "still_waiting")
    counts_drawn = []
    for i, run in enumerate(runs):
        s = run.summary()
        values = [s[c] for c in columns]
        counts_drawn += values
        bars = ax.bar(
            [x + i * 0.4 - 0.2 for x in range(len(columns))], values, 0.4, color=colour[run.label], label=run.label
        )
        ax.bar_label(bars, fontsize=8, padding=1)
    ax.set_xticks(range(len(columns)), [c.replace("_", " ") for c in columns])
    ax.set_xlabel("what became of the jobs (count of jobs)")
    ax.set_ylabel("jobs (count)")
    _y_from_zero(ax, counts_drawn, integer=True)
    ax.set_ylim(0, max(max(counts_drawn, default=0) * 1.15, 1))
    ax.grid(axis="y", alpha=0.3)
    legend(fig, ax)

    # -- inflation ---------------------------------------------------------------------------
    if inflation_results:
        fig, (whole, zoom) = figure(
            "inflation.png", "Inflation (FGD paper): tasks arrive and none leave", size=(12, 4.6), ncols=2
        )
        styles = ("-", "--", "-.", ":")
        curves = {
            name: [(100 * a, 100 * b) for a, b in group[0]["curve"]]
            for name, group in inflation_results["runs"].items()
        }
        first = next(iter(curves.values()), [])
        for ax, low in ((whole, 0), (zoom, 75)):
            for i, (name, curve) in enumerate(curves.items()):
                label = name
                if i and curve and first:
                    # Where this curve first leaves the first one: below that they coincide.
                    apart = next((a for (a, b), (_, b0) in zip(curve, first, strict=False) if abs(b - b0) > 0.05), None)
                    if apart is None:
                        label += f" (same as {next(iter(curves))})"
                    elif apart > 1:
                        label += f" (same as {next(iter(curves))} up to {apart:.0f}% arrived)"
                shown_points = [(a, b) for a, b in curve if a >= low]
                ax.plot(
                    [a for a, _ in shown_points],
                    [b for _, b in shown_points],
                    color=colour[name],
                    linestyle=styles[i % len(styles)],
                    linewidth=max(2.6 - 0.7 * i, 1.0),
                    zorder=2 + i,
                    label=label if ax is whole else None,
                )
            (diagonal,) = ax.plot([low, 130], [low, 130], color="grey", linewidth=0.6, linestyle=":")
            ax.axvline(100, color="grey", linewidth=0.6)
            ax.set_xlabel("arrived GPU demand (% of capacity)")
            ax.set_ylabel("GPU demand placed (% of capacity)")
            ax.grid(alpha=0.3)
        whole.set_xlim(0, 130)
        whole.set_ylim(0, 105)
        whole.set_title("from 0% arrived", fontsize=10)
        zoom.set_xlim(75, 130)
        zoom.set_ylim(75, 100)
        zoom.set_title("from 75% arrived (zoomed)", fontsize=10)
        handles, labels = whole.get_legend_handles_labels()
        handles.append(diagonal)
        labels.append("every task placed (diagonal)")
        # Below the diagonal, where no curve can go: it hides nothing there.
        whole.legend(handles, labels, loc="lower right", fontsize=8)
    return made


def write_plots(
    out: Path,
    primary: ReplayResult,
    comparison: ReplayResult,
    inflation_results: dict[str, Any] | None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Draw :func:`figures` into ``out``; return the file names. ``progress`` is called
    with the count of files written."""
    import matplotlib.pyplot as plt

    written = []
    for name, fig in figures(primary, comparison, inflation_results).items():
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
        if progress is not None:
            progress(len(written))
    return written
