"""The routes of the reconciled inventory (broker.inventory.reconcile): clusters,
nodes, GPUs and slices as the clusters and the node agents see them, the drift
between the two, the gres.conf that matches a node, and MIG layouts for the queue.
"""

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.api.deps import Adapters, Admin, AppClock, Clock, Db, Instant, RowId, Wake, Who
from broker.api.responses import AUTH, BODY, JSONBytes, errors
from broker.core import clusters
from broker.core.clusters import AdapterPool
from broker.core.errors import InvalidRequest, NotFound
from broker.core.models import Cluster, MigChange, MigChangeEvent, NodeMove, NodeMoveEvent
from broker.core.schemas import Name, NodeName
from broker.fleet import mig_changes as changes
from broker.inventory import occupancy as holders
from broker.inventory import report_store as nodereports
from broker.inventory.events import MAX_EVENTS, fleet_events
from broker.inventory.view import Inventory
from broker.mig import queue as migqueue
from broker.mig.config import GRES_STYLES, render_gres_conf
from broker.scheduling.holdings import held_reservations

router = APIRouter(tags=["inventory"], responses=errors(*AUTH, 403, 404, 422))


def _inventory_of(session: Session, cluster: str | None, adapters: AdapterPool, clock: Clock) -> Inventory:
    with session.begin():
        if cluster is not None and session.get(Cluster, cluster) is None:
            raise NotFound(f"no cluster {cluster!r} is registered (gpush cluster list shows them)")
        infos, reports = nodereports.read_sources(session, cluster)
    inventory = nodereports.reconciled(infos, reports, adapters, now=clock())
    if cluster is not None:
        inventory.only(cluster)
    # MIG changes that ended badly are findings too (a failed one keeps its node fenced).
    with session.begin():
        inventory.add(f for f in changes.change_findings(session, clock()) if cluster is None or f.cluster == cluster)
    return inventory


@router.get("/v1/inventory", response_class=JSONBytes)
def inventory(session: Db, _who: Who, adapters: Adapters, clock: AppClock, cluster: Name | None = None) -> JSONBytes:
    """Clusters, nodes, physical GPUs and their slices from the clusters and the node
    agents, in physical GPU-equivalents; with the drift findings. A node reserved for a
    waiting multi-node job says so (``reserved_for``: the job and when it starts by)."""
    body = _inventory_of(session, cluster, adapters, clock).to_dict()
    with session.begin():
        reserved = {
            (r.cluster, node): {"job_id": r.job_id, "start_by": r.start_by.isoformat()}
            for r in held_reservations(session, cluster).values()
            for node in r.nodes
        }
    for c in body.get("clusters", []):
        for node in c.get("nodes", []):
            node["reserved_for"] = reserved.get((node.get("cluster"), node.get("name")))
    return JSONBytes(body)


@router.get("/v1/inventory/occupancy")
def inventory_occupancy(session: Db, who: Who, cluster: Name | None = None) -> list[dict[str, Any]]:
    """Which job holds which capacity (the placements of the jobs a cluster has), to
    colour the inventory by tenant; a user's token sees other tenants' jobs only as
    taken capacity, without id, name, user or tenant."""
    with session.begin():
        return holders.occupancy(session, who, cluster)


@router.get("/v1/inventory/drift")
def inventory_drift(
    session: Db, _who: Who, adapters: Adapters, clock: AppClock, cluster: Name | None = None
) -> list[dict[str, Any]]:
    """Every disagreement between the clusters and the GPUs, worst first, with its fix;
    MIG layout changes that ended badly in the last day among them."""
    return [f.to_dict() for f in _inventory_of(session, cluster, adapters, clock).findings]


@router.get("/v1/nodes/{node}/gres-conf")
def gres_conf(node: NodeName, session: Db, _who: Who, style: str = "multiple-files") -> dict[str, Any]:
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
    _who: Admin,
    adapters: Adapters,
    clock: AppClock,
    cluster: Name | None = None,
    repartition_busy: bool = False,
    enable_mig: bool = False,
) -> dict[str, Any]:
    """MIG layouts, per GPU, that place the most waiting MIG work (broker.mig.queue). Admins only:
    the plan names every tenant's waiting jobs."""
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


class MigApply(BaseModel):
    """What ``gpush mig apply`` asks for: the plan's changes (of one cluster, one node)."""

    model_config = ConfigDict(extra="forbid")

    cluster: Name | None = None
    node: NodeName | None = None
    dry_run: bool = False
    repartition_busy: bool = False


@router.post("/v1/mig/changes", status_code=201, responses=errors(*BODY))
def mig_apply(
    body: MigApply, session: Db, who: Admin, adapters: Adapters, clock: AppClock, wake: Wake
) -> dict[str, Any]:
    """Change the GPUs the MIG plan re-cuts, one recorded change per GPU (broker.fleet.mig_changes);
    the scheduler moves each through its steps. ``dry_run``: say what would change."""
    with session.begin():
        info = None
        if body.cluster is not None:
            row = session.get(Cluster, body.cluster)
            if row is None:
                raise NotFound(f"no cluster {body.cluster!r} is registered (gpush cluster list shows them)")
            info = clusters.ClusterInfo.of(row)
        infos, reports = nodereports.read_sources(session, body.cluster)
    inventory = nodereports.reconciled(infos, reports, adapters, now=clock())
    cluster_of = {node.name: c.name for c in inventory.clusters for node in c.nodes}
    if body.node is not None and body.node not in cluster_of:
        where = f"cluster {body.cluster}" if body.cluster else "any cluster"
        raise NotFound(f"node {body.node!r} is not in {where}: `gpush inventory` lists the nodes")
    if body.node is not None and body.node not in reports:
        raise NotFound(f"no agent reports node {body.node!r}, so gpush does not know its GPUs: run `gpush agent` on it")
    with session.begin():
        result = migqueue.plan_for(session, reports, inventory, cluster=info, repartition_busy=body.repartition_busy)
        requested = changes.request_changes(
            session,
            result.plan,
            cluster_of,
            lambda name: adapters.get(infos[name]),
            reports,
            by=who.user,
            now=clock(),
            node=body.node,
            dry_run=body.dry_run,
        )
    if any(r.change is not None for r in requested):
        wake.set()
    planned = result.to_dict()
    return {
        "dry_run": body.dry_run,
        "summary": planned["summary"],
        "nodes": planned["nodes"],
        "missing_agents": planned["missing_agents"],
        "gpus": [r.to_dict() for r in requested],
    }


@router.get("/v1/mig/changes")
def mig_changes(
    session: Db, _who: Admin, all: bool = False, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> list[dict[str, Any]]:
    """MIG layout changes, newest first: those under way (``all``: those that ended too), with their steps."""
    with session.begin():
        query = select(MigChange).order_by(MigChange.id.desc()).limit(limit)
        if not all:
            query = query.where(MigChange.ended_at.is_(None))
        rows = list(session.execute(query).scalars())
        events = changes.events_of(session, [c.id for c in rows])
        return [_change(c, events[c.id]) for c in rows]


@router.post("/v1/mig/changes/{change_id}:clear")
def mig_change_clear(
    change_id: RowId, session: Db, who: Admin, adapters: Adapters, clock: AppClock, wake: Wake
) -> dict[str, Any]:
    """An admin's word that a failed change's GPU is fine again: its node takes work again."""
    with session.begin():
        change = session.get(MigChange, change_id)
        if change is None:
            raise NotFound(f"no MIG change {change_id} (gpush mig changes --all lists them)")
        infos = {c.name: clusters.ClusterInfo.of(c) for c in session.scalars(select(Cluster))}

        def adapter_of(name: str):
            if name not in infos:
                raise NotFound(f"cluster {name} is not registered any more")
            return adapters.get(infos[name])

        changes.clear_change(session, change, adapter_of, by=who.user, now=clock())
        result = _change(change, changes.events_of(session, [change_id])[change_id])
    wake.set()
    return result


@router.get("/v1/mig/changes/{change_id}")
def mig_change(change_id: RowId, session: Db, _who: Admin) -> dict[str, Any]:
    """One MIG layout change with every step it went through."""
    with session.begin():
        change = session.get(MigChange, change_id)
        if change is None:
            raise NotFound(f"no MIG change {change_id} (gpush mig changes --all lists them)")
        return _change(change, changes.events_of(session, [change_id])[change_id])


def _change(c: MigChange, events: list[MigChangeEvent]) -> dict[str, Any]:
    return {
        "id": c.id,
        "cluster": c.cluster,
        "node": c.node,
        "gpu": c.gpu,
        "model": c.model,
        "from": c.from_layout,
        "to": c.to_layout,
        "target": c.target,
        "step": c.step,
        "rolling_back": c.rolling_back,
        "changed_by": c.changed_by,
        "reason": c.reason,
        "requested_by": c.requested_by,
        "created_at": c.created_at,
        "deadline": c.deadline,
        "ended_at": c.ended_at,
        "events": [{"at": e.at, "step": e.step, "note": e.note} for e in events],
    }


@router.get("/v1/events")
def events(
    session: Db,
    _who: Admin,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS)] = 50,
    since: Instant | None = None,
    node: NodeName | None = None,
) -> list[dict[str, Any]]:
    """The fleet's events, oldest first: each step of the MIG changes and of the nodes lent
    between clusters (the newest ``limit``; at or after ``since``; of ``node``). Admins only:
    they name every tenant's preempted jobs."""
    if since is not None and since.tzinfo is None:
        raise InvalidRequest("since needs a time zone: 2026-12-06T10:00:00Z")
    with session.begin():
        return [e.to_dict() for e in fleet_events(session, limit=limit, since=since, node=node)]


@router.get("/v1/lending/moves")
def lending_moves(
    session: Db, _who: Admin, all: bool = False, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> list[dict[str, Any]]:
    """Nodes lent between clusters (the policy's lending pools), newest first: the moves under
    way (``all``: those that ended too), each with its steps."""
    with session.begin():
        query = select(NodeMove).order_by(NodeMove.id.desc()).limit(limit)
        if not all:
            query = query.where(NodeMove.ended_at.is_(None))
        moves = list(session.execute(query).scalars())
        events: dict[int, list[NodeMoveEvent]] = {m.id: [] for m in moves}
        if moves:
            rows = session.execute(
                select(NodeMoveEvent).where(NodeMoveEvent.move_id.in_(list(events))).order_by(NodeMoveEvent.id)
            ).scalars()
            for event in rows:
                events[event.move_id].append(event)
        return [
            {
                "id": m.id,
                "node": m.node,
                "source": m.source,
                "target": m.target,
                "step": m.step,
                "reason": m.reason,
                "created_at": m.created_at,
                "ended_at": m.ended_at,
                "events": [{"at": e.at, "step": e.step, "note": e.note} for e in events[m.id]],
            }
            for m in moves
        ]
