"""The scheduling cycle: where each queued job runs, and keeping the queue in step with clusters.

Only the elected leader runs cycles (broker.leader), so two broker processes never
place onto the same free capacity. Model functions below take sessions they open
per step: each step commits its own writes, so a crash between steps loses nothing
(step 1 of the next cycle repairs a crash in the middle of step 7).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine, func, select, update

from broker.adapter import (
    AdapterError,
    BackendState,
    CapacityUnit,
    ClusterAdapter,
    Placement,
    Rejected,
    Sharing,
)
from broker.capacity import CapacityView, Fit, NoFit
from broker.clusters import AdapterPool, ClusterInfo, list_clusters
from broker.db import session_factory
from broker.errors import StateConflict
from broker.models import Job, Tenant
from broker.schemas import JobSpec
from broker.states import JobState, set_state

log = logging.getLogger("gpush.scheduler")
S = JobState
ACTIVE = (S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value, S.RUNNING.value)
ACTOR = "scheduler"


@dataclass
class CycleReport:
    recovered: int = 0
    synced: int = 0
    placed: int = 0
    submitted: int = 0
    held: int = 0
    waiting: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class _Candidate:
    job_id: int
    tenant: str
    priority: int
    created_at: datetime
    spec: JobSpec


class Scheduler:
    """One scheduling cycle of the broker, run by the elected leader.

    Each cycle, in order:

    1. Recover: a job left in ``submitting`` (its broker died between the adapter call
       and the database write) is looked up by its gpush id: ``submitted`` if the
       cluster has it, back to ``queued`` if not. Nothing is lost or doubled.
    2. Sync statuses: each cluster's changes since its cursor move jobs to
       ``running``, ``succeeded``, ``failed`` or ``cancelled``.
    3. Cancel: jobs a user cancelled while a cluster had them are cancelled there.
    4. Capacity: each healthy cluster's inventory, minus the placements it has not
       started yet.
    5. Claim queued jobs in order: priority, then the tenant furthest below its
       weighted fair share (GPU-equivalents across both tiers), then age.
    6. Route each by the active policy (no rule: ``held``), check its tenant's quota
       (over: it waits, saying so), fit it on the routes in order (nothing could ever
       hold it: ``held``; nothing free now: it waits, saying for what), and count it
       against capacity.
    7. Submit: placed jobs go ``routed`` then ``submitting`` (committed before any
       adapter call), the adapter is called, then ``submitted`` with the backend id;
       a refusal fails the job, an unreachable cluster puts it back in the queue.
    """

    def __init__(
        self,
        engine: Engine,
        adapters: AdapterPool,
        *,
        clock: Callable[[], datetime],
        policy_source: Callable[[object], object | None] | None = None,
        claim_limit: int = 1000,
    ):
        self.engine = engine
        self.sessions = session_factory(engine)
        self.adapters = adapters
        self.clock = clock
        self.claim_limit = claim_limit
        self._policy_source = policy_source

    # -- the cycle -----------------------------------------------------------------

    def run_cycle(self) -> CycleReport:
        report = CycleReport()
        with self.sessions() as session:
            clusters = {c.name: c for c in list_clusters(session, enabled_only=True)}
        self.recover(clusters, report)
        self.sync_statuses(clusters, report)
        self.act_on_cancels(clusters, report)
        inventory = self.read_inventory(clusters, report)
        self.place(clusters, inventory, report)
        return report

    def _adapter(self, info: ClusterInfo) -> ClusterAdapter:
        return self.adapters.get(info)

    # 1 ------------------------------------------------------------------------------

    def recover(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> None:
        with self.sessions() as session:
            stuck = session.execute(select(Job.id, Job.cluster).where(Job.state == S.SUBMITTING.value)).all()
        for job_id, cluster in stuck:
            info = clusters.get(cluster or "")
            try:
                found = self._adapter(info).find(job_id) if info else None
            except AdapterError as exc:
                report.errors.append(f"recover job {job_id} on {cluster}: {exc}")
                continue
            with self.sessions() as session, session.begin():
                try:
                    if found is not None:
                        set_state(
                            session,
                            job_id,
                            S.SUBMITTING,
                            S.SUBMITTED,
                            now=self.clock(),
                            actor=ACTOR,
                            reason=f"found on {cluster} as {found.backend_id} after a broker restart",
                        )
                        session.execute(update(Job).where(Job.id == job_id).values(backend_id=found.backend_id))
                    else:
                        set_state(
                            session,
                            job_id,
                            S.SUBMITTING,
                            S.QUEUED,
                            now=self.clock(),
                            actor=ACTOR,
                            reason=f"{cluster or 'its cluster'} has no such job after a broker restart: queued again",
                        )
                        session.execute(
                            update(Job)
                            .where(Job.id == job_id)
                            .values(cluster=None, placement=None, gpu_equivalents=None)
                        )
                    report.recovered += 1
                except StateConflict:
                    pass

    # 2 ------------------------------------------------------------------------------

    def sync_statuses(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> None:
        from broker.models import Cluster

        for name, info in clusters.items():
            with self.sessions() as session:
                cursor = session.get(Cluster, name).status_cursor
            try:
                page = self._adapter(info).statuses(cursor)
            except AdapterError as exc:
                report.errors.append(f"statuses of {name}: {exc}")
                continue
            with self.sessions() as session, session.begin():
                ids = [b.job_id for b in page.jobs]
                rows = (
                    {
                        j.id: j
                        for j in session.execute(select(Job).where(Job.id.in_(ids), Job.cluster == name)).scalars()
                    }
                    if ids
                    else {}
                )
                for backend in page.jobs:
                    job = rows.get(backend.job_id)
                    if job is not None:
                        report.synced += self._apply_status(session, job, backend)
                session.execute(update(Cluster).where(Cluster.name == name).values(status_cursor=page.cursor))

    def _apply_status(self, session, job: Job, backend) -> int:
        now = self.clock()
        state = S(job.state)
        target = {
            BackendState.RUNNING: S.RUNNING,
            BackendState.SUCCEEDED: S.SUCCEEDED,
            BackendState.FAILED: S.FAILED,
            BackendState.CANCELLED: S.CANCELLED,
        }.get(backend.state)
        if backend.state == BackendState.PENDING:
            if state == S.SUBMITTED and backend.reason and backend.reason != job.state_reason:
                session.execute(
                    update(Job).where(Job.id == job.id, Job.state == state.value).values(state_reason=backend.reason)
                )
            return 0
        if target is None or target == state or state not in (S.SUBMITTED, S.RUNNING):
            return 0
        if target == S.CANCELLED:
            reason = (
                "cancelled as requested" if job.cancel_requested_at else (backend.reason or "cancelled on the cluster")
            )
        elif target == S.RUNNING:
            reason = f"running on {job.cluster}" + (f" node {backend.node}" if backend.node else "")
        elif target == S.FAILED:
            reason = backend.reason or f"exited {backend.exit_code}"
        else:
            reason = "completed" + (f" (exit {backend.exit_code})" if backend.exit_code is not None else "")
        try:
            set_state(session, job.id, state, target, reason=reason, now=now, actor=ACTOR)
        except StateConflict:
            return 0
        return 1

    # 3 ------------------------------------------------------------------------------

    def act_on_cancels(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> None:
        with self.sessions() as session:
            wanted = session.execute(
                select(Job.id, Job.cluster).where(
                    Job.cancel_requested_at.is_not(None), Job.state.in_([S.SUBMITTED.value, S.RUNNING.value])
                )
            ).all()
        for job_id, cluster in wanted:
            info = clusters.get(cluster or "")
            if info is None:
                continue
            try:
                self._adapter(info).cancel(job_id)
            except AdapterError as exc:
                report.errors.append(f"cancel job {job_id} on {cluster}: {exc}")

    # 4 ------------------------------------------------------------------------------

    def read_inventory(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> CapacityView:
        inventory: dict[str, list[CapacityUnit]] = {}
        for name, info in clusters.items():
            try:
                inventory[name] = list(self._adapter(info).inventory())
            except AdapterError as exc:
                report.errors.append(f"inventory of {name}: {exc}")
        with self.sessions() as session:
            pending = [
                Placement.from_dict(p)
                for (p,) in session.execute(
                    select(Job.placement).where(
                        Job.state.in_([S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value]),
                        Job.placement.is_not(None),
                    )
                )
            ]
            memory: dict[tuple[str, str], float] = defaultdict(float)
            for (p,) in session.execute(select(Job.placement).where(Job.state.in_(ACTIVE), Job.placement.is_not(None))):
                if p.get("sharing") == Sharing.K8S_TIMESLICE.value and p.get("node") and p.get("gpu_memory_gb"):
                    memory[(p["cluster"], p["node"])] += p["gpu_memory_gb"] * p["units"] * p.get("replicas", 1)
        return CapacityView.build(inventory, pending, memory)

    # 5, 6, 7 -------------------------------------------------------------------------

    def _policy(self, session):
        if self._policy_source is not None:
            return self._policy_source(session)
        from broker.policystore import active_policy

        return active_policy(session)

    def place(self, clusters: dict[str, ClusterInfo], view: CapacityView, report: CycleReport) -> None:
        from broker.policy import evaluate

        with self.sessions() as session:
            policy = self._policy(session)
            candidates = self._claim(session)
            usage, weights, quotas = self._ledger(session)
        active_tenants = set(usage) | {c.tenant for c in candidates}
        weight_sum = sum(weights.get(t, 1.0) for t in active_tenants) or 1.0

        def deficit(tenant: str) -> float:
            # A tenant's weighted share minus its share of what all tenants hold now: the
            # next job goes to whoever is furthest below. Shares of what is in use (not of
            # the whole fleet) make tenants converge to their weights on any contended pool,
            # and a tenant alone may use everything.
            in_use = sum(usage.values()) or 1.0
            return weights.get(tenant, 1.0) / weight_sum - usage.get(tenant, 0.0) / in_use

        by_tenant: dict[str, list[_Candidate]] = defaultdict(list)
        for c in candidates:
            by_tenant[c.tenant].append(c)
        for jobs in by_tenant.values():
            jobs.reverse()  # pop() from the end gives each tenant's jobs in claim order

        def next_tenant() -> str:
            # Every placement changes every tenant's deficit, so pick afresh each time
            # (tenants with queued jobs are few; jobs per cycle are bounded).
            def key(tenant: str) -> tuple:
                head = by_tenant[tenant][-1]
                return (-head.priority, -deficit(tenant), head.created_at, head.job_id)

            return min((t for t, jobs in by_tenant.items() if jobs), key=key)

        placed: list[tuple[_Candidate, Placement]] = []
        held: list[tuple[int, str]] = []
        waiting: list[tuple[int, str]] = []
        ahead: dict[tuple, int] = defaultdict(int)
        for _ in range(len(candidates)):
            tenant = next_tenant()
            job = by_tenant[tenant].pop()
            kind, value = self._decide(job, policy, evaluate, view, usage, quotas, ahead)
            if kind == "placed":
                placed.append((job, value))
                usage[tenant] = usage.get(tenant, 0.0) + value.gpu_equivalents
            elif kind == "held":
                held.append((job.job_id, value))
            else:
                waiting.append((job.job_id, value))

        self._write_decisions(placed, held, waiting, report)
        self._submit(clusters, placed, report)

    def _decide(self, job, policy, evaluate, view, usage, quotas, ahead):
        if policy is None:
            return "held", "held: no routing policy is active (an admin runs `gpush policy apply`)"
        decision = evaluate(policy, job.spec, job.tenant)
        if not decision.routes:
            return "held", f"held: {decision.message}"
        reasons: list[str] = []
        never = True
        waiting_for = None
        for route in decision.routes:
            sharing = Sharing(route.sharing)
            fit = view.fit(job.spec, route.cluster, sharing, partition=getattr(route, "partition", None))
            if isinstance(fit, Fit):
                quota = quotas.get(job.tenant)
                if quota is not None and usage.get(job.tenant, 0.0) + fit.placement.gpu_equivalents > quota + 1e-9:
                    view_undo(view, fit.placement)
                    used = usage.get(job.tenant, 0.0)
                    return "waiting", f"tenant {job.tenant} at quota ({used:g}/{quota:g} GPU)"
                return "placed", fit.placement
            assert isinstance(fit, NoFit)
            reasons.append(fit.reason)
            never = never and fit.never
            if waiting_for is None and not fit.never:
                waiting_for = fit.waiting_for
                first_wait = fit.reason
        if never:
            return "held", "held: can never fit: " + "; ".join(reasons)
        n = ahead[waiting_for]
        ahead[waiting_for] += 1
        reason = first_wait if n == 0 else first_wait.rstrip(")") + f", {n} job{'s' if n > 1 else ''} ahead)"
        return "waiting", reason

    def _claim(self, session) -> list[_Candidate]:
        """Queued jobs, at most ``claim_limit`` per tenant, each tenant's in priority then age order."""
        tenants = [t for (t,) in session.execute(select(Job.tenant).where(Job.state == S.QUEUED.value).distinct())]
        out: list[_Candidate] = []
        for tenant in tenants:
            rows = session.execute(
                select(Job.id, Job.tenant, Job.priority, Job.created_at, Job.spec)
                .where(Job.tenant == tenant, Job.state == S.QUEUED.value)
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
                .limit(self.claim_limit)
            ).all()
            out += [_Candidate(r.id, r.tenant, r.priority, r.created_at, JobSpec.model_validate(r.spec)) for r in rows]
        return out

    def _ledger(self, session) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        usage = {
            t: float(ge or 0)
            for t, ge in session.execute(
                select(Job.tenant, func.sum(Job.gpu_equivalents)).where(Job.state.in_(ACTIVE)).group_by(Job.tenant)
            )
        }
        weights, quotas = {}, {}
        for tenant in session.execute(select(Tenant)).scalars():
            weights[tenant.name] = tenant.weight
            if tenant.gpu_quota is not None:
                quotas[tenant.name] = tenant.gpu_quota
        return usage, weights, quotas

    def _write_decisions(self, placed, held, waiting, report: CycleReport) -> None:
        now = self.clock()
        with self.sessions() as session, session.begin():
            for job, placement in placed:
                try:
                    set_state(
                        session,
                        job.job_id,
                        S.QUEUED,
                        S.ROUTED,
                        now=now,
                        actor=ACTOR,
                        reason=f"placed on {placement.cluster} ({describe(placement)})",
                    )
                except StateConflict:
                    continue  # cancelled meanwhile
                session.execute(
                    update(Job)
                    .where(Job.id == job.job_id)
                    .values(
                        cluster=placement.cluster,
                        placement=placement.to_dict(),
                        gpu_equivalents=placement.gpu_equivalents,
                    )
                )
                set_state(
                    session,
                    job.job_id,
                    S.ROUTED,
                    S.SUBMITTING,
                    now=now,
                    actor=ACTOR,
                    reason=f"submitting to {placement.cluster}",
                )
                report.placed += 1
            for job_id, reason in held:
                try:
                    set_state(session, job_id, S.QUEUED, S.HELD, reason=reason, now=now, actor=ACTOR)
                    report.held += 1
                except StateConflict:
                    pass
            for job_id, reason in waiting:
                session.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.state == S.QUEUED.value)
                    .values(state_reason=reason)
                    .execution_options(synchronize_session=False)
                )
                report.waiting += 1

    def _submit(self, clusters, placed: Iterable[tuple[_Candidate, Placement]], report: CycleReport) -> None:
        results = []
        for job, placement in placed:
            info = clusters[placement.cluster]
            try:
                backend_id = self._adapter(info).submit(job.job_id, job.spec, placement)
                results.append((job.job_id, placement, backend_id, None))
            except Rejected as exc:
                results.append((job.job_id, placement, None, ("failed", str(exc))))
            except AdapterError as exc:
                results.append((job.job_id, placement, None, ("queued", str(exc))))
        now = self.clock()
        with self.sessions() as session, session.begin():
            for job_id, placement, backend_id, error in results:
                try:
                    if error is None:
                        set_state(
                            session,
                            job_id,
                            S.SUBMITTING,
                            S.SUBMITTED,
                            now=now,
                            actor=ACTOR,
                            reason=f"submitted to {placement.cluster} as {backend_id}",
                        )
                        session.execute(update(Job).where(Job.id == job_id).values(backend_id=backend_id))
                        report.submitted += 1
                    elif error[0] == "failed":
                        set_state(
                            session,
                            job_id,
                            S.SUBMITTING,
                            S.FAILED,
                            now=now,
                            actor=ACTOR,
                            reason=f"{placement.cluster} refused the job: {error[1]}",
                        )
                        report.failed += 1
                    else:
                        set_state(
                            session,
                            job_id,
                            S.SUBMITTING,
                            S.QUEUED,
                            now=now,
                            actor=ACTOR,
                            reason=f"{placement.cluster} did not answer ({error[1]}): queued again",
                        )
                        session.execute(
                            update(Job)
                            .where(Job.id == job_id)
                            .values(cluster=None, placement=None, gpu_equivalents=None)
                        )
                except StateConflict:
                    pass


def view_undo(view: CapacityView, placement: Placement) -> None:
    """Give back capacity a fit took (the job could not use it after all)."""
    for slot in view.slots.get(placement.cluster, {}).get(placement.sharing, []):
        if slot.unit.node == placement.node and slot.unit.mig_profile == placement.mig_profile:
            slot.free += placement.units * placement.replicas
            if slot.memory_free_gb is not None and placement.gpu_memory_gb:
                slot.memory_free_gb += placement.gpu_memory_gb * placement.units * placement.replicas
            return


def describe(placement: Placement) -> str:
    """A placement in a user's words: "slurm/mig: 1× MIG 1g.5gb on mig-01"."""
    sharing = placement.sharing
    if sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG):
        what = f"{placement.units}× MIG {placement.mig_profile}"
    elif sharing == Sharing.SLURM_MPS:
        what = f"MPS {placement.units}%"
    elif sharing == Sharing.K8S_TIMESLICE:
        limit = f", {placement.gpu_memory_gb:g} GB limit" if placement.gpu_memory_gb else ""
        what = f"{placement.units} time-slice replica(s){limit}"
    else:
        what = f"{placement.units} whole GPU(s)"
    where = f" on {placement.node}" if placement.node else ""
    reps = f", {placement.replicas} replicas" if placement.replicas > 1 else ""
    return f"{sharing.value}: {what}{where}{reps}"
