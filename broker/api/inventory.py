"""The routes of the reconciled inventory (broker.inventory.reconcile): clusters,
nodes, GPUs and slices as the clusters and the node agents see them, the drift
between the two, the gres.conf that matches a node, and MIG layouts for the queue.
"""

from typing import Any

from fastapi import APIRouter
from sqlalchemy.orm import Session

from broker.api.deps import Adapters, AppClock, Clock, Db, Who
from broker.api.responses import AUTH, JSONBytes, errors
from broker.core import clusters
from broker.core.clusters import AdapterPool
from broker.core.errors import InvalidRequest, NotFound
from broker.core.models import Cluster
from broker.inventory import occupancy as holders
from broker.inventory import report_store as nodereports
from broker.inventory.view import Inventory
from broker.mig import queue as migqueue
from broker.mig.config import GRES_STYLES, render_gres_conf

router = APIRouter(tags=["inventory"], responses=errors(*AUTH, 403, 404, 422))


def _inventory_of(session: Session, cluster: str | None, adapters: AdapterPool, clock: Clock) -> Inventory:
    with session.begin():
        if cluster is not None and session.get(Cluster, cluster) is None:
            raise NotFound(f"no cluster {cluster!r} is registered (gpush cluster list shows them)")
        infos, reports = nodereports.read_sources(session, cluster)
    return nodereports.reconciled(infos, reports, adapters, now=clock())


@router.get("/v1/inventory", response_class=JSONBytes)
def inventory(session: Db, _who: Who, adapters: Adapters, clock: AppClock, cluster: str | None = None) -> JSONBytes:
    """Clusters, nodes, physical GPUs and their slices from the clusters and the node
    agents, in physical GPU-equivalents; with the drift findings."""
    return JSONBytes(_inventory_of(session, cluster, adapters, clock).to_dict())


@router.get("/v1/inventory/occupancy")
def inventory_occupancy(session: Db, who: Who, cluster: str | None = None) -> list[dict[str, Any]]:
    """Which job holds which capacity (the placements of the jobs a cluster has), to
    colour the inventory by tenant; a user's token sees other tenants' jobs only as
    taken capacity, without id, name, user or tenant."""
    with session.begin():
        return holders.occupancy(session, who, cluster)


@router.get("/v1/inventory/drift")
def inventory_drift(
    session: Db, _who: Who, adapters: Adapters, clock: AppClock, cluster: str | None = None
) -> list[dict[str, Any]]:
    """Every disagreement between the clusters and the GPUs, worst first, with its fix."""
    return [f.to_dict() for f in _inventory_of(session, cluster, adapters, clock).findings]


@router.get("/v1/nodes/{node}/gres-conf")
def gres_conf(node: str, session: Db, _who: Who, style: str = "multiple-files") -> dict[str, Any]:
    """The gres.conf block and slurm.conf Gres= field matching what the node's agent sees."""
    if style not in GRES_STYLES:
        raise InvalidRequest(f"style {style!r} is not one of {', '.join(GRES_STYLES)}")
    with session.begin():
        report = nodereports.load_reports(session).get(node)
    if report is None:
        raise NotFound(
            f"no agent reports node {node!r}, so gpush does not know its GPUs: run `gpush agent` on it "
            "(gpush inventory lists the nodes agents report)"
        )
    conf = render_gres_conf(node, report.gpus, style=style)
    return {"node": node, "text": conf.text, "gres": conf.gres, "lines": list(conf.lines), "style": style}


@router.get("/v1/mig/plan")
def mig_plan(
    session: Db,
    _who: Who,
    adapters: Adapters,
    clock: AppClock,
    cluster: str | None = None,
    repartition_busy: bool = False,
    enable_mig: bool = False,
) -> dict[str, Any]:
    """MIG layouts, per GPU, that place the most waiting MIG work (broker.mig.queue)."""
    with session.begin():
        info = None
        if cluster is not None:
            row = session.get(Cluster, cluster)
            if row is None:
                raise NotFound(f"no cluster {cluster!r} is registered (gpush cluster list shows them)")
            info = clusters.ClusterInfo.of(row)
        infos, reports = nodereports.read_sources(session, cluster)
    inventory = nodereports.reconciled(infos, reports, adapters, now=clock()) if info is not None else None
    with session.begin():
        result = migqueue.plan_for(
            session, reports, inventory, cluster=info, repartition_busy=repartition_busy, enable_mig=enable_mig
        )
    return result.to_dict()
