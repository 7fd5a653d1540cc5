"""Job specs from YAML files and command-line flags (the same fields in both).

Errors name the field, the value and what is allowed; a YAML syntax error names the
line and column. Nothing here talks to the broker.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.core.validation import MAX_LISTED_ERRORS, describe_details, validation_details
from broker.core.yamltext import load_yaml


def _details(exc: ValidationError, prefix: str = "") -> list[dict[str, Any]]:
    details = validation_details(list(exc.errors()))
    for d in details:
        d["field"] = prefix + d["field"]
    return details


def validate_spec(fields: dict[str, Any], *, where: str = "") -> JobSpec:
    """A JobSpec from plain fields, or :class:`InvalidRequest` naming every bad field."""
    try:
        return JobSpec.model_validate(fields)
    except ValidationError as exc:
        details = _details(exc)
        head = f"{where}: " if where else ""
        message = f"{head}invalid job: {describe_details(details)}"
        raise InvalidRequest(message, details=details[:MAX_LISTED_ERRORS]) from None


def load_documents(text: str, *, source: str) -> list[dict[str, Any]]:
    """Job documents from YAML: one mapping, several ``---`` documents, or a list of mappings."""
    docs = load_yaml(text, source=source, all_documents=True)
    if len(docs) == 1 and isinstance(docs[0], list):
        docs = docs[0]
    if not docs:
        raise InvalidRequest(f"{source} holds no job: write one mapping of job fields (kind, gpus, command, ...)")
    for index, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise InvalidRequest(
                f"{source}, job {index + 1}: expected a mapping of job fields (kind: training, ...), "
                f"got {type(doc).__name__}"
            )
    return docs


def build_specs(
    file_docs: list[dict[str, Any]] | None, overrides: dict[str, Any], *, source: str = ""
) -> list[JobSpec]:
    """Merge flags over each file document (flags win) and validate each job."""
    overrides = {k: v for k, v in overrides.items() if v is not None and v != {} and v != ()}
    docs = file_docs or [{}]
    specs = []
    for index, doc in enumerate(docs):
        merged = dict(doc)
        for key, value in overrides.items():
            if key in ("env", "labels") and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            elif key == "elastic" and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        where = f"{source} job {index + 1}" if source and len(docs) > 1 else source
        specs.append(validate_spec(merged, where=where))
    return specs


def parse_pairs(pairs: tuple[str, ...], *, option: str) -> dict[str, str]:
    """``KEY=VALUE`` options into a dict; a pair without ``=`` is a usage error."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"{option} {pair!r}: write KEY=VALUE")
        out[key] = value
    return out
