"""The routes of clusters: register (the cluster must answer), list with health and
capacity, remove, apply a Kubernetes cluster's GPU time-slicing, and show the limits a
cluster keeps for the tenants' GPU quotas. Admins change clusters; every user may list them.
"""

from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import select

from broker.api.deps import Adapters, Admin, AppClock, Db, Who
from broker.api.responses import AUTH, BODY, errors
from broker.core import clusters
from broker.core.adapter import AdapterError, Rejected, TenantQuotaKeeper, TimesliceConfigurator, capability
from broker.core.errors import Conflict, InvalidRequest, NotFound, Unavailable
from broker.core.models import Cluster, Tenant
from broker.core.schemas import ClusterCreate, Int, Name, label_problem
from broker.intake import queue

router = APIRouter(tags=["clusters"], responses=errors(*AUTH))


class TimesliceRequest(BaseModel):
    replicas: Int = Field(ge=1, le=64, description="time-slices per physical GPU")
    node_label: str | None = Field(None, description="KEY=VALUE: only the nodes with this label")

    @field_validator("node_label")
    @classmethod
    def _label(cls, value: str | None) -> str | None:
        if value is not None:
            key, sep, wanted = value.partition("=")
            if problem := label_problem(key, wanted) if sep and key else "use KEY=VALUE, such as gpu=a100":
                raise ValueError(problem)
        return value


@router.post("/v1/clusters", status_code=201, responses=errors(403, 409, *BODY))
def add_cluster(body: ClusterCreate, session: Db, who: Admin, clock: AppClock, adapters: Adapters) -> dict[str, Any]:
    """Register a cluster; its adapter must accept the config and the cluster must answer."""

    def answers(adapter) -> None:
        health = adapter.health()
        if not health.ok:
            raise InvalidRequest(f"cluster {body.name} does not answer: {health.detail}")

    with session.begin():
        info = clusters.add_cluster(
            session,
            name=body.name,
            kind=body.kind,
            config=body.config,
            actor=who.user,
            now=clock(),
            replace=body.replace,
            check=answers,
        )
        queue.release_held(session, reason=f"cluster {info.name} registered", now=clock())
    return clusters.summarize(info, adapters)


@router.get("/v1/clusters", responses=errors(403))
def list_clusters(session: Db, _who: Who, adapters: Adapters) -> list[dict[str, Any]]:
    """Registered clusters with their health and capacity (GPU-equivalents by sharing mode)."""
    with session.begin():
        infos = clusters.list_clusters(session)
    return [clusters.summarize(info, adapters) for info in infos]


@router.post("/v1/clusters/{name}/timeslice", responses=errors(403, 404, *BODY))
def apply_timeslice(name: Name, body: TimesliceRequest, session: Db, _who: Admin, adapters: Adapters) -> dict[str, Any]:
    """Render and apply a Kubernetes cluster's time-slicing config (the GPU Operator's
    device-plugin ConfigMap and ClusterPolicy patch); returns what changed."""
    with session.begin():
        row = session.get(Cluster, name)
        if row is None:
            raise NotFound(f"no cluster {name}: `gpush cluster list` shows them")
        info = clusters.ClusterInfo.of(row)
    timeslicer = capability(adapters.get(info), TimesliceConfigurator)
    if timeslicer is None:
        raise InvalidRequest(f"cluster {name} is a {info.kind} cluster: time-slicing is configured on Kubernetes")
    plan = timeslicer.timeslice(body.replicas, node_label=body.node_label)
    return {"cluster": name, "changes": timeslicer.apply_timeslice(plan), "rendered": plan.to_yaml()}


@router.get("/v1/clusters/{name}/tenant-quotas", responses=errors(403, 404, 409, 422, 503))
def tenant_quotas(name: Name, session: Db, _who: Admin, adapters: Adapters) -> dict[str, Any]:
    """The cluster's own limits for the tenants' GPU quotas, as YAML for ``kubectl apply -f -``
    (Kubernetes with a namespace per tenant: each tenant's Namespace and ResourceQuota). The
    scheduler applies them itself; this shows what it applies."""
    with session.begin():
        row = session.get(Cluster, name)
        if row is None:
            raise NotFound(f"no cluster {name}: `gpush cluster list` shows them")
        info = clusters.ClusterInfo.of(row)
        quotas = {t.name: t.gpu_quota for t in session.execute(select(Tenant)).scalars() if t.gpu_quota is not None}
    keeper = capability(adapters.get(info), TenantQuotaKeeper)
    if keeper is None:
        raise InvalidRequest(
            f"cluster {name} is a {info.kind} cluster: per-tenant quotas on the cluster's side are Kubernetes "
            "ResourceQuotas (namespace_mode=per-tenant); the broker's ledger holds tenants to their quotas everywhere"
        )
    try:
        plan = keeper.tenant_quotas(quotas)
    except Rejected as exc:
        raise Conflict(f"cluster {name}: {exc}") from None
    except AdapterError as exc:
        raise Unavailable(f"cluster {name} does not answer now: {exc}") from None
    return {"cluster": name, "rendered": plan.to_yaml()}


@router.delete("/v1/clusters/{name}", status_code=204, responses=errors(403, 404, 409, 422))
def remove_cluster(name: Name, session: Db, _who: Admin) -> Response:
    with session.begin():
        clusters.remove_cluster(session, name)
    return Response(status_code=204)
