"""The scheduling cycle: where each queued job runs, and keeping the queue in step with clusters.

Only the elected leader runs cycles (broker.scheduling.leader), so two broker processes never
place onto the same free capacity. Model functions below take sessions they open
per step: each step commits its own writes, so a crash between steps loses nothing
(step 1 of the next cycle repairs a crash in the middle of step 7).

A cycle handles thousands of jobs with a million queued, so it works in bulk: state
changes go through :func:`broker.core.states.set_states` (one compare-and-set statement
per batch of jobs, with their events), and the queue is read in the order it is
decided, per tenant and priority with a LIMIT, so a cycle reads the jobs it decides
and never the whole queue. Work that does not depend on other work runs beside it,
each on a thread and a database connection of its own (see the steps below): the
database's writes then overlap the broker's own deciding. The order that matters is
kept: nothing is decided before the capacity it needs is known, and no adapter call
is made before its job is committed in ``submitting``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from queue import SimpleQueue
from typing import Any

from sqlalchemy import DateTime, Engine, Text, cast, func, literal_column, select, text, type_coerce

from broker.core.adapter import (
    AdapterError,
    BackendState,
    CapacityUnit,
    ClusterAdapter,
    Placement,
    Rejected,
    Sharing,
    submit_each,
)
from broker.core.db import session_factory
from broker.core.metrics import observe_cycle
from broker.core.models import Cluster, Job, Tenant
from broker.core.schemas import JobSpec
from broker.core.states import JobState, set_reasons, set_states
from broker.inventory.report_store import DriftWatch
from broker.placement.capacity import CapacityView
from broker.placement.decision import CycleDecisions, Held, Placed
from broker.placement.fairshare import FairShare
from broker.scheduling.clusters import AdapterPool, ClusterInfo, list_clusters

log = logging.getLogger("gpush.scheduler")
S = JobState
ACTIVE = (S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value, S.RUNNING.value)
ACTOR = "scheduler"
# Ids per IN (...) list when reading jobs by id (SQLite binds each one).
_IDS_PER_QUERY = 1000
# Connections that read tenants' queues side by side at the start of a claim.
_CLAIM_READERS = 2
# A status page with this many jobs changing is written in two halves side by side.
_SYNC_SPLIT = 1000
# Parsed job specs a scheduler keeps (a few MB).
_SPECS_KEPT = 4096
# created_at as the database returns it: the claim only orders by it, so the conversion
# of every row to an aware UTC datetime (models.UTCDateTime) is skipped.
_CREATED_AT = type_coerce(Job.created_at, DateTime(timezone=True))


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
    # Wall seconds each step took (recover, sync, cancel, inventory, claim, decide,
    # write, submit, record), for operators and benchmarks; not the injected clock's
    # time. Steps that run side by side (the claim beside steps 2 to 4, the writing of
    # status changes beside steps 3 to 7, write, submit and record beside decide)
    # overlap, so they add up to more than the cycle.
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timing(self, step: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - begin


@dataclass(slots=True)
class _Candidate:
    job_id: int
    tenant: str
    priority: int
    created_at: datetime
    state_reason: str | None
    document: str  # the stored spec's JSON text, parsed into ``spec`` when the job is decided
    spec_hash: str
    idempotency_key: str | None
    spec: JobSpec | None = None

    @property
    def asked(self) -> JobSpec:  # what the policy's rules match on: the spec itself
        return self.spec


class Scheduler:
    """One scheduling cycle of the broker, run by the elected leader.

    Each cycle, in order:

    1. Recover: a job left in ``submitting`` (its broker died between the adapter call
       and the database write) is looked up by its gpush id: ``submitted`` if the
       cluster has it, back to ``queued`` if not. Nothing is lost or doubled.
    2. Sync statuses: each cluster's changes since its cursor move jobs to
       ``running``, ``succeeded``, ``failed`` or ``cancelled``, each change in the
       order the cluster reported it. The changes are read here and written beside
       steps 3 to 7, which count them as made (the ledger, the capacity and the
       cancels read what the changes touch before they are written); a cluster's
       cursor moves once its changes are in.
    3. Cancel: jobs a user cancelled while a cluster had them are cancelled there.
    4. Capacity: each healthy cluster's inventory, minus the placements it has not
       started yet.
    5. Claim queued jobs in order: priority, then the tenant furthest below its
       weighted fair share (GPU-equivalents across both tiers), then age; at most
       ``claim_limit`` per tenant. Each tenant's jobs are read per priority level as the
       order reaches them, with a LIMIT, so a cycle reads the jobs it decides however
       long the queue is. Steps 2 to 4 never touch queued jobs, so the claim is read
       beside them.
    6. Decide each, in fair-share order, by the one decision the replays also make
       (:class:`broker.placement.decision.CycleDecisions`): routed by the active policy
       (no rule: ``held``), fitted on the routes in order and counted against capacity,
       checked against its tenant's quota (over: it waits, saying so); nothing could
       ever hold it: ``held``; nothing free now: it waits, saying for what.
    7. Submit: placed jobs go ``routed`` then ``submitting`` (committed before any
       adapter call), the adapter is called, then ``submitted`` with the backend id;
       a refusal fails the job, an unreachable cluster puts it back in the queue.
       Placed jobs go through this step in batches while step 6 decides the next ones.
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
        # Units that drift findings break (broker.inventory.report_store): never placed on.
        self.drift = DriftWatch()
        # Parsed specs by their fingerprint (jobs.spec_hash: the spec without its
        # idempotency key). Queues are full of copies of one spec (arrays, sweeps,
        # retries), and validating a stored spec again costs more than deciding it.
        self._specs: dict[str, JobSpec] = {}

    # -- the cycle -----------------------------------------------------------------

    @observe_cycle  # its duration, steps and outcomes to /metrics (broker.core.metrics)
    def run_cycle(self) -> CycleReport:
        report = CycleReport()
        with self.sessions() as session:
            clusters = {c.name: c for c in list_clusters(session, enabled_only=True)}
        with report.timing("recover"):
            self.recover(clusters, report)
        # Steps 2 to 4 never touch queued jobs: the claim (step 5) reads them meanwhile.
        claim = _Claim(self.sessions, self.claim_limit)
        sync: _StatusChanges | None = None
        try:
            with report.timing("sync"):
                sync = self.read_statuses(clusters, report)
            # What steps 3 to 6 read of the jobs the changes touch is read now, before the
            # changes are written, and counted as if they were: then they are written
            # beside those steps.
            with report.timing("inventory"):
                ledger = self.read_ledger(sync)
                booked = self.read_booked_capacity(sync)
            with report.timing("cancel"):
                wanted = self.read_cancel_requests(sync)
            sync.start(self)
            with report.timing("cancel"):
                self.act_on_cancels(clusters, wanted, report)
            with report.timing("inventory"):
                view = self.read_inventory(clusters, report, booked)
        except BaseException:
            claim.wait(report, raise_error=False)
            if sync is not None:
                sync.wait(report, raise_error=False)
            raise
        try:
            claim.wait(report)
            self.place(clusters, view, report, claim=claim, ledger=ledger)
        except BaseException:
            sync.wait(report, raise_error=False)
            raise
        sync.wait(report)
        return report

    def _adapter(self, info: ClusterInfo) -> ClusterAdapter:
        return self.adapters.get(info)

    # 1 ------------------------------------------------------------------------------

    def recover(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> None:
        with self.sessions() as session:
            stuck = session.execute(select(Job.id, Job.cluster).where(Job.state == S.SUBMITTING.value)).all()
        if not stuck:
            return
        found: list[tuple[int, str | None, str]] = []
        gone: list[tuple[int, str | None]] = []
        for job_id, cluster in stuck:
            info = clusters.get(cluster or "")
            try:
                backend = self._adapter(info).find(job_id) if info else None
            except AdapterError as exc:
                report.errors.append(f"recover job {job_id} on {cluster}: {exc}")
                continue
            if backend is not None:
                found.append((job_id, cluster, backend.backend_id))
            else:
                gone.append((job_id, cluster))
        now = self.clock()
        with self.sessions() as session, session.begin():
            moved = set_states(
                session,
                [job_id for job_id, _, _ in found],
                S.SUBMITTING,
                S.SUBMITTED,
                reasons=[
                    f"found on {cluster} as {backend_id} after a broker restart" for _, cluster, backend_id in found
                ],
                now=now,
                actor=ACTOR,
                values={"backend_id": [backend_id for _, _, backend_id in found]},
            )
            requeued = set_states(
                session,
                [job_id for job_id, _ in gone],
                S.SUBMITTING,
                S.QUEUED,
                reasons=[
                    f"{cluster or 'its cluster'} has no such job after a broker restart: queued again"
                    for _, cluster in gone
                ],
                now=now,
                actor=ACTOR,
                values=_unplaced(len(gone)),
            )
            report.recovered += len(moved) + len(requeued)

    # 2 ------------------------------------------------------------------------------

    def read_statuses(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> _StatusChanges:
        """Each cluster's status changes since its cursor, as the transitions they make."""
        changes = _StatusChanges()
        for name, info in clusters.items():
            with self.sessions() as session:
                cursor = session.execute(select(Cluster.status_cursor).where(Cluster.name == name)).scalar_one()
            try:
                page = self._adapter(info).statuses(cursor)
            except AdapterError as exc:
                report.errors.append(f"statuses of {name}: {exc}")
                continue
            chains, pending = self._chains(name, page.jobs) if page.jobs else ({}, {})
            changes.pages.append((name, chains, pending, page.cursor))
            for job_id, chain in chains.items():
                if chain[0][0] == S.SUBMITTED:
                    changes.leaving_submitted.add(job_id)
                if chain[-1][1] in _FINISHED or chain[-1][1] == S.QUEUED:  # it holds nothing any more
                    changes.finishing.add(job_id)
        if changes.finishing:
            with self.sessions() as session:
                changes.finished = {
                    row.id: row for row in _rows_by_id(session, _FINISHED_ROWS, sorted(changes.finishing))
                }
        return changes

    def write_statuses(self, changes: _StatusChanges) -> int:
        """Write the changes; each cluster's cursor moves once its changes are in (a crash in
        between replays the page, and the compare-and-set of each change makes the replay
        a no-op)."""
        synced = 0
        for name, chains, pending, cursor in changes.pages:
            if chains:
                synced += self._apply_chains(chains)
            with self.sessions() as session, session.begin():
                # A reason is only for a job still waiting in the cluster (set_reasons checks the state).
                set_reasons(session, S.SUBMITTED, pending)
                session.execute(Cluster.__table__.update().where(Cluster.name == name).values(status_cursor=cursor))
        return synced

    def _chains(self, cluster: str, changes) -> tuple[dict[int, list[tuple[JobState, JobState, str]]], dict[int, str]]:
        """A cluster's status changes replayed, in order, over its jobs' states: per job, the
        chain of transitions they make; and what jobs still waiting in the cluster wait for."""
        ids = list(dict.fromkeys(b.job_id for b in changes))
        with self.sessions() as session:
            rows = {r.id: r for r in _sync_rows(session, cluster, ids)}
        current = {job_id: S(row.state) for job_id, row in rows.items()}
        chains: dict[int, list[tuple[JobState, JobState, str]]] = defaultdict(list)
        pending: dict[int, str] = {}
        for backend in changes:
            row = rows.get(backend.job_id)
            if row is None:
                continue
            state = current[backend.job_id]
            if backend.state == BackendState.PENDING:
                if state == S.SUBMITTED and backend.reason and backend.reason != row.state_reason:
                    pending[backend.job_id] = backend.reason
                continue
            if backend.state == BackendState.LOST:
                if state == S.SUBMITTED:  # it never started: run it again, wherever it now fits
                    lost = backend.reason or f"{cluster} lost the job before it started"
                    chains[backend.job_id] += [(S.SUBMITTED, S.REQUEUED, lost), (S.REQUEUED, S.QUEUED, "queued again")]
                    current[backend.job_id] = S.QUEUED
                continue
            target = _BACKEND_TARGETS.get(backend.state)
            if target is None or target == state or state not in (S.SUBMITTED, S.RUNNING):
                continue
            chains[backend.job_id].append((state, target, _status_reason(target, cluster, row, backend)))
            current[backend.job_id] = target
        return chains, pending

    def _apply_chains(self, chains: dict[int, list[tuple[JobState, JobState, str]]]) -> int:
        """Apply the chains link by link, in bulk; a page of thousands of changes is split
        in two halves written side by side, each in its own transaction."""
        if len(chains) < _SYNC_SPLIT:
            return self._apply_links(chains)
        ids = sorted(chains)
        halves = [{i: chains[i] for i in ids[: len(ids) // 2]}, {i: chains[i] for i in ids[len(ids) // 2 :]}]
        return sum(_side_by_side(self._apply_links, halves))

    def _apply_links(self, chains: dict[int, list[tuple[JobState, JobState, str]]]) -> int:
        moved = 0
        broken: set[int] = set()  # moved by someone else: the rest of its chain does not apply
        with self.sessions() as session, session.begin():
            for link in range(max((len(c) for c in chains.values()), default=0)):
                by_edge: dict[tuple[JobState, JobState], list[tuple[int, str]]] = defaultdict(list)
                for job_id, chain in chains.items():
                    if link < len(chain) and job_id not in broken:
                        frm, to, reason = chain[link]
                        by_edge[(frm, to)].append((job_id, reason))
                for (frm, to), items in by_edge.items():
                    done = set(
                        set_states(
                            session,
                            [job_id for job_id, _ in items],
                            frm,
                            to,
                            reasons=[reason for _, reason in items],
                            now=self.clock(),
                            actor=ACTOR,
                            # Back in the queue: the placement it had is void.
                            values=_unplaced(len(items)) if to == S.QUEUED else None,
                        )
                    )
                    moved += len(done)
                    broken.update(job_id for job_id, _ in items if job_id not in done)
        return moved

    # 3 ------------------------------------------------------------------------------

    def read_cancel_requests(self, sync: _StatusChanges) -> list[tuple[int, str | None]]:
        """Jobs a user cancelled that a cluster still runs (not those the changes end)."""
        with self.sessions() as session:
            wanted = session.execute(
                select(Job.id, Job.cluster).where(
                    Job.cancel_requested_at.is_not(None), Job.state.in_([S.SUBMITTED.value, S.RUNNING.value])
                )
            ).all()
        return [(job_id, cluster) for job_id, cluster in wanted if job_id not in sync.finishing]

    def act_on_cancels(
        self, clusters: dict[str, ClusterInfo], wanted: list[tuple[int, str | None]], report: CycleReport
    ) -> None:
        for job_id, cluster in wanted:
            info = clusters.get(cluster or "")
            if info is None:
                continue
            try:
                self._adapter(info).cancel(job_id)
            except AdapterError as exc:
                report.errors.append(f"cancel job {job_id} on {cluster}: {exc}")

    # 4 ------------------------------------------------------------------------------

    def read_booked_capacity(self, sync: _StatusChanges) -> _Booked:
        """What the broker holds that clusters' inventories may not show: placements not
        started yet, and GPU memory of time-sliced jobs per node."""
        placement = Job.placement
        with self.sessions() as session:
            # Placements not started: routed and submitting jobs (few), and submitted ones
            # the status changes do not start or end. Most submitted jobs started since the
            # last cycle (the changes say so), so their ids are read first and only the
            # others' placements parsed.
            not_started = [
                job_id
                for job_id in session.execute(
                    select(Job.id).where(
                        Job.state.in_([S.ROUTED.value, S.SUBMITTING.value, S.SUBMITTED.value]),
                        Job.placement.is_not(None),
                    )
                ).scalars()
                if job_id not in sync.leaving_submitted
            ]
            pending = [
                Placement.from_dict(p) for _, p in _rows_by_id(session, select(Job.id, Job.placement), not_started)
            ]
            # GPU memory of time-sliced jobs per node, summed by the database: every
            # running job has a placement, and only these few numbers are needed.
            node = placement["node"].as_string()
            memory_gb = placement["gpu_memory_gb"].as_float()
            timesliced = (
                select(
                    placement["cluster"].as_string().label("cluster"),
                    node.label("node"),
                    (
                        memory_gb * placement["units"].as_float() * func.coalesce(placement["replicas"].as_float(), 1.0)
                    ).label("memory_gb"),
                )
                .where(
                    Job.state.in_(ACTIVE),
                    placement["sharing"].as_string() == Sharing.K8S_TIMESLICE.value,
                    node.is_not(None),
                    node != "",
                    memory_gb.is_not(None),
                    memory_gb != 0,
                )
                .subquery()
            )
            memory = defaultdict(
                float,
                {
                    (cluster, on_node): float(total)
                    for cluster, on_node, total in session.execute(
                        select(timesliced.c.cluster, timesliced.c.node, func.sum(timesliced.c.memory_gb)).group_by(
                            timesliced.c.cluster, timesliced.c.node
                        )
                    )
                },
            )
        for row in sync.finished.values():  # ending: their memory is free
            p = row.placement or {}
            if p.get("sharing") == Sharing.K8S_TIMESLICE.value and p.get("node") and p.get("gpu_memory_gb"):
                memory[(p["cluster"], p["node"])] -= p["gpu_memory_gb"] * p["units"] * (p.get("replicas") or 1)
        return _Booked(pending, dict(memory))

    def read_inventory(
        self, clusters: dict[str, ClusterInfo], report: CycleReport, booked: _Booked | None = None
    ) -> CapacityView:
        """Each cluster's inventory, minus what the broker holds there."""
        if booked is None:
            booked = self.read_booked_capacity(_StatusChanges())
        inventory: dict[str, list[CapacityUnit]] = {}
        unavailable: dict[str, str] = {}
        for name, info in clusters.items():
            try:
                inventory[name] = list(self._adapter(info).inventory())
            except AdapterError as exc:
                report.errors.append(f"inventory of {name}: {exc}")
                unavailable[name] = str(exc)
        if inventory:
            with self.sessions() as session:
                inventory = self.drift.apply(session, inventory, clusters, now=self.clock())
        pending = _beyond_backlog(booked.pending, clusters)
        return CapacityView.build(inventory, pending, booked.memory, unavailable=unavailable)

    # 5, 6, 7 -------------------------------------------------------------------------

    def _policy(self, session):
        if self._policy_source is not None:
            return self._policy_source(session)
        from broker.routing.versions import active_policy

        return active_policy(session)

    def place(
        self,
        clusters: dict[str, ClusterInfo],
        view: CapacityView,
        report: CycleReport,
        *,
        claim: _Claim | None = None,
        ledger: tuple[dict[str, float], dict[str, float], dict[str, float]] | None = None,
    ) -> None:
        if claim is None:
            claim = _Claim(self.sessions, self.claim_limit)
            claim.wait(report)
        usage, weights, quotas = ledger if ledger is not None else self.read_ledger(_StatusChanges())
        with report.timing("claim"), self.sessions() as session:
            policy = self._policy(session)
        decide_begin = time.perf_counter()
        claim_before = report.seconds["claim"]
        # The tenants that share are those holding GPUs and those with jobs queued at the
        # start of the cycle (broker.placement.fairshare has the rule and why).
        fair = FairShare(weights, quotas, usage, waiting=claim.tenants)

        def next_tenant() -> str | None:
            # Every placement changes every tenant's deficit, so pick afresh each time
            # (tenants with queued jobs are few; jobs per cycle are bounded).
            return fair.next_tenant(
                (tenant, queue.buffer[0].priority, (queue.buffer[0].created_at, queue.buffer[0].job_id))
                for tenant, queue in claim.queues.items()
                if queue.buffer
            )

        # Batches of about an eighth of what the cycle may decide: the first is written
        # while the rest is decided, and the last one, which nothing overlaps, stays small.
        batch = min(max(self.claim_limit * len(claim.tenants) // 8, 100), _Submission.BATCH)
        submission = _Submission(self, clusters, batch=batch)
        held: list[tuple[int, str]] = []
        waiting: list[tuple[_Candidate, str]] = []
        decisions = CycleDecisions(policy, view, fair)
        try:
            while (tenant := next_tenant()) is not None:
                job = claim.pop(tenant, report)
                job.spec = self._spec(job)
                outcome = decisions.decide(job)
                if isinstance(outcome, Placed):
                    submission.add(job, outcome.placement)
                elif isinstance(outcome, Held):
                    held.append((job.job_id, outcome.reason))
                else:
                    waiting.append((job, outcome.reason))
        except BaseException:
            submission.close(report, abandon=True)
            raise
        claim_in_loop = report.seconds["claim"] - claim_before
        report.seconds["decide"] = time.perf_counter() - decide_begin - claim_in_loop
        submission.close(report)
        with report.timing("write"):
            self._write_waits(held, waiting, report)

    def _spec(self, job: _Candidate) -> JobSpec:
        spec = self._specs.get(job.spec_hash)
        if spec is None:
            spec = JobSpec.model_validate_json(job.document)
            if len(self._specs) >= _SPECS_KEPT:
                self._specs.clear()
            self._specs[job.spec_hash] = spec
        if spec.idempotency_key != job.idempotency_key:
            spec = spec.model_copy(update={"idempotency_key": job.idempotency_key})
        return spec

    def read_ledger(self, sync: _StatusChanges) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """GPU-equivalents each tenant holds (less what the status changes end), and the
        tenants' weights and quotas."""
        with self.sessions() as session:
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
        for row in sync.finished.values():
            if row.gpu_equivalents and row.tenant in usage:
                usage[row.tenant] = max(usage[row.tenant] - row.gpu_equivalents, 0.0)
        return usage, weights, quotas

    def _write_placed(self, placed, report: CycleReport) -> list[tuple[_Candidate, Placement]]:
        """Commit placed jobs in ``submitting`` (through ``routed``), before any adapter call;
        returns those that moved (a job cancelled meanwhile did not)."""
        with report.timing("write"), self.sessions() as session, session.begin():
            # queued -> routed -> submitting in one write of each row, both events kept.
            moved = set(
                set_states(
                    session,
                    [job.job_id for job, _ in placed],
                    S.QUEUED,
                    S.SUBMITTING,
                    via=[(S.ROUTED, [f"placed on {p.cluster} ({describe(p)})" for _, p in placed])],
                    reasons=[f"submitting to {p.cluster}" for _, p in placed],
                    now=self.clock(),
                    actor=ACTOR,
                    values={
                        "cluster": [p.cluster for _, p in placed],
                        "placement": [p.to_dict() for _, p in placed],
                        "gpu_equivalents": [p.gpu_equivalents for _, p in placed],
                    },
                )
            )
        placed = [(job, p) for job, p in placed if job.job_id in moved]
        report.placed += len(placed)
        return placed

    def _write_waits(self, held, waiting, report: CycleReport) -> None:
        """Record the jobs held, and what the waiting ones wait for."""
        with self.sessions() as session, session.begin():
            report.held += len(
                set_states(
                    session,
                    [job_id for job_id, _ in held],
                    S.QUEUED,
                    S.HELD,
                    reasons=[reason for _, reason in held],
                    now=self.clock(),
                    actor=ACTOR,
                )
            )
            # A waiting job's reason is rewritten only when it changed: on a full fleet
            # the same jobs wait cycle after cycle for the same thing.
            set_reasons(session, S.QUEUED, {j.job_id: r for j, r in waiting if r != j.state_reason})
            report.waiting += len(waiting)

    def _hand_over(self, clusters, placed: Iterable[tuple[_Candidate, Placement]], report: CycleReport) -> _Answers:
        """The adapter calls of step 7, for jobs already committed in ``submitting``: one
        ``submit_many`` per cluster where the adapter has it (broker.core.adapter), else one
        ``submit`` per job."""
        answers = _Answers()
        by_cluster: dict[str, list[tuple[_Candidate, Placement]]] = defaultdict(list)
        for job, placement in placed:
            by_cluster[placement.cluster].append((job, placement))
        with report.timing("submit"):
            for cluster, items in by_cluster.items():
                adapter = self._adapter(clusters[cluster])
                many = getattr(adapter, "submit_many", None)
                if many is not None:
                    results = many([(job.job_id, job.spec, placement) for job, placement in items])
                else:
                    results = submit_each(adapter, [(job.job_id, job.spec, placement) for job, placement in items])
                for (job, placement), result in zip(items, results):
                    if isinstance(result, Rejected):
                        answers.refused.append((job.job_id, placement, str(result)))
                    elif isinstance(result, AdapterError):
                        answers.unanswered.append((job.job_id, placement, str(result)))
                    else:
                        answers.submitted.append((job.job_id, placement, result))
        return answers

    def _record(self, answers: _Answers, report: CycleReport) -> None:
        """What the clusters answered: ``submitted`` with the backend id, ``failed`` when
        refused, back to ``queued`` when a cluster did not answer."""
        submitted, refused, unanswered = answers.submitted, answers.refused, answers.unanswered
        now = self.clock()
        with report.timing("record"), self.sessions() as session, session.begin():

            def move(rows: list[tuple[int, Placement, str]], target: S, reason, values=None) -> int:
                """Move ``rows`` (job id, placement, answer) out of submitting; how many moved."""
                return len(
                    set_states(
                        session,
                        [job_id for job_id, _, _ in rows],
                        S.SUBMITTING,
                        target,
                        reasons=[reason(p, answer) for _, p, answer in rows],
                        now=now,
                        actor=ACTOR,
                        values=values,
                    )
                )

            report.submitted += move(
                submitted,
                S.SUBMITTED,
                lambda p, backend_id: f"submitted to {p.cluster} as {backend_id}",
                {"backend_id": [backend_id for _, _, backend_id in submitted]},
            )
            report.failed += move(refused, S.FAILED, lambda p, error: f"{p.cluster} refused the job: {error}")
            move(
                unanswered,
                S.QUEUED,
                lambda p, error: f"{p.cluster} did not answer ({error}): queued again",
                _unplaced(len(unanswered)),
            )


@dataclass
class _Answers:
    """What clusters said to the jobs handed to them: (job id, placement, backend id or error)."""

    submitted: list[tuple[int, Placement, str]] = field(default_factory=list)
    refused: list[tuple[int, Placement, str]] = field(default_factory=list)
    unanswered: list[tuple[int, Placement, str]] = field(default_factory=list)


@dataclass
class _Booked:
    """What the broker holds on clusters that their inventories may not show yet."""

    pending: list[Placement]  # placements made that clusters have not started yet
    memory: dict[tuple[str, str], float]  # GPU memory of time-sliced jobs per (cluster, node)


@dataclass
class _StatusChanges:
    """Step 2 of a cycle: the clusters' status changes, read, then written on a thread of
    their own beside steps 3 to 7 (which count them as made)."""

    # (cluster, chains of transitions per job, reasons of jobs still waiting there, new cursor)
    pages: list[tuple[str, dict, dict[int, str], str | None]] = field(default_factory=list)
    leaving_submitted: set[int] = field(default_factory=set)  # the cluster started or ended them
    finishing: set[int] = field(default_factory=set)  # their chains end in a final state
    finished: dict[int, Any] = field(default_factory=dict)  # those jobs' tenant, ledger share, placement
    synced: int = 0
    seconds: float = 0.0
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, scheduler: Scheduler) -> None:
        if self.pages:
            self.thread = threading.Thread(target=self._write, args=(scheduler,), name="gpush-sync", daemon=True)
            self.thread.start()

    def _write(self, scheduler: Scheduler) -> None:
        begin = time.perf_counter()
        try:
            self.synced = scheduler.write_statuses(self)
        except BaseException as exc:  # raised again in the cycle's thread, by wait()
            self.error = exc
        self.seconds = time.perf_counter() - begin

    def wait(self, report: CycleReport, *, raise_error: bool = True) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            report.synced += self.synced
            report.seconds["sync"] = report.seconds.get("sync", 0.0) + self.seconds
        if self.error is not None and raise_error:
            error, self.error = self.error, None
            raise error


class _Claim:
    """The queued jobs of one cycle, per tenant, read as the cycle's order reaches them.

    Each tenant's queue is its jobs by priority (highest first), then age, then id, and
    at most ``limit`` of them are claimed a cycle: a tenant whose jobs all wait (at its
    quota, or for a kind of GPU that is full) holds up only its own. The queue is read
    one priority level at a time with the level and the age in the query and a LIMIT of
    what is left of the tenant's claim (``ix_jobs_state_priority_created``, or
    ``ix_jobs_tenant_state`` for tenants with few jobs), so a cycle reads the jobs it
    decides and no others. The first read runs on a thread of its own from creation to
    :meth:`wait`, beside the steps that do not touch queued jobs.
    """

    def __init__(self, sessions, limit: int):
        self.sessions = sessions
        self.limit = limit
        self.tenants: list[str] = []
        self.queues: dict[str, _TenantQueue] = {}
        self._seconds = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="gpush-claim", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        begin = time.perf_counter()
        try:
            with self.sessions() as session:
                self.tenants = list(session.execute(_TENANTS_WITH_QUEUED, {"queued": S.QUEUED.value}).scalars())
                levels = list(session.execute(_PRIORITY_LEVELS, {"queued": S.QUEUED.value}).scalars())
            self.queues = {t: _TenantQueue(t, levels, self.limit) for t in self.tenants}
            # Tenants' first reads side by side, a few connections at a time: each is an
            # index walk of its own, and the cycle needs every tenant's head to begin.
            queues = list(self.queues.values())
            groups = [queues[n::_CLAIM_READERS] for n in range(min(_CLAIM_READERS, len(queues)))]
            _side_by_side(self._fill, groups)
        except BaseException as exc:  # raised again in the cycle's thread, by wait()
            self._error = exc
        self._seconds = time.perf_counter() - begin

    def _fill(self, queues: list[_TenantQueue]) -> None:
        with self.sessions() as session:
            for queue in queues:
                queue.fill(session)

    def wait(self, report: CycleReport, *, raise_error: bool = True) -> None:
        self._thread.join()
        report.seconds["claim"] = report.seconds.get("claim", 0.0) + self._seconds
        self._seconds = 0.0
        if self._error is not None and raise_error:
            error, self._error = self._error, None
            raise error

    def pop(self, tenant: str, report: CycleReport) -> _Candidate:
        """The tenant's next job; the next priority level is read when this was the last
        one read of its level."""
        queue = self.queues[tenant]
        job = queue.buffer.popleft()
        if not queue.buffer and not queue.done:
            with report.timing("claim"), self.sessions() as session:
                queue.fill(session)
        return job


class _Submission:
    """Step 7 for one cycle's placed jobs, beside step 6 (which goes on deciding).

    Placed jobs go in batches, in the order they were placed, through three stages:
    *write* commits a batch in ``submitting``; *submit* then makes the batch's adapter
    calls, batch after batch in placement order and job after job as before, on one
    thread; *record* writes the answers. Writes and records run two batches at a time,
    each on its own connection. It is the protocol of a single job, a batch at a time:
    no adapter call before its job is committed in ``submitting``, and a crash anywhere
    leaves jobs that step 1 of the next cycle repairs. The stages overlap one another
    and the deciding, so the database's writes run beside the broker's own work.
    """

    BATCH = 500  # the most jobs of one batch
    WRITERS = 2

    def __init__(self, scheduler: Scheduler, clusters: dict[str, ClusterInfo], *, batch: int = BATCH):
        self.scheduler = scheduler
        self.clusters = clusters
        self.size = batch
        self.batch: list[tuple[_Candidate, Placement]] = []
        self.submit_report = CycleReport()  # the submit thread's; close() adds it to the cycle's
        self.written: SimpleQueue = SimpleQueue()  # futures of the writes, in placement order
        self.recorded: list[Future] = []
        self.pool: ThreadPoolExecutor | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def add(self, job: _Candidate, placement: Placement) -> None:
        self.batch.append((job, placement))
        if len(self.batch) >= self.size:
            self._send()

    def _send(self) -> None:
        if self.pool is None:
            # Writers and recorders: each a batch's transaction on a connection of its own.
            self.pool = ThreadPoolExecutor(2 * self.WRITERS, thread_name_prefix="gpush-write")
            self.thread = threading.Thread(target=self._submit, name="gpush-submit", daemon=True)
            self.thread.start()
        batch, self.batch = self.batch, []
        self.written.put(self.pool.submit(self._in_report, self.scheduler._write_placed, batch))

    @staticmethod
    def _in_report(work, item) -> tuple[Any, CycleReport]:
        report = CycleReport()
        return work(item, report), report

    def _submit(self) -> None:
        failed = False
        while (future := self.written.get()) is not None:
            try:
                placed, report = future.result()
                self.recorded.append(future)  # its counts are added by close()
                if failed:
                    continue  # a batch failed: the later ones are not handed over (step 1 repairs them)
                answers = self.scheduler._hand_over(self.clusters, placed, self.submit_report)
            except BaseException as exc:  # raised again in the cycle's thread, by close()
                self.error = self.error or exc
                failed = True
                continue
            self.recorded.append(self.pool.submit(self._in_report, self.scheduler._record, answers))

    def close(self, report: CycleReport, *, abandon: bool = False) -> None:
        """Send the last batch (unless ``abandon``), wait for every batch sent to pass the
        three stages, add their counts to ``report``, and raise what failed in a stage."""
        if self.batch and not abandon:
            self._send()
        if self.pool is not None:
            self.written.put(None)
            self.thread.join()
            for future in self.recorded:
                try:
                    _add_counts(report, future.result()[1])
                except BaseException as exc:
                    self.error = self.error or exc
            self.pool.shutdown()
        _add_counts(report, self.submit_report)
        if self.error is not None and not abandon:
            raise self.error


def _add_counts(report: CycleReport, other: CycleReport) -> None:
    report.placed += other.placed
    report.submitted += other.submitted
    report.failed += other.failed
    for step, seconds in other.seconds.items():
        report.seconds[step] = report.seconds.get(step, 0.0) + seconds


class _TenantQueue:
    """One tenant's part of a claim: its jobs read so far, and where to read on."""

    __slots__ = ("tenant", "levels", "level", "left", "buffer", "done")

    def __init__(self, tenant: str, levels: list[int], limit: int):
        self.tenant = tenant
        self.levels = levels
        self.level = 0  # index into levels
        self.left = limit  # of the tenant's claim this cycle
        self.buffer: deque[_Candidate] = deque()
        self.done = not levels or limit <= 0

    def fill(self, session) -> None:
        """Read the tenant's jobs of its next priority level that has any, up to what is
        left of its claim (nothing when it is done)."""
        while not self.buffer and not self.done:
            rows = session.execute(
                select(
                    Job.id,
                    Job.priority,
                    _CREATED_AT,
                    Job.state_reason,
                    cast(Job.spec, Text),
                    Job.spec_hash,
                    Job.idempotency_key,
                )
                .where(Job.tenant == self.tenant, _IS_QUEUED, Job.priority == self.levels[self.level])
                .order_by(Job.created_at, Job.id)
                .limit(self.left)
            ).all()
            self.buffer.extend(_Candidate(r[0], self.tenant, r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows)
            self.left -= len(rows)
            self.level += 1
            self.done = self.left <= 0 or self.level >= len(self.levels)


# A literal, not a bound parameter: the planner can then use the partial index of queued
# jobs (ix_jobs_queued_claim, migration 0003) whatever plan a prepared statement gets.
_IS_QUEUED = Job.state == literal_column(f"'{S.QUEUED.value}'")

# Loose index scans: each step of the recursion is one probe of an index, so finding
# the few tenants and priority levels of a queue of a million jobs reads a few entries
# per tenant or level, not the queue. Every tenant that has jobs is visited (the index
# on (tenant, ...) has no state first), and each asked whether it has a queued one.
_TENANTS_WITH_QUEUED = text(
    """WITH RECURSIVE tenants(name) AS (
        SELECT (SELECT tenant FROM jobs ORDER BY tenant LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant FROM jobs j WHERE j.tenant > tenants.name ORDER BY j.tenant LIMIT 1)
        FROM tenants WHERE tenants.name IS NOT NULL
    )
    SELECT name FROM tenants
    WHERE name IS NOT NULL AND EXISTS (SELECT 1 FROM jobs q WHERE q.tenant = tenants.name AND q.state = :queued)"""
)
_PRIORITY_LEVELS = text(
    """WITH RECURSIVE levels(priority) AS (
        SELECT (SELECT priority FROM jobs WHERE state = :queued ORDER BY priority DESC LIMIT 1)
        UNION ALL
        SELECT (
            SELECT j.priority FROM jobs j WHERE j.state = :queued AND j.priority < levels.priority
            ORDER BY j.priority DESC LIMIT 1
        )
        FROM levels WHERE levels.priority IS NOT NULL
    )
    SELECT priority FROM levels WHERE priority IS NOT NULL"""
)

_BACKEND_TARGETS = {
    BackendState.RUNNING: S.RUNNING,
    BackendState.SUCCEEDED: S.SUCCEEDED,
    BackendState.FAILED: S.FAILED,
    BackendState.CANCELLED: S.CANCELLED,
}


def _beyond_backlog(pending: list[Placement], clusters: dict[str, ClusterInfo]) -> list[Placement]:
    """The placements not started yet that count against free capacity: all of them, but
    for a cluster whose config allows a backlog (``backlog_jobs``, a Slurm setting), whose
    first that many may wait in the cluster's own queue instead. Slurm starts jobs faster
    with a queue to choose from (400 small jobs: 12.2 s with all queued, 14.1 s with 100 at a
    time); the price is that those jobs are committed to that cluster before they fit."""
    allowance = {name: int(info.config.get("backlog_jobs") or 0) for name, info in clusters.items()}
    if not any(allowance.values()):
        return pending
    out = []
    for placement in pending:
        if allowance.get(placement.cluster, 0) > 0:
            allowance[placement.cluster] -= 1
            continue
        out.append(placement)
    return out


def _status_reason(target: JobState, cluster: str, row, backend) -> str:
    if target == S.CANCELLED:
        return "cancelled as requested" if row.cancel_requested else (backend.reason or "cancelled on the cluster")
    if target == S.RUNNING:
        return f"running on {cluster}" + (f" node {backend.node}" if backend.node else "")
    if target == S.FAILED:
        return backend.reason or f"exited {backend.exit_code}"
    return "completed" + (f" (exit {backend.exit_code})" if backend.exit_code is not None else "")


def _sync_rows(session, cluster: str, ids: list[int]):
    """State, reason and cancel intent of the jobs ``ids`` that ``cluster`` has. PostgreSQL
    gets the ids as one array joined to the jobs by primary key; SQLite binds them, a
    thousand at a time."""
    if session.get_bind().dialect.name == "postgresql":
        return session.execute(_SYNC_ROWS_POSTGRESQL, {"ids": "{" + ",".join(map(str, ids)) + "}", "cluster": cluster})
    query = select(
        Job.id, Job.state, Job.state_reason, Job.cancel_requested_at.is_not(None).label("cancel_requested")
    ).where(Job.cluster == cluster)
    return _rows_by_id(session, query, ids)


def _rows_by_id(session, query, ids: list[int]):
    """Rows of ``query`` for the jobs ``ids``, a thousand ids at a time."""
    rows = []
    for start in range(0, len(ids), _IDS_PER_QUERY):
        rows += session.execute(query.where(Job.id.in_(ids[start : start + _IDS_PER_QUERY]))).all()
    return rows


_FINISHED_ROWS = select(Job.id, Job.tenant, Job.gpu_equivalents, Job.placement)
_FINISHED = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})

_SYNC_ROWS_POSTGRESQL = text(
    """SELECT jobs.id, jobs.state, jobs.state_reason, jobs.cancel_requested_at IS NOT NULL AS cancel_requested
    FROM jobs JOIN unnest(CAST(:ids AS bigint[])) AS wanted(id) ON jobs.id = wanted.id
    WHERE jobs.cluster = :cluster"""
)


def _side_by_side(work: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``work`` on each item, each on a thread of its own (so on a connection of its own);
    results in order; the first error is raised after all are done."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            results[n] = work(items[n])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _unplaced(n: int) -> dict[str, list[None]]:
    """set_states values that take a job's placement away (it goes back to the queue)."""
    return {"cluster": [None] * n, "placement": [None] * n, "gpu_equivalents": [None] * n}


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
