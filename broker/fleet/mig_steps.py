"""Moving MIG layout changes on, a step at a time: the executor the scheduling cycle runs.

The steps, their deadlines and rollback are described in broker.fleet.mig_changes, which
also owns asking for changes and reading them; :class:`Reconfigurations` here moves each
change in flight on by one step per cycle (:meth:`Reconfigurations.advance`), says which
nodes they fence (:meth:`Reconfigurations.fenced`), and asks for the plan's changes in the
policy's automatic mode (:meth:`Reconfigurations.automatic`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.core.adapter import AdapterError, ClusterAdapter, MigPublisher, NodeFencer, capability
from broker.core.clock import Clock
from broker.core.clusters import AdapterPool, ClusterInfo
from broker.core.gangs import held_on
from broker.core.models import Job, MigChange
from broker.core.models import NodeReport as NodeReportRow
from broker.fleet.eviction import preempt_for_fleet
from broker.fleet.mig_changes import (
    HOLDING,
    STEPS,
    Requested,
    StepLimits,
    gpu_of,
    holds_node,
    node_report,
    open_changes,
    others_hold,
    record_event,
    reported_layout,
    request_changes,
    same_instances,
    shown,
    span,
    which_gpu,
)
from broker.inventory.agent_report import NodeReport
from broker.inventory.report_store import load_reports, reconciled
from broker.inventory.view import CRITICAL, Finding
from broker.mig.layouts import MigSlot
from broker.mig.queue import plan_for
from broker.routing.fleet_sections import MigLayouts
from broker.routing.rules import Policy

log = logging.getLogger("gpush.mig")

# -- moving them on -----------------------------------------------------------------------


class Reconfigurations:
    """The changes in flight, moved on a step at a time by the scheduling cycle
    (:meth:`advance`), and the nodes they fence (:meth:`fenced`)."""

    def __init__(
        self,
        sessions: Callable[[], Session],
        clock: Clock,
        adapter_of: Callable[[str], ClusterAdapter],
        *,
        limits: StepLimits | None = None,
        max_at_once: int = 2,
        findings_of: Callable[[Session, str, str], list[Finding]] | None = None,
    ) -> None:
        self.sessions = sessions
        self.clock = clock
        self.adapter_of = adapter_of
        self.limits = limits or StepLimits()
        self.max_at_once = max_at_once
        # (cluster, node) -> the inventory's findings there (the drift check of "confirming").
        self.findings_of = findings_of
        self._planned_at: datetime | None = None  # the automatic mode's last plan
        self.policy: Policy | None = None  # whose preemption section lets a change preempt

    def configure(self, settings: MigLayouts | None, policy: Policy | None = None) -> None:
        """Take the limits of the policy's ``mig`` section (its defaults without one), and
        the policy, which says which jobs may be preempted to empty a GPU."""
        self.policy = policy
        settings = settings or MigLayouts()
        step = timedelta(seconds=settings.step_timeout)
        self.limits = StepLimits(timedelta(seconds=settings.wait_for_jobs), step, step, step)
        self.max_at_once = settings.max_reconfiguring

    def fenced(self) -> dict[tuple[str, str], str]:
        """(cluster, node) -> why the scheduler places nothing there: a change under way
        past ``planned``, or one that failed (until an admin clears it)."""
        with self.sessions() as session:
            rows = session.execute(select(MigChange).where(holds_node())).scalars()
            return {(c.cluster, c.node): f"MIG change {c.id} of GPU {c.gpu} ({c.step})" for c in rows}

    def automatic(
        self, clusters: Mapping[str, ClusterInfo], pool: AdapterPool, settings: MigLayouts
    ) -> list[Requested]:
        """The policy's automatic mode: every ``settings.every`` seconds outside its quiet
        hours, plan each cluster's reported GPUs as ``gpush mig plan`` does and ask for the
        changes the plan makes (GPUs changed less than ``min_interval`` ago are left)."""
        now = self.clock()
        if self._planned_at is not None and now - self._planned_at < timedelta(seconds=settings.every):
            return []
        self._planned_at = now
        if settings.quiet(now):
            return []
        with self.sessions() as session:
            reports = load_reports(session)
        if not reports:
            return []
        requested: list[Requested] = []
        for name, info in clusters.items():
            if settings.clusters and name not in settings.clusters:
                continue
            inventory = reconciled({name: info}, reports, pool, now=now)
            cluster_of = {node.name: name for c in inventory.clusters for node in c.nodes}
            with self.sessions() as session, session.begin():
                result = plan_for(session, reports, inventory, cluster=info, repartition_busy=settings.repartition_busy)
                requested += request_changes(
                    session,
                    result.plan,
                    cluster_of,
                    self.adapter_of,
                    reports,
                    by="scheduler",
                    now=now,
                    not_since=now - timedelta(seconds=settings.min_interval),
                )
        return requested

    def advance(self) -> list[str]:
        """Move every open change on as far as it can go now; returns what happened."""
        said: list[str] = []
        with self.sessions() as session:
            ids = [c.id for c in open_changes(session)]
        for change_id in ids:
            with self.sessions() as session, session.begin():
                change = session.get(MigChange, change_id)
                if change is None or change.ended_at is not None:
                    continue
                for _ in STEPS:  # as many steps as can be taken now, one transaction
                    before = change.step
                    note = self._step(session, change)
                    if note:
                        said.append(f"MIG change {change.id}: {note}")
                    if change.step == before or change.ended_at is not None:
                        break
        return said

    # Each step: do what it can, move to the next step (or stay), say what happened.

    def _step(self, session: Session, change: MigChange) -> str | None:
        now = self.clock()
        limit = self.limits.of(change.step)
        late = limit is not None and now >= change.step_at + limit
        try:
            adapter = self.adapter_of(change.cluster)
        except AdapterError as exc:
            adapter, problem = None, str(exc)
        else:
            problem = None
        if change.step == "planned":
            return self._planned(session, change, adapter, now)
        if adapter is None:
            return (
                self._late(session, change, now, f"cluster {change.cluster} cannot be reached: {problem}")
                if late
                else None
            )
        try:
            return getattr(self, "_" + change.step)(session, change, adapter, now, late)
        except AdapterError as exc:
            if late:
                return self._late(session, change, now, f"{change.cluster} refused: {exc}")
            return None
        except Exception as exc:  # an adapter's bug must not stop every cycle: this change waits, then rolls back
            log.exception("MIG change %s (%s): step %s failed", change.id, change.node, change.step)
            if late:
                return self._late(session, change, now, f"{change.cluster} failed: {type(exc).__name__}: {exc}")
            return None

    def _planned(
        self, session: Session, change: MigChange, adapter: ClusterAdapter | None, now: datetime
    ) -> str | None:
        under_way = session.scalar(
            select(func.count()).where(
                MigChange.ended_at.is_(None), MigChange.step != "planned", MigChange.id != change.id
            )
        )
        if under_way >= self.max_at_once or adapter is None:
            return None
        fencer = capability(adapter, NodeFencer)
        where = "gpush places nothing there"
        if fencer is not None:
            fencer.fence(change.node, f"gpush MIG change {change.id}")
            where += f" and {change.cluster} takes no new job there"
        return self._move(session, change, "emptying", now, f"draining {change.node}: {where}", via="draining")

    def _emptying(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        destroyed = Counter(change.from_layout) - Counter(change.target)
        profiles = {MigSlot.parse(text).profile for text in destroyed}
        # A cluster that aborts the jobs on a node whose GPUs change (Slurm) needs it empty.
        whole = bool(getattr(adapter, "needs_empty_node", False))
        holding = [
            job
            for job in session.execute(
                select(Job).where(Job.cluster == change.cluster, Job.state.in_(HOLDING))
            ).scalars()
            if job.placement
            and change.node in held_on(job.placement)  # a gang's rank there too
            and (whole or job.placement.get("mig_profile") in profiles)
        ]
        holders = [job.id for job in holding]
        if holding and self.policy is not None:
            self._preempt(session, change, holding, now)
        report = node_report(session, change.node)
        busy_destroyed = []
        for gpu in report.gpus if report is not None else ():
            if gpu.index != change.gpu and not whole:
                continue
            in_use = {p.mig_uuid for p in gpu.processes if p.mig_uuid}
            busy = [f"{m.profile}@{m.placement_start}" for m in gpu.mig_instances if m.uuid in in_use]
            if gpu.index != change.gpu:
                busy_destroyed += [f"{s} of GPU {gpu.index}" for s in busy]
                busy_destroyed += [f"GPU {gpu.index}"] if gpu.processes and not gpu.mig_instances else []
            else:
                busy_destroyed += [s for s in busy if s in destroyed or whole]
        if not holders and not busy_destroyed:
            what = f"no work on {change.node}" if whole else "no work on the instances that change"
            nxt = (
                f"next, the agent of {change.node} re-cuts GPU {change.gpu} (it must run with --allow-mig-changes)"
                if change.changed_by == "agent"
                else f"next, {change.cluster} re-cuts GPU {change.gpu} itself"
            )
            return self._move(session, change, "changing", now, f"empty: {what}; {nxt}")
        if late:
            what = ", ".join([f"job {i}" for i in holders] + [f"a process on {s}" for s in busy_destroyed])
            return self._end(
                session,
                change,
                adapter,
                now,
                "cancelled",
                f"still in use after {span(self.limits.emptying)}: {what}; nothing was changed",
            )
        return None

    def _preempt(self, session: Session, change: MigChange, holding: list[Job], now: datetime) -> None:
        """Preempt the preemptible jobs that hold an instance the change destroys
        (broker.scheduling.preemption tells them, stops them after their grace, and the
        status sync queues them again); the others are waited for."""
        why = f"preempted for MIG change {change.id} of {change.node} GPU {change.gpu}"
        asked = preempt_for_fleet(
            session, self.policy, holding, why=why, kind="mig-change", now=now, mig_change_id=change.id
        )
        for job_id, signal, grace in asked:
            told = f"to be told with {signal}, {grace} s of grace"
            record_event(session, change, now, f"preempting job {job_id} (preemptible): {told}")

    def _changing(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        if change.changed_by == "cluster":
            publisher = capability(adapter, MigPublisher)
            if publisher is None:
                return self._late(session, change, now, f"cluster {change.cluster} cannot publish a MIG layout")
            if not same_instances(publisher.mig_published(change.node, change.gpu) or (), change.target):
                publisher.publish_mig(change.node, change.gpu, list(change.target))
            return self._move(
                session, change, "confirming", now, f"{change.cluster} told to change the GPU itself", via="publishing"
            )
        row = session.get(NodeReportRow, change.node)
        if row is not None and row.received_at >= change.step_at:
            report = NodeReport.model_validate(row.report)
            refused = [r.why for r in report.mig_refused if r.change == change.id and r.gpu == change.gpu]
            if refused:  # the agent says it will not: no use waiting for the step to run out
                return self._late(session, change, now, f"the agent of {change.node} did not make it: {refused[0]}")
            gpu = gpu_of(report, change.gpu)
            if gpu is not None and same_instances(reported_layout(gpu), change.target):
                return self._move(
                    session,
                    change,
                    "publishing",
                    now,
                    f"the agent of {change.node} reports the {which_gpu(change)}",
                )
        if late:
            return self._late(
                session,
                change,
                now,
                f"the agent of {change.node} did not report the {'old' if change.rolling_back else 'new'} layout "
                f"in {span(self.limits.changing)}",
            )
        return None

    def _publishing(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        publisher = capability(adapter, MigPublisher)
        if publisher is None:
            return self._late(session, change, now, f"cluster {change.cluster} cannot publish a MIG layout")
        if same_instances(publisher.mig_published(change.node, change.gpu) or (), change.target):
            return self._move(session, change, "confirming", now, f"{change.cluster} offers that layout already")
        report = node_report(session, change.node)
        reported = gpu_of(report, change.gpu) if report is not None else None
        publisher.publish_mig(change.node, change.gpu, list(change.target), reported)
        return self._move(session, change, "confirming", now, f"{change.cluster} told of the {which_gpu(change)}")

    def _confirming(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        publisher = capability(adapter, MigPublisher)
        offered = publisher.mig_published(change.node, change.gpu) if publisher else None
        problems = []
        if offered is None or not same_instances(offered, change.target):
            problems.append(f"{change.cluster} offers {', '.join(offered or ()) or 'nothing'} yet")
        report = node_report(session, change.node)
        if report is not None:
            gpu = gpu_of(report, change.gpu)
            # A cluster that changes the GPU itself places the instances its own way
            # (mig-parted): its agent's report need only show the same profiles.
            exact = change.changed_by == "agent"
            if gpu is None or not same_instances(shown(reported_layout(gpu), exact), shown(change.target, exact)):
                problems.append(f"the agent of {change.node} reports another layout")
        if not problems and self.findings_of is not None:
            critical = [
                f.what
                for f in self.findings_of(session, change.cluster, change.node)
                if f.severity == CRITICAL and f.gpu in (None, change.gpu) and not f.kind.startswith("mig_change")
            ]
            problems += critical
        if not problems:
            return self._move(
                session,
                change,
                "admitting",
                now,
                f"confirmed: {change.cluster} and the agent agree, no critical finding",
            )
        if late:
            return self._late(session, change, now, "not confirmed: " + "; ".join(problems))
        return None

    def _admitting(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        if change.rolling_back:
            return self._end(
                session, change, adapter, now, "rolled-back", "back on its last good layout; new work may land"
            )
        return self._end(session, change, adapter, now, "done", f"{', '.join(change.target)}; new work may land")

    # -- bookkeeping --------------------------------------------------------------------

    def _late(self, session: Session, change: MigChange, now: datetime, why: str) -> str:
        if change.rolling_back:
            change.step, change.ended_at, change.deadline = "failed", now, None
            record_event(
                session, change, now, f"rollback failed: {why}; {change.node} stays fenced until an admin looks"
            )
            return f"failed: {why}"
        change.rolling_back = True
        change.target = list(change.from_layout)
        return self._move(
            session, change, "changing", now, f"{why}; rolling back to {', '.join(change.from_layout) or 'no instance'}"
        )

    def _move(
        self, session: Session, change: MigChange, step: str, now: datetime, note: str, *, via: str | None = None
    ) -> str:
        """The step ``change`` is in (or ``via``, one it passed through at once) is over,
        as ``note`` says; it is in ``step`` now."""
        done = via or change.step
        record_event(session, change, now, note, step=done)
        change.step, change.step_at = step, now
        limit = self.limits.of(step)
        change.deadline = now + limit if limit is not None else None
        return f"{done}: {note}"

    def _end(
        self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, ending: str, note: str
    ) -> str:
        fencer = capability(adapter, NodeFencer)
        if fencer is not None and not others_hold(session, change):
            fencer.unfence(change.node)
        change.step, change.ended_at, change.deadline, change.step_at = ending, now, None, now
        record_event(session, change, now, note)
        return f"{ending}: {note}"
