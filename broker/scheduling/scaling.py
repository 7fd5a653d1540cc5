"""Scaling an elastic job's replicas while it runs: `gpush scale ID N` and its API.

What callers may assume:

- **Within the job's range.** ``N`` must lie in the job's ``elastic`` range
  (``min_replicas`` .. ``max_replicas``); a job without one cannot be scaled.
- **Only a job a cluster holds.** A queued job starts with ``min_replicas``; scaling
  is for jobs in ``submitted`` or ``running`` whose cluster's adapter declares the
  :class:`~broker.core.adapter.Scaler` capability (the Kubernetes adapter patches the
  Deployment's scale subresource). Others are refused with what to do instead.
- **Under the tenant's quota.** Growing charges the extra replicas' physical
  GPU-equivalents to the tenant's ledger first: a tenant that would go over its GPU
  quota is refused with the same words the scheduler uses ("tenant vision at quota
  (16/16 GPU)"); shrinking is always allowed.
- **One ledger.** The job's placement (``replicas``) and ``gpu_equivalents`` change
  with the cluster's answer in one transaction, with an event in the job's history,
  so fair share and quotas count the new size from the next cycle on. If the cluster
  refuses or does not answer, nothing in the database changes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from broker.accounting import equivalents
from broker.core.adapter import AdapterError, ClusterAdapter, Placement, Rejected, Scaler, capability
from broker.core.auth import Principal
from broker.core.errors import Conflict, InvalidRequest, Unavailable
from broker.core.models import Job, JobEvent, Tenant
from broker.core.schemas import JobSpec
from broker.core.states import JobState
from broker.intake.queue import get_job
from broker.placement.fairshare import FairShare
from broker.placement.tenants import tenant_usage

SCALABLE_STATES = (JobState.SUBMITTED, JobState.RUNNING)


def scale_job(
    session: Session,
    job_id: int,
    replicas: int,
    principal: Principal,
    *,
    now: datetime,
    adapter_for: Callable[[str], ClusterAdapter],
) -> Job:
    """Scale job ``job_id`` to ``replicas`` (see the module docstring)."""
    job = get_job(session, job_id, principal)
    spec = JobSpec.model_validate(job.spec)
    if spec.elastic is None:
        raise InvalidRequest(
            f"job {job_id} is not elastic: only jobs submitted with elastic min_replicas/max_replicas scale"
        )
    low, high = max(spec.elastic.min_replicas, 1), spec.elastic.max_replicas
    if not low <= replicas <= high:
        raise InvalidRequest(
            f"job {job_id} scales between {low} and {high} replicas (its elastic range); {replicas} is outside it",
            details=[{"field": "replicas", "value": replicas}],
        )
    state = JobState(job.state)
    if state not in SCALABLE_STATES or not job.placement or not job.cluster:
        raise Conflict(
            f"job {job_id} is {state.value}: a job scales once a cluster holds it (submitted or running); "
            f"it starts with {low} replica{'s' if low > 1 else ''}"
        )
    placement = Placement.from_dict(job.placement)
    if replicas == placement.replicas:
        return job
    scaler = capability(adapter_for(job.cluster), Scaler)
    if scaler is None:
        raise InvalidRequest(
            f"cluster {job.cluster} cannot change a running job's replicas; cancel and resubmit with the size you want"
        )
    per_replica = equivalents.per_replica(job.placement)
    grown = per_replica * (replicas - placement.replicas)
    if grown > 0:
        _check_quota(session, job.tenant, grown)
    try:
        scaler.scale(job_id, replicas)
    except Rejected as exc:
        raise InvalidRequest(f"{job.cluster} refused to scale job {job_id}: {exc}") from None
    except AdapterError as exc:
        raise Unavailable(f"{job.cluster} did not answer ({exc}): job {job_id} keeps {placement.replicas}") from None
    old = placement.replicas
    # The cluster places the new replicas itself: the devices of the old ones no longer say where.
    new_placement = Placement.from_dict(
        {**placement.to_dict(), "replicas": replicas, "gpu_equivalents": per_replica * replicas, "gpus": []}
    )
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == job.state)
        .values(placement=new_placement.to_dict(), gpu_equivalents=per_replica * replicas, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        raise Conflict(f"job {job_id} changed state while being scaled: look at `gpush status {job_id}`")
    session.add(
        JobEvent(
            job_id=job_id,
            at=now,
            type="scaled",
            from_state=job.state,
            to_state=job.state,
            actor=principal.user,
            reason=f"scaled from {old} to {replicas} replicas by {principal.user}",
        )
    )
    session.flush()
    session.refresh(job)
    return job


def _check_quota(session: Session, tenant: str, grown: float) -> None:
    row = session.get(Tenant, tenant)
    if row is None or row.gpu_quota is None:
        return
    used = next((u.gpu_used for u in tenant_usage(session) if u.name == tenant), 0.0)
    why = FairShare({}, {tenant: row.gpu_quota}, {tenant: used}).over_quota(tenant, grown)
    if why:
        raise Conflict(f"{why}: {grown:g} more GPU-equivalents would pass it; scale less, or ask for more quota")
