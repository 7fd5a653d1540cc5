"""Pydantic's validation errors in a user's words: field path, value, what is allowed.

Shared by the API (422 bodies) and the CLI (messages before anything is sent), so a
bad job reads the same wherever it is refused.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from broker.core.schemas import Elastic, JobBatch, JobSpec

# What a pattern means, in words, by the last part of the field's path.
PATTERN_WORDS = {
    "name": "letters, digits and _ . @ -, starting with a letter or digit, at most 64 characters",
    "tenant": "letters, digits and _ . @ -, starting with a letter or digit, at most 64 characters",
    "user": "letters, digits and _ . @ -, starting with a letter or digit, at most 64 characters",
    "idempotency_key": "printable ASCII without spaces, 1 to 128 characters",
}


def _friendly_message(err: dict[str, Any], loc: list[str], body: type[BaseModel] | None = None) -> str:
    message = err.get("msg", "invalid").removeprefix("Value error, ")
    kind = err.get("type")
    if kind == "extra_forbidden" and loc:
        parent = loc[-2] if len(loc) > 1 else None
        if _is_job(body) and parent == "elastic":
            what, known = "Elastic fields", list(Elastic.model_fields)
        elif _is_job(body) and (len(loc) == 1 or (len(loc) == 3 and loc[0] == "jobs")):
            what, known = "Job fields", list(JobSpec.model_fields)
        elif body is not None and len(loc) == 1:
            what, known = "Known fields", list(body.model_fields)
        else:
            what, known = "", []
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        listed = f" {what}: {', '.join(known)}." if known else ""
        return f"unknown field{hint}{listed}"
    if kind == "string_pattern_mismatch" and loc and loc[-1] in PATTERN_WORDS:
        return f"use {PATTERN_WORDS[loc[-1]]}"
    return message


def _is_job(body: type[BaseModel] | None) -> bool:
    return body is None or body in (JobSpec, JobBatch)


def validation_details(
    errors: list[dict[str, Any]], skip: int = 0, *, body: type[BaseModel] | None = None
) -> list[dict[str, Any]]:
    """Pydantic errors -> [{field, value, message}] with dotted field paths (``jobs.3.gpus``).
    ``body``: the model the request body is (None: a job), so an unknown field is
    compared with that model's fields rather than a job's."""
    details = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ())[skip:]]
        message = _friendly_message(err, loc, body)
        value = err.get("input")
        if isinstance(value, dict | list) and loc == [] or err.get("type") == "missing":
            value = None
        details.append(
            {"field": ".".join(loc) or ("(job)" if _is_job(body) else "(body)"), "value": value, "message": message}
        )
    return details


def describe_details(details: list[dict[str, Any]]) -> str:
    parts = []
    for d in details:
        shown = "" if d["value"] is None else f" = {d['value']!r}"
        parts.append(f"{d['field']}{shown}: {d['message']}")
    return "; ".join(parts)
