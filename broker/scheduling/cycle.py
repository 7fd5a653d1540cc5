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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, select

from broker.core.adapter import (
    AdapterError,
    CapacityUnit,
    ClusterAdapter,
    TenantQuotaKeeper,
    capability,
)
from broker.core.clock import Clock
from broker.core.clusters import AdapterPool, ClusterInfo, list_clusters
from broker.core.db import session_factory
from broker.core.metrics import observe_cycle
from broker.core.models import Job
from broker.core.states import JobState, set_reasons, set_states
from broker.placement.capacity import CapacityView
from broker.placement.decision import CycleDecisions, Held, Placed, WaitCause
from broker.placement.fairshare import FairShare
from broker.placement.reservation import Reservations
from broker.scheduling import holdings
from broker.scheduling.claim import Candidate, Claim
from broker.scheduling.parts import CycleParts, cycle_parts
from broker.scheduling.preemption import terms_of
from broker.scheduling.steps import CycleReport, PhaseObserver, unplaced
from broker.scheduling.submission import Submission
from broker.scheduling.sync import StatusChanges

log = logging.getLogger("gpush.scheduler")
S = JobState
ACTOR = "scheduler"


class Scheduler:
    """One scheduling cycle of the broker, run by the elected leader.

    Each cycle, in order (:meth:`run_cycle` reads as this list):

    1. Carry on: a job left in ``submitting`` (its broker died between the adapter call
       and the database write) is looked up by its gpush id: ``submitted`` if the
       cluster has it, back to ``queued`` if not. Nothing is lost or doubled. MIG layout
       changes under way (broker.fleet.mig_steps) move on a step, and the policy's
       automatic mode asks for the plan's; their nodes take no new work meanwhile.
    2. Sync statuses: each cluster's changes since its cursor move jobs to
       ``running``, ``succeeded``, ``failed`` or ``cancelled``, each change in the
       order the cluster reported it. The changes are read here and written beside
       steps 3 to 7, which count them as made (the ledger, the capacity and the
       cancels read what the changes touch before they are written); they are all in
       before step 8, whose steps read jobs from the database. A cluster's cursor moves
       once its changes are in.
    3. Cancel: jobs a user cancelled while a cluster had them are cancelled there, and
       preemption victims are told and stopped (broker.scheduling.preemption).
    4. Capacity: each healthy cluster's inventory, minus the placements it has not
       started yet, the units drift findings break and the nodes fleet changes fence.
       A cluster that keeps tenants' quotas on its side too
       (:class:`broker.core.adapter.TenantQuotaKeeper`: Kubernetes with a namespace per
       tenant) is handed the quotas the ledger read, and writes what changed; the
       ledger remains what holds tenants to them (step 6).
    5. Claim queued jobs in order: priority, then the tenant furthest below its
       weighted fair share (GPU-equivalents across both tiers), then age; at most
       ``claim_limit`` per tenant. Each tenant's jobs are read per priority level as the
       order reaches them, with a LIMIT, so a cycle reads the jobs it decides however
       long the queue is. The claim is read beside steps 2 to 4; the jobs step 2 puts
       back in the queue (a preemption ended, a cluster lost them) are left out of it
       whether its read saw their write or not, and claimed from the next cycle on.
    6. Decide each, in fair-share order, by the one decision the replays also make
       (:class:`broker.placement.decision.CycleDecisions`): routed by the active policy
       (no rule: ``held``), fitted on the routes in order and counted against capacity,
       checked against its tenant's quota (over: it waits, saying so); nothing could
       ever hold it: ``held``; nothing free now: it waits, saying for what.
    7. Submit: placed jobs go ``routed`` then ``submitting`` (committed before any
       adapter call), the adapter is called, then ``submitted`` with the backend id;
       a refusal fails the job, an unreachable cluster puts it back in the queue.
       Placed jobs go through this step in batches while step 6 decides the next ones.
    8. Preempt: jobs that wait for capacity may preempt running ones (the policy's
       ``preemption`` section; broker.scheduling.preemption chooses and tells).
    9. Lend: the policy's lending pools move nodes between two clusters as the jobs
       waiting for capacity call for it (broker.fleet.lending).
    10. Record what the held and waiting jobs wait for.

    The collaborators of the steps come from :func:`broker.scheduling.parts.cycle_parts`
    (or are handed in as ``parts``); none of them knows this class.
    """

    def __init__(
        self,
        engine: Engine,
        adapters: AdapterPool,
        *,
        clock: Clock,
        policy_source: Callable[[object], object | None] | None = None,
        claim_limit: int = 1000,
        parts: CycleParts | None = None,
        on_phase: PhaseObserver | None = None,
    ):
        self.engine = engine
        self.sessions = session_factory(engine)
        self.adapters = adapters
        self.clock = clock
        self.claim_limit = claim_limit
        self._policy_source = policy_source
        # Told of each step as it ends (broker.scheduling.steps.CycleReport.on_phase).
        self.on_phase = on_phase
        parts = parts if parts is not None else cycle_parts(self.sessions, adapters, clock)
        self.clusters = parts.clusters
        self.specs = parts.specs
        self.reconfigurations = parts.reconfigurations
        self.status_sync = parts.status_sync
        self.preemptions = parts.preemptions
        self.drift = parts.drift
        self.node_lending = parts.node_lending
        # GPUs that jobs pinned to a GPU model waited for last cycle (CapacityView.pinned).
        self._pinned_waiting: dict[tuple[str, str], int] = {}

    # -- the cycle -----------------------------------------------------------------

    @observe_cycle  # its duration, steps and outcomes to /metrics (broker.core.metrics)
    def run_cycle(self) -> CycleReport:
        report = CycleReport(on_phase=self.on_phase)
        clusters = self.enabled_clusters()
        with report.timing("recover"):
            self.recover(clusters, report)  # 1
        with report.timing("mig"):
            self.move_mig_changes(clusters)  # 1
        claim = Claim(self.sessions, self.claim_limit)  # 5, read beside steps 2 to 4
        sync: StatusChanges | None = None
        try:
            with report.timing("sync"):  # 2
                # Victims told of a preemption: their end requeues them.
                preempting = self.preemptions.in_flight().victims
                sync = self.status_sync.read_statuses(clusters, report, preempting=preempting)
            # What steps 3 to 6 read of the jobs the changes touch is read now, before the
            # changes are written, and counted as if they were: then they are written
            # beside those steps.
            with report.timing("inventory"):
                ledger = holdings.ledger(self.sessions, sync)
                booked = holdings.booked_capacity(self.sessions, sync)
            with report.timing("cancel"):
                wanted = self.read_cancel_requests(sync)
            sync.start(self.status_sync)
            with report.timing("cancel"):  # 3
                self.act_on_cancels(clusters, wanted, report)
                self.preemptions.act(clusters, report)
            with report.timing("inventory"):  # 4
                view = self.read_inventory(clusters, report, booked)
                self.keep_tenant_quotas(clusters, ledger.quotas, report, skip=view.unavailable)
        except BaseException:
            claim.wait(report, raise_error=False)
            if sync is not None:
                sync.wait(report, raise_error=False)
            raise
        try:
            claim.wait(report)  # 5
            claim.leave_out(sync.requeued, report)
            decided = self.place(clusters, view, report, claim=claim, ledger=ledger, sync=sync)  # 6, 7
            # Steps 8 and 9 read jobs' states and placements from the database: the status
            # changes must be in by then, not on their way beside them.
            sync.wait(report)
            if decided.blocked and decided.preempting:
                with report.timing("preempt"):  # 8
                    told = self.preemptions.choose(
                        clusters, decided.policy, decided.decisions, decided.blocked, decided.fair.gaps(), report
                    )
                decided.told(told)
            if decided.lending:
                with report.timing("lend"):  # 9
                    self.node_lending.step(decided.policy, decided.blocked)
            with report.timing("write"):  # 10
                self._write_waits(decided.held, decided.waiting, report)
        except BaseException:
            sync.wait(report, raise_error=False)
            raise
        return report

    def enabled_clusters(self) -> dict[str, ClusterInfo]:
        """The clusters this cycle works with (the enabled ones), by name."""
        with self.sessions() as session:
            clusters = {c.name: c for c in list_clusters(session, enabled_only=True)}
        self.clusters.enabled = clusters
        return clusters

    def _adapter(self, info: ClusterInfo) -> ClusterAdapter:
        return self.clusters.of(info)

    def move_mig_changes(self, clusters: dict[str, ClusterInfo]) -> None:
        """MIG layout changes: the policy's automatic mode asks for the plan's, and every
        change under way moves on (broker.fleet.mig_steps)."""
        with self.sessions() as session:
            policy = self._policy(session)
        settings = policy.mig if policy is not None else None
        self.reconfigurations.configure(settings, policy)
        if settings is not None and settings.automatic:
            for asked in self.reconfigurations.automatic(clusters, self.adapters, settings):
                if asked.change is not None:
                    log.info("MIG change %s asked: %s GPU %s -> %s", asked.change, asked.node, asked.gpu, asked.planned)
        for line in self.reconfigurations.advance():
            log.info("%s", line)

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
                values=unplaced(len(gone)),
            )
            report.recovered += len(moved) + len(requeued)

    # 3 ------------------------------------------------------------------------------

    def read_cancel_requests(self, sync: StatusChanges) -> list[tuple[int, str | None]]:
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

    def read_inventory(
        self, clusters: dict[str, ClusterInfo], report: CycleReport, booked: holdings.Booked | None = None
    ) -> CapacityView:
        """Each cluster's inventory, minus what the broker holds there."""
        if booked is None:
            booked = holdings.booked_capacity(self.sessions, StatusChanges())
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
            inventory = holdings.fence(inventory, self.reconfigurations.fenced())
        pending = holdings.beyond_backlog(booked.pending, clusters)
        return CapacityView.build(inventory, pending, booked.memory, unavailable=unavailable)

    def keep_tenant_quotas(
        self,
        clusters: dict[str, ClusterInfo],
        quotas: dict[str, float],
        report: CycleReport,
        *,
        skip: Mapping[str, str] = {},  # noqa: B006 - read only
    ) -> None:
        """Hand the tenants' quotas to each cluster that keeps them too (not those whose
        inventory failed this cycle: their GPU resources are not known). The adapter
        writes only what changed, so this costs nothing while the quotas stay as they are."""
        for name, info in clusters.items():
            if name in skip:
                continue
            keeper = capability(self._adapter(info), TenantQuotaKeeper)
            if keeper is None:
                continue
            try:
                changes = keeper.apply_tenant_quotas(keeper.tenant_quotas(quotas))
            except AdapterError as exc:
                report.errors.append(f"tenant quotas on {name}: {exc}")
                continue
            for change in changes:
                log.info("%s: %s", name, change)

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
        claim: Claim | None = None,
        ledger: holdings.Ledger | None = None,
        sync: StatusChanges | None = None,
    ) -> Decided:
        """Steps 6 and 7: each claimed job decided, the placed ones submitted in batches
        meanwhile; what the others wait for is returned for steps 8 to 10."""
        if claim is None:
            claim = Claim(self.sessions, self.claim_limit)
            claim.wait(report)
        usage, weights, quotas = ledger if ledger is not None else holdings.ledger(self.sessions, StatusChanges())
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
        batch = min(max(self.claim_limit * len(claim.tenants) // 8, 100), Submission.BATCH)
        submission = Submission(self.sessions, self.clock, self._adapter, clusters, batch=batch)
        held: list[tuple[int, str]] = []
        waiting: list[tuple[Candidate, str]] = []
        # Jobs waiting for capacity, with their routes: those that may preempt (step 8), and
        # what the lending pools weigh (step 9).
        blocked: list[tuple[Candidate, list]] = []
        preempting = terms_of(policy) is not None
        lending = policy is not None and bool(policy.lending)
        view.pinned = dict(self._pinned_waiting)
        kept = holdings.reservations(self.sessions)
        book = self._reservations(policy, sync, kept)
        decisions = CycleDecisions(policy, view, fair, book)
        try:
            while (tenant := next_tenant()) is not None:
                job = claim.pop(tenant, report)
                job.spec = self.specs.of(job)
                outcome = decisions.decide(job)
                if isinstance(outcome, Placed):
                    submission.add(job, outcome.placement)
                elif isinstance(outcome, Held):
                    held.append((job.job_id, outcome.reason))
                else:
                    waiting.append((job, outcome.reason))
                    if (preempting or lending) and outcome.cause is WaitCause.CAPACITY:
                        blocked.append((job, decisions.routing(job.asked, job.tenant).routes))
        except BaseException:
            submission.close(report, abandon=True)
            raise
        self._pinned_waiting = dict(decisions.pinned_waiting)
        holdings.keep_reservations(self.sessions, kept, book.held if book is not None else {})
        claim_in_loop = report.seconds["claim"] - claim_before
        report.add_time("decide", time.perf_counter() - decide_begin - claim_in_loop)
        submission.close(report)
        return Decided(policy, fair, held, waiting, blocked, decisions, preempting=preempting, lending=lending)

    def _reservations(self, policy, sync: StatusChanges | None, kept) -> Reservations | None:
        """The cycle's book of gang reservations: those kept from the last cycle
        (``kept``), and the expected ends of what runs (read only if a reservation needs
        them). None when the policy makes none."""
        after = policy.gang_reservation_after if policy is not None else None
        if after is None:
            return None
        changes = sync if sync is not None else StatusChanges()
        now = self.clock()
        return Reservations(
            timedelta(seconds=after), now, kept, lambda: holdings.expected_ends(self.sessions, changes, now)
        )

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


@dataclass
class Decided:
    """What steps 6 and 7 leave to steps 8 to 10: the jobs held, those waiting (with what
    for), and those waiting for capacity with their routes (what may preempt, what the
    lending pools weigh)."""

    policy: Any
    fair: FairShare
    held: list[tuple[int, str]]
    waiting: list[tuple[Candidate, str]]
    blocked: list[tuple[Candidate, list]]
    decisions: CycleDecisions  # the cycle's capacity and reservations, where preemption fits (step 8)
    preempting: bool = False  # the policy preempts
    lending: bool = False  # the policy has lending pools

    def told(self, reasons: Mapping[int, str]) -> None:
        """The waiting jobs' reasons, with what the preemption step told them."""
        self.waiting = [(job, reasons.get(job.job_id, reason)) for job, reason in self.waiting]
