"""API tokens: creation, hashing and lookup.

A token is ``gpush_`` followed by 43 random URL-safe characters. Only its sha256 is
stored: tokens are high-entropy secrets, so a fast hash is enough and lets the
broker find a token by its hash in one indexed lookup.

An agent token lives on every GPU node it serves, so it is bound to the node names (or
globs, ``gpu-*``) it may report for: one taken from a node cannot rewrite what the
broker believes about the rest of the fleet (:func:`check_may_report`). A new agent
token must name its nodes (``['*']`` says any node, on purpose); agent tokens from
before the binding (no nodes stored) report for any node, as they always did.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from fnmatch import fnmatchcase

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from broker.core.errors import InvalidRequest, NotAllowed, NotFound, Unauthenticated
from broker.core.models import ApiToken
from broker.core.schemas import Role

TOKEN_PREFIX = "gpush_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the user, the tenant whose jobs they see, and their role."""

    user: str
    tenant: str
    role: Role
    token_id: int | None = None
    # An agent token's node names or globs; None: any node (see the module docstring).
    nodes: tuple[str, ...] | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == Role.ADMIN

    def can_see_tenant(self, tenant: str) -> bool:
        return self.is_admin or tenant == self.tenant


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def create_token(
    session: Session,
    *,
    user: str,
    tenant: str,
    role: Role,
    description: str | None,
    now: datetime,
    nodes: Sequence[str] | None = None,
) -> tuple[ApiToken, str]:
    """Store a new token and return it with its secret (which is not stored); an agent
    token with the nodes it may report for, which it must name."""
    if role == Role.AGENT and not nodes:
        raise InvalidRequest(
            "an agent token needs the nodes it may report for: give their names or globs "
            "(gpush admin token create --role agent --nodes gpu-01,gpu-*), or '*' for any node",
            details=[{"field": "nodes", "value": None}],
        )
    if role != Role.AGENT and nodes is not None:
        raise InvalidRequest(
            f"only agent tokens are bound to nodes; a {role.value} token is not: drop nodes, or use role agent",
            details=[{"field": "nodes", "value": list(nodes)}],
        )
    secret = new_token()
    row = ApiToken(
        token_hash=hash_token(secret),
        prefix=secret[: len(TOKEN_PREFIX) + 6],
        user=user,
        tenant=tenant,
        role=role.value,
        description=description,
        created_at=now,
        nodes=list(dict.fromkeys(nodes)) if nodes is not None else None,
    )
    session.add(row)
    session.flush()
    return row, secret


def check_may_report(who: Principal, node: str) -> None:
    """Raise :class:`NotAllowed` unless ``who`` may post the GPU report of ``node``."""
    if who.nodes is None or any(fnmatchcase(node, pattern) for pattern in who.nodes):
        return
    raise NotAllowed(
        f"the agent token of {who.user!r} may report for {', '.join(who.nodes)}, not for node {node!r}: "
        "run the agent with --node set to one of those, or have an admin create a token for this node "
        f"(gpush admin token create --role agent --nodes {node} ...)"
    )


def revoke_token(session: Session, token_id: int, *, now: datetime) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"no API token with id {token_id}: `gpush admin token list` shows them")
    if row.revoked_at is None:
        session.execute(update(ApiToken).where(ApiToken.id == token_id).values(revoked_at=now))
        row.revoked_at = now
    return row


class TokenCache:
    """Remembers recent token lookups for ``ttl`` seconds, to keep auth off the hot path.

    A revoked token therefore keeps working for at most ``ttl`` seconds on each
    broker process that saw it recently.
    """

    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000):
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, digest: str) -> Principal | None:
        entry = self._entries.get(digest)
        if entry and entry[0] > time.monotonic():
            return entry[1]
        return None

    def put(self, digest: str, principal: Principal) -> None:
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[digest] = (time.monotonic() + self.ttl, principal)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def authenticate(session: Session, token: str | None, cache: TokenCache | None = None) -> Principal:
    if not token:
        raise Unauthenticated(
            "this endpoint needs an API token: pass --token or set GPUSH_TOKEN "
            "(an admin creates one with `gpush admin token create`)"
        )
    digest = hash_token(token)
    if cache is not None and (hit := cache.get(digest)) is not None:
        return hit
    row = session.execute(
        select(ApiToken).where(ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None))
    ).scalar_one_or_none()
    if row is None:
        raise Unauthenticated("the API token is unknown or revoked: ask an admin for a new one")
    nodes = tuple(row.nodes) if row.nodes is not None else None
    principal = Principal(user=row.user, tenant=row.tenant, role=Role(row.role), token_id=row.id, nodes=nodes)
    if cache is not None:
        cache.put(digest, principal)
    return principal
