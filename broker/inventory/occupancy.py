"""Who holds the capacity the inventory counts as allocated: the placements of the jobs
that a cluster has (submitting, submitted or running), one entry a job and node (a
multi-node job has one on each of its nodes, each holding its share), as the
dashboard colours the units of a node by tenant.

The inventory itself (broker.inventory.view) counts allocated units as the clusters
report them, which includes work gpush did not place; the dashboard fills a node's
allocated units with these entries and shows the rest as work from outside gpush.
A caller who is not an admin sees its own tenant's jobs; another tenant's job is
kept (the capacity is taken) without its id, name, user or tenant.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.auth import Principal
from broker.core.gangs import held_on
from broker.core.models import Job
from broker.core.states import CANCEL_NEEDS_CLUSTER

HOLDING = tuple(sorted(s.value for s in CANCEL_NEEDS_CLUSTER))
OTHER_TENANT = "(another tenant)"


def occupancy(session: Session, principal: Principal, cluster: str | None = None) -> list[dict[str, Any]]:
    """One entry per job that holds capacity: where (cluster, node, sharing, MIG
    profile, GPU indexes when the placement names them), how much (units a replica,
    replicas, GPU-equivalents) and whose, in job id order."""
    query = select(Job.id, Job.name, Job.tenant, Job.user, Job.cluster, Job.placement).where(
        Job.state.in_(HOLDING), Job.placement.is_not(None)
    )
    if cluster is not None:
        query = query.where(Job.cluster == cluster)
    out = []
    for job_id, name, tenant, user, job_cluster, placement in session.execute(query.order_by(Job.id)):
        mine = principal.is_admin or tenant == principal.tenant
        nodes = held_on(placement) or (None,)
        held = placement.get("gpu_equivalents")
        if len(nodes) > 1 and held is not None:  # the gang's figure, the same on each node
            held = float(held) / len(nodes)
        out.extend(
            {
                "job": job_id if mine else None,
                "name": name if mine else None,
                "tenant": tenant if mine else OTHER_TENANT,
                "user": user if mine else None,
                "cluster": job_cluster,
                "node": node,
                "sharing": placement.get("sharing"),
                "mig_profile": placement.get("mig_profile"),
                "gpus": list(placement.get("gpus") or []),
                "units": int(placement.get("units") or 1),
                "replicas": int(placement.get("replicas") or 1),
                "gpu_equivalents": held,
            }
            for node in nodes
        )
    return out
