"""Routing policy versions in the database: validate, apply, roll back, read.

Versions are immutable (text as the admin wrote it, author, time, comment); one is
active. Applying is a compare-and-set on the active version: an admin applies on top
of the version they reviewed, and if another admin applied first, the second is
told so instead of silently winning. A refused policy leaves the active one in place.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from broker.core.clusters import AdapterPool, list_clusters
from broker.core.errors import Conflict, InvalidRequest, NotFound
from broker.core.models import ActivePolicy, PolicyVersion
from broker.routing import policy as policies

ViewSource = Callable[[], Mapping[str, "policies.ClusterView"]]


@dataclass(frozen=True)
class VersionInfo:
    version: int
    author: str
    comment: str
    created_at: datetime
    active: bool

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "created_at": self.created_at.isoformat()}


# Keyed by the text as well as the number: one process may serve several databases
# (tests, a re-created database) whose version 1 are different policies.
_cache: dict[tuple[int, str], policies.Policy] = {}
_cache_lock = threading.Lock()


def parsed(version: int, text: str) -> policies.Policy:
    with _cache_lock:
        key = (version, text)
        if key not in _cache:
            if len(_cache) >= 64:
                _cache.clear()
            _cache[key] = policies.load_policy(text, f"policy version {version}")
        return _cache[key]


def active_version(session: Session) -> int | None:
    row = session.get(ActivePolicy, 1)
    return row.version if row else None


def active_policy(session: Session) -> policies.Policy | None:
    """The active policy, parsed once per version and process."""
    row = session.execute(
        select(PolicyVersion.version, PolicyVersion.text).join(
            ActivePolicy, ActivePolicy.version == PolicyVersion.version
        )
    ).first()
    return parsed(row.version, row.text) if row else None


def get_version(session: Session, version: int | None = None) -> tuple[PolicyVersion, bool]:
    """A stored version (the active one when ``version`` is None) and whether it is active."""
    active = active_version(session)
    wanted = active if version is None else version
    if wanted is None:
        raise NotFound("no routing policy has been applied yet: `gpush policy apply policies/default.yaml -m ...`")
    row = session.get(PolicyVersion, wanted)
    if row is None:
        raise NotFound(f"no policy version {wanted}: `gpush policy history` lists them")
    return row, wanted == active


def history(session: Session) -> list[VersionInfo]:
    active = active_version(session)
    rows = session.execute(select(PolicyVersion).order_by(PolicyVersion.version.desc())).scalars()
    return [VersionInfo(r.version, r.author, r.comment, r.created_at, r.version == active) for r in rows]


def check(text: str, views: Mapping[str, policies.ClusterView], *, source: str = "policy") -> Any:
    """Parse and validate; raises InvalidRequest (with line and column) on schema errors,
    returns the validation report (errors refuse, warnings inform)."""
    parsed = policies.load_policy(text, source)
    return parsed, policies.validate(parsed, views)


def apply(
    session: Session,
    text: str,
    *,
    comment: str,
    author: str,
    now: datetime,
    views: Mapping[str, policies.ClusterView],
    base_version: int | None,
    source: str = "policy",
) -> tuple[VersionInfo, Any]:
    """Validate and activate a new version on top of ``base_version`` (the version the admin
    reviewed; None means "whatever is active", for scripts that own the policy)."""
    if not comment.strip():
        raise InvalidRequest("say why with -m: the comment is the policy's history")
    _parsed_policy, report = check(text, views, source=source)
    if not report.ok:
        raise InvalidRequest(
            f"{source} is refused, the active policy stays:\n{report.describe()}",
            details=[getattr(f, "to_dict", lambda f=f: {"message": str(f)})() for f in report.errors],
        )
    current = active_version(session)
    if current is not None:
        active = session.get(PolicyVersion, current)
        if active.text == text:  # re-applying the active text changes nothing: no new version
            return VersionInfo(current, active.author, active.comment, active.created_at, True), report
    if base_version is not None and base_version != current:
        raise Conflict(
            f"the active policy is version {current}, not {base_version}: another admin applied meanwhile. "
            f"Review `gpush policy diff {base_version} {current}` and apply again"
        )
    version = (session.execute(select(func.max(PolicyVersion.version))).scalar() or 0) + 1
    try:
        with session.begin_nested():
            session.add(PolicyVersion(version=version, text=text, author=author, comment=comment, created_at=now))
            session.flush()
    except IntegrityError:
        raise Conflict("another admin applied a policy at the same moment: look at `gpush policy history`") from None
    if current is None:
        session.add(ActivePolicy(id=1, version=version, activated_by=author, activated_at=now))
        try:
            session.flush()
        except IntegrityError:
            raise Conflict("another admin applied the first policy at the same moment: try again") from None
    else:
        moved = session.execute(
            update(ActivePolicy)
            .where(ActivePolicy.id == 1, ActivePolicy.version == current)
            .values(version=version, activated_by=author, activated_at=now)
        ).rowcount
        if moved != 1:
            raise Conflict("another admin applied a policy at the same moment: look at `gpush policy history`")
    from broker.intake.queue import release_held

    release_held(session, reason=f"routing policy version {version} applied", now=now)
    return VersionInfo(version, author, comment, now, True), report


def rollback(
    session: Session,
    version: int,
    *,
    comment: str,
    author: str,
    now: datetime,
    views: Mapping[str, policies.ClusterView],
) -> tuple[VersionInfo, Any]:
    """Make an old version's text active again, as a new version (history only grows)."""
    row, _ = get_version(session, version)
    note = f"rollback to version {version}" + (f": {comment}" if comment.strip() else "")
    return apply(
        session,
        row.text,
        comment=note,
        author=author,
        now=now,
        views=views,
        base_version=None,
        source=f"policy version {version}",
    )


def diff(session: Session, a: int, b: int) -> str:
    old, _ = get_version(session, a)
    new, _ = get_version(session, b)
    return _unified(old.text, new.text, f"version {a}", f"version {b}") or f"versions {a} and {b} are the same\n"


def diff_with_active(session: Session, text: str) -> str:
    """What applying ``text`` would change in the active version ("" when it is the same)."""
    version = active_version(session)
    if version is None:
        return _unified("", text, "no policy", "new policy")
    old, _ = get_version(session, version)
    return _unified(old.text, text, f"version {version} (active)", "new policy")


def _unified(old: str, new: str, old_name: str, new_name: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), fromfile=old_name, tofile=new_name
    )
    return "".join(lines)


def cluster_views(session: Session, pool: AdapterPool) -> dict[str, Any]:
    """Every registered cluster's view for policy validation (broker.routing.policy.cluster_view),
    from its adapter's inventory; a cluster that does not answer has an unknown inventory
    (None), not an empty one, so checks that need it become warnings."""
    views = {}
    for info in list_clusters(session):
        try:
            units = pool.get(info).inventory()
        except Exception:  # unreachable, whatever the adapter raised: unknown, not empty
            units = None
        views[info.name] = policies.cluster_view(info.name, info.kind, units)
    return views
