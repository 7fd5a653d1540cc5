"""Evaluating a job against a routing policy: which rule routes it, and why.

This module owns :func:`evaluate`, which tries the rules in order and returns the
first match's routes (the scheduling cycle, ``gpush mig plan`` and the simulator call
it), and the record of every rule tried with the reasons it matched or not, which
``gpush policy explain`` prints. It is pure: no database, no HTTP, no adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.core.schemas import DEFAULT_ISOLATION, JobSpec
from broker.routing.rules import GpuCountRange, Match, MemoryRange, Policy, Route, list_text, number_text


@dataclass(frozen=True)
class RuleTrial:
    """One rule tried against one job: whether it matched, and why, in a user's words."""

    index: int  # position in the policy, from 0
    name: str
    matched: bool | None  # None: not tried, an earlier rule matched first
    reasons: tuple[str, ...]

    @property
    def outcome(self) -> str:
        return {True: "matched", False: "no match", None: "not tried"}[self.matched]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "matched": self.matched,
            "outcome": self.outcome,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class Decision:
    """Where a policy sends a job: the first matching rule's route, then its fallbacks."""

    rule: int | None  # index of the rule that matched, from 0; None when none did
    rule_name: str | None
    routes: list[Route]  # candidates in order; empty when no rule matched
    trials: list[RuleTrial]
    job: dict[str, Any]  # the job's fields that rules match on, as evaluated
    message: str
    why: str | None = None  # the matched rule's `why`

    @property
    def matched(self) -> bool:
        return self.rule is not None

    def explain(self) -> str:
        lines = [f"job: {_job_text(self.job)}", "rules, in order (the first that matches routes the job):"]
        for trial in self.trials:
            reasons = "; ".join(trial.reasons)
            lines.append(f"  {trial.index + 1}. {trial.name}: {trial.outcome} - {reasons}")
        if self.routes:
            lines.append(f"route: {self.routes[0]}")
            lines += [f"fallback {n}: {route}" for n, route in enumerate(self.routes[1:], 1)]
            if self.why:
                lines.append(f"why: {self.why}")
        lines.append(self.message)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "rule_name": self.rule_name,
            "why": self.why,
            "routes": [r.model_dump(mode="json", exclude_none=True) for r in self.routes],
            "trials": [t.to_dict() for t in self.trials],
            "job": self.job,
            "message": self.message,
        }


def _job_facts(spec: JobSpec, tenant: str | None) -> dict[str, Any]:
    isolation = spec.isolation or DEFAULT_ISOLATION[spec.kind]
    return {
        "kind": spec.kind.value,
        "isolation": isolation.value,
        "gpus": spec.gpus,
        "gpu_memory_gb": spec.gpu_memory_gb,
        "nodes": spec.nodes,
        "topology": spec.topology.model_dump() if spec.topology else None,
        "tenant": tenant or spec.tenant,
        "labels": dict(spec.labels),
    }


def _job_text(job: Mapping[str, Any]) -> str:
    parts = [f"kind={job['kind']}", f"isolation={job['isolation']}", f"gpus={job['gpus']}"]
    if job.get("gpu_memory_gb") is not None:
        parts.append(f"gpu_memory_gb={number_text(job['gpu_memory_gb'])}")
    if (job.get("nodes") or 1) > 1:
        parts.append(f"nodes={job['nodes']}")
    if topology := job.get("topology"):
        parts.append(f"topology={topology['level']}:{topology.get('mode', 'preferred')}")
    if job.get("tenant"):
        parts.append(f"tenant={job['tenant']}")
    parts += [f"label {k}={v}" for k, v in sorted(job.get("labels", {}).items())]
    return " ".join(parts)


def _try(match: Match, job: Mapping[str, Any]) -> tuple[bool, list[str]]:
    """Whether ``match`` takes the job: (True, what held) or (False, every check that failed)."""
    held: list[str] = []
    failed: list[str] = []
    for key in ("kind", "isolation", "tenant"):
        wanted = getattr(match, key)
        if wanted is None:
            continue
        value = job[key]
        if value is None:
            failed.append(f"the job has no {key} (the rule wants {list_text(wanted)})")
        elif value in wanted:
            held.append(f"{key}={value}")
        else:
            failed.append(f"{key}={value} is not in {list_text(wanted)}")
    for key in ("gpus", "gpu_memory_gb"):
        bounds: GpuCountRange | MemoryRange | None = getattr(match, key)
        if bounds is None:
            continue
        value = job[key]
        if value is None:
            failed.append(f"{key} is not set (the rule wants {bounds.describe()})")
        elif refusal := bounds.refusal(key, value):
            failed.append(refusal)
        else:
            held.append(f"{key}={number_text(value)} ({bounds.describe()})")
    for key, wanted in match.labels.items():
        value = job["labels"].get(key)
        if value is None:
            failed.append(f"label {key} is not set (the rule wants {key}={wanted})")
        elif value != wanted:
            failed.append(f"label {key}={value} is not {key}={wanted}")
        else:
            held.append(f"label {key}={value}")
    if failed:
        return False, failed
    return True, [f"matches: {', '.join(held)}" if held else "matches every job (match: {})"]


def evaluate(policy: Policy, spec: JobSpec, tenant: str | None) -> Decision:
    """Try the rules in order; the first that matches gives the job's candidate routes.

    ``tenant`` is the owner the broker resolved for the job (the spec's own tenant
    is used when it is None). Rules after the first match are reported as not tried.
    """
    job = _job_facts(spec, tenant)
    trials: list[RuleTrial] = []
    chosen: int | None = None
    for index, rule in enumerate(policy.rules):
        if chosen is not None:
            first = policy.rules[chosen].name
            trials.append(RuleTrial(index, rule.name, None, (f"rule {chosen + 1} {first!r} matched first",)))
            continue
        matched, reasons = _try(rule.match, job)
        trials.append(RuleTrial(index, rule.name, matched, tuple(reasons)))
        if matched:
            chosen = index
    if chosen is None:
        message = (
            f"no rule matches {_job_text(job)}: the job is held until the policy routes it "
            "(an admin can add a rule for it, or a catch-all rule with match: {})"
        )
        return Decision(None, None, [], trials, job, message)
    rule = policy.rules[chosen]
    routes = rule.routes
    if spec.cluster is not None:
        # A job pinned to a cluster goes only where its rule would send it on that
        # cluster: pinning picks among the policy's routes, it never adds one.
        routes = [r for r in routes if r.cluster == spec.cluster]
        if not routes:
            offered = ", ".join(dict.fromkeys(r.cluster for r in rule.routes))
            message = (
                f"rule {chosen + 1} {rule.name!r} routes this job to {offered}, not to cluster {spec.cluster} "
                f"that it asks for: submit without --cluster, or ask an admin to route such jobs to {spec.cluster}"
            )
            return Decision(chosen, rule.name, [], trials, job, message, rule.why)
    then = "".join(f", then {route}" for route in routes[1:])
    pinned = f" (pinned to {spec.cluster})" if spec.cluster is not None else ""
    message = f"rule {chosen + 1} {rule.name!r} routes the job to {routes[0]}{then}{pinned}"
    return Decision(chosen, rule.name, routes, trials, job, message, rule.why)


def preemptible(policy: Policy | None, spec: JobSpec, tenant: str | None) -> bool:
    """Whether the job may be preempted: its spec's ``preemptible``, else the first of the
    policy's ``preemption.defaults`` that matches it, else not (nor without a
    ``preemption`` section: then nothing is preempted)."""
    if policy is None or policy.preemption is None:
        return False
    if spec.preemptible is not None:
        return spec.preemptible
    job = _job_facts(spec, tenant)
    for default in policy.preemption.defaults:
        if _try(default.match, job)[0]:
            return default.preemptible
    return False
