"""Pydantic's validation errors in a user's words: field path, value, what is allowed.

Shared by the API (422 bodies) and the CLI (messages before anything is sent), so a
bad job reads the same wherever it is refused.
"""

from __future__ import annotations

import difflib
import math
import reprlib
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


# What an error shows of a value: enough to recognise it. A 10 MB command or 100,000
# labels echoed whole made a message (and a 422 body) the size of the request.
SHOWN_CHARS = 200
_shown_repr = reprlib.Repr()
_shown_repr.maxstring = _shown_repr.maxother = SHOWN_CHARS
_shown_repr.maxlevel = 3


def shown_value(value: Any) -> Any:
    """``value`` as an error shows it: numbers, booleans and short strings as they are;
    what JSON cannot carry (NaN, the infinities, a lone surrogate) and anything long or
    nested as a short repr, with any lone surrogate escaped."""
    if value is None or isinstance(value, bool | int) and abs(value) < 2**63:
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, str) and len(value) <= SHOWN_CHARS:
        return _escaped(value)
    try:
        text = _shown_repr.repr(value)
    except ValueError:  # an integer too long for Python to print
        return f"<a {type(value).__name__} too large to show>"
    if isinstance(value, dict | list) and "..." not in text and _plain(value):
        return value  # small enough to show whole, and JSON can carry it
    return _escaped(text)


def _escaped(text: str) -> str:
    # A lone surrogate cannot be written as UTF-8; its escape can.
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _plain(value: Any) -> bool:
    """Whether JSON carries ``value`` as it is (called on small values only)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    if isinstance(value, str):
        return _escaped(value) == value
    return shown_value(value) is value


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
        value = shown_value(value)
        field = ".".join(loc) or ("(job)" if _is_job(body) else "(body)")
        if len(field) > SHOWN_CHARS:  # a path through a long key (env, labels, an unknown field)
            field = field[: SHOWN_CHARS - 1] + "…"
        details.append({"field": field, "value": value, "message": message})
    return details


# The most errors one message lists: a spec with thousands of bad items (a command of
# 4,096 lists) gets the first ones and a count, not a message many times its own size.
MAX_LISTED_ERRORS = 50


def describe_details(details: list[dict[str, Any]]) -> str:
    parts = []
    for d in details[:MAX_LISTED_ERRORS]:
        text = repr(d["value"])  # a shown value is short, but its repr escapes again
        text = text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"
        shown = "" if d["value"] is None else f" = {text}"
        parts.append(f"{d['field']}{shown}: {d['message']}")
    if len(details) > MAX_LISTED_ERRORS:
        parts.append(f"... and {len(details) - MAX_LISTED_ERRORS} more errors: fix these and try again")
    return "; ".join(parts)
