"""Errors of the Kubernetes API test server, rendered as the Status bodies the real API server sends.

The official client turns these into ``ApiException(status=code)`` with the body as its ``body``; the
``reason`` words and the ``details`` (``kind`` is the plural resource for NotFound, AlreadyExists and
Conflict, the Kind for Invalid) follow k8s.io/apimachinery/pkg/api/errors so that code written against
this server reads errors the way it must read them from a real cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import orjson

_NO_VALUE = object()

# field.ErrorType words as the real server prints them, and the cause reason each one carries.
_CAUSE_REASONS = {
    "Invalid value": "FieldValueInvalid",
    "Required value": "FieldValueRequired",
    "Forbidden": "FieldValueForbidden",
    "Unsupported value": "FieldValueNotSupported",
    "Duplicate value": "FieldValueDuplicate",
    "Too long": "FieldValueTooLong",
}


class _Resource(Protocol):
    group: str
    kind: str
    plural: str


def _go_value(value: Any) -> str:
    """A value the way Go's %#v / %q print it in field errors, near enough for a message."""
    if isinstance(value, str):
        return orjson.dumps(value).decode()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        inner = ", ".join(f"{orjson.dumps(k).decode()}:{orjson.dumps(v).decode()}" for k, v in value.items())
        return f"map[string]string{{{inner}}}"
    return orjson.dumps(value).decode()


@dataclass(frozen=True)
class FieldError:
    """One entry of an Invalid (422) Status: ``field: Type: value: detail``."""

    field: str
    type: str
    detail: str = ""
    value: Any = _NO_VALUE

    def cause_message(self) -> str:
        parts = [self.type]
        if self.value is not _NO_VALUE:
            parts.append(_go_value(self.value))
        if self.detail:
            parts.append(self.detail)
        return ": ".join(parts)

    def message(self) -> str:
        return f"{self.field}: {self.cause_message()}"

    def cause(self) -> dict[str, str]:
        return {
            "reason": _CAUSE_REASONS.get(self.type, "FieldValueInvalid"),
            "message": self.cause_message(),
            "field": self.field,
        }


def invalid_value(field: str, value: Any, detail: str) -> FieldError:
    return FieldError(field, "Invalid value", detail, value)


def required(field: str, detail: str = "") -> FieldError:
    return FieldError(field, "Required value", detail)


def forbidden(field: str, detail: str) -> FieldError:
    return FieldError(field, "Forbidden", detail)


def unsupported(field: str, value: Any, supported: list[str]) -> FieldError:
    return FieldError(field, "Unsupported value", "supported values: " + ", ".join(f'"{s}"' for s in supported), value)


def immutable(field: str, value: Any) -> FieldError:
    return invalid_value(field, value, "field is immutable")


class ApiError(Exception):
    """A request the server refuses; ``status()`` is the body, ``code`` the HTTP status."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _qualified_resource(rt: _Resource) -> str:
    return f"{rt.plural}.{rt.group}" if rt.group else rt.plural


def _details(name: str, group: str, kind: str, **extra: Any) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name}
    if group:
        details["group"] = group
    details["kind"] = kind
    details.update(extra)
    return details


def not_found(rt: _Resource, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{_qualified_resource(rt)} "{name}" not found', _details(name, rt.group, rt.plural)
    )


def namespace_not_found(name: str) -> ApiError:
    return ApiError(404, "NotFound", f'namespaces "{name}" not found', _details(name, "", "namespaces"))


def no_such_resource() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def already_exists(rt: _Resource, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{_qualified_resource(rt)} "{name}" already exists', _details(name, rt.group, rt.plural)
    )


def conflict(rt: _Resource, name: str, why: str, subresource: str = "") -> ApiError:
    resource = _qualified_resource(rt) + (f"/{subresource}" if subresource else "")
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource} "{name}": {why}',
        _details(name, rt.group, rt.plural),
    )


STALE_WRITE = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(
    rt: _Resource, name: str, errors: list[FieldError], kind: str | None = None, group: str | None = None
) -> ApiError:
    kind = kind or rt.kind
    group = rt.group if group is None else group
    qualified = f"{kind}.{group}" if group else kind
    text = errors[0].message() if len(errors) == 1 else "[" + ", ".join(e.message() for e in errors) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{qualified} "{name}" is invalid: {text}',
        _details(name, group, kind, causes=[e.cause() for e in errors]),
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def expired(message: str) -> ApiError:
    # The real server answers a too-old resourceVersion or continue token with reason Expired, code 410.
    return ApiError(410, "Expired", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def unsupported_media_type(content_type: str, accepted: list[str]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
        {},
    )


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")
