"""``gpush mig plan``: the waiting jobs that want MIG slices, and the layout that places them.

Waiting work is of two sorts:

- jobs still in gpush's queue (queued, held) whose policy route — the first matching
  rule's, or a fallback — is a MIG mode (slurm/mig, k8s/mig) on the cluster asked
  about: each wants ``gpus`` slices per replica (the elastic minimum for elastic
  jobs) of a profile that covers its ``gpu_memory_gb``, of the route's GPU model if
  it names one;
- jobs the broker placed on a MIG slice that the cluster has not started yet (routed,
  submitting, submitted): their profile is known.

The GPUs come from the node agents' reports (broker.inventory.report_store) of the cluster's
nodes, or of every reported node without ``cluster``; the instances placed jobs hold are
busy (a multi-node job's on each of its nodes), and the GPUs of a node a multi-node job
keeps (reserved for a waiting gang, or running a rank of one: broker.core.gangs) keep
their layout. Planning itself is broker.mig.plan; rendering broker.mig.config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.adapter import Placement, Sharing
from broker.core.clusters import ClusterInfo
from broker.core.gangs import held_on, kept_for_gangs
from broker.core.models import Job
from broker.core.schemas import JobSpec
from broker.core.states import JobState as S
from broker.inventory.agent_report import NodeReport
from broker.inventory.view import Inventory
from broker.mig.config import render_mig_parted, render_planned_gres, render_summary
from broker.mig.matching import SliceDemand
from broker.mig.plan import MigPlan, gpus_from_reports, keep_nodes, mark_held, plan_mig
from broker.routing import versions as policystore
from broker.routing.policy import evaluate

MIG_SHARING = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
_WAITING = (S.QUEUED.value, S.HELD.value)
_PLACED_NOT_STARTED = (S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value)


def mig_demand(session: Session, cluster: str | None = None, *, limit: int = 100_000) -> list[SliceDemand]:
    """One demand per slice the waiting jobs want (oldest, most urgent first)."""
    demand: list[SliceDemand] = []
    policy = policystore.active_policy(session)
    rows = session.execute(
        select(Job.id, Job.tenant, Job.spec, Job.state, Job.placement)
        .where(Job.state.in_(_WAITING + _PLACED_NOT_STARTED))
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
        .limit(limit)
    )
    for job_id, tenant, spec_doc, state, placement_doc in rows:
        if state in _PLACED_NOT_STARTED:
            if not placement_doc:
                continue
            placement = Placement.from_dict(placement_doc)
            if placement.sharing not in MIG_SHARING or not placement.mig_profile:
                continue
            if cluster is not None and placement.cluster != cluster:
                continue
            models = (placement.gpu_model,) if placement.gpu_model else ()
            demand += [
                SliceDemand(f"{job_id}", profile=placement.mig_profile, models=models)
                for _ in range(placement.units * placement.replicas)
            ]
            continue
        if policy is None:
            continue
        spec = JobSpec.model_validate(spec_doc)
        route = next(
            (
                r
                for r in evaluate(policy, spec, tenant).routes
                if r.sharing in MIG_SHARING and (cluster is None or r.cluster == cluster)
            ),
            None,
        )
        if route is None or spec.gpu_memory_gb is None:
            continue
        replicas = spec.elastic.min_replicas if spec.elastic is not None else 1
        models = (route.gpu_model,) if route.gpu_model else ()
        demand += [
            SliceDemand(f"{job_id}", memory_gb=spec.gpu_memory_gb, models=models)
            for _ in range(spec.gpus * max(replicas, 1))
        ]
    return demand


def held_instances(session: Session, nodes: list[str]) -> dict[tuple[str, str], int]:
    """MIG instances the scheduler's placed jobs hold on ``nodes``, per (node, profile): an
    agent sees only processes, and a job between its start and its first CUDA call has none."""
    held: dict[tuple[str, str], int] = {}
    if not nodes:
        return held
    wanted = set(nodes)
    # Running jobs only: those placed and not started yet count as waiting demand (mig_demand).
    rows = session.execute(select(Job.placement).where(Job.state == S.RUNNING.value))
    for (placement,) in rows:
        if not placement or not placement.get("mig_profile"):
            continue
        for node in wanted.intersection(held_on(placement)):  # a multi-node job's on each node
            key = (node, placement["mig_profile"])
            held[key] = held.get(key, 0) + int(placement.get("units") or 1) * int(placement.get("replicas") or 1)
    return held


@dataclass(frozen=True)
class PlanResult:
    plan: MigPlan
    nodes: list[str]  # the nodes whose GPUs were planned
    missing_agents: list[str]  # the cluster's nodes no agent reports (their GPUs are not planned)

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "nodes": self.nodes,
            "missing_agents": self.missing_agents,
            "waiting_slices": plan.waiting,
            "today": {"jobs": plan.today.jobs, "gpu_equivalents": round(plan.today.gpu_equivalents, 3)},
            "planned": {"jobs": plan.planned.jobs, "gpu_equivalents": round(plan.planned.gpu_equivalents, 3)},
            "gpus_changed": len(plan.changed),
            "drain_first": list(plan.nodes_to_drain),
            "gpus": [
                {
                    "node": g.node,
                    "index": g.index,
                    "model": g.model.name,
                    "action": g.action,
                    "reason": g.reason,
                    "today": [s.profile for s in g.today],
                    "planned": [s.profile for s in g.planned],
                }
                for g in plan.gpus
            ],
            "unplaced": [{"job": u.job, "wants": u.wants, "reason": u.reason} for u in plan.unplaced],
            "summary": render_summary(plan),
            "mig_parted": render_mig_parted(plan),
            "gres_conf": {node: _planned_gres(plan, node) for node in self.nodes},
        }


def _planned_gres(plan: MigPlan, node: str) -> str | None:
    try:
        return render_planned_gres(plan, node).text
    except ValueError:  # no GPU of the node is in the plan
        return None


def plan_for(
    session: Session,
    reports: Mapping[str, NodeReport],
    inventory: Inventory | None,
    *,
    cluster: ClusterInfo | None = None,
    repartition_busy: bool = False,
    enable_mig: bool = False,
) -> PlanResult:
    """The plan for ``cluster``'s reported GPUs (every reported node without one)."""
    if cluster is not None and inventory is not None:
        listed = sorted({n.name for c in inventory.clusters if c.name == cluster.name for n in c.nodes})
    else:
        listed = sorted(reports)
    nodes = [n for n in listed if n in reports]
    gpus = mark_held(gpus_from_reports(reports[n] for n in nodes), held_instances(session, nodes))
    # Nodes a multi-node job keeps (reserved for a waiting gang, or running a rank of one) keep their layout.
    kept = {node: why for (on, node), why in kept_for_gangs(session).items() if cluster is None or on == cluster.name}
    gpus = keep_nodes(gpus, kept)
    demand = mig_demand(session, cluster.name if cluster is not None else None)
    plan = plan_mig(gpus, demand, repartition_busy=repartition_busy, enable_mig=enable_mig)
    return PlanResult(plan, nodes, [n for n in listed if n not in reports])
