"""How the broker's REST API answers: job rows rendered by orjson, and the error
envelope ``{"error": {"code", "message", "details"}}`` with the status of the
error's type, for gpush's own errors and for requests FastAPI refuses.
"""

from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from broker.core.errors import GpushError, InvalidRequest
from broker.core.validation import describe_details, validation_details


class JSONBytes(Response):
    """A JSON response rendered by orjson from plain dicts (job rows), without
    re-validating them against the response model: the hot path of submit and list."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_UTC_Z)


def error_response(exc: GpushError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
    return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status, headers=headers)


async def gpush_error(_request: Request, exc: GpushError) -> JSONResponse:
    return error_response(exc)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The route's body model, so an unknown field is named against its own fields
    # (a node report's, a token's), not a job's.
    body_field = getattr(request.scope.get("route"), "body_field", None)
    body = getattr(getattr(body_field, "field_info", None), "annotation", None)
    body = body if isinstance(body, type) and issubclass(body, BaseModel) else None
    details = validation_details(list(exc.errors()), skip=1, body=body)
    return error_response(InvalidRequest(describe_details(details), details=details))
