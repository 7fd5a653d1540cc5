"""The workload a replay runs: jobs with ``at:`` and ``duration:``, tenants' terms, and
the same workload on whole GPUs.

The workload file (:func:`load_workload`) is a YAML list of jobs, each with ``at:``
(seconds from the start) and ``duration:`` (seconds it runs once started) beside the
usual job fields, and optionally ``count:`` copies ``every:`` seconds apart; and,
optionally, the tenants' fair-share weights and GPU quotas, as ``gpush tenant set``
gives them to the live broker (a tenant not listed has weight 1 and no quota, as in the
broker; jobs without a tenant share as one)::

    tenants:
      nlp: {weight: 2, gpu_quota: 8}
      vision: {weight: 1}
    jobs:
      - {at: 0, duration: 3600, count: 4, every: 60, kind: training,
         isolation: hardware, gpu_memory_gb: 5, tenant: nlp}

A job may also say ``preemptible: true`` and ``checkpoint_every:`` (seconds, or 30m): a
replay with preemption (``gpush simulate --preemption``) may stop it for a job of higher
priority, which loses the work since its last checkpoint and runs the rest when placed
again.

**Whole GPUs** (:func:`whole_gpu_fleet`, :func:`whole_gpu_policy`,
:func:`whole_gpu_spec`): the same workload on the same physical GPUs when nothing is
shared (what Slurm and Kubernetes do by default): every GPU whole, every route to its
cluster's exclusive mode, every job one whole GPU per GPU, slice, share or replica it
asked for.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from broker.core.adapter import Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import Isolation, JobSpec
from broker.core.spec_values import parse_time_limit
from broker.core.yamltext import excerpt, load_yaml
from broker.intake.jobfile import validate_spec
from broker.placement.fgd import TaskShape
from broker.routing.policy import Policy
from broker.simulation.fleet import Fleet, FleetCluster

# -- the workload -----------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """One job of a workload: when it arrives and how long it runs once started.

    ``task`` is the exact demand of a trace pod on GPU-sharing nodes (its milli-GPU,
    CPU and memory); ``gpu_models`` the trace models it accepts (empty: any).
    """

    at: float
    spec: JobSpec
    duration: float
    tenant: str | None = None
    task: TaskShape | None = None
    gpu_models: tuple[str, ...] = ()
    preemptible: bool = False  # a replay with preemption may stop it for a job of higher standing
    checkpoint_every: float | None = None  # seconds between its checkpoints: what a preemption loses at most


def _seconds(value: Any, what: str, where: str, *, positive: bool) -> float:
    if isinstance(value, bool) or value is None:
        raise InvalidRequest(f"{where}: {what} is required: seconds, or a duration such as 90m or 1h30m")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = float(parse_time_limit(text))
            except ValueError as exc:
                raise InvalidRequest(f"{where}: {what} {excerpt(value)}: {exc}") from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "more than 0" if positive else "0 or more"
        raise InvalidRequest(f"{where}: {what} {excerpt(value)} must be {bound} seconds")
    return seconds


@dataclass(frozen=True)
class TenantTerms:
    """A tenant's fair-share weight and GPU quota (GPU-equivalents; None: no cap), as
    ``gpush tenant set`` gives them to the live broker."""

    weight: float = 1.0
    gpu_quota: float | None = None


@dataclass(frozen=True)
class Workload:
    """A workload file: its jobs in file order, and the tenants it lists."""

    arrivals: list[Arrival]
    tenants: dict[str, TenantTerms] = field(default_factory=dict)


def read_workload(text: str, source: str) -> Workload:
    """The jobs and tenants of workload YAML (see the module docstring);
    :class:`InvalidRequest` names the job or tenant and the field that is wrong."""
    raw = load_yaml(text, source=source)
    tenants = _tenants(raw.get("tenants") if isinstance(raw, dict) else None, source)
    return Workload(_arrivals(raw, source), tenants)


def parse_workload(text: str, source: str) -> list[Arrival]:
    """The jobs of workload YAML, in file order (:func:`read_workload` without tenants)."""
    return read_workload(text, source).arrivals


def _arrivals(raw: Any, source: str) -> list[Arrival]:
    entries = raw.get("jobs") if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise InvalidRequest(
            f"{source}: expected jobs: followed by a list of jobs, each with at:, duration: and job fields"
        )
    arrivals: list[Arrival] = []
    for index, entry in enumerate(entries, 1):
        where = f"{source}, job {index}"
        if not isinstance(entry, dict):
            raise InvalidRequest(
                f"{where}: expected a mapping (at:, duration:, kind:, ...), got {type(entry).__name__}"
            )
        fields = dict(entry)
        if fields.get("name"):
            where += f" ({excerpt(fields['name'], quote=False)})"
        at = _seconds(fields.pop("at", None), "at", where, positive=False)
        duration = _seconds(fields.pop("duration", None), "duration", where, positive=True)
        count = fields.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100_000:
            raise InvalidRequest(f"{where}: count {excerpt(count)} must be a whole number from 1 to 100000")
        every = _seconds(fields.pop("every", 0), "every", where, positive=False)
        preemptible = fields.pop("preemptible", False)
        if not isinstance(preemptible, bool):
            raise InvalidRequest(f"{where}: preemptible {excerpt(preemptible)} must be true or false")
        checkpoint = fields.pop("checkpoint_every", None)
        checkpoint = None if checkpoint is None else _seconds(checkpoint, "checkpoint_every", where, positive=True)
        if "command" not in fields and "image" not in fields:
            # A simulated job runs nothing; a command keeps the spec valid and says so.
            fields["command"] = ["sleep", str(int(duration))]
        name = fields.get("name")
        for copy in range(count):
            if count > 1 and name:
                fields["name"] = f"{name}-{copy + 1}"
            spec = validate_spec(dict(fields), where=where)
            arrivals.append(
                Arrival(
                    at + copy * every,
                    spec,
                    duration,
                    spec.tenant,
                    preemptible=preemptible,
                    checkpoint_every=checkpoint,
                )
            )
    return arrivals


def _tenants(raw: Any, source: str) -> dict[str, TenantTerms]:
    """The ``tenants:`` section, checked as ``gpush tenant set`` checks its options."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{source}: tenants: expected a mapping of tenant names, such as nlp: {{weight: 2}}")
    tenants: dict[str, TenantTerms] = {}
    for name, terms in raw.items():
        where = f"{source}, tenant {excerpt(name, quote=False)}"
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}: a tenant's name is text, as jobs' tenant: fields give it")
        terms = {} if terms is None else terms
        if not isinstance(terms, dict):
            raise InvalidRequest(f"{where}: expected weight: and/or gpu_quota:, got {excerpt(terms)}")
        unknown = sorted(set(terms) - {"weight", "gpu_quota"}, key=str)
        if unknown:
            raise InvalidRequest(f"{where}: unknown field {excerpt(unknown[0])}: a tenant has weight: and gpu_quota:")
        weight = _number(terms.get("weight", 1.0), "weight", where)
        if weight <= 0:
            raise InvalidRequest(f"{where}: weight {weight:g} must be more than 0 (1 is the default share)")
        quota = terms.get("gpu_quota")
        if quota is not None:
            quota = _number(quota, "gpu_quota", where)
            if quota < 0:
                raise InvalidRequest(f"{where}: gpu_quota {quota:g} must be 0 or more GPU-equivalents")
        tenants[name] = TenantTerms(weight, quota)
    return tenants


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{where}: {what} {excerpt(value)} must be a number")
    return float(value)


def load_workload(path: str | os.PathLike[str]) -> Workload:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read workload file {str(path)!r}: {exc.strerror or exc}") from None
    return read_workload(text, str(path))


# -- whole GPUs ---------------------------------------------------------------------------


def whole_gpu_fleet(fleet: Fleet) -> Fleet:
    """The same nodes and GPUs with nothing shared: MIG, MPS and time-slicing off."""
    clusters = {}
    for name, cluster in fleet.clusters.items():
        nodes = tuple(
            replace(node, gpus=tuple(replace(gpu, mode="whole", mig=(), replicas=1) for gpu in node.gpus))
            for node in cluster.nodes
        )
        clusters[name] = FleetCluster(cluster.name, cluster.flavor, nodes)
    return Fleet(f"{fleet.source} (whole GPUs)", clusters)


def whole_gpu_policy(policy: Policy) -> Policy:
    """The same rules, every route to its cluster's exclusive mode: jobs go where the
    policy sends them, as whole GPUs. Evaluate it on the job as submitted (the matches
    are unchanged) and fit :func:`whole_gpu_spec` of the job."""
    data = policy.model_dump(mode="json", exclude_none=True)
    for rule in data["rules"]:
        routes: list[dict[str, Any]] = []
        for route in [rule["route"], *rule.get("fallbacks", [])]:
            flavor = Sharing(route["sharing"]).flavor
            whole = {**route, "sharing": f"{flavor}/exclusive"}
            if whole not in routes:
                routes.append(whole)
        rule["route"], rule["fallbacks"] = routes[0], routes[1:]
    return Policy.model_validate(data)


def whole_gpu_spec(spec: JobSpec) -> JobSpec:
    """The job taking one whole GPU per GPU, slice, share or replica it asked for."""
    return spec.model_copy(update={"isolation": Isolation.EXCLUSIVE})


NO_TENANT = "(no tenant)"  # jobs of a workload that name no tenant share as one


def tenant_of(name: str | None) -> str:
    return name or NO_TENANT
