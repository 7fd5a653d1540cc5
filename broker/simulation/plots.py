"""The simulation report's PNG plots (matplotlib, drawn off-screen)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from broker.simulation.results import KINDS, PERCENTILES, ReplayResult


def shows_tenants(tenants: dict[str, dict[str, Any]]) -> bool:
    """Per-tenant figures say something when tenants share or a quota caps one."""
    return len(tenants) > 1 or any(t["gpu_quota"] is not None for t in tenants.values())


def _time_axis(t: Sequence[float]) -> tuple[list[float], str]:
    span = (t[-1] - t[0]) if t else 0
    if span > 3 * 86400:
        return [x / 86400 for x in t], "days"
    if span > 3 * 3600:
        return [x / 3600 for x in t], "hours"
    return [x / 60 for x in t], "minutes"


def write_plots(
    out: Path, primary: ReplayResult, comparison: ReplayResult, inflation_results: dict[str, Any] | None
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = (primary, comparison)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def over_time(name: str, title: str, ylabel: str, series: Callable[[ReplayResult], list[tuple[str, list]]]):
        fig, ax = plt.subplots(figsize=(9, 4))
        unit = "minutes"
        for run in runs:
            x, unit = _time_axis(run.timeline.t)
            for label, values in series(run):
                if x:
                    ax.step(x, values, where="post", label=label, linewidth=1)
        ax.set_xlabel(f"virtual time ({unit})")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        save(fig, name)

    def percent_of(run: ReplayResult, values: list[float], total: float | None = None) -> list[float]:
        total = total or run.total_gpus or 1.0
        return [100 * v / total for v in values]

    over_time(
        "allocation.png",
        "GPU allocation (held), and what the running jobs need",
        "% of GPUs",
        lambda r: (
            [(f"{r.label}: held", percent_of(r, r.timeline.allocated))]
            + (
                [(f"{r.label}: needed", percent_of(r, r.timeline.demand))]
                if r.timeline.demand != r.timeline.allocated
                else []
            )
        ),
    )
    over_time(
        "tiers.png",
        "GPU allocation per tier",
        "% of the tier's GPUs",
        lambda r: [
            (f"{r.label}: {tier}", percent_of(r, values, r.tier_gpus.get(tier)))
            for tier, values in r.timeline.tiers.items()
        ],
    )
    over_time("queue.png", "Jobs waiting", "jobs", lambda r: [(r.label, r.timeline.queue)])
    over_time(
        "fragmentation.png",
        "Free GPU no waiting job fits (stranded) and FGD fragmentation",
        "GPU-equivalents",
        lambda r: (
            [(f"{r.label}: stranded", r.timeline.stranded)]
            + ([(f"{r.label}: fragmentation", r.timeline.fragmentation)] if any(r.timeline.fragmentation) else [])
        ),
    )

    fig, ax = plt.subplots(figsize=(9, 4))
    kinds = [k for k in (*KINDS, "all") if any(k in r.waits() for r in runs)]
    bar = 0.8 / (len(runs) * len(PERCENTILES))
    for i, run in enumerate(runs):
        waits = run.waits()
        for j, p in enumerate(PERCENTILES):
            offset = (i * len(PERCENTILES) + j) * bar
            values = [((waits.get(k) or {}).get(f"p{p}") or 0) / 60 for k in kinds]
            ax.bar([x + offset for x in range(len(kinds))], values, bar, label=f"{run.label} p{p}")
    ax.set_xticks([x + 0.4 - bar / 2 for x in range(len(kinds))], kinds)
    ax.set_ylabel("queue wait (minutes)")
    ax.set_title("Queue wait per kind")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    save(fig, "waits.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    columns = ("placed", "succeeded", "failed", "held", "still_waiting")
    for i, run in enumerate(runs):
        s = run.summary()
        ax.bar([x + i * 0.4 for x in range(len(columns))], [s[c] for c in columns], 0.4, label=run.label)
    ax.set_xticks([x + 0.2 for x in range(len(columns))], [c.replace("_", " ") for c in columns])
    ax.set_ylabel("jobs")
    ax.set_title("Jobs placed and held")
    ax.legend()
    save(fig, "jobs.png")

    if inflation_results:
        fig, (whole, zoom) = plt.subplots(1, 2, figsize=(11, 4))
        for ax, low in ((whole, 0), (zoom, 75)):
            for name, group in inflation_results["runs"].items():
                curve = [(100 * a, 100 * b) for a, b in group[0]["curve"] if 100 * a >= low]
                ax.plot([a for a, _ in curve], [b for _, b in curve], label=name)
            ax.plot([low, 130], [low, 130], color="grey", linewidth=0.5, linestyle="--")
            ax.axvline(100, color="grey", linewidth=0.5)
            ax.set_xlabel("arrived GPU demand (% of capacity)")
            ax.grid(alpha=0.3)
        whole.set_ylabel("GPU allocation (% of capacity)")
        whole.set_title("Inflation (FGD paper): tasks arrive, none leave")
        zoom.set_title("from 75% arrived")
        zoom.set_ylim(75, 100)
        zoom.legend()
        save(fig, "inflation.png")
    return written
