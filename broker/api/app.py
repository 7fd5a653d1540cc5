"""The REST API of the broker (FastAPI): ``create_app`` assembles it.

It owns what one app shares across its routes, put on ``app.state`` for the
dependencies of broker.api.deps (engine, session factory, clock, adapter pool, token
cache, metrics registry, HTTP limits), the error handlers of broker.api.responses,
the edge limits of broker.api.limits, and which routers it serves: one module per
resource in broker.api, broker.api.docs (/docs and /redoc with their assets served from
the package, not a CDN) and broker.api.dashboard (the web page at ``/``).

Routes own the transaction: each opens ``with session.begin()`` around the model
functions of ``broker.intake.queue`` and ``broker.core.auth``, which only flush. Errors leave
as ``{"error": {"code", "message", "details"}}`` with the status of their type.
"""

from __future__ import annotations

import sqlalchemy.exc
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Engine
from starlette.exceptions import HTTPException

import broker
from broker.api import (
    admin,
    agent,
    clusters,
    dashboard,
    docs,
    health,
    inventory,
    jobs,
    policy,
    responses,
    tenants,
    usage,
)
from broker.api.limits import EdgeLimits, HttpLimits
from broker.api.metrics import app_registry
from broker.core import auth
from broker.core.clock import Clock, utcnow
from broker.core.clusters import AdapterPool
from broker.core.db import session_factory
from broker.core.errors import GpushError
from broker.scheduling.leader import Wakeup

ROUTERS = (dashboard, health, admin, jobs, clusters, agent, inventory, tenants, policy, usage)


def create_app(
    engine: Engine, *, clock: Clock = utcnow, token_cache_ttl: float = 5.0, limits: HttpLimits | None = None
) -> FastAPI:
    """The broker's ASGI application on ``engine`` (schema must be at head); ``limits``
    default to ``HttpLimits.from_env()``."""
    limits = HttpLimits.from_env() if limits is None else limits
    app = docs.documented_app(
        title="gpush broker",
        version=broker.__version__,
        description="One global queue of GPU jobs above Slurm and Kubernetes.",
    )
    app.state.engine = engine
    app.state.sessions = session_factory(engine)
    app.state.clock = clock
    app.state.token_cache = auth.TokenCache(ttl=token_cache_ttl)
    app.state.wakeup = Wakeup()  # the scheduling loop of this process waits on it (broker.api.server)
    app.state.adapters = AdapterPool(clock, on_change=app.state.wakeup.set)
    app.state.metrics_registry = app_registry(engine)
    app.state.limits = limits
    app.state.disk_full = health.DiskFullMemory(clock)  # written by responses.database_unavailable
    app.add_middleware(EdgeLimits, limits=limits)

    app.add_exception_handler(GpushError, responses.gpush_error)
    app.add_exception_handler(RequestValidationError, responses.validation_error)
    app.add_exception_handler(HTTPException, responses.http_error)
    # Only connection-level errors: a bad statement is a bug and stays a 500.
    app.add_exception_handler(sqlalchemy.exc.OperationalError, responses.database_unavailable)
    app.add_exception_handler(sqlalchemy.exc.InterfaceError, responses.database_unavailable)

    for module in ROUTERS:
        app.include_router(module.router)
    # Every route's methods, the docs' own included, for the Allow header of 405 and OPTIONS
    # (app.routes holds the docs' routes; each included router, its own).
    app.state.route_methods = responses.route_methods(
        [*app.routes, *(route for module in ROUTERS for route in module.router.routes)]
    )
    return app
