"""The global queue: submit, read, list and cancel jobs.

Model functions here take a session and only flush; the API route (or the service
loop) that calls them owns the transaction. Visibility rules live here too: a user
sees only its own tenant's jobs, and another tenant's job is "not found", never
"forbidden", so job ids do not leak across tenants.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from broker.auth import Principal
from broker.errors import Conflict, InvalidRequest, NotAllowed, NotFound, StateConflict
from broker.models import Job, JobEvent
from broker.schemas import JobSpec, Kind
from broker.states import CANCEL_NEEDS_CLUSTER, CANCELLABLE_AT_ONCE, TERMINAL, JobState, set_state

MAX_PAGE = 1000


@dataclass
class Submitted:
    """A job as stored, and whether this call created it (False: an idempotent replay)."""

    job: dict[str, Any]
    created: bool


def _owner(spec: JobSpec, principal: Principal) -> tuple[str, str]:
    tenant = spec.tenant or principal.tenant
    user = spec.user or principal.user
    if not principal.is_admin:
        if tenant != principal.tenant:
            raise NotAllowed(
                f"your token belongs to tenant {principal.tenant!r}; only an admin submits for tenant {tenant!r}"
            )
        if user != principal.user:
            raise NotAllowed(f"your token belongs to user {principal.user!r}; only an admin submits as user {user!r}")
    return tenant, user


def job_row(job: Job) -> dict[str, Any]:
    return {c: getattr(job, c) for c in _JOB_FIELDS}


_JOB_FIELDS = (
    "id",
    "name",
    "state",
    "state_reason",
    "tenant",
    "user",
    "kind",
    "isolation",
    "priority",
    "cancel_requested_at",
    "created_at",
    "updated_at",
    "spec",
)


def submit_jobs(session: Session, specs: Sequence[JobSpec], principal: Principal, *, now: datetime) -> list[Submitted]:
    """Put jobs in the queue, all or none; replays of an idempotency key return the stored job.

    Raises :class:`Conflict` if a key was used before with another spec, and
    :class:`InvalidRequest` if one batch uses a key twice for different specs.
    """
    prepared = []
    for index, spec in enumerate(specs):
        tenant, user = _owner(spec, principal)
        body = spec.model_dump(mode="json")
        body["tenant"], body["user"] = tenant, user
        prepared.append((index, spec, tenant, user, body, spec.fingerprint(tenant=tenant, user=user)))

    keyed = [p for p in prepared if p[1].idempotency_key]
    if not keyed:
        return _insert(session, prepared, principal, now)
    try:
        with session.begin_nested():
            return _submit_keyed(session, prepared, keyed, principal, now)
    except IntegrityError:
        # Another request inserted one of our keys between our lookup and our insert:
        # look again; the stored job now answers the replay (or the conflict).
        with session.begin_nested():
            return _submit_keyed(session, prepared, keyed, principal, now)


def _submit_keyed(session, prepared, keyed, principal, now) -> list[Submitted]:
    seen: dict[tuple[str, str], tuple[int, str]] = {}
    for index, spec, tenant, _user, _body, digest in keyed:
        ident = (tenant, spec.idempotency_key)
        if ident in seen and seen[ident][1] != digest:
            raise InvalidRequest(
                f"jobs.{seen[ident][0]} and jobs.{index} of the batch use idempotency key "
                f"{spec.idempotency_key!r} for different specs",
                details=[{"field": f"jobs.{index}.idempotency_key", "value": spec.idempotency_key}],
            )
        seen.setdefault(ident, (index, digest))
    existing: dict[tuple[str, str], Job] = {}
    for tenant in {t for t, _ in seen}:
        keys = [k for t, k in seen if t == tenant]
        for chunk_start in range(0, len(keys), 500):
            rows = session.execute(
                select(Job).where(Job.tenant == tenant, Job.idempotency_key.in_(keys[chunk_start : chunk_start + 500]))
            ).scalars()
            existing.update({(j.tenant, j.idempotency_key): j for j in rows})
    results: dict[int, Submitted] = {}
    fresh = []
    first_of_key: dict[tuple[str, str], int] = {}
    for item in prepared:
        index, spec, tenant, _user, _body, digest = item
        ident = (tenant, spec.idempotency_key) if spec.idempotency_key else None
        if ident and ident in existing:
            job = existing[ident]
            if job.spec_hash != digest:
                raise Conflict(
                    f"idempotency key {spec.idempotency_key!r} was used for job {job.id} with a "
                    "different spec: use a new key for a new job",
                    details=[{"field": "idempotency_key", "value": spec.idempotency_key, "job_id": job.id}],
                )
            results[index] = Submitted(job_row(job), created=False)
        elif ident and ident in first_of_key:
            continue  # the same job twice in one batch: filled in below
        else:
            if ident:
                first_of_key[ident] = index
            fresh.append(item)
    for sub, item in zip(_insert(session, fresh, principal, now), fresh):
        results[item[0]] = sub
    for index, spec, tenant, *_ in prepared:
        if index not in results:
            first = results[first_of_key[(tenant, spec.idempotency_key)]]
            results[index] = Submitted(first.job, created=False)
    return [results[i] for i in range(len(prepared))]


def _insert(session: Session, prepared, principal: Principal, now: datetime) -> list[Submitted]:
    if not prepared:
        return []
    rows = [
        {
            "name": spec.name,
            "tenant": tenant,
            "user": user,
            "kind": spec.kind.value,
            "isolation": spec.isolation.value,
            "priority": spec.priority,
            "state": JobState.QUEUED.value,
            "state_reason": None,
            "spec": body,
            "spec_hash": digest,
            "idempotency_key": spec.idempotency_key,
            "cancel_requested_at": None,
            "created_at": now,
            "updated_at": now,
        }
        for _index, spec, tenant, user, body, digest in prepared
    ]
    ids = session.execute(insert(Job).returning(Job.id, sort_by_parameter_order=True), rows).scalars().all()
    actor = principal.user
    session.execute(
        insert(JobEvent),
        [
            {
                "job_id": job_id,
                "at": now,
                "type": "transition",
                "from_state": None,
                "to_state": JobState.QUEUED.value,
                "reason": "submitted",
                "actor": actor,
            }
            for job_id in ids
        ],
    )
    out = []
    for job_id, row in zip(ids, rows):
        row["id"] = job_id
        out.append(Submitted({c: row[c] for c in _JOB_FIELDS}, created=True))
    return out


def get_job(session: Session, job_id: int, principal: Principal) -> Job:
    job = session.get(Job, job_id)
    if job is None or not principal.can_see_tenant(job.tenant):
        raise NotFound(f"no job {job_id}" + ("" if principal.is_admin else f" in tenant {principal.tenant!r}"))
    return job


def encode_cursor(before_id: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"before": before_id}).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        before = json.loads(raw)["before"]
        if not isinstance(before, int):
            raise ValueError
        return before
    except (ValueError, KeyError, TypeError, binascii.Error, json.JSONDecodeError):
        raise InvalidRequest(
            f"cursor {cursor!r} is not one gpush gave out: pass the next_cursor of the previous page",
            details=[{"field": "cursor", "value": cursor}],
        ) from None


def list_jobs(
    session: Session,
    principal: Principal,
    *,
    states: Iterable[JobState] = (),
    tenant: str | None = None,
    user: str | None = None,
    kind: Kind | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[Job], str | None]:
    """Jobs newest first; ``next_cursor`` is None on the last page."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(
            f"limit {limit} is out of range: use 1 to {MAX_PAGE}", details=[{"field": "limit", "value": limit}]
        )
    query = select(Job)
    if not principal.is_admin:
        if tenant is not None and tenant != principal.tenant:
            return [], None  # another tenant's jobs do not exist for this caller
        tenant = principal.tenant
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    states = [s.value for s in states]
    if states:
        query = query.where(Job.state.in_(states))
    if user is not None:
        query = query.where(Job.user == user)
    if kind is not None:
        query = query.where(Job.kind == kind.value)
    if cursor:
        query = query.where(Job.id < decode_cursor(cursor))
    jobs = list(session.execute(query.order_by(Job.id.desc()).limit(limit + 1)).scalars())
    next_cursor = encode_cursor(jobs[limit - 1].id) if len(jobs) > limit else None
    return jobs[:limit], next_cursor


def job_events(session: Session, job_id: int, principal: Principal) -> list[JobEvent]:
    get_job(session, job_id, principal)
    return list(session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars())


class CancelOutcome(StrEnum):
    CANCELLED = "cancelled"  # ended at once: no cluster had it
    REQUESTED = "cancel_requested"  # intent recorded: the adapter will stop it on the cluster
    ALREADY_REQUESTED = "already_requested"
    ALREADY_FINISHED = "already_finished"


def cancel_job(session: Session, job_id: int, principal: Principal, *, now: datetime) -> tuple[Job, CancelOutcome]:
    """Cancel a job: end it now if no cluster has it, else record the intent.

    Retries when the scheduler moves the job between our read and our write, so a
    cancel is never lost to a race; the state change itself is a compare-and-set.
    """
    actor = principal.user
    for _attempt in range(5):
        job = get_job(session, job_id, principal)
        session.refresh(job)
        state = JobState(job.state)
        try:
            if state in TERMINAL:
                return job, CancelOutcome.ALREADY_FINISHED
            if state in CANCELLABLE_AT_ONCE:
                set_state(
                    session,
                    job_id,
                    state,
                    JobState.CANCELLED,
                    reason=f"cancelled by {actor}",
                    now=now,
                    actor=actor,
                )
                session.refresh(job)
                return job, CancelOutcome.CANCELLED
            assert state in CANCEL_NEEDS_CLUSTER
            if job.cancel_requested_at is not None:
                return job, CancelOutcome.ALREADY_REQUESTED
            result = session.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == state.value, Job.cancel_requested_at.is_(None))
                .values(cancel_requested_at=now, updated_at=now)
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:
                continue
            session.add(
                JobEvent(
                    job_id=job_id,
                    at=now,
                    type="cancel_requested",
                    from_state=state.value,
                    to_state=state.value,
                    actor=actor,
                    reason=f"cancel requested by {actor}; the cluster is asked to stop the job",
                )
            )
            session.flush()
            session.refresh(job)
            return job, CancelOutcome.REQUESTED
        except StateConflict:
            continue
    raise Conflict(f"job {job_id} kept changing state while being cancelled: try again")
