"""Routing policies: which cluster and sharing mode a job goes to, and why.

This module owns the policy format (an ordered list of rules, first match wins,
written in YAML by admins), its JSON Schema, loading with errors that name the line
and column, evaluating a job against a policy (with the reason every rule matched or
not, for ``gpush policy explain``), the MIG profile choice, and the checks a policy
must pass before it becomes active. It is pure: no database, no HTTP, no adapters.
The broker stores policy versions and calls :func:`evaluate` in the scheduling cycle.

A policy, in YAML::

    rules:
      - name: isolated-training-on-mig
        why: training that asks for hardware isolation gets a MIG slice
        match: {kind: training, isolation: hardware, gpu_memory_gb: {max: 20}}
        route: {cluster: slurm-a, sharing: slurm/mig}
        fallbacks:
          - {cluster: k8s-a, sharing: k8s/mig}
      - name: everything-else
        match: {}
        route: {cluster: slurm-a, sharing: slurm/exclusive}
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any, ClassVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.errors import InvalidRequest
from broker.core.gpus import MODELS, gpu_model
from broker.core.schemas import DEFAULT_ISOLATION, Isolation, JobSpec, Kind

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

MIG_SHARING = frozenset({Sharing.SLURM_MIG, Sharing.K8S_MIG})
CLUSTER_KINDS = ("sim", "slurm", "k8s")

_RULE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_CLUSTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"
_PARTITION = r"^[A-Za-z0-9_.-]{1,64}$"


def _num(value: float) -> str:
    """8 rather than 8.0; 2.5 stays 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _listed(values: Iterable[Any]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


# -- the format ------------------------------------------------------------------------


def _as_list(value: Any) -> Any:
    # `kind: training` and `kind: [training]` mean the same: admins write the one
    # value they mean without brackets.
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return [value]


def _one_or_many(item: Any) -> Any:
    return Annotated[
        list[item],
        Field(min_length=1),
        BeforeValidator(_as_list, json_schema_input_type=item | list[item]),
    ]


TenantName = Annotated[str, Field(pattern=_TENANT_NAME)]


def _label_text(value: Any) -> Any:
    # YAML reads `tier: 1` as a number and `gpu: true` as a bool; job labels are
    # text, and the admin meant the text.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int | float) else value


LabelValue = Annotated[str, BeforeValidator(_label_text, json_schema_input_type=str | int | float | bool)]


class _Bounds(BaseModel):
    """An inclusive range; a bound left out is no bound."""

    model_config = ConfigDict(extra="forbid")

    # The least value a job can have, so that `{max: 4}` and `{min: 1, max: 4}` are
    # the same range when rules are compared for shadowing.
    lowest: ClassVar[float] = 0.0

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _ordered(self) -> _Bounds:
        if self.min is None and self.max is None:
            raise ValueError("an empty range: give min, max or both (inclusive), or leave the key out to match any")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({_num(self.min)}) is above max ({_num(self.max)}): no job could match")
        return self

    @property
    def low(self) -> float:
        return self.lowest if self.min is None else self.min

    @property
    def high(self) -> float:
        return math.inf if self.max is None else self.max

    def describe(self) -> str:
        parts = [f"min {_num(self.min)}"] if self.min is not None else []
        parts += [f"max {_num(self.max)}"] if self.max is not None else []
        return ", ".join(parts)

    def refusal(self, name: str, value: float) -> str | None:
        """Why ``value`` is outside the range, in a user's words, or None if inside."""
        if self.min is not None and value < self.min:
            return f"{name}={_num(value)} is below min {_num(self.min)}"
        if self.max is not None and value > self.max:
            return f"{name}={_num(value)} is above max {_num(self.max)}"
        return None

    def covers(self, other: _Bounds | None) -> bool:
        """Every value in ``other`` (None: every value a job can have) is in this range."""
        low, high = (self.lowest, math.inf) if other is None else (other.low, other.high)
        return self.low <= low and high <= self.high


class GpuCountRange(_Bounds):
    """How many GPUs (or slices) per replica the job asks for; inclusive."""

    lowest: ClassVar[float] = 1

    min: int | None = Field(None, ge=1, description="fewest GPUs, inclusive")
    max: int | None = Field(None, ge=1, description="most GPUs, inclusive")


class MemoryRange(_Bounds):
    """GPU memory the job asks for per GPU or slice, in GB; inclusive."""

    min: float | None = Field(None, ge=0, description="least GB per GPU or slice, inclusive")
    max: float | None = Field(None, gt=0, description="most GB per GPU or slice, inclusive")


class Match(BaseModel):
    """Which jobs a rule takes. Every key given must hold; a key left out matches any
    job; ``match: {}`` matches every job."""

    model_config = ConfigDict(extra="forbid")

    kind: _one_or_many(Kind) | None = Field(None, description="job kinds: training, inference, batch; one or a list")
    isolation: _one_or_many(Isolation) | None = Field(
        None, description="isolation the job asks for: exclusive, hardware, process, none; one or a list"
    )
    gpus: GpuCountRange | None = Field(None, description="GPUs (or slices) per replica: {min: , max: }, inclusive")
    gpu_memory_gb: MemoryRange | None = Field(
        None,
        description="GPU memory per GPU or slice in GB: {min: , max: }, inclusive. A job that states no "
        "gpu_memory_gb (whole GPUs) does not match a rule that sets this.",
    )
    tenant: _one_or_many(TenantName) | None = Field(None, description="tenants; one or a list")
    labels: dict[str, LabelValue] = Field(
        default_factory=dict, description="job labels that must all be present with these values"
    )


class Route(BaseModel):
    """Where a rule sends jobs: a registered cluster and how jobs share its GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: str = Field(pattern=_CLUSTER_NAME, description="the name of a registered cluster")
    sharing: Sharing = Field(
        description="slurm/exclusive, slurm/mig, slurm/mps (Slurm); k8s/timeslice, k8s/mig, k8s/exclusive (Kubernetes)"
    )
    partition: str | None = Field(None, pattern=_PARTITION, description="Slurm partition (slurm/* routes only)")
    gpu_model: str | None = Field(
        None, description="only GPUs of this model, e.g. A100-SXM4-40GB or an alias such as A100-40GB"
    )

    @field_validator("partition")
    @classmethod
    def _slurm_only(cls, value: str | None, info: Any) -> str | None:
        sharing = info.data.get("sharing")
        if value is not None and sharing is not None and sharing.flavor != "slurm":
            raise ValueError(
                f"partition is a Slurm setting and {sharing.value} is a Kubernetes mode: "
                "remove partition, or route to a slurm/* mode"
            )
        return value

    @field_validator("gpu_model")
    @classmethod
    def _known_model(cls, value: str | None, info: Any) -> str | None:
        if value is None:
            return None
        model = gpu_model(value)  # its ValueError lists the models gpush knows
        sharing = info.data.get("sharing")
        if sharing in MIG_SHARING and not model.mig_capable:
            capable = ", ".join(m.name for m in MODELS if m.mig_capable)
            raise ValueError(
                f"{model.name} is not MIG-capable, so {sharing.value} cannot use it: name one of {capable}, "
                "or remove gpu_model"
            )
        # The canonical name, so "A100" in a policy and "A100-SXM4-40GB" in an
        # inventory are recognised as one model.
        return model.name

    def __str__(self) -> str:
        extras = [f"partition {self.partition}"] if self.partition else []
        extras += [f"gpu_model {self.gpu_model}"] if self.gpu_model else []
        return f"{self.cluster} {self.sharing.value}" + (f" ({', '.join(extras)})" if extras else "")


class Rule(BaseModel):
    """One rule: the jobs it matches and where they go."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_RULE_NAME, description="unique in the policy; explain and history refer to it")
    why: str | None = Field(None, max_length=500, description="one line on why; `gpush policy explain` shows it")
    match: Match = Field(description="which jobs this rule takes; match: {} takes every job")
    route: Route = Field(description="where matched jobs go first")
    fallbacks: list[Route] = Field(
        default_factory=list, description="further routes, in order, for when the route cannot take the job"
    )

    @property
    def routes(self) -> list[Route]:
        return [self.route, *self.fallbacks]


class Policy(BaseModel):
    """A routing policy: rules tried in order, the first that matches a job routes it."""

    model_config = ConfigDict(extra="forbid", title="gpush routing policy")

    rules: list[Rule] = Field(min_length=1, description="tried in order; the first rule that matches routes the job")

    # Where each node sat in the YAML it was loaded from, so that findings name a
    # line and column; empty for a policy built from plain data.
    _source: str | None = PrivateAttr(None)
    _value_marks: dict[tuple[Any, ...], tuple[int, int]] = PrivateAttr(default_factory=dict)

    @field_validator("rules")
    @classmethod
    def _unique_names(cls, rules: list[Rule]) -> list[Rule]:
        first: dict[str, int] = {}
        for index, rule in enumerate(rules):
            if rule.name in first:
                raise PydanticCustomError(
                    "duplicate_rule_name",
                    "rule {number} repeats the name of rule {first}: give each rule its own name "
                    "(explain and history refer to rules by name)",
                    {"index": index, "number": index + 1, "first": first[rule.name] + 1, "name": rule.name},
                )
            first[rule.name] = index
        return rules

    @property
    def source(self) -> str | None:
        """The file name given to :func:`load_policy`, or None."""
        return self._source

    def position(self, path: tuple[Any, ...]) -> tuple[int, int] | None:
        """(line, column), 1-based, of the YAML node at ``path`` such as ``("rules", 2,
        "route")``, or of its nearest ancestor that was written; None without YAML."""
        while True:
            if path in self._value_marks:
                return self._value_marks[path]
            if not path:
                return None
            path = path[:-1]


# -- loading ---------------------------------------------------------------------------

# What to write when a required key is missing, by its name.
_MISSING_HINTS = {
    "rules": "write rules: followed by a list of rules",
    "name": "give the rule a name; explain and history refer to it",
    "match": "write match: {} to match every job",
    "route": "write route: {cluster: NAME, sharing: MODE}",
    "cluster": "name a registered cluster",
    "sharing": "use one of " + ", ".join(s.value for s in Sharing),
}

# The model a mapping at a path holds, by the last key of the path (list indexes skipped).
_NESTED: dict[str | None, tuple[type[BaseModel], str]] = {
    None: (Policy, "A policy"),
    "rules": (Rule, "A rule"),
    "match": (Match, "match"),
    "route": (Route, "A route"),
    "fallbacks": (Route, "A route"),
    "gpus": (GpuCountRange, "A range"),
    "gpu_memory_gb": (MemoryRange, "A range"),
}


def _message(err: Mapping[str, Any], loc: tuple[Any, ...]) -> str:
    kind = err.get("type")
    if kind == "extra_forbidden" and loc:
        parent = next((p for p in reversed(loc[:-1]) if isinstance(p, str)), None)
        model, what = _NESTED.get(parent, (None, ""))
        known = list(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        return f"unknown field{hint} {what} has: {', '.join(known)}." if known else f"unknown field{hint}"
    if kind == "missing" and loc:
        return f"required: {_MISSING_HINTS.get(str(loc[-1]), 'add it')}"
    if kind == "too_short" and loc and loc[-1] in Match.model_fields:
        return f"an empty list matches no job: list at least one value, or leave {loc[-1]} out to match any"
    if kind == "enum":
        return f"use one of {err.get('ctx', {}).get('expected', '')}"
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")


def _record_marks(node: yaml.Node, path: tuple[Any, ...], values: dict, keys: dict, depth: int = 0) -> None:
    """Line and column (1-based) of every node, by its path; also of every mapping key."""
    values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if depth > 64:  # a recursive alias; nothing a policy needs lies that deep
        return
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line, column = key_node.start_mark.line + 1, key_node.start_mark.column + 1
            if key in seen:
                # YAML keeps the last of two equal keys; in a policy that silently
                # drops a route or a match, so say so.
                raise _YamlProblem(
                    f"key {key!r} appears twice in this mapping (first on line {seen[key]})", line, column
                )
            seen[key] = line
            keys[path + (key,)] = (line, column)
            _record_marks(value_node, path + (key,), values, keys, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_marks(item, path + (index,), values, keys, depth + 1)


class _YamlProblem(Exception):
    def __init__(self, problem: str, line: int | None, column: int | None):
        super().__init__(problem)
        self.problem, self.line, self.column = problem, line, column


def _where(source: str, line: int | None, column: int | None) -> str:
    return f"{source}, line {line}, column {column}" if line is not None else source


def _refuse(source: str, details: list[dict[str, Any]]) -> InvalidRequest:
    lines = []
    for d in details:
        shown = "" if d["value"] is None else f" = {d['value']!r}"
        field_text = "" if d["field"] is None else f"{d['field']}{shown}: "
        lines.append(f"{_where(source, d['line'], d['column'])}: {field_text}{d['message']}")
    return InvalidRequest("\n".join(lines), details=details)


def load_policy(text: str, source: str = "policy") -> Policy:
    """A policy from YAML text, or :class:`InvalidRequest` whose message names ``source``,
    the line and column, the field, the value and what is allowed, for every error."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
        values: dict[tuple[Any, ...], tuple[int, int]] = {}
        keys: dict[tuple[Any, ...], tuple[int, int]] = {}
        if root is not None:
            _record_marks(root, (), values, keys)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
        problem = f"not valid YAML: {exc.problem or exc.context}"
        raise _refuse(source, [_detail(None, None, problem, line, column)]) from None
    except yaml.YAMLError as exc:
        raise _refuse(source, [_detail(None, None, f"not valid YAML: {exc}", None, None)]) from None
    except _YamlProblem as exc:
        raise _refuse(source, [_detail(None, None, exc.problem, exc.line, exc.column)]) from None
    finally:
        loader.dispose()
    if data is None:
        problem = "holds no policy: write rules: followed by a list of rules (see policies/default.yaml)"
        raise _refuse(source, [_detail(None, None, problem, None, None)])
    if not isinstance(data, dict):
        problem = f"expected a mapping with a rules: list, got a {type(data).__name__}"
        raise _refuse(source, [_detail(None, None, problem, *values[()])])
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        details = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            value = err.get("input")
            if loc and loc[-1] == 0 and loc not in values and loc[:-1] in values:
                loc = loc[:-1]  # `kind: trainig`: one value written where a list is allowed
            if err["type"] == "duplicate_rule_name":
                loc = ("rules", err["ctx"]["index"], "name")
                value = err["ctx"]["name"]
            if err["type"] == "missing" or isinstance(value, dict | list):
                value = None
            if err["type"] == "extra_forbidden" and loc in keys:
                line, column = keys[loc]
            else:
                line, column = _nearest(values, loc)
            field_path = ".".join(str(p) for p in loc) or "(policy)"
            details.append(_detail(field_path, value, _message(err, loc), line, column))
        raise _refuse(source, details) from None
    policy._source = source
    policy._value_marks = values
    return policy


def _nearest(marks: Mapping[tuple[Any, ...], tuple[int, int]], path: tuple[Any, ...]) -> tuple[int, int]:
    # A key that is missing has no node: point at the mapping it should be in.
    while path and path not in marks:
        path = path[:-1]
    return marks.get(path, (1, 1))


def _detail(field_path: str | None, value: Any, message: str, line: int | None, column: int | None) -> dict[str, Any]:
    return {"field": field_path, "value": value, "message": message, "line": line, "column": column}


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy file, for editors (yaml-language-server) and checks."""
    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = (
        "A gpush routing policy: rules tried in order; the first rule that matches a job routes it "
        "to a cluster and sharing mode, with optional fallbacks."
    )
    return schema


# -- evaluating a job ------------------------------------------------------------------


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
        "tenant": tenant or spec.tenant,
        "labels": dict(spec.labels),
    }


def _job_text(job: Mapping[str, Any]) -> str:
    parts = [f"kind={job['kind']}", f"isolation={job['isolation']}", f"gpus={job['gpus']}"]
    if job.get("gpu_memory_gb") is not None:
        parts.append(f"gpu_memory_gb={_num(job['gpu_memory_gb'])}")
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
            failed.append(f"the job has no {key} (the rule wants {_listed(wanted)})")
        elif value in wanted:
            held.append(f"{key}={value}")
        else:
            failed.append(f"{key}={value} is not in {_listed(wanted)}")
    for key in ("gpus", "gpu_memory_gb"):
        bounds: _Bounds | None = getattr(match, key)
        if bounds is None:
            continue
        value = job[key]
        if value is None:
            failed.append(f"{key} is not set (the rule wants {bounds.describe()})")
        elif refusal := bounds.refusal(key, value):
            failed.append(refusal)
        else:
            held.append(f"{key}={_num(value)} ({bounds.describe()})")
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
    then = "".join(f", then {route}" for route in rule.fallbacks)
    message = f"rule {chosen + 1} {rule.name!r} routes the job to {rule.route}{then}"
    return Decision(chosen, rule.name, rule.routes, trials, job, message, rule.why)


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
                f"{label} {route}: the rule matches jobs asking at least {_num(memory.min)} GB per GPU, but no "
                f"{sharing.value} unit on {view.name!r} has more than {_num(most)} GB; "
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
            f"(match.isolation: {_listed(weaker_ok)})",
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
    biggest = ", ".join(f"{p} ({_num(m)} GB)" for p, m in sorted(offered.items(), key=lambda pm: pm[1]))
    if memory is not None and memory.min is not None and choose_mig_profile(memory.min, offered) is None:
        out.add(
            "error",
            index,
            path,
            f"{label} {route}: the rule matches jobs asking at least {_num(memory.min)} GB per slice, and no "
            f"MIG profile on {view.name!r} covers that (offered: {biggest}); route these jobs to whole GPUs, "
            "or create a larger MIG profile",
        )
    elif memory is None or memory.high > largest:
        out.add(
            "warning",
            index,
            path,
            f"{label} {route}: jobs asking more than {_num(largest)} GB per slice match this rule, but no MIG "
            f"profile on {view.name!r} covers them (offered: {biggest}); they wait here. Add match.gpu_memory_gb: "
            f"{{max: {_num(largest)}}} so larger jobs fall through to a rule that gives them whole GPUs",
        )


def _covers(earlier: Match, later: Match) -> bool:
    """Every job ``later`` matches is matched by ``earlier`` (checked key by key)."""
    for key, universe in (("kind", set(Kind)), ("isolation", set(Isolation)), ("tenant", None)):
        wide, narrow = getattr(earlier, key), getattr(later, key)
        if wide is None:
            continue
        if narrow is None:
            if universe is None or not universe <= set(wide):
                return False
        elif not set(narrow) <= set(wide):
            return False
    if earlier.gpus is not None and not earlier.gpus.covers(later.gpus):
        return False
    if earlier.gpu_memory_gb is not None:
        # `later` without a memory range also takes jobs that state no memory,
        # which `earlier` never matches.
        if later.gpu_memory_gb is None or not earlier.gpu_memory_gb.covers(later.gpu_memory_gb):
            return False
    return earlier.labels.items() <= later.labels.items()


def _match_text(match: Match) -> str:
    parts = [f"{k}={_listed(getattr(match, k))}" for k in ("kind", "isolation", "tenant") if getattr(match, k)]
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
    out = _Findings(policy)
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
        for earlier_index, earlier in enumerate(policy.rules[:index]):
            if _covers(earlier.match, rule.match):
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
                break
    if not any(_covers(rule.match, _EVERY_JOB) for rule in policy.rules):
        last = len(policy.rules) - 1
        out.add(
            "warning",
            None,
            ("rules", last),
            "no rule matches every job, so a job that matches none is held until the policy changes; "
            "end the policy with a catch-all rule (match: {}) that routes to whole GPUs",
        )
    return ValidationReport(out.errors, out.warnings, policy.source, len(policy.rules))
