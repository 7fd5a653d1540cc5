"""The dependencies every route of the broker's REST API is built on.

It owns how a route gets what ``create_app`` set up once per app on ``app.state``
(engine, session factory, clock, adapter pool, token cache, metrics registry), its
database session, and the caller: who they are (``AnyWho``) and what their role lets
them do (``Who``, ``Admin``, ``Agent``), and the ids, versions and times routes take in
their paths and queries, bounded to what their columns and clock hold (``RowId``,
``Version``, ``Instant``).
Routes name these through the ``Annotated`` aliases at the bottom, so no route reads
``app.state`` or a module global itself, and several apps (one per test) live side by
side in one process.
"""

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Path, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from pydantic import AfterValidator
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from broker.api.limits import MAX_AUTHORIZATION_CHARS, HttpLimits
from broker.core import auth
from broker.core.clock import Clock, within_supported_years
from broker.core.clusters import AdapterPool
from broker.core.errors import NotAllowed, Unauthenticated
from broker.core.schemas import MAX_POLICY_VERSION, MAX_ROW_ID, Role
from broker.scheduling.leader import Wakeup

# Dependencies are async so that FastAPI runs them on the event loop: a sync
# dependency costs a hop to the thread pool and back on every request.


async def engine(request: Request) -> Engine:
    return request.app.state.engine


async def clock(request: Request) -> Clock:
    return request.app.state.clock


async def adapters(request: Request) -> AdapterPool:
    return request.app.state.adapters


async def token_cache(request: Request) -> auth.TokenCache:
    return request.app.state.token_cache


async def metrics_registry(request: Request) -> CollectorRegistry:
    return request.app.state.metrics_registry


async def limits(request: Request) -> HttpLimits:
    return request.app.state.limits


async def db(request: Request) -> AsyncIterator[Session]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    with sessions() as session:
        yield session


def _lookup_token(sessions: sessionmaker[Session], token: str | None, cache: auth.TokenCache) -> auth.Principal:
    with sessions() as session:
        return auth.authenticate(session, token, cache)


# The bearer scheme in the OpenAPI document, on every route that takes a token (and on
# no other), so that /docs can authorise. It refuses nothing itself (auto_error off):
# any_principal reads the header, so that a missing, overlong or unknown token is a 401
# in the error envelope with a message that says what to do.
bearer = HTTPBearer(
    scheme_name="bearer",
    bearerFormat="gpush_...",
    description="An API token: an admin creates one with `gpush admin token create` (the secret is shown once).",
    auto_error=False,
)


async def any_principal(
    request: Request, _declared: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]
) -> auth.Principal:
    cache: auth.TokenCache = request.app.state.token_cache
    authorization = request.headers.get("authorization")
    token = None
    if authorization and len(authorization) > MAX_AUTHORIZATION_CHARS:
        # Refused before hashing or looking it up: a long header would cost both.
        raise Unauthenticated(
            f"the Authorization header is too long ({len(authorization)} characters) to hold an API token: "
            "send `Bearer gpush_...` with the token `gpush admin token create` printed"
        )
    if authorization:
        scheme, _, value = authorization.partition(" ")
        token = value.strip() if scheme.lower() == "bearer" else None
    if token and (hit := cache.get(auth.hash_token(token))) is not None:
        return hit
    return await run_in_threadpool(_lookup_token, request.app.state.sessions, token, cache)


async def principal(who: Annotated[auth.Principal, Depends(any_principal)]) -> auth.Principal:
    if who.role == Role.AGENT:
        raise NotAllowed(
            f"{who.user!r} has an agent token, which may only report its node's GPUs (gpush agent); "
            "use a user or admin token for this"
        )
    return who


async def agent(who: Annotated[auth.Principal, Depends(any_principal)]) -> auth.Principal:
    if who.role not in (Role.AGENT, Role.ADMIN):
        raise NotAllowed(
            f"only a node agent may report GPUs; {who.user!r} has role {who.role.value} "
            "(create one with: gpush admin token create --role agent --user <node> --tenant agents)"
        )
    return who


async def admin(who: Annotated[auth.Principal, Depends(principal)]) -> auth.Principal:
    if not who.is_admin:
        raise NotAllowed(f"only an admin may do this; {who.user!r} has role {who.role.value}")
    return who


def wakeup(request: Request) -> Wakeup:
    return request.app.state.wakeup


Db = Annotated[Session, Depends(db)]
AnyWho = Annotated[auth.Principal, Depends(any_principal)]
Who = Annotated[auth.Principal, Depends(principal)]
Admin = Annotated[auth.Principal, Depends(admin)]
Agent = Annotated[auth.Principal, Depends(agent)]
AppClock = Annotated[Clock, Depends(clock)]
Adapters = Annotated[AdapterPool, Depends(adapters)]
DbEngine = Annotated[Engine, Depends(engine)]
CachedTokens = Annotated[auth.TokenCache, Depends(token_cache)]
MetricsRegistry = Annotated[CollectorRegistry, Depends(metrics_registry)]
Limits = Annotated[HttpLimits, Depends(limits)]
Wake = Annotated[Wakeup, Depends(wakeup)]

# Ids are BIGINT columns and policy versions INTEGER ones (32-bit on PostgreSQL): a larger
# number is refused here with a 422, rather than failing in the driver (OverflowError,
# "integer out of range").
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID)]
Version = Annotated[int, Query(ge=1, le=MAX_POLICY_VERSION, description="a stored policy version")]
# A time a user gives (ISO 8601), its UTC within 1970..9999: Python's datetime ends at year
# 9999, and 9999-12-31T23:59:59-14:00 converted to UTC failed as a 500.
Instant = Annotated[datetime, AfterValidator(within_supported_years)]
