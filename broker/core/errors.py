"""Typed errors of the broker, each mapped to one HTTP status and one CLI exit code.

Every error carries a message that says what was wrong and what to do; the API
turns it into ``{"error": {"code", "message", "details"}}`` and the CLI prints the
message and exits with the error's exit code.
"""

from __future__ import annotations

from typing import Any

# Stable exit codes of the `gpush` command line (documented in the README).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_NOT_ALLOWED = 4


class GpushError(Exception):
    """Base of every error gpush raises on purpose."""

    code = "error"
    http_status = 500
    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, details: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.message = message
        self.details = details or []

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidRequest(GpushError):
    """The request (a job spec, a filter, a cursor) is not valid; nothing was written."""

    code = "invalid"
    http_status = 422
    exit_code = EXIT_USAGE


class NotFound(GpushError):
    code = "not_found"
    http_status = 404
    exit_code = EXIT_NOT_FOUND


class Unauthenticated(GpushError):
    code = "unauthenticated"
    http_status = 401
    exit_code = EXIT_NOT_ALLOWED


class NotAllowed(GpushError):
    code = "not_allowed"
    http_status = 403
    exit_code = EXIT_NOT_ALLOWED


class Conflict(GpushError):
    """The request contradicts what is stored (an idempotency key reused with another spec)."""

    code = "conflict"
    http_status = 409
    exit_code = EXIT_ERROR


class IllegalTransition(GpushError):
    """A state change that the transition table does not allow."""

    code = "illegal_transition"
    http_status = 409
    exit_code = EXIT_ERROR


class StateConflict(GpushError):
    """A compare-and-set on a job's state lost: the job was not in the state the caller expected."""

    code = "state_conflict"
    http_status = 409
    exit_code = EXIT_ERROR

    def __init__(self, job_id: int, expected: str, actual: str | None):
        super().__init__(f"job {job_id} is {actual or 'gone'}, not {expected}: another process changed it first")
        self.job_id = job_id
        self.expected = expected
        self.actual = actual


class Unavailable(GpushError):
    """The broker or its database cannot be reached."""

    code = "unavailable"
    http_status = 503
    exit_code = EXIT_ERROR


class StorageFull(GpushError):
    """The database refused a write because its disk is full: nothing was written, and
    nothing will be until someone frees space (not worth retrying in a moment)."""

    code = "storage_full"
    http_status = 507
    exit_code = EXIT_ERROR


# What a client rebuilds from an error body's code (a lost compare-and-set reaches
# clients as a plain conflict).
ERRORS_BY_CODE: dict[str, type[GpushError]] = {
    StateConflict.code: Conflict,
    **{
        cls.code: cls
        for cls in (
            GpushError,
            InvalidRequest,
            NotFound,
            Unauthenticated,
            NotAllowed,
            Conflict,
            IllegalTransition,
            Unavailable,
            StorageFull,
        )
    },
}
