"""The routes of tenants: an admin sets a tenant's fair-share weight and GPU quota;
a user lists the tenants they may see, with what each holds now.
"""

from typing import Any

from fastapi import APIRouter

from broker.api.deps import Admin, AppClock, Db, Who
from broker.api.responses import AUTH, BODY, errors
from broker.core.schemas import Principal, TenantSet
from broker.placement import tenants

router = APIRouter(tags=["tenants"], responses=errors(*AUTH))


@router.put("/v1/tenants/{name}", responses=errors(403, *BODY))
def set_tenant(name: Principal, body: TenantSet, session: Db, _who: Admin, clock: AppClock) -> dict[str, Any]:
    """Set a tenant's fair-share weight and GPU quota (physical GPU-equivalents)."""
    with session.begin():
        tenants.set_tenant(
            session,
            name,
            weight=body.weight,
            gpu_quota=body.gpu_quota,
            clear_quota=body.clear_quota,
            now=clock(),
        )
        usage = {u.name: u for u in tenants.tenant_usage(session)}
    return usage[name].__dict__


@router.get("/v1/tenants", responses=errors(403))
def list_tenants(session: Db, who: Who) -> list[dict[str, Any]]:
    """Tenants with weight, quota and the GPU-equivalents they hold now, each with its
    share of the weights and of the GPU-equivalents held, over every tenant; a user's
    token sees its own tenant by name and the others as one row, ``(other tenants)``."""
    with session.begin():
        rows = tenants.tenant_usage(session)
    return tenants.tenants_as_seen(rows, who.can_see_tenant)
