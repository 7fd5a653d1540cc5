"""Preemption in the live cycle: choosing victims, telling them, and what their end means.

The choice is :class:`broker.placement.preemption.Planner`'s, the one the replays make;
this module brings it the cycle's jobs and carries it out, as a recorded intent that
survives a broker restart (the ``preemptions`` table, :class:`broker.core.models.Preemption`):

- **Choose** (after step 6, :meth:`Preemptions.choose`): the jobs that wait for capacity
  (not a quota, not a rule), in the order the cycle decided them, against the running jobs
  that may be preempted (their spec's ``preemptible``, else the policy's default) and
  have no preemption in flight. Each choice is written, with an event on both jobs,
  before any cluster is asked; the waiting job then says what it waits for.
- **Tell** (step 3, :meth:`Preemptions.act`, and at once after a choice): a victim not
  yet told gets its checkpoint signal (its cluster's :class:`broker.core.adapter.Preemptor`:
  Slurm signals the batch step, Kubernetes deletes the pods with the grace period); a
  cluster without that capability cancels it. A victim still running once its grace ran
  out is cancelled. A multi-node victim (a gang) is one job there, told and stopped by
  one call for its id on every node (the simulated cluster ends all its ranks;
  Kubernetes deletes the Indexed Job's Pods, Job and Service), and queued again whole.
  A preemption whose victim left ``running`` is closed, with the GPU-seconds of work it
  lost (since its last checkpoint, else its start).
- **End** (step 2, :class:`broker.scheduling.sync.StatusSync`): a told victim that ends,
  however (it saved and exited, was killed, or cancelled), goes ``running`` ->
  ``requeued`` with the preemption's reason -> ``queued``, placement void, and routing
  may send it to the other tier. A user's cancel still wins: that victim ends cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update

from broker.core.adapter import AdapterError, ClusterAdapter, Placement, Preemptor, capability
from broker.core.clock import Clock
from broker.core.clusters import ClusterInfo
from broker.core.models import Job
from broker.core.models import Preemption as PreemptionRow
from broker.core.schemas import JobSpec
from broker.core.states import JobState
from broker.fleet.eviction import DEFAULT_SIGNAL, how_told, preemption_event
from broker.intake.queue import last_events
from broker.placement.preemption import Blocked, Planner, Running, Terms, Waiting
from broker.routing.evaluation import preemptible
from broker.scheduling.steps import CycleReport

log = logging.getLogger("gpush.scheduler")
S = JobState
ACTOR = "scheduler"


def terms_of(policy) -> Terms | None:
    """The policy's preemption terms, or None when it preempts nothing."""
    section = getattr(policy, "preemption", None)
    if section is None:
        return None
    return Terms(section.min_priority_gap, section.reclaim, section.reclaims_per_hour)


def _seconds(seconds: int) -> str:
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min" + (f" {seconds % 60} s" if seconds % 60 else "")


@dataclass
class InFlight:
    """The preemptions not yet closed, as the cycle reads them once at its start."""

    victims: dict[int, str]  # victim id -> the reason it will be requeued with (told victims only)
    preemptors: set[int]  # jobs that wait for victims to stop: they do not preempt more
    reserved: set[int]  # victims already chosen: no other job takes them


class Preemptions:
    """The cycle's preemption steps (module docstring). ``spec_of`` parses a stored spec
    (the scheduler's cache); ``adapter_of`` is the cluster's adapter."""

    def __init__(
        self,
        sessions,
        clock: Clock,
        adapter_of: Callable[[ClusterInfo], ClusterAdapter],
        spec_of: Callable[[str, dict | str], JobSpec],
    ):
        self.sessions = sessions
        self.clock = clock
        self._adapter = adapter_of
        self._spec_of = spec_of

    # -- what is in flight ---------------------------------------------------------------

    def in_flight(self) -> InFlight:
        with self.sessions() as session:
            rows = session.execute(
                select(
                    PreemptionRow.victim_id,
                    PreemptionRow.preemptor_id,
                    PreemptionRow.reason,
                    PreemptionRow.signalled_at,
                ).where(PreemptionRow.ended_at.is_(None))
            ).all()
        return InFlight(
            victims={r.victim_id: r.reason for r in rows if r.signalled_at is not None},
            preemptors={r.preemptor_id for r in rows if r.preemptor_id is not None},
            reserved={r.victim_id for r in rows},
        )

    # -- step 3: tell the victims, stop those whose grace is over, close the ended -------

    def act(self, clusters: dict[str, ClusterInfo], report: CycleReport) -> None:
        now = self.clock()
        with self.sessions() as session:
            rows = session.execute(
                select(PreemptionRow, Job.state, Job.cluster)
                .join(Job, Job.id == PreemptionRow.victim_id)
                .where(PreemptionRow.ended_at.is_(None))
            ).all()
        live = [(p, cluster) for p, state, cluster in rows if state in (S.RUNNING.value, S.SUBMITTED.value)]
        if len(live) < len(rows):
            self._close([p for p, state, _ in rows if state not in (S.RUNNING.value, S.SUBMITTED.value)], now)
        for p, cluster in live:
            info = clusters.get(cluster or "")
            if info is None:
                continue
            if p.signalled_at is None:
                self._tell(info, p, report)
            elif p.stopped_at is None and now >= p.signalled_at + timedelta(seconds=p.grace_seconds):
                self._stop(info, p, report)

    def _tell(self, info: ClusterInfo, p: PreemptionRow, report: CycleReport) -> None:
        adapter = self._adapter(info)
        teller = capability(adapter, Preemptor)
        try:
            if teller is not None:
                teller.preempt(p.victim_id, p.signal, p.grace_seconds)
            else:
                adapter.cancel(p.victim_id)
        except AdapterError as exc:
            report.errors.append(f"preempt job {p.victim_id} on {info.name}: {exc}")
            return
        now = self.clock()
        told = (
            f"told with {p.signal}; {_seconds(p.grace_seconds)} to save its state"
            if teller is not None
            else f"{info.name} cannot signal a job first: cancelled at once"
        )
        with self.sessions() as session, session.begin():
            session.execute(
                update(PreemptionRow)
                .where(PreemptionRow.id == p.id)
                .values(signalled_at=now, stopped_at=None if teller is not None else now)
            )
            session.add(preemption_event(p.victim_id, S.RUNNING, told, now))
        report.preempted += 1

    def _stop(self, info: ClusterInfo, p: PreemptionRow, report: CycleReport) -> None:
        try:
            self._adapter(info).cancel(p.victim_id)
        except AdapterError as exc:
            report.errors.append(f"stop preempted job {p.victim_id} on {info.name}: {exc}")
            return
        now = self.clock()
        with self.sessions() as session, session.begin():
            session.execute(update(PreemptionRow).where(PreemptionRow.id == p.id).values(stopped_at=now))
            over = f"its {_seconds(p.grace_seconds)} of grace are over: stopped"
            session.add(preemption_event(p.victim_id, S.RUNNING, over, now))

    def _close(self, rows: Sequence[PreemptionRow], now: datetime) -> None:
        """Close the preemptions whose victims left ``running``, with the work each lost:
        GPU-seconds from its last checkpoint (else its start) to its end."""
        ids = [p.victim_id for p in rows]
        with self.sessions() as session, session.begin():
            started = last_events(session, ids, "transition", S.RUNNING.value)
            saved = last_events(session, ids, "checkpoint")
            requeued = last_events(session, ids, "transition", S.REQUEUED.value)
            for p in rows:
                lost = None
                end = requeued.get(p.victim_id)
                begin = max(filter(None, (started.get(p.victim_id), saved.get(p.victim_id))), default=None)
                if end is not None and begin is not None and p.signalled_at is not None:
                    lost = max((end - begin).total_seconds(), 0.0) * p.gpu_equivalents
                session.execute(
                    update(PreemptionRow)
                    .where(PreemptionRow.id == p.id)
                    .values(ended_at=end or now, lost_gpu_seconds=lost)
                )

    # -- after step 6: choose victims ------------------------------------------------------

    def choose(
        self,
        clusters: dict[str, ClusterInfo],
        policy,
        decisions,
        blocked: Sequence[tuple[object, Sequence]],
        gaps: dict[str, float],
        report: CycleReport,
    ) -> dict[int, str]:
        """Victims for the jobs in ``blocked`` (each ``(candidate, routes)``: waiting for
        capacity, in the cycle's order), fitted by the cycle's ``decisions``
        (:class:`broker.placement.decision.CycleDecisions`: its capacity, and the nodes its
        gang reservations keep); returns the waiting reason of each job that now
        waits for victims to stop. Writes the choices, then tells the victims."""
        terms = terms_of(policy)
        if terms is None or not blocked:
            return {}
        flight = self.in_flight()
        asking = [(job, routes) for job, routes in blocked if job.job_id not in flight.preemptors]
        if not asking:
            return {}
        highest = max(job.priority for job, _ in asking)
        running = self._running(policy, terms, highest, flight.reserved, {r.cluster for _, rs in asking for r in rs})
        if not running:
            return {}
        now = self.clock()
        with self.sessions() as session:
            recent = list(
                session.execute(
                    select(PreemptionRow.requested_at).where(
                        PreemptionRow.why == "reclaim", PreemptionRow.requested_at > now - timedelta(hours=1)
                    )
                ).scalars()
            )
        planner = Planner(running, terms=terms, share_gap=gaps, now=now, recent_reclaims=recent)
        chosen = planner.plan(
            [Blocked(Waiting(job.job_id, job.tenant, job.priority), job, routes) for job, routes in asking], decisions
        )
        if not chosen:
            return {}
        reasons: dict[int, str] = {}
        with self.sessions() as session, session.begin():
            for item, choice in chosen:
                waiting = item.waiting
                why = choice.reason(waiting)
                names = ", ".join(f"job {v.job_id}" for v in choice.victims)
                for victim in choice.victims:
                    signal, grace = victim.told
                    session.add(
                        PreemptionRow(
                            victim_id=victim.job_id,
                            preemptor_id=waiting.job_id,
                            why=choice.why,
                            reason=why,
                            signal=signal,
                            grace_seconds=grace,
                            gpu_equivalents=victim.placement.gpu_equivalents,
                            placement=victim.placement.to_dict(),
                            requested_at=now,
                        )
                    )
                    session.add(preemption_event(victim.job_id, S.RUNNING, f"{why}: to be told with {signal}", now))
                longest = max(v.told[1] for v in choice.victims)
                theirs = "its" if len(choice.victims) == 1 else "their"
                reasons[waiting.job_id] = (
                    f"waiting for {names} to stop: preempted for it ({choice.why}), "
                    f"{_seconds(longest)} to save {theirs} state"
                )
                session.add(
                    preemption_event(
                        waiting.job_id, S.QUEUED, f"preempts {names}: only {theirs} GPUs could hold it", now
                    )
                )
        self.act(clusters, report)
        return reasons

    def _running(self, policy, terms: Terms, highest: int, reserved: set[int], clusters: set[str]) -> list[Running]:
        """The running jobs on ``clusters`` that may be preempted and are not already."""
        query = select(Job.id, Job.tenant, Job.priority, Job.spec_hash, Job.spec, Job.placement).where(
            Job.state == S.RUNNING.value, Job.cluster.in_(sorted(clusters))
        )
        if not terms.reclaim:  # only lower priorities can be preempted
            query = query.where(Job.priority <= highest - terms.min_priority_gap)
        with self.sessions() as session:
            rows = [r for r in session.execute(query) if r.id not in reserved]
            ids = [r.id for r in rows]
            started = last_events(session, ids, "transition", S.RUNNING.value)
            saved = last_events(session, ids, "checkpoint")
        now = self.clock()
        out = []
        for r in rows:
            spec = self._spec_of(r.spec_hash, r.spec)
            if not preemptible(policy, spec, r.tenant) or r.placement is None:
                continue
            begin = started.get(r.id, now)
            checkpoint = saved.get(r.id)
            out.append(
                _Victim(
                    r.id,
                    r.tenant,
                    r.priority,
                    True,
                    begin,
                    checkpoint if checkpoint is not None and checkpoint > begin else None,
                    Placement.from_dict(r.placement),
                    told=how_told(spec, policy),
                )
            )
        return out


@dataclass(frozen=True)
class _Victim(Running):
    told: tuple[str, int] = (DEFAULT_SIGNAL, 60)  # (signal, grace seconds)
