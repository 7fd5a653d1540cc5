"""Tenants' fair-share weights and GPU quotas, and what they use now.

Usage counts physical GPU-equivalents of every job a cluster holds or is about to
hold (routed, submitting, submitted, running) across both tiers, in one ledger: a
1g MIG slice of a 7-slice GPU is 1/7, a time-slice replica of a GPU split 4 ways 1/4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.core.errors import InvalidRequest
from broker.core.models import Job, Tenant
from broker.core.schemas import MAX_GPU_QUOTA, MAX_TENANT_WEIGHT
from broker.core.states import JobState

OTHER_TENANTS = "(other tenants)"
HOLDING = (JobState.ROUTED.value, JobState.SUBMITTING.value, JobState.SUBMITTED.value, JobState.RUNNING.value)


@dataclass(frozen=True)
class TenantUsage:
    name: str
    weight: float
    gpu_quota: float | None
    gpu_used: float
    jobs_running: int
    jobs_queued: int


def set_tenant(
    session: Session, name: str, *, weight: float | None, gpu_quota: float | None, clear_quota: bool, now: datetime
) -> Tenant:
    # Checked here too, not only by the API's schema: an infinite weight stored made every
    # share NaN, and the tenant's jobs never went next.
    if weight is not None and not 0 < weight <= MAX_TENANT_WEIGHT:
        raise InvalidRequest(
            f"weight {weight:g} must be more than 0 and at most {MAX_TENANT_WEIGHT:,} (1 is the default share)",
            details=[{"field": "weight", "value": weight if math.isfinite(weight) else str(weight)}],
        )
    if gpu_quota is not None and not 0 <= gpu_quota <= MAX_GPU_QUOTA:
        raise InvalidRequest(
            f"gpu quota {gpu_quota:g} must be 0 to {MAX_GPU_QUOTA:,} GPU-equivalents",
            details=[{"field": "gpu_quota", "value": gpu_quota if math.isfinite(gpu_quota) else str(gpu_quota)}],
        )
    row = session.get(Tenant, name)
    if row is None:
        row = Tenant(name=name, weight=1.0, gpu_quota=None, updated_at=now)
        session.add(row)
    if weight is not None:
        row.weight = weight
    if gpu_quota is not None:
        row.gpu_quota = gpu_quota
    if clear_quota:
        row.gpu_quota = None
    row.updated_at = now
    session.flush()
    return row


def tenant_usage(session: Session) -> list[TenantUsage]:
    used = dict(
        session.execute(
            select(Job.tenant, func.coalesce(func.sum(Job.gpu_equivalents), 0.0))
            .where(Job.state.in_(HOLDING))
            .group_by(Job.tenant)
        ).all()
    )
    counts: dict[tuple[str, str], int] = {
        (t, s): n
        for t, s, n in session.execute(
            select(Job.tenant, Job.state, func.count())
            .where(Job.state.in_([JobState.RUNNING.value, JobState.QUEUED.value]))
            .group_by(Job.tenant, Job.state)
        )
    }
    configured = {t.name: t for t in session.execute(select(Tenant)).scalars()}
    names = sorted(set(configured) | set(used) | {t for t, _ in counts})
    return [
        TenantUsage(
            name=n,
            weight=configured[n].weight if n in configured else 1.0,
            gpu_quota=configured[n].gpu_quota if n in configured else None,
            gpu_used=float(used.get(n, 0.0)),
            jobs_running=counts.get((n, JobState.RUNNING.value), 0),
            jobs_queued=counts.get((n, JobState.QUEUED.value), 0),
        )
        for n in names
    ]


def tenants_as_seen(rows: list[TenantUsage], can_see: Callable[[str], bool]) -> list[dict[str, Any]]:
    """The tenants a caller may see, each with its share of all the weights
    (``fair_share``) and of all the GPU-equivalents held (``gpu_share``), both over every
    tenant; the tenants it may not see are one row, ``(other tenants)`` (``others``:
    their count), so hiding their names changes no number a caller reads."""
    weights = sum(r.weight for r in rows)
    held = sum(r.gpu_used for r in rows)

    def shares(weight: float, used: float) -> dict[str, float]:
        return {"fair_share": weight / weights if weights else 0.0, "gpu_share": used / held if held else 0.0}

    seen = [{**r.__dict__, **shares(r.weight, r.gpu_used), "others": 0} for r in rows if can_see(r.name)]
    hidden = [r for r in rows if not can_see(r.name)]
    if hidden:
        weight = sum(r.weight for r in hidden)
        used = sum(r.gpu_used for r in hidden)
        seen.append(
            {
                "name": OTHER_TENANTS,
                "weight": weight,
                "gpu_quota": None,
                "gpu_used": used,
                "jobs_running": sum(r.jobs_running for r in hidden),
                "jobs_queued": sum(r.jobs_queued for r in hidden),
                **shares(weight, used),
                "others": len(hidden),
            }
        )
    return seen
