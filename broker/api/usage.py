"""The route of accounting (broker.accounting.usage): GPU-hours in physical
GPU-equivalents over a window, grouped as asked. A user's token counts its own
tenant's jobs; an admin's, every tenant's."""

from typing import Annotated, Any

from fastapi import APIRouter, Query

from broker.accounting import usage
from broker.api.deps import AppClock, Db, Instant, Who
from broker.api.responses import AUTH, errors
from broker.core.clock import as_utc
from broker.core.schemas import Name

router = APIRouter(tags=["accounting"], responses=errors(*AUTH))


@router.get("/v1/usage", responses=errors(403, 422))
def gpu_usage(
    session: Db,
    who: Who,
    clock: AppClock,
    since: Annotated[Instant | None, Query(description="start of the window (ISO 8601); default: all time")] = None,
    until: Annotated[Instant | None, Query(description="end of the window (ISO 8601); default: now")] = None,
    by: Annotated[str, Query(max_length=100, description=f"comma-separated: {', '.join(usage.GROUPS)}")] = "tenant",
    tenant: Name | None = None,
) -> dict[str, Any]:
    """GPU-hours per group: a MIG slice counts its fraction of the GPU, an MPS share its
    percentage, a time-sliced job its memory budget's fraction, whole GPUs whole; running
    jobs count up to now (or ``until``)."""
    groups = usage.parse_groups(by)
    end = as_utc(until) if until is not None else clock()
    start = as_utc(since) if since is not None else None
    with session.begin():
        jobs = usage.job_usage(session, who, since=start, until=end, tenant=tenant)
    rows = usage.summarize(jobs, groups)
    return {
        "since": start.isoformat() if start else None,
        "until": end.isoformat(),
        "by": list(groups),
        "rows": rows,
        "total": {
            "gpu_hours": sum(j.gpu_seconds for j in jobs) / 3600,
            "jobs": len(jobs),
            "run_hours": sum(j.run_seconds for j in jobs) / 3600,
        },
    }
