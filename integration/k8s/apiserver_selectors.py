"""Label and field selectors as the API server parses and applies them on list, watch and deleteCollection.

Label selectors take the string syntax of ``?labelSelector=`` (``=``, ``==``, ``!=``, ``in``, ``notin``,
``key`` for exists, ``!key`` for does-not-exist) and the ``LabelSelector`` object of workload specs
(``matchLabels``, ``matchExpressions``). Field selectors take ``=``, ``==`` and ``!=`` on the fields each
kind declares selectable; any other field is refused with 400, as the real server does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from integration.k8s.apiserver_errors import ApiError, bad_request

_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
)
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SET_TERM = re.compile(r"^\s*(\S+)\s+(in|notin)\s*\(([^)]*)\)\s*$")
_EQUALITY_TERM = re.compile(r"^\s*([^\s!=]+)\s*(==|=|!=)\s*(\S*)\s*$")


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.operator == "=":
            return value is not None and value in self.values
        if self.operator == "!=":
            return value is None or value not in self.values
        if self.operator == "in":
            return value is not None and value in self.values
        if self.operator == "notin":
            return value is None or value not in self.values
        if self.operator == "exists":
            return value is not None
        return value is None


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.requirements)

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    def matches_object(self, obj: Mapping[str, Any]) -> bool:
        return self.matches(obj.get("metadata", {}).get("labels"))


def _split_terms(text: str) -> list[str]:
    """Commas separate requirements except inside the parentheses of a set."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t for t in (t.strip() for t in terms) if t]


def _check_key(key: str, term: str) -> None:
    if len(key) > 316 or not _KEY.match(key):
        raise bad_request(f"unable to parse requirement: invalid label key {key!r} in {term!r}")


def _check_value(value: str, term: str) -> None:
    if len(value) > 63 or not _VALUE.match(value):
        raise bad_request(f"unable to parse requirement: invalid label value {value!r} in {term!r}")


def parse_label_selector(text: str | None) -> LabelSelector:
    """The ``?labelSelector=`` syntax; 400 BadRequest for anything the real parser refuses."""
    if not text:
        return LabelSelector()
    requirements = []
    for term in _split_terms(text):
        if m := _SET_TERM.match(term):
            key, op, raw = m.group(1), m.group(2), m.group(3)
            values = [v.strip() for v in raw.split(",") if v.strip()]
            _check_key(key, term)
            for v in values:
                _check_value(v, term)
            if not values:
                raise bad_request(
                    f"unable to parse requirement: for 'in', 'notin' operators, values set can't be empty: {term!r}"
                )
            requirements.append(Requirement(key, op, frozenset(values)))
        elif m := _EQUALITY_TERM.match(term):
            key, op, value = m.group(1), m.group(2), m.group(3)
            _check_key(key, term)
            _check_value(value, term)
            requirements.append(Requirement(key, "!=" if op == "!=" else "=", frozenset({value})))
        elif term.startswith("!"):
            key = term[1:].strip()
            _check_key(key, term)
            requirements.append(Requirement(key, "!"))
        else:
            _check_key(term, term)
            requirements.append(Requirement(term, "exists"))
    return LabelSelector(tuple(requirements))


_EXPRESSION_OPERATORS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}


def selector_from_object(selector: Mapping[str, Any] | None) -> LabelSelector | None:
    """A ``LabelSelector`` object of a workload spec; None when it is malformed."""
    if not isinstance(selector, Mapping):
        return None
    requirements = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        requirements.append(Requirement(key, "=", frozenset({str(value)})))
    for expr in selector.get("matchExpressions") or []:
        op = _EXPRESSION_OPERATORS.get(expr.get("operator"))
        if op is None or not expr.get("key"):
            return None
        requirements.append(Requirement(expr["key"], op, frozenset(expr.get("values") or ())))
    return LabelSelector(tuple(requirements))


def selector_to_string(selector: Mapping[str, Any] | None) -> str:
    """The string form a Scale's ``status.selector`` carries."""
    parsed = selector_from_object(selector)
    if parsed is None:
        return ""
    parts = []
    for r in parsed.requirements:
        if r.operator == "=":
            parts.append(f"{r.key}={next(iter(r.values))}")
        elif r.operator in ("in", "notin"):
            parts.append(f"{r.key} {r.operator} ({','.join(sorted(r.values))})")
        elif r.operator == "exists":
            parts.append(r.key)
        else:
            parts.append(f"!{r.key}")
    return ",".join(parts)


# Selectable fields whose Go type is not a string: the real server compares their printed form.
_FIELD_DEFAULTS = {"spec.unschedulable": "false", "spec.hostNetwork": "false", "status.successful": "0"}
# Field labels that are not the object's own path.
_FIELD_PATHS = {"status.successful": "status.succeeded", "source": "source.component"}


def field_value(obj: Mapping[str, Any], label: str) -> str:
    value: Any = obj
    for part in _FIELD_PATHS.get(label, label).split("."):
        if not isinstance(value, Mapping):
            value = None
            break
        value = value.get(part)
    if value is None:
        return _FIELD_DEFAULTS.get(label, "")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class FieldSelector:
    terms: tuple[tuple[str, bool, str], ...] = ()  # (field, equal, value)

    def __bool__(self) -> bool:
        return bool(self.terms)

    def matches_object(self, obj: Mapping[str, Any]) -> bool:
        return all((field_value(obj, f) == v) == eq for f, eq, v in self.terms)

    def names(self) -> set[str] | None:
        """Names an equality on metadata.name pins, so a lookup can skip the scan."""
        for f, eq, v in self.terms:
            if f == "metadata.name" and eq:
                return {v}
        return None


def parse_field_selector(text: str | None, allowed: Callable[[str], bool]) -> FieldSelector:
    if not text:
        return FieldSelector()
    terms = []
    for term in _split_terms(text):
        if "!=" in term:
            field, value = term.split("!=", 1)
            equal = False
        elif "==" in term:
            field, value = term.split("==", 1)
            equal = True
        elif "=" in term:
            field, value = term.split("=", 1)
            equal = True
        else:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        field = field.strip()
        if not allowed(field):
            raise ApiError(400, "BadRequest", f"field label not supported: {field}")
        terms.append((field, equal, value.strip()))
    return FieldSelector(tuple(terms))
