"""API tokens: creation, hashing and lookup.

A token is ``gpush_`` followed by 43 random URL-safe characters. Only its sha256 is
stored: tokens are high-entropy secrets, so a fast hash is enough and lets the
broker find a token by its hash in one indexed lookup.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from broker.core.errors import NotFound, Unauthenticated
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
) -> tuple[ApiToken, str]:
    """Store a new token and return it with its secret (which is not stored)."""
    secret = new_token()
    row = ApiToken(
        token_hash=hash_token(secret),
        prefix=secret[: len(TOKEN_PREFIX) + 6],
        user=user,
        tenant=tenant,
        role=role.value,
        description=description,
        created_at=now,
    )
    session.add(row)
    session.flush()
    return row, secret


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
    principal = Principal(user=row.user, tenant=row.tenant, role=Role(row.role), token_id=row.id)
    if cache is not None:
        cache.put(digest, principal)
    return principal
