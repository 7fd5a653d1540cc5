"""The routes a load balancer and Prometheus call: liveness, readiness and metrics."""

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse

import broker
from broker.api.deps import DbEngine, MetricsRegistry
from broker.api.responses import error_response
from broker.core import metrics
from broker.core.clock import Clock
from broker.core.db import check_schema
from broker.core.errors import StorageFull, Unavailable

router = APIRouter(tags=["health"])

# How long /readyz answers 503 after a write was refused for a full disk: longer than a
# load balancer needs to take this server out (Kubernetes: 3 failed probes 10 s apart).
# A write that fails again once it is back in starts the time again.
NOT_READY_AFTER_DISK_FULL = 60.0


class DiskFullMemory:
    """The last write this process's database refused for a full disk, remembered for
    :data:`NOT_READY_AFTER_DISK_FULL` seconds of the app's clock.

    A probe of its own cannot tell: a small write lands in space SQLite's WAL or
    PostgreSQL's last page already holds, and succeeds while inserts that need a new
    page fail. The writes users send are the test that counts. Each process remembers
    its own (a worker that has not written yet says ready); they share one disk, so
    each soon sees the same."""

    def __init__(self, clock: Clock, seconds: float = NOT_READY_AFTER_DISK_FULL):
        self._clock = clock
        self._seconds = seconds
        self._last: tuple[float, StorageFull] | None = None

    def remember(self, error: StorageFull) -> None:
        self._last = (self._clock().timestamp(), error)

    def recent(self) -> StorageFull | None:
        """The refusal, while it is recent enough to keep this server out of rotation."""
        last = self._last
        if last is None:
            return None
        ago = self._clock().timestamp() - last[0]
        if ago >= self._seconds:
            return None
        return StorageFull(
            f"not ready for writes (one was refused {ago:.0f} s ago; /readyz says ready again "
            f"{self._seconds:.0f} s after the last): {last[1].message}"
        )


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up (no database check: that is /readyz)."""
    return {"status": "ok", "version": broker.__version__}


@router.get("/readyz")
def readyz(request: Request, engine: DbEngine) -> JSONResponse:
    """The database answers, its schema is the one this broker needs, and it has not
    refused a write for a full disk in the last minute (503 until then, code
    ``storage_full``)."""
    try:
        check_schema(engine)
    except Unavailable as exc:
        return error_response(exc)
    refused = request.app.state.disk_full.recent()
    if refused is not None:
        return error_response(refused, status=503)
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
