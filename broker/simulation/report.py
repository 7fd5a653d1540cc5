"""The simulation report: :func:`run_simulation` replays (broker.simulation.replay),
writes ``report.md``, ``results.json`` and the plots (broker.simulation.plots);
:func:`summary_lines` is the terminal's short version.

Both say, beside each figure, which way is good, and define the measures a reader may
not know (``*_NOTE`` of :mod:`broker.simulation.results`). Runs are named by who placed
them and how, in ``--placement``'s words (:func:`broker.simulation.results.run_label`),
the same in the summary, report.md, the plots and results.json."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.core.errors import InvalidRequest
from broker.placement.preemption import Terms
from broker.routing.policy import Policy, load_policy
from broker.simulation import traces
from broker.simulation.fleet import load_fleet_file
from broker.simulation.inflation import INFLATION_VARIANTS, inflation_experiment
from broker.simulation.plots import CAPTIONS, shows_tenants, write_plots
from broker.simulation.progress import Silent
from broker.simulation.replay import PLACEMENT_ON_FLEET, replay
from broker.simulation.results import (
    ALLOCATION_NOTE,
    FRAGMENTATION_NOTE,
    PERCENTILES,
    STRANDED_NOTE,
    ReplayResult,
    run_label,
)
from broker.simulation.shared import replay_shared
from broker.simulation.workload import TenantTerms, load_workload

# -- reports ------------------------------------------------------------------------------


def _duration_text(seconds: float | None) -> str:
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


def _percent(value: float | None) -> str:
    """A share as a percentage, with the digits a small one needs to be told apart
    (0.21% against 0.26%, where one decimal would say 0.2% and 0.3%)."""
    if value is None:
        return "-"
    percent = 100 * value
    digits = 1 if percent >= 1 or percent == 0 else 2 if percent >= 0.1 else 3
    return f"{percent:.{digits}f}%"


def _check_policy_names(policy: Policy, cluster: str, source: str) -> None:
    routes = {route.cluster for rule in policy.rules for route in rule.routes}
    if cluster not in routes:
        raise InvalidRequest(
            f"{source} routes to {', '.join(sorted(routes))}, but the trace's fleet is one cluster called "
            f"{cluster!r}: write a policy that routes to {cluster}, or leave the policy out to use the trace's own "
            "(fractional pods share GPUs, whole-GPU pods take whole GPUs)"
        )


def _tenants_text(tenants: Mapping[str, TenantTerms]) -> str:
    """ "nlp (weight 2, quota 8 GPU), vision (weight 1)": the tenants: section in a line."""
    return ", ".join(
        f"{name} (weight {t.weight:g}" + (f", quota {t.gpu_quota:g} GPU)" if t.gpu_quota is not None else ")")
        for name, t in tenants.items()
    )


def _distinct(label: str, other: str) -> str:
    """A comparison's label, told apart from the primary's if they are the same."""
    return label if label != other else f"{label}, compared"


def load_policy_file(path: str) -> Policy:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read policy file {path!r}: {exc.strerror or exc}") from None
    return load_policy(text, path)


def run_simulation(
    fleet_path: str | None,
    workload_path: str | None,
    trace_dir: str | None,
    policy_path: str | None,
    compare_policy_path: str | None,
    report_dir: str,
    seed: int = 0,
    *,
    placement: str = "fgd",
    trace_pods: str | None = None,
    trace_nodes: str | None = None,
    inflation: bool = True,
    plots: bool = True,
    progress: Silent | None = None,
    preemption: bool = False,
) -> dict[str, Any]:
    """Replay a workload (``fleet_path`` + ``workload_path``) or the openb trace
    (``trace_dir``; its node list is the fleet) under ``policy_path``, beside
    ``compare_policy_path`` or, without one, the same workload on whole GPUs; write
    ``report.md``, ``results.json`` and PNG plots to ``report_dir``; return the results.

    For a trace, ``policy_path`` None means the trace's own routing
    (:func:`broker.simulation.traces.openb_policy`), ``placement`` is gpush's placement on its
    GPU-sharing nodes (``fgd`` or ``best-fit``), and ``inflation`` adds the FGD
    paper's inflation experiment at ``seed``.

    ``preemption`` (a workload on a fleet): jobs of higher priority preempt the workload's
    ``preemptible`` ones (broker.placement.preemption), and the comparison is the same
    replay without preemption (unless ``compare_policy_path`` is given).

    ``progress`` (:class:`broker.simulation.progress.Progress`) hears of each step: the
    replays, the inflation experiment, the plots, results.json.
    """
    progress = progress or Silent()
    if (workload_path is None) == (trace_dir is None):
        raise InvalidRequest("give a workload file or a trace directory (one of them)")
    if preemption and trace_dir is not None:
        raise InvalidRequest("--preemption replays a workload on a fleet; a trace's pods say nothing of preemption")
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs: dict[str, Any] = {
        "fleet": fleet_path,
        "workload": workload_path,
        "trace": trace_dir,
        "policy": policy_path,
        "compare_policy": compare_policy_path,
        "seed": seed,
    }
    notes: list[str] = []
    inflation_results = None
    if trace_dir is not None:
        progress.step("reading the trace")
        trace = traces.load_openb(
            trace_dir, pods_file=trace_pods or traces.DEFAULT_PODS, nodes_file=trace_nodes or traces.DEFAULT_NODES
        )
        if fleet_path:
            notes.append(f"{fleet_path} not used: the trace's node list ({trace.nodes_file}) is the fleet")
        policy = trace.policy() if policy_path is None else load_policy_file(policy_path)
        if policy_path:
            _check_policy_names(policy, trace.cluster, policy_path)
        nodes = trace.shared_nodes()
        workload = trace.workload()
        inputs.update(
            trace_pods=trace.pods_file,
            trace_nodes=trace.nodes_file,
            placement=placement,
            fleet_description=f"{len(nodes)} GPU nodes, {trace.gpu_count} GPUs (openb)",
            jobs=len(workload),
        )
        cpu_work = trace.cpu_work()
        notes.append(
            f"{len(cpu_work)} CPU-only pods of {len(trace.pods)} are not jobs (gpush schedules GPU work): each run "
            "places them beside the jobs, where they hold the nodes' CPU and memory as on the trace's cluster"
        )
        notes.append(
            "the trace's own times are a light load (its README: at most ~1% of the GPUs busy at once): the "
            "replay shows routing and waits; the inflation experiment is the test of placement quality"
        )
        notes.append(
            "fractional pods: isolation none, gpu_memory_gb = share x "
            f"{trace.reference_memory_gb:g} GB (the fleet's most common GPU); packing uses the exact milli-GPU"
        )
        label = run_label("gpush", placement)
        progress.step(f"replaying {label}", len(workload), "jobs")
        primary = replay_shared(
            nodes,
            trace.cluster,
            policy,
            workload,
            placement=placement,
            label=label,
            progress=progress.update,
            cpu_work=cpu_work,
        )
        if compare_policy_path:
            other = load_policy_file(compare_policy_path)
            _check_policy_names(other, trace.cluster, compare_policy_path)
            label = _distinct(run_label(Path(compare_policy_path).stem, placement), primary.label)
            progress.step(f"replaying {label}", len(workload), "jobs")
            comparison = replay_shared(
                nodes,
                trace.cluster,
                other,
                workload,
                placement=placement,
                label=label,
                progress=progress.update,
                cpu_work=cpu_work,
            )
        else:
            # Whole GPUs are what Slurm and Kubernetes give without sharing, and they place
            # by best fit whatever --placement says of gpush's run.
            label = run_label("whole GPUs", "best-fit")
            progress.step(f"replaying {label}", len(workload), "jobs")
            comparison = replay_shared(
                nodes,
                trace.cluster,
                policy,
                workload,
                placement="best-fit",
                whole_gpus=True,
                label=label,
                progress=progress.update,
                cpu_work=cpu_work,
            )
            notes.append(
                f"{label}: every job on whole GPUs, placed by best-fit as Slurm and Kubernetes place without "
                f"sharing; --placement ({placement}) is the placement of gpush's run"
            )
        if inflation:
            progress.step("inflation experiment (FGD paper)", len(INFLATION_VARIANTS), "runs")
            done = iter(range(1, len(INFLATION_VARIANTS) + 1))
            inflation_results = inflation_experiment(
                nodes, trace.inflation_tasks(), seeds=[seed], progress=lambda _run: progress.update(next(done))
            )
    else:
        if not fleet_path:
            raise InvalidRequest("a workload replays on a fleet: give the fleet file too")
        if not policy_path:
            raise InvalidRequest("a workload replay needs a routing policy file")
        fleet = load_fleet_file(fleet_path)
        policy = load_policy_file(policy_path)
        loaded = load_workload(workload_path)
        workload, tenants = loaded.arrivals, loaded.tenants
        inputs.update(
            fleet_description=", ".join(
                f"{name} ({c.flavor}, {len(c.nodes)} nodes, {c.gpu_count} GPUs)" for name, c in fleet.clusters.items()
            ),
            jobs=len(workload),
            tenants=_tenants_text(tenants) or None,
            placement=PLACEMENT_ON_FLEET,
        )
        idle = sorted(set(tenants) - {a.tenant for a in workload})
        if idle:
            notes.append(f"tenants: lists {', '.join(idle)}, which no job of the workload names")
        label = f"gpush ({Path(policy_path).name})" + (" with preemption" if preemption else "")
        progress.step(f"replaying {label}", len(workload), "jobs")
        terms = Terms() if preemption else None
        primary = replay(
            fleet, policy, workload, label=label, tenants=tenants, progress=progress.update, preemption=terms
        )
        if preemption and not compare_policy_path:
            label = "without preemption"
            progress.step(f"replaying {label}", len(workload), "jobs")
            comparison = replay(fleet, policy, workload, label=label, tenants=tenants, progress=progress.update)
            notes.append(
                "preemption: a job preempts running preemptible jobs of lower priority when only they block it, "
                "choosing those that lose the least work (broker.placement.preemption); the comparison is the "
                "same replay without preemption"
            )
        elif compare_policy_path:
            label = _distinct(Path(compare_policy_path).name, primary.label)
            progress.step(f"replaying {label}", len(workload), "jobs")
            comparison = replay(
                fleet,
                load_policy_file(compare_policy_path),
                workload,
                label=label,
                tenants=tenants,
                progress=progress.update,
            )
        else:
            # What each job needs is what gpush's sharing gave it; whole GPUs hold more.
            need = {j.job_id: j.gpu_equivalents for j in primary.jobs if j.start is not None}
            progress.step("replaying whole GPUs", len(workload), "jobs")
            comparison = replay(
                fleet,
                policy,
                workload,
                whole_gpus=True,
                label="whole GPUs",
                demand_of=need.get,
                tenants=tenants,
                progress=progress.update,
            )

    results: dict[str, Any] = {
        "inputs": inputs,
        "notes": notes,
        "primary": primary.summary(),
        "comparison": comparison.summary(),
        "inflation": None if inflation_results is None else {k: v for k, v in inflation_results.items() if k != "runs"},
        "report_dir": str(out),
    }
    files = ["report.md", "results.json"]
    if plots:
        progress.step("drawing the plots", 7 if inflation_results else 6, "plots")
        files += write_plots(out, primary, comparison, inflation_results, progress=progress.update)
    results["files"] = [str(out / name) for name in files]
    detail = {
        **results,
        "primary": primary.to_dict(),
        "comparison": comparison.to_dict(),
        "inflation": inflation_results,
    }
    progress.step("writing results.json and report.md")
    # Indented for a reader when small; a trace's per-job records are for programs.
    indent = 1 if len(primary.jobs) <= 2000 else None
    (out / "results.json").write_text(json.dumps(detail, indent=indent, default=str))
    (out / "report.md").write_text(
        _report_markdown(results, primary, comparison, [f for f in files if f.endswith(".png")])
    )
    return results


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
            f"for the same need ({_percent(a['allocation_mean'])} against {_percent(b['allocation_mean'])})"
        )
    elif abs(a["allocation_mean"] - b["allocation_mean"]) > 1e-4:
        parts.append(
            f"{a['label']} held {_percent(a['allocation_mean'])} of the GPUs, {b['label']} "
            f"{_percent(b['allocation_mean'])} (needs differ: {_percent(a['demand_mean'])} against "
            f"{_percent(b['demand_mean'])})"
        )
    wait_a, wait_b = a["waits"]["all"]["p95"], b["waits"]["all"]["p95"]
    if (wait_a or 0) != (wait_b or 0):
        parts.append(f"queue wait p95 {_duration_text(wait_a)} against {_duration_text(wait_b)}")
    if a["placed"] != b["placed"]:
        parts.append(f"{a['placed']} jobs placed against {b['placed']}")
    return "; ".join(parts) if parts else "the two runs did the same on every measure above"


def _preemption_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Protected work's waits, preemptions and the work they cost, when a run preempted."""
    if not (a.get("preemption") or b.get("preemption")):
        return []

    def waits(run: dict[str, Any]) -> str:
        w = run["protected_waits"]
        return "-" if not w["jobs"] else f"{_duration_text(w['p50'])} / {_duration_text(w['p99'])}"

    def lost(run: dict[str, Any]) -> tuple[str, str]:
        p = run.get("preemption")
        return ("0", "0.00") if not p else (str(p["requeues"]), f"{p['gpu_hours_lost']:.2f}")

    return [
        ("protected work (priority > 0) wait p50/p99", waits(a), waits(b), "shorter"),
        ("preemptions (jobs requeued)", lost(a)[0], lost(b)[0], "fewer"),
        ("GPU-hours of work lost to preemption", lost(a)[1], lost(b)[1], "fewer"),
    ]


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
            _percent(a["allocation_mean"]),
            _percent(b["allocation_mean"]),
            "lower, for the same need",
        ),
        ("GPU the running jobs need, mean", _percent(a["demand_mean"]), _percent(b["demand_mean"]), "(the work)"),
        (
            "stranded GPU while jobs wait, mean",
            f"{a['stranded_mean_gpus']:.2f}",
            f"{b['stranded_mean_gpus']:.2f}",
            "lower",
        ),
        ("queue wait p50/p95/p99", _waits_text(a), _waits_text(b), "shorter"),
        *_preemption_rows(a, b),
        ("all jobs done after", _duration_text(a["makespan"]), _duration_text(b["makespan"]), "sooner"),
    ]
    if shows_tenants(a["tenants"]):
        rows.append(("GPU share / weight share", "", "", "share near weight"))
        for name, t in a["tenants"].items():
            other = b["tenants"].get(name) or {}
            weight = _percent(t["weight_share"])
            rows.append(
                (
                    f"  {name}",
                    f"{_percent(t['gpu_share_mean'])} / {weight}",
                    f"{_percent(other.get('gpu_share_mean'))} / {weight}",
                    "",
                )
            )
            if t["time_at_quota"] or other.get("time_at_quota"):
                rows.append(
                    (
                        f"  {name} at quota",
                        _duration_text(t["time_at_quota"]),
                        _duration_text(other.get("time_at_quota")),
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
        parts = ", ".join(f"{name} {_percent(m['at_full'])}" for name, m in medians.items())
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
            f"a light load: at most {_percent(peak)} of the GPUs were held at once, so allocation says little "
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
    return "/".join(_duration_text(w[f"p{p}"]) for p in PERCENTILES)


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


def _report_markdown(
    results: dict[str, Any], primary: ReplayResult, comparison: ReplayResult, images: list[str]
) -> str:
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
        _percent(a["allocation_mean"]),
        _percent(b["allocation_mean"]),
        lower,
    )
    add("GPU allocation (held), peak", _percent(a["allocation_peak"]), _percent(b["allocation_peak"]), lower)
    add("GPU the running jobs need, mean", _percent(a["demand_mean"]), _percent(b["demand_mean"]), "(the work)")
    for tier in sorted(set(a["tier_allocation_mean"]) | set(b["tier_allocation_mean"])):
        add(
            f"{tier} tier allocation, mean",
            _percent(a["tier_allocation_mean"].get(tier)),
            _percent(b["tier_allocation_mean"].get(tier)),
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
    add("all jobs done after", _duration_text(a["makespan"]), _duration_text(b["makespan"]), "sooner")
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
            cells = " | ".join(_duration_text(w[f"p{p}"]) for p in PERCENTILES)
            lines.append(f"| {kind} | {run['label']} | {w['jobs']} | {cells} |")

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
            at_quota = _duration_text(t["time_at_quota"]) if t["time_at_quota"] else "-"
            if t["jobs_waited_at_quota"]:
                at_quota += f" ({t['jobs_waited_at_quota']} jobs)"
            lines.append(
                f"| {name} | {t['weight']:g} ({_percent(t['weight_share'])}) | {quota} "
                f"| {t['placed']} / {t['held']} of {t['jobs']} | {_percent(t['gpu_share_mean'])} "
                f"| {t['gpu_peak']:.2f} | {t['gpu_hours']:.1f} | {_duration_text(t['wait_p50'])} "
                f"| {_duration_text(t['wait_p95'])} | {at_quota} |"
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
                f"| {name} | {_percent(m['at_full'])} | {_percent(m['at_first_failure'])} | {_percent(m['at_end'])} |"
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
