"""The simulation report: :func:`run_simulation` replays (broker.simulation.replay),
writes ``report.md``, ``results.json`` and the plots (broker.simulation.plots);
:func:`summary_lines` is the terminal's short version."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.core.errors import InvalidRequest
from broker.routing.policy import Policy, load_policy
from broker.simulation import traces
from broker.simulation.fleet import load_fleet_file
from broker.simulation.inflation import inflation_experiment
from broker.simulation.plots import shows_tenants, write_plots
from broker.simulation.replay import PLACEMENT_ON_FLEET, replay
from broker.simulation.results import PERCENTILES, ReplayResult
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
    return "-" if value is None else f"{100 * value:.1f}%"


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


def _load_policy_file(path: str) -> Policy:
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
) -> dict[str, Any]:
    """Replay a workload (``fleet_path`` + ``workload_path``) or the openb trace
    (``trace_dir``; its node list is the fleet) under ``policy_path``, beside
    ``compare_policy_path`` or, without one, the same workload on whole GPUs; write
    ``report.md``, ``results.json`` and PNG plots to ``report_dir``; return the results.

    For a trace, ``policy_path`` None means the trace's own routing
    (:func:`broker.simulation.traces.openb_policy`), ``placement`` is gpush's placement on its
    GPU-sharing nodes (``fgd`` or ``best-fit``), and ``inflation`` adds the FGD
    paper's inflation experiment at ``seed``.
    """
    if (workload_path is None) == (trace_dir is None):
        raise InvalidRequest("give a workload file or a trace directory (one of them)")
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
        trace = traces.load_openb(
            trace_dir, pods_file=trace_pods or traces.DEFAULT_PODS, nodes_file=trace_nodes or traces.DEFAULT_NODES
        )
        if fleet_path:
            notes.append(f"{fleet_path} not used: the trace's node list ({trace.nodes_file}) is the fleet")
        policy = trace.policy() if policy_path is None else _load_policy_file(policy_path)
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
        notes.append(f"{trace.cpu_only_pods} CPU-only pods of {len(trace.pods)} skipped: gpush schedules GPU jobs only")
        notes.append(
            "the trace's own times are a light load (its README: at most ~1% of the GPUs busy at once): the "
            "replay shows routing and waits; the inflation experiment is the test of placement quality"
        )
        notes.append(
            "fractional pods: isolation none, gpu_memory_gb = share x "
            f"{trace.reference_memory_gb:g} GB (the fleet's most common GPU); packing uses the exact milli-GPU"
        )
        primary = replay_shared(nodes, trace.cluster, policy, workload, placement=placement, label="gpush")
        if compare_policy_path:
            other = _load_policy_file(compare_policy_path)
            _check_policy_names(other, trace.cluster, compare_policy_path)
            comparison = replay_shared(
                nodes, trace.cluster, other, workload, placement=placement, label=Path(compare_policy_path).stem
            )
        else:
            comparison = replay_shared(
                nodes, trace.cluster, policy, workload, placement="best-fit", whole_gpus=True, label="whole GPUs"
            )
        if inflation:
            inflation_results = inflation_experiment(nodes, trace.tasks(), seeds=[seed])
    else:
        if not fleet_path:
            raise InvalidRequest("a workload replays on a fleet: give the fleet file too")
        if not policy_path:
            raise InvalidRequest("a workload replay needs a routing policy file")
        fleet = load_fleet_file(fleet_path)
        policy = _load_policy_file(policy_path)
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
        primary = replay(fleet, policy, workload, label=f"gpush ({Path(policy_path).name})", tenants=tenants)
        if compare_policy_path:
            comparison = replay(
                fleet,
                _load_policy_file(compare_policy_path),
                workload,
                label=Path(compare_policy_path).name,
                tenants=tenants,
            )
        else:
            # What each job needs is what gpush's sharing gave it; whole GPUs hold more.
            need = {j.job_id: j.gpu_equivalents for j in primary.jobs if j.start is not None}
            comparison = replay(
                fleet, policy, workload, whole_gpus=True, label="whole GPUs", demand_of=need.get, tenants=tenants
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
        files += write_plots(out, primary, comparison, inflation_results)
    results["files"] = [str(out / name) for name in files]
    detail = {
        **results,
        "primary": primary.to_dict(),
        "comparison": comparison.to_dict(),
        "inflation": inflation_results,
    }
    # Indented for a reader when small; a trace's per-job records are for programs.
    indent = 1 if len(primary.jobs) <= 2000 else None
    (out / "results.json").write_text(json.dumps(detail, indent=indent, default=str))
    (out / "report.md").write_text(
        _report_markdown(results, primary, comparison, [f for f in files if f.endswith(".png")])
    )
    return results


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What ``gpush simulate`` and ``make demo`` print: the two runs side by side."""
    a, b = result["primary"], result["comparison"]
    inputs = result["inputs"]
    source = inputs.get("workload") or f"openb trace {inputs.get('trace_pods', '')}"
    width = max(len(a["label"]), len(b["label"]), 12)

    def row(name: str, left: str, right: str) -> str:
        return f"  {name:<26}{left:>{width}}  {right:>{width}}"

    def waits(s: dict[str, Any]) -> str:
        w = s["waits"]["all"]
        return f"{_duration_text(w['p50'])}/{_duration_text(w['p95'])}/{_duration_text(w['p99'])}"

    lines = [
        f"simulated {inputs.get('jobs')} jobs from {source} on {inputs.get('fleet_description')}",
        row("", a["label"], b["label"]),
        row("jobs placed / held", f"{a['placed']} / {a['held']}", f"{b['placed']} / {b['held']}"),
        row("GPU allocation, mean", _percent(a["allocation_mean"]), _percent(b["allocation_mean"])),
        row("GPU the running jobs need", _percent(a["demand_mean"]), _percent(b["demand_mean"])),
        row("queue wait p50/p95/p99", waits(a), waits(b)),
        row("all jobs done after", _duration_text(a["makespan"]), _duration_text(b["makespan"])),
    ]
    if shows_tenants(a["tenants"]):
        lines.append(row("GPU share / weight share", "", ""))
        for name, t in a["tenants"].items():
            other = b["tenants"].get(name) or {}
            weight = _percent(t["weight_share"])
            lines.append(
                row(
                    f"  {name}",
                    f"{_percent(t['gpu_share_mean'])} / {weight}",
                    f"{_percent(other.get('gpu_share_mean'))} / {weight}",
                )
            )
            if t["time_at_quota"] or other.get("time_at_quota"):
                lines.append(
                    row(
                        f"  {name} at quota",
                        _duration_text(t["time_at_quota"]),
                        _duration_text(other.get("time_at_quota")),
                    )
                )
    inflation = result.get("inflation")
    if inflation:
        medians = inflation["medians"]
        parts = ", ".join(f"{name} {_percent(m['at_full'])}" for name, m in medians.items())
        lines.append(f"  inflation (FGD paper), allocation at 100% arrived: {parts}")
    for reason, count in list(a["held_reasons"].items())[:3]:
        lines.append(f"  held ({count}): {reason}")
    return lines


def _report_markdown(
    results: dict[str, Any], primary: ReplayResult, comparison: ReplayResult, images: list[str]
) -> str:
    a, b = results["primary"], results["comparison"]
    inputs = results["inputs"]
    lines = ["# gpush simulation report", ""]
    lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in inputs.items() if v is not None]
    lines += ["", "## Summary", "", f"| | {a['label']} | {b['label']} |", "| --- | --- | --- |"]

    def add(name: str, left: Any, right: Any) -> None:
        lines.append(f"| {name} | {left} | {right} |")

    add("placement", a["placement"], b["placement"])
    add("jobs", a["jobs"], b["jobs"])
    add("placed (started)", a["placed"], b["placed"])
    add("succeeded / failed", f"{a['succeeded']} / {a['failed']}", f"{b['succeeded']} / {b['failed']}")
    add("held", a["held"], b["held"])
    add("still waiting at the end", a["still_waiting"], b["still_waiting"])
    add("GPU allocation, time-weighted mean", _percent(a["allocation_mean"]), _percent(b["allocation_mean"]))
    add("GPU allocation, peak", _percent(a["allocation_peak"]), _percent(b["allocation_peak"]))
    add("GPU the running jobs need, mean", _percent(a["demand_mean"]), _percent(b["demand_mean"]))
    for tier in sorted(set(a["tier_allocation_mean"]) | set(b["tier_allocation_mean"])):
        add(
            f"{tier} tier allocation, mean",
            _percent(a["tier_allocation_mean"].get(tier)),
            _percent(b["tier_allocation_mean"].get(tier)),
        )
    add(
        "jobs waiting, mean / peak",
        f"{a['queue_mean']:.2f} / {a['queue_peak']}",
        f"{b['queue_mean']:.2f} / {b['queue_peak']}",
    )
    add("stranded GPU while jobs wait, mean", f"{a['stranded_mean_gpus']:.2f}", f"{b['stranded_mean_gpus']:.2f}")
    add(
        "FGD fragmentation, mean (GPUs)",
        *("-" if r["fragmentation_mean_gpus"] is None else f"{r['fragmentation_mean_gpus']:.2f}" for r in (a, b)),
    )
    add("GPU-hours held", f"{a['gpu_hours']:.1f}", f"{b['gpu_hours']:.1f}")
    add("all jobs done after", _duration_text(a["makespan"]), _duration_text(b["makespan"]))
    add("replay wall time", f"{a['wall_seconds']:.2f}s", f"{b['wall_seconds']:.2f}s")

    lines += ["", "## Queue wait per kind (arrival to start)", ""]
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
            "Allocation: GPU demand placed over capacity.",
            "",
            "| placement | at 100% arrived | at the first failure | at the end |",
            "| --- | --- | --- | --- |",
        ]
        for name, m in inflation["medians"].items():
            lines.append(
                f"| {name} | {_percent(m['at_full'])} | {_percent(m['at_first_failure'])} | {_percent(m['at_end'])} |"
            )

    if images:
        lines += ["", "## Plots", ""]
        lines += [f"![{name}]({name})" for name in images]
    notes = results["notes"] + [n for n in (*a["notes"], *b["notes"]) if n not in results["notes"]]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"
