"""The simulation report, made: :func:`run_simulation` reads the fleet, workload or trace
and the policies, replays them (broker.simulation.replay, broker.simulation.shared, the
inflation experiment), and writes ``results.json``, ``report.md`` and the plots.

The report's words, ``report.md`` and the terminal's short version
(:func:`~broker.simulation.report_text.summary_lines`), are
:mod:`broker.simulation.report_text`; the plots are :mod:`broker.simulation.plots`. Runs
are named by who placed them and how, in ``--placement``'s words
(:func:`broker.simulation.results.run_label`), the same in the summary, report.md, the
plots and results.json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.core.errors import InvalidRequest
from broker.placement.preemption import Terms
from broker.routing.policy import Policy, load_policy
from broker.simulation import traces
from broker.simulation.fleet import load_fleet_file
from broker.simulation.inflation import INFLATION_VARIANTS, inflation_experiment
from broker.simulation.plots import write_plots
from broker.simulation.progress import Silent
from broker.simulation.replay import PLACEMENT_ON_FLEET, replay
from broker.simulation.report_text import report_markdown
from broker.simulation.results import run_label
from broker.simulation.shared import replay_shared
from broker.simulation.workload import TenantTerms, load_workload


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
    reservations: bool = False,
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

    ``reservations`` (a workload on a fleet): the comparison is the same replay without
    gang reservations (broker.placement.reservation), to show what they change.

    ``progress`` (:class:`broker.simulation.progress.Progress`) hears of each step: the
    replays, the inflation experiment, the plots, results.json.
    """
    progress = progress or Silent()
    if (workload_path is None) == (trace_dir is None):
        raise InvalidRequest("give a workload file or a trace directory (one of them)")
    if reservations and (trace_dir is not None or preemption or compare_policy_path):
        raise InvalidRequest(
            "--reservations compares a --fleet workload with and without gang reservations: leave out --trace, "
            "--compare and --preemption"
        )
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
        if reservations:
            label = "without reservations"
            progress.step(f"replaying {label}", len(workload), "jobs")
            comparison = replay(
                fleet, policy, workload, label=label, tenants=tenants, progress=progress.update, reservations=False
            )
            notes.append(
                "reservations: a multi-node job that waited the policy's scheduling.gang_reservation_after gets the "
                "nodes it will use reserved (those that free soonest); they take only work that ends before it can "
                "start; the comparison is the same replay without reservations"
            )
        elif preemption and not compare_policy_path:
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
        report_markdown(results, primary, comparison, [f for f in files if f.endswith(".png")])
    )
    return results
