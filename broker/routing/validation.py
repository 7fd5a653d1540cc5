"""Checking a routing policy against the registered clusters before it becomes active.

This module owns :func:`validate` (errors that refuse a policy, warnings worth a
look, each with its rule, line and column), what validation knows about one cluster
(:class:`ClusterView`, built from its inventory by :func:`cluster_view`), the isolation
order a route must respect, and the MIG profile choice a MIG route is checked with; the
rules an earlier one takes every job of come from broker.routing.shadowing. It is pure:
the broker builds the views (broker.core.clusters) and stores the policy.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.errors import InvalidRequest
from broker.core.gpus import MODELS, gpu_model
from broker.core.schemas import Isolation
from broker.core.yamltext import gc_paused
from broker.routing.rules import (
    MIG_SHARING,
    Match,
    Policy,
    Route,
    Rule,
    list_text,
    number_text,
)
from broker.routing.shadowing import covers, shadowed_by

# How strongly each isolation class keeps a job apart from others on a GPU. A route
# must give at least the strongest isolation its rule admits: a job that asked for
# MIG must never land on a time-sliced GPU, but a job content with time-slicing may
# well get a MIG slice.
ISOLATION_STRENGTH: dict[Isolation, int] = {
    Isolation.NONE: 0,
    Isolation.PROCESS: 1,
    Isolation.HARDWARE: 2,
    Isolation.EXCLUSIVE: 3,
}

CLUSTER_KINDS = ("sim", "slurm", "k8s")


# -- MIG profile choice ----------------------------------------------------------------


@cache
def _known_compute_slices() -> dict[str, int]:
    return {name: p.compute_slices for model in MODELS for name, p in model.mig_profiles.items()}


def _compute_slices(profile: str) -> int:
    known = _known_compute_slices().get(profile)
    if known is not None:
        return known
    # A profile gpush has no geometry for ("1g.12gb" on an H100 94 GB): NVIDIA's
    # names start with the compute slices.
    match = re.match(r"^(\d+)g\.", profile)
    return int(match.group(1)) if match else 99


def choose_mig_profile(gpu_memory_gb: float | None, offered: Mapping[str, float]) -> str | None:
    """The smallest offered MIG profile whose memory covers ``gpu_memory_gb``: least
    memory, then fewest compute slices; None if no offered profile covers it.

    ``offered`` maps profile names to their memory in GB, as the cluster's live
    inventory reports them (what exists is what can be placed, not what the GPU
    model could be carved into). No memory asked means the smallest profile.
    """
    fits = [(name, memory) for name, memory in offered.items() if gpu_memory_gb is None or memory >= gpu_memory_gb]
    if not fits:
        return None
    return min(fits, key=lambda nm: (nm[1], _compute_slices(nm[0]), nm[0]))[0]


# -- what validation knows about clusters ----------------------------------------------


@dataclass(frozen=True)
class ClusterView:
    """What validating a policy needs to know about one registered cluster."""

    name: str
    kind: str  # "sim" | "slurm" | "k8s"
    sharing: frozenset[Sharing]  # the modes a route may name on this cluster
    mig_profiles: Mapping[str, float] = field(default_factory=dict)  # MIG profile -> memory GB, offered now
    mps_on_mig_nodes: tuple[str, ...] = ()  # nodes with MPS units on GPUs in MIG mode
    largest_gpu_memory_gb: float | None = None
    in_inventory: frozenset[Sharing] = frozenset()  # the modes it has units of now
    usable_memory_gb: Mapping[Sharing, float] = field(default_factory=dict)  # most one job can use, by mode
    gpu_models: frozenset[str] = frozenset()
    inventory_known: bool = True  # False: the cluster did not answer; inventory checks are skipped

    @property
    def mps_in_mig_mode(self) -> bool:
        """Whether any MPS unit sits on a GPU in MIG mode (MPS and MIG cannot share a GPU)."""
        return bool(self.mps_on_mig_nodes)


def _physical_memory(unit: CapacityUnit) -> float:
    if unit.gpu_memory_gb is not None:
        return unit.gpu_memory_gb
    try:
        return gpu_model(unit.gpu_model).memory_gb
    except ValueError:
        return unit.unit_memory_gb


def _canonical_model(name: str) -> str:
    try:
        return gpu_model(name).name
    except ValueError:
        return name


def cluster_view(name: str, kind: str, units: Iterable[CapacityUnit] | None) -> ClusterView:
    """The view of cluster ``name`` of ``kind`` from its inventory ``units``.

    A Slurm or Kubernetes cluster may be routed to in every mode of its flavor (its
    admins can reconfigure nodes), a simulated one only in the modes it has. Pass
    ``units=None`` for a cluster that did not answer: it still exists, and a policy
    naming it is checked for everything but what its inventory would tell.
    """
    if kind not in CLUSTER_KINDS:
        raise ValueError(f"unknown cluster kind {kind!r}: use one of {', '.join(CLUSTER_KINDS)}")
    if units is None:
        modes = frozenset(Sharing) if kind == "sim" else frozenset(s for s in Sharing if s.flavor == kind)
        return ClusterView(name=name, kind=kind, sharing=modes, inventory_known=False)
    units = list(units)
    present = frozenset(u.sharing for u in units)
    modes = present if kind == "sim" else frozenset(s for s in Sharing if s.flavor == kind)
    profiles: dict[str, float] = {}
    for unit in units:
        # A broken MIG unit (a GRES type that matches no MIG instance) serves nothing:
        # its profile does not count as offered.
        if unit.sharing in MIG_SHARING and unit.mig_profile and not unit.broken:
            profiles[unit.mig_profile] = min(profiles.get(unit.mig_profile, math.inf), unit.unit_memory_gb)
    # Broken units count here: reconciliation marks MPS-on-MIG units broken, and it
    # is exactly those a policy must not route MPS to.
    mps_on_mig = tuple(sorted({u.node for u in units if u.sharing is Sharing.SLURM_MPS and u.in_mig_mode}))
    usable: dict[Sharing, float] = {}
    for unit in units:
        most = unit.unit_memory_gb if unit.sharing in MIG_SHARING else _physical_memory(unit)
        usable[unit.sharing] = max(usable.get(unit.sharing, 0.0), most)
    return ClusterView(
        name=name,
        kind=kind,
        sharing=modes,
        mig_profiles=profiles,
        mps_on_mig_nodes=mps_on_mig,
        largest_gpu_memory_gb=max((_physical_memory(u) for u in units), default=None),
        in_inventory=present,
        usable_memory_gb=usable,
        gpu_models=frozenset(_canonical_model(u.gpu_model) for u in units),
    )


# -- validation ------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One thing wrong (an error) or worth a look (a warning) in a policy."""

    severity: str  # "error" | "warning"
    message: str  # what is wrong and what to do
    rule: int | None = None  # index of the rule, from 0
    rule_name: str | None = None
    field: str | None = None  # e.g. "rules.2.fallbacks.0"
    line: int | None = None
    column: int | None = None

    def describe(self, source: str | None = None) -> str:
        where = f"line {self.line}, column {self.column}: " if self.line is not None else ""
        if source:
            where = f"{source}, {where}" if where else f"{source}: "
        rule = f"rule {self.rule + 1} {self.rule_name!r}: " if self.rule is not None else ""
        return f"{where}{self.severity}: {rule}{self.message}"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ValidationReport:
    """The outcome of :func:`validate`: a policy with errors must not become active."""

    errors: list[Finding]
    warnings: list[Finding]
    source: str | None = None
    rules: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def describe(self) -> str:
        name = self.source or "policy"
        findings = [f.describe(self.source) for f in (*self.errors, *self.warnings)]
        counts = f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
        head = f"{name}: {self.rules} rules, valid" if self.ok else f"{name}: {self.rules} rules, NOT valid"
        return "\n".join([f"{head}: {counts}", *findings])

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "source": self.source,
            "rules": self.rules,
            "errors": [f.to_dict() for f in self.errors],
            "warnings": [f.to_dict() for f in self.warnings],
        }

    def raise_if_invalid(self) -> None:
        """:class:`InvalidRequest` listing every error, for `gpush policy apply`."""
        if self.errors:
            details = [{**f.to_dict(), "value": None} for f in self.errors]
            raise InvalidRequest(self.describe(), details=details)


class _Findings:
    """Collects findings with their rule and source position."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.errors: list[Finding] = []
        self.warnings: list[Finding] = []

    def add(self, severity: str, index: int | None, path: tuple[Any, ...], message: str) -> None:
        line, column = self.policy.position(path) or (None, None)
        rule_name = self.policy.rules[index].name if index is not None else None
        found = Finding(severity, message, index, rule_name, ".".join(str(p) for p in path), line, column)
        (self.errors if severity == "error" else self.warnings).append(found)


def _strongest_isolation(match: Match) -> Isolation:
    admitted = match.isolation or list(Isolation)
    return max(admitted, key=ISOLATION_STRENGTH.__getitem__)


def _check_inventory(
    out: _Findings, index: int, rule: Rule, path: tuple[Any, ...], label: str, route: Route, view: ClusterView
) -> None:
    """The checks of one route that need the cluster's inventory: models, MIG profiles, memory."""
    sharing = route.sharing
    if route.gpu_model and view.gpu_models and route.gpu_model not in view.gpu_models:
        has = ", ".join(sorted(view.gpu_models))
        out.add(
            "error",
            index,
            path,
            f"{label} {route}: {view.name!r} has no {route.gpu_model} GPUs (it has {has}); fix gpu_model or remove it",
        )

    memory = rule.match.gpu_memory_gb
    if sharing in MIG_SHARING:
        _check_mig(out, index, path, label, route, view, memory)
    elif sharing in view.in_inventory:
        most = view.usable_memory_gb.get(sharing)
        if memory is not None and memory.min is not None and most is not None and memory.min > most:
            out.add(
                "error",
                index,
                path,
                f"{label} {route}: the rule matches jobs asking at least {number_text(memory.min)} GB per GPU, but no "
                f"{sharing.value} unit on {view.name!r} has more than {number_text(most)} GB; "
                "route these jobs to larger GPUs or lower match.gpu_memory_gb.min",
            )
    else:
        out.add(
            "warning",
            index,
            path,
            f"{label} {route}: {view.name!r} has no {sharing.value} units right now; "
            "jobs routed here wait until it has",
        )


def _check_route(
    out: _Findings, index: int, rule: Rule, path: tuple[Any, ...], label: str, route: Route, clusters: Mapping
) -> None:
    """Every check of one route (``label``: "route" or "fallback N") against the clusters."""
    view: ClusterView | None = clusters.get(route.cluster)
    sharing = route.sharing
    if view is None:
        known = ", ".join(sorted(clusters)) or "none yet"
        close = difflib.get_close_matches(route.cluster, list(clusters), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        out.add(
            "error",
            index,
            path,
            f"{label} names cluster {route.cluster!r}, which is not registered (registered: {known}).{hint} "
            "Fix the name, or register the cluster first.",
        )
        return
    if sharing not in view.sharing:
        offered = ", ".join(sorted(s.value for s in view.sharing)) or "nothing yet"
        if view.kind == "sim":
            why = f"simulated cluster {view.name!r} has no {sharing.value} units"
        else:
            why = f"{view.name!r} is a {view.kind} cluster and {sharing.value} is a {sharing.flavor} mode"
        out.add("error", index, path, f"{label} {route}: {why}; route to one of {offered}")
        return

    gives = Isolation(sharing.isolation)
    needs = _strongest_isolation(rule.match)
    if ISOLATION_STRENGTH[gives] < ISOLATION_STRENGTH[needs]:
        enough = ", ".join(
            s.value
            for s in sorted(view.sharing)
            if ISOLATION_STRENGTH[Isolation(s.isolation)] >= ISOLATION_STRENGTH[needs]
        )
        weaker_ok = [i.value for i in Isolation if ISOLATION_STRENGTH[i] <= ISOLATION_STRENGTH[gives]]
        scope = "" if rule.match.isolation else " (its match sets no isolation, so it takes jobs of every isolation)"
        out.add(
            "error",
            index,
            path,
            f"{label} {route} gives {gives.value} isolation, but the rule matches jobs that ask for "
            f"{needs.value} isolation{scope}: route to a mode that gives {needs.value} isolation "
            f"({enough or 'none on this cluster'}), or match only the isolation this mode suits "
            f"(match.isolation: {list_text(weaker_ok)})",
        )

    if view.inventory_known:
        _check_inventory(out, index, rule, path, label, route, view)
    else:
        out.add(
            "warning",
            index,
            path,
            f"{label} {route}: {view.name!r} did not report its inventory, so its MIG profiles, MPS GPUs, "
            "GPU models and memory were not checked; validate again once it answers",
        )

    if sharing is Sharing.SLURM_MPS and view.mps_in_mig_mode:
        out.add(
            "error",
            index,
            path,
            f"{label} {route}: MPS and MIG cannot run on one GPU, and {view.name!r} has MPS units on GPUs in "
            f"MIG mode (nodes {', '.join(view.mps_on_mig_nodes)}); turn MIG mode off on those GPUs or stop "
            "offering MPS there, or route this rule elsewhere",
        )

    memory = rule.match.gpu_memory_gb
    if sharing is Sharing.K8S_TIMESLICE and (memory is None or memory.max is None):
        out.add(
            "warning",
            index,
            path,
            f"{label} {route}: time-slicing has no memory isolation and the rule sets no gpu_memory_gb max, "
            "so jobs can over-commit a GPU and be OOM-killed; add match.gpu_memory_gb: {max: N} so larger "
            "jobs fall through to a rule that gives them more isolation",
        )


def _check_mig(
    out: _Findings, index: int, path: tuple[Any, ...], label: str, route: Route, view: ClusterView, memory: Any
) -> None:
    offered = view.mig_profiles
    if not offered:
        out.add(
            "error",
            index,
            path,
            f"{label} {route}: {view.name!r} offers no MIG profile (no GPU in MIG mode with instances); "
            "create MIG instances there first, or route this rule to a mode the cluster has",
        )
        return
    largest = max(offered.values())
    biggest = ", ".join(f"{p} ({number_text(m)} GB)" for p, m in sorted(offered.items(), key=lambda pm: pm[1]))
    if memory is not None and memory.min is not None and choose_mig_profile(memory.min, offered) is None:
        out.add(
            "error",
            index,
            path,
            f"{label} {route}: the rule matches jobs asking at least {number_text(memory.min)} GB per slice, and no "
            f"MIG profile on {view.name!r} covers that (offered: {biggest}); route these jobs to whole GPUs, "
            "or create a larger MIG profile",
        )
    elif memory is None or memory.high > largest:
        out.add(
            "warning",
            index,
            path,
            f"{label} {route}: jobs asking more than {number_text(largest)} GB per slice match this rule, but no MIG "
            f"profile on {view.name!r} covers them (offered: {biggest}); they wait here. Add match.gpu_memory_gb: "
            f"{{max: {number_text(largest)}}} so larger jobs fall through to a rule that gives them whole GPUs",
        )


def _match_text(match: Match) -> str:
    parts = [f"{k}={list_text(getattr(match, k))}" for k in ("kind", "isolation", "tenant") if getattr(match, k)]
    parts += [f"{k} {getattr(match, k).describe()}" for k in ("gpus", "gpu_memory_gb") if getattr(match, k)]
    parts += [f"label {k}={v}" for k, v in match.labels.items()]
    return ", ".join(parts) or "every job"


_EVERY_JOB = Match()


def validate(policy: Policy, clusters: Mapping[str, ClusterView]) -> ValidationReport:
    """Check ``policy`` against the registered ``clusters`` (name -> view).

    Errors (the policy must not become active): a route to an unknown cluster; a
    sharing mode the cluster does not have; a MIG route where no offered profile
    could serve the rule; MPS routed to a cluster whose MPS GPUs are in MIG mode; a
    route whose isolation is weaker than the rule's jobs ask for; a GPU model or
    memory the cluster does not have; a rule that can never match because an earlier
    one takes all its jobs. Warnings: no rule matches every job (unmatched jobs are
    held), MIG routes that cover only part of a rule's memory range, time-slicing
    without a memory bound, modes a cluster has no units of right now, and repeated
    routes.
    """
    with gc_paused():  # thousands of findings and index entries: see gc_paused
        return _validate(policy, clusters)


def _validate(policy: Policy, clusters: Mapping[str, ClusterView]) -> ValidationReport:
    out = _Findings(policy)
    shadows = shadowed_by([rule.match for rule in policy.rules])
    for index, rule in enumerate(policy.rules):
        labelled = [(("rules", index, "route"), "route", rule.route)]
        labelled += [(("rules", index, "fallbacks", n), f"fallback {n + 1}", r) for n, r in enumerate(rule.fallbacks)]
        seen: set[Route] = set()
        for path, label, route in labelled:
            if route in seen:
                out.add("warning", index, path, f"{label} {route} repeats an earlier route of this rule; remove it")
                continue
            seen.add(route)
            _check_route(out, index, rule, path, label, route, clusters)
        earlier_index = shadows[index]
        if earlier_index is not None:
            earlier = policy.rules[earlier_index]
            at = policy.position(("rules", earlier_index))
            line = f", line {at[0]}" if at else ""
            out.add(
                "error",
                index,
                ("rules", index),
                f"never matches: every job it matches is taken first by rule {earlier_index + 1} "
                f"{earlier.name!r}{line} ({_match_text(earlier.match)}); move this rule above it, "
                "or narrow that rule's match",
            )
    if not any(covers(rule.match, _EVERY_JOB) for rule in policy.rules):
        last = len(policy.rules) - 1
        out.add(
            "warning",
            None,
            ("rules", last),
            "no rule matches every job, so a job that matches none is held until the policy changes; "
            "end the policy with a catch-all rule (match: {}) that routes to whole GPUs",
        )
    _check_sections(out, policy, clusters)
    return ValidationReport(out.errors, out.warnings, policy.source, len(policy.rules))


def _check_sections(out: _Findings, policy: Policy, clusters: Mapping[str, ClusterView]) -> None:
    """The ``mig`` section's clusters and the ``lending`` pools' must be registered."""
    known = ", ".join(sorted(clusters)) or "none yet"
    if policy.mig is not None:
        for n, name in enumerate(policy.mig.clusters):
            if name not in clusters:
                out.add(
                    "error",
                    None,
                    ("mig", "clusters", n),
                    f"mig.clusters names {name!r}, which is not registered (registered: {known})",
                )
    for p, pool in enumerate(policy.lending):
        for n, name in enumerate(pool.clusters):
            if name not in clusters:
                out.add(
                    "error",
                    None,
                    ("lending", p, "clusters", n),
                    f"lending pool {p + 1} names cluster {name!r}, which is not registered (registered: {known})",
                )
        for name, setup in pool.setup.items():
            view = clusters.get(name)
            if view is not None and view.kind != "k8s":
                out.add(
                    "error",
                    None,
                    ("lending", p, "setup", name),
                    f"lending pool {p + 1} sets nodes up on {name}, a {view.kind} cluster, but only Kubernetes "
                    f"clusters take a setup (the GPU Operator's device plugin and MIG manager configs): remove "
                    f"setup.{name} (a node moving to {name} is offered as its own configuration has it)",
                )
                continue
            other = clusters.get(next((c for c in pool.clusters if c != name), ""))
            if setup.mig and not setup.mig_on_leave and other is not None and other.kind == "slurm":
                out.add(
                    "warning",
                    None,
                    ("lending", p, "setup", name),
                    f"lending pool {p + 1}: {name} sets its nodes' MIG config to {setup.mig} but gives no "
                    f"mig_on_leave, so a node goes back to {other.name} with that layout, not the one its gres.conf "
                    f"names: add mig_on_leave (the MIG manager config of {other.name}'s layout)",
                )
