"""The routes a load balancer and Prometheus call: liveness, readiness and metrics."""

from typing import Annotated

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse

import broker
from broker.api.deps import DbEngine, MetricsRegistry
from broker.api.responses import error_response
from broker.core import metrics
from broker.core.db import check_schema
from broker.core.errors import Unavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up (no database check: that is /readyz)."""
    return {"status": "ok", "version": broker.__version__}


@router.get("/readyz")
def readyz(engine: DbEngine) -> JSONResponse:
    """The database answers and its schema is the one this broker needs."""
    try:
        check_schema(engine)
    except Unavailable as exc:
        return error_response(exc)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response)
def prometheus_metrics(
    exported: MetricsRegistry,
    authorization: Annotated[str | None, Header()] = None,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    """Prometheus metrics: queue depth, GPU-equivalents, cycles, adapter calls, drift.
    No token needed unless GPUSH_METRICS_TOKEN is set (then ``Bearer`` that value)."""
    metrics.check_scrape_token(authorization)
    body, content_type = metrics.exposition(exported, accept)
    return Response(body, media_type=content_type)
