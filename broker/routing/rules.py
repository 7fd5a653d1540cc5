"""The routing policy's format: its rules, loading them from YAML, and its JSON Schema.

A policy is an ordered list of rules, first match wins, written in YAML by admins.
This module owns the pydantic model of that format (what a rule may match on, where
it may route, who may preempt whom, the :class:`Policy` that holds it all), loading
YAML into it with errors that name the line, column, field and value, the JSON Schema
editors check policy files with, and the two small formatters every message about a
policy uses. The sections that change the fleet (``mig:``, ``lending:``) are
broker.routing.fleet_sections. Evaluating a job against a policy is
broker.routing.evaluation; the checks before a policy becomes active are
broker.routing.validation.

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
from collections.abc import Iterable, Mapping
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

from broker.core.adapter import Sharing
from broker.core.errors import InvalidRequest
from broker.core.gpus import MODELS, gpu_model
from broker.core.schemas import Isolation, Kind
from broker.core.spec_values import MAX_GRACE_SECONDS, parse_grace, parse_seconds
from broker.core.yamltext import EXCERPT_CHARS, BoundedLoader, excerpt, gc_paused, yaml_problem

# broker.fleet imports LendingPool and MigLayouts from here, beside Policy.
from broker.routing.fleet_sections import LendingPool, MigLayouts

MIG_SHARING = frozenset({Sharing.SLURM_MIG, Sharing.K8S_MIG})

_RULE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_CLUSTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"
_PARTITION = r"^[A-Za-z0-9_.-]{1,64}$"


def number_text(value: float) -> str:
    """8 rather than 8.0; 2.5 stays 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def list_text(values: Iterable[Any]) -> str:
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
            least, most = number_text(self.min), number_text(self.max)
            raise ValueError(f"min ({least}) is above max ({most}): no job could match")
        return self

    @property
    def low(self) -> float:
        return self.lowest if self.min is None else self.min

    @property
    def high(self) -> float:
        return math.inf if self.max is None else self.max

    def describe(self) -> str:
        parts = [f"min {number_text(self.min)}"] if self.min is not None else []
        parts += [f"max {number_text(self.max)}"] if self.max is not None else []
        return ", ".join(parts)

    def refusal(self, name: str, value: float) -> str | None:
        """Why ``value`` is outside the range, in a user's words, or None if inside."""
        if self.min is not None and value < self.min:
            return f"{name}={number_text(value)} is below min {number_text(self.min)}"
        if self.max is not None and value > self.max:
            return f"{name}={number_text(value)} is above max {number_text(self.max)}"
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


class PreemptibleDefault(BaseModel):
    """Whether the jobs a match takes may be preempted when their spec does not say."""

    model_config = ConfigDict(extra="forbid")

    match: Match = Field(description="which jobs: the keys of a rule's match (tenant, kind, labels...)")
    preemptible: bool = Field(description="true: they may be stopped for work of higher standing and queued again")


class Preemption(BaseModel):
    """Who may preempt whom. Without this section nothing is preempted.

    A waiting job preempts a running one that may be preempted (its spec's
    ``preemptible``, else the first of ``defaults`` that matches it, else not) when its
    priority is at least ``min_priority_gap`` higher, or, with ``reclaim``, when at equal
    priority its tenant is below its fair share and the running job's tenant above its own
    (at most ``reclaims_per_hour`` such preemptions an hour). A victim gets its
    checkpoint signal and ``grace`` seconds (its spec's, else this one) before it is stopped."""

    model_config = ConfigDict(extra="forbid")

    min_priority_gap: int = Field(1, ge=1, le=2000, description="how much higher a priority must be to preempt")
    reclaim: bool = Field(
        False, description="equal priority: a tenant below its fair share takes back GPUs lent beyond others' shares"
    )
    reclaims_per_hour: int = Field(6, ge=0, le=10_000, description="fair-share reclaims a fleet may make in an hour")
    grace: Annotated[int, BeforeValidator(parse_grace)] = Field(
        60, ge=0, le=MAX_GRACE_SECONDS, description="seconds a victim gets to save its state when its job says none"
    )
    defaults: list[PreemptibleDefault] = Field(
        default_factory=list,
        max_length=1000,
        description="whether jobs that do not say may be preempted, by match; first match wins; none: not preemptible",
    )


# How long a multi-node job waits for capacity before its nodes are reserved, when the
# policy does not say: long enough that gangs which find room soon take none (a reservation
# holds nodes partly idle), short against the hours a gang starves behind a stream of small
# jobs without one (the starving case of tests/simulation/test_reservations.py).
GANG_RESERVATION_AFTER = 600
# The longest wait a policy may set: a day (longer is a gang left to starve).
MAX_GANG_RESERVATION_AFTER = 86_400


def _parse_reservation_after(value: Any) -> Any:
    return parse_seconds(value, "a wait before a reservation") if isinstance(value, str | int | float) else value


class Scheduling(BaseModel):
    """How the scheduler treats large jobs against a stream of small ones.

    A multi-node job (a gang) that has waited for capacity ``gang_reservation_after``
    gets a reservation: the decision picks the nodes it will use (those whose jobs end
    soonest, by when they were placed plus their time limit) and those nodes take no work
    that would end after the gang could start; shorter work is backfilled onto them, as
    Slurm's backfill does (broker.placement.reservation)."""

    model_config = ConfigDict(extra="forbid")

    gang_reservations: bool = Field(
        True, description="reserve nodes for multi-node jobs that waited long; false: never (they may starve)"
    )
    gang_reservation_after: Annotated[int, BeforeValidator(_parse_reservation_after)] = Field(
        GANG_RESERVATION_AFTER,
        ge=0,
        le=MAX_GANG_RESERVATION_AFTER,
        description="seconds (or 10m, 1h) a multi-node job waits for capacity before its nodes are reserved",
    )


# The most rules a policy may hold. Any user may ask to validate a policy, every
# policy is read and checked whole, and routing a job tries rules in order, so each
# queued job of each cycle may walk them all: without a cap the cost of one request
# and of every cycle has no bound. 10,000 is the largest policy issue 14 set a target
# for (validated in well under 2 s, integration/bench/policy.py), and far above what
# people write: the shipped policies have 6 rules, and a rule for each of a thousand
# tenants is 1,000. Rules that route alike fold into one with lists.
MAX_RULES = 10_000


class Policy(BaseModel):
    """A routing policy: rules tried in order, the first that matches a job routes it."""

    model_config = ConfigDict(extra="forbid", title="gpush routing policy")

    rules: list[Rule] = Field(
        min_length=1,
        max_length=MAX_RULES,
        description=f"tried in order; the first rule that matches routes the job; at most {MAX_RULES:,}",
    )
    preemption: Preemption | None = Field(
        None, description="who may preempt whom, and which jobs may be preempted; leave out to preempt nothing"
    )
    mig: MigLayouts | None = Field(
        None, description="MIG layouts that follow the queue; leave out to change them only by gpush mig apply"
    )
    lending: list[LendingPool] = Field(
        default_factory=list, max_length=100, description="nodes two clusters share, lent as their queues call for it"
    )
    scheduling: Scheduling | None = Field(
        None, description="reservations for multi-node jobs; leave out for the defaults (reserve after 10 minutes)"
    )

    # Where each node sat in the YAML it was loaded from, so that findings name a
    # line and column; empty for a policy built from plain data.
    _source: str | None = PrivateAttr(None)
    _value_marks: dict[tuple[Any, ...], tuple[int, int]] = PrivateAttr(default_factory=dict)

    @property
    def gang_reservation_after(self) -> int | None:
        """Seconds a gang waits before its nodes are reserved; None: never reserved."""
        settings = self.scheduling or Scheduling()
        return settings.gang_reservation_after if settings.gang_reservations else None

    @field_validator("rules", mode="before")
    @classmethod
    def _at_most_max_rules(cls, rules: Any) -> Any:
        # Before each rule is validated, so an oversized policy is refused at once and
        # with what to do (max_length alone would say only "at most 10000 items").
        if isinstance(rules, list | tuple) and len(rules) > MAX_RULES:
            raise PydanticCustomError(
                "too_many_rules",
                "the policy has {count} rules, more than the {cap} a policy may hold: merge rules that match "
                "and route alike into one rule with lists (tenant: [team-a, team-b], kind: [training, batch]), "
                "or split the clusters between brokers, each with its own policy",
                {"count": f"{len(rules):,}", "cap": f"{MAX_RULES:,}"},
            )
        return rules

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
        # A key far longer than any field is no typo of one (and difflib's work grows with it).
        written = str(loc[-1])
        close = difflib.get_close_matches(written, known, n=1) if len(written) <= 64 else []
        hint = f"; did you mean {close[0]!r}?" if close else "."
        return f"unknown field{hint} {what} has: {', '.join(known)}." if known else f"unknown field{hint}"
    if kind == "missing" and loc:
        return f"required: {_MISSING_HINTS.get(str(loc[-1]), 'add it')}"
    if kind == "too_short" and loc and loc[-1] in Match.model_fields:
        return f"an empty list matches no job: list at least one value, or leave {loc[-1]} out to match any"
    if kind == "enum":
        return f"use one of {err.get('ctx', {}).get('expected', '')}"
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")


def _record_marks(node: yaml.Node, path: tuple[Any, ...], values: dict, keys: dict) -> None:
    """Line and column (1-based) of every node, by its path; also of every mapping key.
    The loader bounds how deep and how many (aliases walked once per use) they are."""
    values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line, column = key_node.start_mark.line + 1, key_node.start_mark.column + 1
            if key in seen:
                # YAML keeps the last of two equal keys; in a policy that silently
                # drops a route or a match, so say so.
                raise _YamlProblem(
                    f"key {excerpt(key)} appears twice in this mapping (first on line {seen[key]})", line, column
                )
            seen[key] = line
            keys[path + (key,)] = (line, column)
            _record_marks(value_node, path + (key,), values, keys)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_marks(item, path + (index,), values, keys)


class _YamlProblem(Exception):
    def __init__(self, problem: str, line: int | None, column: int | None):
        super().__init__(problem)
        self.problem, self.line, self.column = problem, line, column


def _where(source: str, line: int | None, column: int | None) -> str:
    return f"{source}, line {line}, column {column}" if line is not None else source


# The most errors one refusal lists: a file with thousands of bad values gets the first
# ones and a count, not a message many times its own size.
MAX_LISTED_ERRORS = 50


def _refuse(source: str, details: list[dict[str, Any]]) -> InvalidRequest:
    lines = []
    for d in details[:MAX_LISTED_ERRORS]:
        shown = "" if d["value"] is None else f" = {excerpt(d['value'])}"
        field_text = "" if d["field"] is None else f"{d['field']}{shown}: "
        lines.append(f"{_where(source, d['line'], d['column'])}: {field_text}{d['message']}")
    if len(details) > MAX_LISTED_ERRORS:
        lines.append(f"{source}: ... and {len(details) - MAX_LISTED_ERRORS} more errors: fix these and validate again")
    return InvalidRequest("\n".join(lines), details=details[:MAX_LISTED_ERRORS])


def load_policy(text: str, source: str = "policy") -> Policy:
    """A policy from YAML text, or :class:`InvalidRequest` whose message names ``source``,
    the line and column, the field, the value and what is allowed, for every error."""
    with gc_paused():
        return _load_policy(text, source)


def _load_policy(text: str, source: str) -> Policy:
    try:
        loader = BoundedLoader(text)  # reading starts here: a control character is refused at once
    except yaml.YAMLError as exc:
        raise _refuse(source, [_detail(None, None, *yaml_problem(exc))]) from None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
        values: dict[tuple[Any, ...], tuple[int, int]] = {}
        keys: dict[tuple[Any, ...], tuple[int, int]] = {}
        if root is not None:
            _record_marks(root, (), values, keys)
    except yaml.YAMLError as exc:
        raise _refuse(source, [_detail(None, None, *yaml_problem(exc))]) from None
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
    # What the policy held is echoed back only as an excerpt: a field path made of a
    # long key, or a long value, would otherwise come back whole in the message.
    if field_path is not None and len(field_path) > EXCERPT_CHARS:
        field_path = excerpt(field_path, quote=False)
    if isinstance(value, str) and len(value) > EXCERPT_CHARS:
        value = excerpt(value, quote=False)
    elif not (value is None or isinstance(value, bool | float | str) or isinstance(value, int) and abs(value) < 2**63):
        value = excerpt(value)
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
