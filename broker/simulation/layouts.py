"""MIG layouts and lent nodes that follow the queue, in a replay (``gpush simulate --layouts``).

The same workload on the same fleet, three ways:

- **static**: every GPU keeps the layout of the fleet file, every node its cluster;
- **dynamic MIG**: every ``every`` seconds the scheduler plans each cluster's MIG GPUs for
  the waiting MIG work (:func:`broker.mig.plan.plan_mig`, as ``gpush mig plan`` and the
  policy's automatic mode do) and re-cuts the GPUs the plan changes; a re-cut GPU's node
  is fenced for ``reconfigure`` seconds (the change and the cluster taking it in), and a
  GPU whose instances run work is never re-cut;
- **dynamic MIG and lending**: the same, and the nodes that both clusters list (a node
  named in both: slurmd and a kubelet on one machine) move between them by
  :func:`broker.placement.lending.plan_moves`: fenced where they are, drained, then
  offered by the other side. A node starts with the first cluster of the fleet file
  that lists it; the other keeps it fenced, so no GPU is ever offered by both. As live, a
  node a gang keeps (broker.core.gangs) is neither re-cut nor lent.

What it measures beside a replay's usual figures (:class:`LayoutRun`): GPU-equivalents
held over the physical GPUs (a lent node counts once), the share of the fleet idle at
the workload's peak hours (:func:`peak_hours`: the quarter of its hours with the most
work offered, the same hours for every run), re-cuts, node moves, and GPU-hours spent
fenced for a re-cut or draining for a move.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.core.adapter import Rejected, Sharing
from broker.core.gangs import gang_nodes, held_on
from broker.core.gpus import GpuModel
from broker.mig.layouts import MigSlot
from broker.mig.matching import SliceDemand
from broker.mig.plan import MigGpu, keep_nodes, mark_held, plan_mig
from broker.placement.lending import LendableNode, LendingTerms, called_off, need, plan_moves
from broker.routing.policy import Policy
from broker.simulation.fleet import Fleet
from broker.simulation.pools import SHARING_BY_MODE
from broker.simulation.replay import T0, _FleetReplay
from broker.simulation.results import ReplayResult
from broker.simulation.workload import Arrival, TenantTerms

MODES = {"static": "static layouts", "dynamic": "dynamic MIG", "lending": "dynamic MIG + lending"}
MIG_SHARINGS = (Sharing.SLURM_MIG, Sharing.K8S_MIG)


@dataclass(frozen=True)
class LayoutTerms:
    """How often the replay plans (seconds), how long a re-cut fences its node, and how
    lent nodes move (their ``clusters`` are filled in from the fleet)."""

    every: float = 300.0
    reconfigure: float = 120.0
    hold: float = 1800.0
    threshold: float = 2.0
    max_moving: int = 2


@dataclass
class LayoutRun:
    """One run of the comparison: its replay result and what the layouts did."""

    mode: str
    result: ReplayResult
    physical_gpus: int
    recuts: int = 0
    moves: int = 0
    fenced_gpu_hours: float = 0.0  # re-cuts' fences and moves' drains
    idle_at_peaks: float | None = None
    moved: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, node, from, to)
    lendable: int = 0  # nodes two clusters list

    def summary(self) -> dict[str, Any]:
        s = self.result.summary()
        waits = s["waits"]
        return {
            "mode": self.mode,
            "label": MODES[self.mode],
            "physical_gpus": self.physical_gpus,
            "allocation_mean": self._held_mean() / self.physical_gpus,
            "idle_at_peaks": self.idle_at_peaks,
            "waits": {kind: {p: waits[kind][p] for p in ("p50", "p95")} for kind in waits},
            "placed": s["placed"],
            "still_waiting": s["still_waiting"],
            "recuts": self.recuts,
            "moves": self.moves,
            "fenced_gpu_hours": self.fenced_gpu_hours,
            "gpu_hours": s["gpu_hours"],
            "last_end_hours": (self.result.timeline.t[-1] / 3600) if self.result.timeline.t else 0.0,
        }

    def _held_mean(self) -> float:
        timeline = self.result.timeline
        return timeline.mean(timeline.allocated)


class _LayoutReplay(_FleetReplay):
    """:class:`broker.simulation.replay._FleetReplay` with layouts that change as it goes."""

    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        workload: Sequence[Arrival],
        tenants: Mapping[str, TenantTerms] | None,
        mode: str,
        terms: LayoutTerms,
        progress: Callable[[int], None] | None,
    ) -> None:
        super().__init__(fleet, policy, workload, False, T0, None, tenants, progress=progress)
        self.mode, self.terms = mode, terms
        self.next_tick = 0.0
        self.acted = False
        self.timers: list[tuple[float, int, str, str, str]] = []  # (t, n, cluster, node, why): unfence then
        self.fences: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.run_stats = {"recuts": 0, "moves": 0, "fenced_gpu_seconds": 0.0}
        self.moved: list[tuple[float, str, str, str]] = []
        listed: dict[str, list[str]] = defaultdict(list)
        gpus_of: dict[str, int] = {}
        for name, cluster in self.fleet.clusters.items():
            for node in cluster.nodes:
                listed[node.name].append(name)
                gpus_of[node.name] = len(node.gpus)
        self.lendable = {node: tuple(names) for node, names in listed.items() if len(names) == 2}
        self.physical_gpus = sum(gpus_of.values())
        self.owner = {node: names[0] for node, names in self.lendable.items()}
        self.since = {node: 0.0 for node in self.lendable}
        self.moving: dict[str, tuple[str, float]] = {}  # node -> (target, since when it drains)
        self.gpus_of = gpus_of
        for node, names in self.lendable.items():
            self._fence(names[1], node, "lent")  # offered by its first cluster only
            self.tier_gpus[self.fleet.clusters[names[1]].flavor] -= gpus_of[node]
        pairs = {names for names in self.lendable.values()}
        if mode == "lending" and len(pairs) > 1:
            raise ValueError(f"lending joins two clusters; the fleet lists nodes in several pairs: {sorted(pairs)}")
        self.lending = (
            LendingTerms(next(iter(pairs)), hold=terms.hold, threshold=terms.threshold, max_moving=terms.max_moving)
            if mode == "lending" and pairs
            else None
        )

    # -- fences, whoever asked -----------------------------------------------------------

    def _fence(self, cluster: str, node: str, why: str) -> None:
        if not self.fences[(cluster, node)]:
            self.sims[cluster].fence(node, why)
        self.fences[(cluster, node)].add(why)

    def _unfence(self, cluster: str, node: str, why: str) -> None:
        held = self.fences[(cluster, node)]
        held.discard(why)
        if not held:
            self.sims[cluster].unfence(node)

    # -- the replay's clock ------------------------------------------------------------

    def _next_timer(self, busy: bool) -> float | None:
        due = [self.timers[0][0]] if self.timers else []
        if self.mode != "static" and (busy or self.moving or (self.queue and self.acted)):
            due.append(self.next_tick)
        return min(due) if due else None

    def _on_time(self, t: float) -> None:
        while self.timers and self.timers[0][0] <= t:
            _, _, cluster, node, why = heapq.heappop(self.timers)
            self._unfence(cluster, node, why)
        if self.moving:
            self._carry_on(t)
        if self.mode == "static" or t < self.next_tick:
            return
        self.next_tick = t + self.terms.every
        self.acted = False
        self._recut(t)
        if self.lending is not None:
            self._lend(t)

    # -- dynamic MIG -------------------------------------------------------------------

    def _recut(self, t: float) -> None:
        """Plan each cluster's MIG GPUs for its waiting MIG work and re-cut what the plan changes."""
        for name, sim in self.sims.items():
            demand = self._slice_demand(name)
            if not demand:
                continue
            gpus = self._mig_gpus(name)
            if not gpus:
                continue
            plan = plan_mig(gpus, demand)
            recut: set[str] = set()
            for gpu in plan.changed:
                try:
                    sim.publish_mig(gpu.node, gpu.index, [str(s) for s in gpu.planned])
                except Rejected:
                    continue  # its jobs still hold what the change would take
                recut.add(gpu.node)
                self.run_stats["recuts"] += 1
            for node in recut:
                self._fence(name, node, "re-cut")
                heapq.heappush(self.timers, (t + self.terms.reconfigure, len(self.timers), name, node, "re-cut"))
                self.run_stats["fenced_gpu_seconds"] += self.gpus_of[node] * self.terms.reconfigure
                self.acted = True

    def _mig_gpus(self, cluster: str) -> list[MigGpu]:
        """The cluster's MIG GPUs it offers now (not fenced), the instances its jobs hold marked busy
        (counted per node and profile, as the broker does), those of a node a gang keeps kept."""
        sim = self.sims[cluster]
        kept = {node: why for (on, node), why in self._kept_for_gangs().items() if on == cluster}
        gpus, held = [], {}
        for node in sim.layout.nodes:
            if self.fences.get((cluster, node.name)):
                continue
            held |= {(node.name, profile): count for profile, count in sim.mig_in_use(node.name).items()}
            gpus += [
                MigGpu(
                    node.name,
                    gpu.index,
                    gpu.model,
                    True,
                    tuple(map(MigSlot.parse, sim.mig_published(node.name, gpu.index))),
                )
                for gpu in node.gpus
                if gpu.mode == "mig"
            ]
        return keep_nodes(mark_held(gpus, held), kept)

    def _slice_demand(self, cluster: str) -> list[SliceDemand]:
        """One demand per slice the waiting jobs routed to MIG on ``cluster`` want (as
        broker.mig.queue reads the live queue)."""
        out = []
        for entry in self.queue:
            route = next((r for r in entry.routes if r.sharing in MIG_SHARINGS and r.cluster == cluster), None)
            if route is None or entry.spec.gpu_memory_gb is None:
                continue
            replicas = entry.spec.elastic.min_replicas if entry.spec.elastic is not None else 1
            models = (route.gpu_model,) if route.gpu_model else ()
            out += [
                SliceDemand(str(entry.seq), memory_gb=entry.spec.gpu_memory_gb, models=models)
                for _ in range(entry.spec.gpus * max(replicas, 1))
            ]
        return out

    # -- lending -----------------------------------------------------------------------

    def _lend(self, t: float) -> None:
        waiting = self._waiting_for_lent()
        for move in plan_moves(self.lending, self._lendable_nodes(), waiting, t):
            self._fence(move.source, move.node, "lent")
            self.moving[move.node] = (move.target, t)
            self.acted = True

    def _carry_on(self, t: float) -> None:
        """Moves under way: the node joins its new side once its work has ended, or stays
        where it is when the reason to move went away."""
        waiting = self._waiting_for_lent() if self.lending is not None else {}
        nodes = {n.name: n for n in self._lendable_nodes()}
        for node, (target, since) in list(self.moving.items()):
            source = self.owner[node]
            if called_off(self.lending, nodes[node], waiting):
                self._unfence(source, node, "lent")
            elif self._held_on(source, node) <= 0:
                self._unfence(target, node, "lent")
                self.owner[node], self.since[node] = target, t
                self.run_stats["moves"] += 1
                self.moved.append((t, node, source, target))
            else:
                continue
            del self.moving[node]
            self.run_stats["fenced_gpu_seconds"] += self.gpus_of[node] * (t - since)
            self.acted = True

    def _lendable_nodes(self) -> list[LendableNode]:
        kept = self._kept_for_gangs()
        return [
            LendableNode(
                node,
                self.owner[node],
                self.gpus_of[node],
                busy=self._held_on(self.owner[node], node),
                since=self.since[node],
                moving_to=self.moving[node][0] if node in self.moving else None,
                kept=kept.get((self.owner[node], node)),
            )
            for node in sorted(self.lendable)
        ]

    def _kept_for_gangs(self) -> dict[tuple[str, str], str]:
        """The nodes multi-node jobs keep from a move or a re-cut (broker.core.gangs)."""
        return gang_nodes(
            ((r.job_id, r.cluster, r.nodes) for r in self.reservations.values()),
            ((e.seq, e.placement.cluster, held_on(e.placement)) for e in self.holding.values()),
        )

    def _held_on(self, cluster: str, node: str) -> float:
        """GPU-equivalents jobs placed on ``node`` of ``cluster`` hold (started or not; a gang's share per node)."""
        ranks = (
            (e, e.placement.nodes if e.placement.gang else (e.record.node or e.placement.node,))
            for e in self.holding.values()
        )
        return sum(
            e.placement.gpu_equivalents / len(on) for e, on in ranks if e.placement.cluster == cluster and node in on
        )

    def _waiting_for_lent(self) -> dict[str, float]:
        """Per side of the pool, the GPU-equivalents of waiting work a lent node would
        serve there (in the sharing it has there), by the smallest unit that holds each job."""
        out: dict[str, float] = defaultdict(float)
        offered = self._lent_sharings()
        for entry in self.queue:
            for route in entry.routes:
                how = offered.get((route.cluster, route.sharing))
                if how is not None:
                    out[route.cluster] += need(entry.spec, route.sharing, *how)
                    break
        return out

    def _lent_sharings(self) -> dict[tuple[str, Sharing], tuple[GpuModel, int]]:
        """(cluster, sharing) the lendable nodes offer on each side -> (GPU model, time-slice replicas)."""
        out = {}
        for node, names in self.lendable.items():
            for name in names:
                cluster = self.fleet.clusters[name]
                fleet_node = next(n for n in cluster.nodes if n.name == node)
                for gpu in fleet_node.gpus:
                    sharing = SHARING_BY_MODE[(cluster.flavor, gpu.mode)]
                    out.setdefault((name, sharing), (gpu.model, gpu.replicas))
        return out


# -- the comparison -------------------------------------------------------------------------


def replay_layouts(
    fleet: Fleet,
    policy: Policy,
    workload: Sequence[Arrival],
    *,
    tenants: Mapping[str, TenantTerms] | None = None,
    modes: Sequence[str] = tuple(MODES),
    terms: LayoutTerms | None = None,
    progress: Callable[[str], Callable[[int], None] | None] | None = None,
) -> list[LayoutRun]:
    """Replay ``workload`` once per mode (:data:`MODES`) and measure each (module docstring).
    ``progress(label)`` is called as each run starts and may give a callable that hears how
    many jobs arrived so far."""
    import time

    terms = terms or LayoutTerms()
    runs: list[LayoutRun] = []
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown layout mode {mode!r}: use one of {', '.join(MODES)}")
        began = time.perf_counter()
        loop = _LayoutReplay(fleet, policy, workload, tenants, mode, terms, progress(MODES[mode]) if progress else None)
        timeline, jobs = loop.run()
        result = ReplayResult(
            MODES[mode],
            "gpush's, with " + MODES[mode],
            jobs,
            timeline,
            float(loop.physical_gpus),
            dict(loop.tier_gpus),
            time.perf_counter() - began,
            [],
            tenant_terms=dict(tenants or {}),
        )
        runs.append(
            LayoutRun(
                mode,
                result,
                loop.physical_gpus,
                loop.run_stats["recuts"],
                loop.run_stats["moves"],
                loop.run_stats["fenced_gpu_seconds"] / 3600,
                moved=loop.moved,
                lendable=len(loop.lendable),
            )
        )
    hours = peak_hours(runs[0].result)
    for run in runs:
        run.idle_at_peaks = idle_during(run.result, hours, run.physical_gpus)
    return runs


def offered_by_hour(result: ReplayResult) -> list[float]:
    """GPU-equivalents of work offered in each hour: every placed job's holding from its
    arrival for as long as it ran, as if it had started at once."""
    hours: list[float] = []
    for job in result.jobs:
        if job.start is None or job.end is None:
            continue
        begin, end = job.arrival, job.arrival + (job.end - job.start)
        first, last = int(begin // 3600), int(math.ceil(end / 3600))
        while len(hours) < last:
            hours.append(0.0)
        for h in range(first, last):
            overlap = min(end, (h + 1) * 3600) - max(begin, h * 3600)
            if overlap > 0:
                hours[h] += job.gpu_equivalents * overlap / 3600
    return hours


def peak_hours(result: ReplayResult, share: float = 0.25) -> list[int]:
    """The quarter of the workload's hours with the most work offered (at least one)."""
    offered = offered_by_hour(result)
    if not offered:
        return []
    count = max(1, round(len(offered) * share))
    return sorted(sorted(range(len(offered)), key=lambda h: (-offered[h], h))[:count])


def idle_during(result: ReplayResult, hours: Sequence[int], physical_gpus: int) -> float | None:
    """The mean share of the fleet not held by any job during ``hours`` (time-weighted)."""
    timeline = result.timeline
    if not hours or len(timeline.t) < 2:
        return None
    shares = []
    for h in hours:
        start, end = h * 3600.0, (h + 1) * 3600.0
        area = 0.0
        for i in range(len(timeline.t)):
            a = max(timeline.t[i], start)
            b = min(timeline.t[i + 1] if i + 1 < len(timeline.t) else end, end)
            if b > a:
                area += timeline.allocated[i] * (b - a)
        shares.append(1 - area / (3600.0 * physical_gpus))
    return statistics.mean(shares)


# -- the report -----------------------------------------------------------------------------

# The target: dynamic MIG and lending hold at least this much less of the fleet
# idle at the peaks than the static split, with p95 waits no worse for either kind.
IDLE_TARGET = 0.10


def table(runs: Sequence[LayoutRun]) -> list[str]:
    """The comparison as lines of at most 80 characters."""
    from broker.simulation.report_text import duration_text, percent

    summaries = [r.summary() for r in runs]
    widths = [max(len(s["label"]), 11) + 2 for s in summaries]

    def row(name: str, cells: list[str]) -> str:
        return f"{name:<28}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths, strict=True))

    head = row("", [s["label"] for s in summaries])

    def waits(kind: str) -> list[str]:
        out = []
        for s in summaries:
            w = s["waits"].get(kind)
            out.append("-" if w is None else f"{duration_text(w['p50'])} / {duration_text(w['p95'])}")
        return out

    gpus = summaries[0]["physical_gpus"]
    lines = [
        head,
        row(f"GPU held, mean (of {gpus})", [percent(s["allocation_mean"]) for s in summaries]),
        row("fleet idle at the peak hours", [percent(s["idle_at_peaks"]) for s in summaries]),
    ]
    kinds = [k for k in ("training", "inference", "batch") if any(k in s["waits"] for s in summaries)]
    lines += [row(f"{kind} wait p50 / p95", waits(kind)) for kind in kinds]
    lines += [
        row("MIG re-cuts", [str(s["recuts"]) for s in summaries]),
        row("node moves between tiers", [str(s["moves"]) for s in summaries]),
        row("GPU-hours fenced or draining", [f"{s['fenced_gpu_hours']:.2f}" for s in summaries]),
        row("GPU-hours of work done", [f"{s['gpu_hours']:.0f}" for s in summaries]),
        row("all work done after", [f"{s['last_end_hours']:.1f}h" for s in summaries]),
        row("jobs placed / still waiting", [f"{s['placed']} / {s['still_waiting']}" for s in summaries]),
    ]
    return lines


def verdict(runs: Sequence[LayoutRun]) -> str:
    """Whether the last run meets the target against the first (the static split)."""
    static, best = runs[0].summary(), runs[-1].summary()
    if static["idle_at_peaks"] is None or best["idle_at_peaks"] is None:
        return "no peak hours to compare"
    less = static["idle_at_peaks"] - best["idle_at_peaks"]
    worse = [
        kind
        for kind, w in best["waits"].items()
        if kind != "all" and kind in static["waits"] and (w["p95"] or 0) > (static["waits"][kind]["p95"] or 0)
    ]
    met = less >= IDLE_TARGET and not worse
    how = f"{abs(100 * less):.1f} points {'less' if less >= 0 else 'more'}"
    return (
        f"{best['label']}: {_pct(best['idle_at_peaks'])} of the fleet idle at the peak hours against "
        f"{_pct(static['idle_at_peaks'])} with static layouts ({how}); p95 waits "
        + (f"longer for {', '.join(worse)}" if worse else "no longer for any kind of work")
        + f". gpush's aim for it: at least {100 * IDLE_TARGET:.0f} points less, no p95 wait longer: "
        + ("met." if met else "not met.")
    )


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def no_lending_note(runs: Sequence[LayoutRun]) -> str | None:
    """What to say when the fleet has no node both clusters list (so nothing can be lent)."""
    lending = next((r for r in runs if r.mode == "lending"), None)
    if lending is None or lending.lendable:
        return None
    return (
        "no node is listed by two clusters of the fleet, so nothing can be lent: the lending run is dynamic MIG "
        "alone (list a node under both clusters, as examples/fleet-lending.yaml does with lend-01 and lend-02)"
    )


def write_report(out: Any, runs: Sequence[LayoutRun], inputs: Mapping[str, Any]) -> list[str]:
    """report.md, results.json and two plots in ``out``; returns the file names."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    hours = peak_hours(runs[0].result)
    files = _plots(out, runs, hours)
    results = {
        "inputs": dict(inputs),
        "peak_hours": hours,
        "runs": [r.summary() for r in runs],
        "moves": {r.mode: [list(m) for m in r.moved] for r in runs},
        "verdict": verdict(runs),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [
        "# gpush simulate --layouts",
        "",
        f"Fleet: {inputs.get('fleet')}; workload: {inputs.get('workload')} ({inputs.get('jobs')} jobs); "
        f"policy: {inputs.get('policy')}.",
        "",
        "The same workload three ways: static layouts and a fixed split of the nodes; MIG layouts re-planned "
        f"every {_every(inputs)} for the waiting work; and that plus nodes lent between the "
        "tiers as their queues call for them (broker/simulation/layouts.py). Peak hours: the quarter of the "
        f"workload's hours with the most work offered ({', '.join(f'{h:02d}h' for h in hours)}).",
        "",
        "```",
        *table(runs),
        "```",
        "",
        verdict(runs),
        "",
        *([f"Note: {note}.", ""] if (note := no_lending_note(runs)) else []),
        "GPU held is a mean over the run, so a run that finishes the same work sooner holds more. The fleet idle "
        "at the peak hours counts every GPU no job holds in those hours. MIG layouts alone re-cut a tier's own "
        "GPUs for its queue; they cannot give one tier's waiting work the other tier's idle nodes, which lending "
        "does. GPU-hours fenced or draining: re-cut nodes fenced while the change is taken in, lent nodes "
        "fenced from the moment they were chosen until their work there ended.",
        "",
        *(f"![{name}]({name})" for name in files),
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    return ["report.md", "results.json", *files]


def _every(inputs: Mapping[str, Any]) -> str:
    return f"{inputs.get('every', LayoutTerms.every) / 60:g} min"


def _plots(out: Any, runs: Sequence[LayoutRun], hours: Sequence[int]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = ("#7f7f7f", "#1f77b4", "#d62728")
    files = []
    for name, title, column, ylabel in (
        ("layouts-held.png", "GPU held (share of the physical GPUs)", "allocated", "share of the fleet held"),
        ("layouts-queue.png", "Jobs waiting", "queue", "jobs waiting"),
    ):
        fig, ax = plt.subplots(figsize=(10, 4.2))
        for h in hours:
            ax.axvspan(h, h + 1, color="#f3e6c4", zorder=0)
        # Wider lines first, so that a run that does the same as another still shows beneath it.
        for run, colour, width in zip(runs, colours, (3.4, 2.2, 1.3), strict=False):
            timeline = run.result.timeline
            values = getattr(timeline, column)
            ys = [v / run.physical_gpus for v in values] if column == "allocated" else values
            ax.step([t / 3600 for t in timeline.t], ys, where="post", color=colour, label=MODES[run.mode], lw=width)
        ax.set_title(title + " (shaded: peak hours)")
        ax.set_xlabel("hours since the start")
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, max(t for r in runs for t in r.result.timeline.t[-1:]) / 3600 or 1)
        if column == "allocated":
            ax.set_ylim(0, 1.05)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=9, frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files
