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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from broker.core import job_shape
from broker.core.auth import Principal
from broker.core.errors import Conflict, InvalidRequest, NotAllowed, NotFound, StateConflict
from broker.core.models import Job, JobEvent
from broker.core.schemas import JobSpec, Kind
from broker.core.states import CANCEL_NEEDS_CLUSTER, CANCELLABLE_AT_ONCE, TERMINAL, JobState, set_state
from broker.intake import jobstore

MAX_PAGE = 1000


@dataclass
class Submitted:
    """A job as stored, and whether this call created it (False: an idempotent replay)."""

    job: dict[str, Any]
    created: bool


@dataclass(slots=True)
class _Pending:
    index: int
    key: str | None
    digest: str
    row: dict[str, Any]


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
    "cluster",
    "placement",
    "backend_id",
    "gpu_equivalents",
)


# Ids per IN (...) list (SQLite binds each one).
_IDS_PER_QUERY = 1000


def job_row(job: Job) -> dict[str, Any]:
    return _with_shape({c: getattr(job, c) for c in _JOB_FIELDS})


def _stored(row: dict[str, Any], job_id: int) -> dict[str, Any]:
    """What job_row() would read back for a row just written with this id."""
    return _with_shape({c: job_id if c == "id" else row[c] for c in _JOB_FIELDS})


def _with_shape(row: dict[str, Any]) -> dict[str, Any]:
    """The row with what the job asked in words and a gang's nodes and ranks (JobOut's
    ``gpu_request`` and ``gang``), as every reader of the API shows them."""
    row["gpu_request"] = job_shape.gpu_request(row["spec"], row["placement"])
    row["gang"] = job_shape.gang(row["spec"], row["placement"])
    return row


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


def _prepare(index: int, spec: JobSpec, principal: Principal, now: datetime) -> _Pending:
    tenant, user = _owner(spec, principal)
    body = spec.model_dump(mode="json")
    body["tenant"], body["user"] = tenant, user
    row = {
        "name": spec.name,
        "tenant": tenant,
        "user": user,
        "kind": body["kind"],
        "isolation": body["isolation"],
        "priority": spec.priority,
        "state": JobState.QUEUED.value,
        "state_reason": None,
        "spec": body,
        "spec_hash": spec_fingerprint(body),
        "idempotency_key": spec.idempotency_key,
        "cancel_requested_at": None,
        "created_at": now,
        "updated_at": now,
        "cluster": None,
        "placement": None,
        "backend_id": None,
        "gpu_equivalents": None,
    }
    return _Pending(index, spec.idempotency_key, row["spec_hash"], row)


def submit_jobs(session: Session, specs: Sequence[JobSpec], principal: Principal, *, now: datetime) -> list[Submitted]:
    """Put jobs in the queue, all or none; a replayed idempotency key returns the stored job.

    Raises :class:`Conflict` if a key was used before with another spec, and
    :class:`InvalidRequest` if one batch uses a key twice for different specs.
    Keys are unique per tenant; the database's unique index is the arbiter when
    two requests race with one key. Inserts are optimistic: keys are looked up
    only when the index refuses one, which is the rare case of a retry.
    """
    pending = [_prepare(i, spec, principal, now) for i, spec in enumerate(specs)]
    unique, first_of = _dedupe(pending)
    if len(unique) == 1:
        results = {unique[0].index: _submit_one(session, unique[0])}
    elif not any(p.key for p in unique):
        ids = jobstore.insert_many(session, [p.row for p in unique])
        results = {p.index: Submitted(_stored(p.row, i), created=True) for p, i in zip(unique, ids, strict=True)}
    else:
        results = _submit_keyed(session, unique)
    return [
        results[p.index] if p.index in results else Submitted(results[first_of[p.index]].job, created=False)
        for p in pending
    ]


def spec_fingerprint(body: dict[str, Any]) -> str:
    """sha256 of a resolved spec body without its idempotency key (see JobSpec.fingerprint)."""
    return JobSpec.fingerprint_of(body)


def _dedupe(pending: list[_Pending]) -> tuple[list[_Pending], dict[int, int]]:
    """The jobs to insert, and for a job repeated in one batch (same key), its first copy."""
    seen: dict[tuple[str, str], _Pending] = {}
    unique: list[_Pending] = []
    first_of: dict[int, int] = {}
    for p in pending:
        if not p.key:
            unique.append(p)
            continue
        first = seen.setdefault((p.row["tenant"], p.key), p)
        if first is p:
            unique.append(p)
        elif first.digest != p.digest:
            raise InvalidRequest(
                f"jobs.{first.index} and jobs.{p.index} of the batch use idempotency key {p.key!r} for different specs",
                details=[{"field": f"jobs.{p.index}.idempotency_key", "value": p.key}],
            )
        else:
            first_of[p.index] = first.index
    return unique, first_of


def _replay(job: Job, p: _Pending) -> Submitted:
    if job.spec_hash != p.digest:
        raise Conflict(
            f"idempotency key {p.key!r} was used for job {job.id} with a different spec: use a new key for a new job",
            details=[{"field": "idempotency_key", "value": p.key, "job_id": job.id}],
        )
    return Submitted(job_row(job), created=False)


def _submit_one(session: Session, p: _Pending) -> Submitted:
    job_id = jobstore.insert_one(session, p.row)
    if job_id is not None:
        return Submitted(_stored(p.row, job_id), created=True)
    existing = _existing(session, [(p.row["tenant"], p.key)])
    return _replay(existing[(p.row["tenant"], p.key)], p)


def _existing(session: Session, idents: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Job]:
    by_tenant: dict[str, list[str]] = {}
    for tenant, key in set(idents):
        by_tenant.setdefault(tenant, []).append(key)
    found: dict[tuple[str, str], Job] = {}
    for tenant, keys in by_tenant.items():
        for start in range(0, len(keys), 500):
            rows = session.execute(
                select(Job).where(Job.tenant == tenant, Job.idempotency_key.in_(keys[start : start + 500]))
            ).scalars()
            found.update({(j.tenant, j.idempotency_key): j for j in rows})
    return found


def _submit_keyed(session: Session, unique: list[_Pending]) -> dict[int, Submitted]:
    for attempt in range(3):
        try:
            with session.begin_nested():
                if attempt == 0:  # optimistic: no replays in the batch
                    existing: dict[tuple[str, str], Job] = {}
                else:
                    existing = _existing(session, [(p.row["tenant"], p.key) for p in unique if p.key])
                results = {
                    p.index: _replay(existing[(p.row["tenant"], p.key)], p)
                    for p in unique
                    if p.key and (p.row["tenant"], p.key) in existing
                }
                fresh = [p for p in unique if p.index not in results]
                ids = jobstore.insert_many(session, [p.row for p in fresh])
                results.update(
                    {p.index: Submitted(_stored(p.row, i), created=True) for p, i in zip(fresh, ids, strict=True)}
                )
                return results
        except jobstore.KeyTaken:
            # A key of the batch is taken (a replay), or was taken by a request racing
            # this one since we looked: look (again) and let the stored jobs answer.
            continue
    raise Conflict("the batch's idempotency keys kept being taken by concurrent requests: retry the batch")


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
        # A bool is an int to Python; past 2**63 no id exists (and the driver would overflow).
        if not isinstance(before, int) or isinstance(before, bool) or not 0 < before < 2**63:
            raise ValueError
        return before
    except (ValueError, KeyError, TypeError, binascii.Error, json.JSONDecodeError):
        raise InvalidRequest(
            f"cursor {cursor!r} is not one gpush gave out: pass the next_cursor of the previous page",
            details=[{"field": "cursor", "value": cursor}],
        ) from None


def job_filters(
    principal: Principal,
    *,
    tenant: str | None,
    user: str | None,
    kind: Kind | None,
    cluster: str | None,
    labels: Mapping[str, str] | None,
) -> list[Any] | None:
    """The WHERE clauses of a job query in the caller's scope: a user's token sees its
    own tenant only. None: the filters name another tenant, nothing there exists for it."""
    if not principal.is_admin:
        if tenant is not None and tenant != principal.tenant:
            return None  # another tenant's jobs do not exist for this caller
        tenant = principal.tenant
    where: list[Any] = []
    if tenant is not None:
        where.append(Job.tenant == tenant)
    if user is not None:
        where.append(Job.user == user)
    if kind is not None:
        where.append(Job.kind == kind.value)
    if cluster is not None:
        where.append(Job.cluster == cluster)
    for key, value in (labels or {}).items():
        where.append(Job.spec["labels"][key].as_string() == value)
    return where


def list_jobs(
    session: Session,
    principal: Principal,
    *,
    states: Iterable[JobState] = (),
    tenant: str | None = None,
    user: str | None = None,
    kind: Kind | None = None,
    cluster: str | None = None,
    labels: Mapping[str, str] | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[Job], str | None]:
    """Jobs newest first; ``next_cursor`` is None on the last page. ``labels``: only jobs
    that carry every one of these labels (how Ray's node provider finds its workers);
    ``cluster``: only jobs placed on that cluster."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(
            f"limit {limit} is out of range: use 1 to {MAX_PAGE}", details=[{"field": "limit", "value": limit}]
        )
    where = job_filters(principal, tenant=tenant, user=user, kind=kind, cluster=cluster, labels=labels)
    if where is None:
        return [], None
    # The page's ids first, from the indexes alone, then their rows: ordering the rows
    # themselves by id would sort every matching row (the dashboard's active jobs among
    # 100,000: 250 ms on SQLite, against 25 ms for the ids).
    ids = select(Job.id).where(*where)
    states = [s.value for s in states]
    if states:
        ids = ids.where(Job.state.in_(states))
    if cursor:
        ids = ids.where(Job.id < decode_cursor(cursor))
    ids = ids.order_by(Job.id.desc()).limit(limit + 1)
    jobs = list(session.execute(select(Job).where(Job.id.in_(ids.scalar_subquery())).order_by(Job.id.desc())).scalars())
    next_cursor = encode_cursor(jobs[limit - 1].id) if len(jobs) > limit else None
    return jobs[:limit], next_cursor


def count_jobs(
    session: Session,
    principal: Principal,
    *,
    tenant: str | None = None,
    user: str | None = None,
    kind: Kind | None = None,
    cluster: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """How many jobs are in each state, in the caller's scope and under the same
    filters as :func:`list_jobs` (states with none are left out)."""
    where = job_filters(principal, tenant=tenant, user=user, kind=kind, cluster=cluster, labels=labels)
    if where is None:
        return {}
    rows = session.execute(select(Job.state, func.count()).where(*where).group_by(Job.state))
    return {state: count for state, count in rows}


def job_events(session: Session, job_id: int, principal: Principal) -> list[JobEvent]:
    """The job's history, oldest first, starting with its submission.

    The submission is read off the job's row (it is not stored twice), as event 0.
    """
    job = get_job(session, job_id, principal)
    submitted = JobEvent(
        id=0,
        job_id=job.id,
        at=job.created_at,
        type="transition",
        from_state=None,
        to_state=JobState.QUEUED.value,
        reason="submitted",
        actor=job.user,
    )
    stored = session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars()
    return [submitted, *stored]


class CancelOutcome(StrEnum):
    CANCELLED = "cancelled"  # ended at once: no cluster had it
    REQUESTED = "cancel_requested"  # intent recorded: the adapter will stop it on the cluster
    ALREADY_REQUESTED = "already_requested"
    ALREADY_FINISHED = "already_finished"


MAX_CHECKPOINT_NOTE = 200


def record_checkpoint(
    session: Session, job_id: int, principal: Principal, *, now: datetime, note: str | None = None
) -> JobEvent:
    """A running job says it saved its state (``checkpoint`` event): preemption counts the
    work it would lose from the last one (broker.placement.preemption), not from its start."""
    job = get_job(session, job_id, principal)
    if job.state != JobState.RUNNING.value:
        raise StateConflict(job_id, expected=JobState.RUNNING.value, actual=job.state)
    event = JobEvent(
        job_id=job_id,
        at=now,
        type="checkpoint",
        from_state=JobState.RUNNING.value,
        to_state=JobState.RUNNING.value,
        reason=f"checkpoint: {note}" if note else "checkpoint",
        actor=principal.user,
    )
    session.add(event)
    session.flush()
    return event


def last_events(
    session: Session, job_ids: Iterable[int], type_: str, to_state: str | None = None
) -> dict[int, datetime]:
    """When each of these jobs last had an event of ``type_`` (``checkpoint``; a
    ``transition`` to ``to_state``); jobs that never had one are left out."""
    ids = list(job_ids)
    out: dict[int, datetime] = {}
    for start in range(0, len(ids), _IDS_PER_QUERY):
        query = (
            select(JobEvent.job_id, func.max(JobEvent.at))
            .where(JobEvent.job_id.in_(ids[start : start + _IDS_PER_QUERY]), JobEvent.type == type_)
            .group_by(JobEvent.job_id)
        )
        if to_state is not None:
            query = query.where(JobEvent.to_state == to_state)
        out.update({job_id: at for job_id, at in session.execute(query)})
    return out


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


def release_held(session: Session, *, reason: str, now: datetime) -> int:
    """Put held jobs back in the queue when what held them may have gone (a new policy, a
    new cluster): the next cycle routes them again, and holds them again if nothing changed."""
    held = session.execute(select(Job.id).where(Job.state == JobState.HELD.value)).scalars().all()
    moved = 0
    for job_id in held:
        try:
            set_state(session, job_id, JobState.HELD, JobState.QUEUED, reason=reason, now=now, actor="broker")
            moved += 1
        except StateConflict:
            pass
    return moved
