"""What ``GET /metrics`` exports (the database's queue depth, the GPU-equivalent seconds
of the usage ledger, and this process's own metrics), and the same on a port of its own
for a process that runs no API (``gpush scheduler run --metrics-port``)."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from sqlalchemy import Engine

from broker.accounting.metrics import GpuSeconds
from broker.core.metrics import REGISTRY, Forward, QueueDepth


def app_registry(engine: Engine) -> CollectorRegistry:
    """What one app's ``GET /metrics`` exports: its database's queue depth and GPU-equivalent
    seconds, and this process's metrics."""
    registry = CollectorRegistry()
    registry.register(QueueDepth(engine))
    registry.register(GpuSeconds(engine))
    registry.register(Forward(REGISTRY))
    return registry


def serve(engine: Engine, port: int, addr: str = "127.0.0.1") -> tuple[Any, threading.Thread]:
    """Export the same metrics on a port of their own, in a thread, for a process that
    runs no API (``gpush scheduler run``); returns the server (``shutdown()`` stops it).
    Nothing checks a token there: bind it where only Prometheus reaches."""
    return start_http_server(port, addr, registry=app_registry(engine))
