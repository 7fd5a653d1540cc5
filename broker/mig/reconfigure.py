"""MIG layout changes, one GPU at a time, recorded and resumable (``gpush mig apply``).

This module owns the broker's half of changing a GPU's MIG layout; the node agent's half
(the NVML calls) is broker.nodeagent.mig_apply. A change is a :class:`MigChange` row,
written before anything is touched, that moves through these steps, each an event
(:class:`MigChangeEvent`) with what happened:

1. ``planned``: asked for (``gpush mig apply``), from the plan of broker.mig.plan. It waits
   while ``max_at_once`` other GPUs are changing.
2. ``draining``: no new work lands on the GPU's node: the scheduler places nothing there
   (:meth:`Reconfigurations.fenced`, its units marked unavailable) and a cluster that can
   fence a node (:class:`broker.core.adapter.NodeFencer`: Slurm drains, Kubernetes cordons)
   is asked to.
3. ``emptying``: the instances the change destroys must be idle: no gpush job running on
   the node with their profile, and no process on them in the agent's report. Jobs there
   that may be preempted (the policy's ``preemption`` section) are preempted for the
   change (a ``preemptions`` row with ``mig_change_id``; broker.scheduling.preemption
   tells and stops them, and they are queued again); the others are waited for.
   Instances the change keeps go on running their work.
4. ``changing``: the node's agent, in the answer to its next report, is handed the layout
   (:func:`wanted_by_agent`); it destroys and creates the instances and reports again. The
   step ends when a report received after the step began shows the target layout. A
   cluster that is the GPU too (the simulator: ``MigPublisher.changes_gpus``) changes it
   itself when no agent reports the node.
5. ``publishing``: the tier is told (:class:`broker.core.adapter.MigPublisher`: Slurm's
   gres.conf and a reconfigure, Kubernetes' ``nvidia.com/mig.config``, the simulator's pools).
6. ``confirming``: the tier offers the target layout, the agent's report shows it, and the
   inventory has no critical finding for the GPU.
7. ``admitting``: the node is unfenced (unless another change holds it): ``done``.

Every step has a deadline (:class:`StepLimits`). ``emptying`` running out ends the change
``cancelled``: nothing was touched. A later step running out rolls back: the target becomes
the layout the GPU had (the last good one) and the change goes through ``changing`` again;
if the rollback runs out too, the change ends ``failed`` and the node stays fenced until an
admin looks (a critical finding, :func:`change_findings`). A broker that stops mid-way
resumes from the step the row holds: every step reads what is, not what it did before.

Never touched: a GPU a non-preemptible job uses on an instance the change destroys (the
change waits in ``emptying``), and the lent GPU machines of the device tool
(integration/gpu only reads).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.core.adapter import AdapterError, ClusterAdapter, MigPublisher, NodeFencer, capability
from broker.core.clock import Clock
from broker.core.clusters import AdapterPool, ClusterInfo
from broker.core.errors import InvalidRequest
from broker.core.models import Job, MigChange, MigChangeEvent
from broker.core.models import NodeReport as NodeReportRow
from broker.core.states import JobState
from broker.inventory.agent_report import GpuReport, NodeReport
from broker.inventory.report_store import load_reports, reconciled
from broker.inventory.view import CRITICAL, WARNING, Finding
from broker.mig.layouts import MigSlot
from broker.mig.plan import MigPlan
from broker.mig.queue import plan_for
from broker.routing.rules import MigLayouts, Policy
from broker.scheduling.preemption import preempt_for_fleet

STEPS = ("planned", "draining", "emptying", "changing", "publishing", "confirming", "admitting")
ENDINGS = ("done", "rolled-back", "cancelled", "failed")
# Jobs that hold their units on the node until they end.
_HOLDING = (JobState.SUBMITTED.value, JobState.RUNNING.value)

log = logging.getLogger("gpush.mig")


@dataclass(frozen=True)
class StepLimits:
    """How long each step may take before the change rolls back (see the module docstring)."""

    emptying: timedelta = timedelta(hours=1)
    changing: timedelta = timedelta(minutes=10)
    publishing: timedelta = timedelta(minutes=10)
    confirming: timedelta = timedelta(minutes=10)

    def of(self, step: str) -> timedelta | None:
        return getattr(self, step, None)


def same_instances(a: Iterable[str], b: Iterable[str]) -> bool:
    return Counter(a) == Counter(b)


def reported_layout(gpu: GpuReport) -> list[str]:
    """The GPU's instances as the agent read them, as a change writes them."""
    return sorted(f"{m.profile}@{m.placement_start}" for m in gpu.mig_instances)


# -- asking for changes -------------------------------------------------------------------


@dataclass(frozen=True)
class Requested:
    """One GPU of ``gpush mig apply``: the change written (``change`` its id), or why not."""

    node: str
    gpu: int
    cluster: str | None
    today: list[str]
    planned: list[str]
    change: int | None = None
    refused: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def request_changes(
    session: Session,
    plan: MigPlan,
    cluster_of: Mapping[str, str],
    adapter_of: Callable[[str], ClusterAdapter],
    reports: Mapping[str, NodeReport],
    *,
    by: str,
    now: datetime,
    node: str | None = None,
    dry_run: bool = False,
    not_since: datetime | None = None,
) -> list[Requested]:
    """A change for each GPU ``plan`` re-cuts (on ``node`` only, when given), written as
    ``planned`` unless ``dry_run``; GPUs that cannot be changed say why (an open change,
    MIG mode to switch on, a cluster that cannot take a new layout, no way to change it,
    a change that ended after ``not_since``)."""
    busy = {
        (c.node, c.gpu): f"change {c.id} of this GPU is under way (gpush mig changes {c.id})"
        for c in open_changes(session)
    }
    for c in session.scalars(select(MigChange).where(MigChange.step == "failed")):
        busy[(c.node, c.gpu)] = (
            f"change {c.id} of this GPU failed and holds its node: look at the GPU (gpush mig changes {c.id}), "
            f"then gpush mig changes {c.id} --clear"
        )
    if not_since is not None:
        recent = session.execute(select(MigChange.node, MigChange.gpu).where(MigChange.ended_at >= not_since))
        for n, g in recent:
            busy.setdefault((n, g), "this GPU changed less than the policy's mig.min_interval ago")
    out: list[Requested] = []
    for gpu in plan.changed:
        if node is not None and gpu.node != node:
            continue
        today = sorted(str(s) for s in gpu.today)
        planned = sorted(str(s) for s in gpu.planned)
        cluster = cluster_of.get(gpu.node)
        refused, changed_by = _refusal(gpu.node, gpu.index, gpu.action, cluster, adapter_of, reports, busy)
        if refused or dry_run:
            out.append(Requested(gpu.node, gpu.index, cluster, today, planned, refused=refused))
            continue
        change = MigChange(
            cluster=cluster,
            node=gpu.node,
            gpu=gpu.index,
            model=gpu.model.name,
            from_layout=today,
            to_layout=planned,
            target=planned,
            step="planned",
            rolling_back=False,
            changed_by=changed_by,
            reason=gpu.reason,
            requested_by=by,
            created_at=now,
            step_at=now,
        )
        session.add(change)
        session.flush()
        _event(
            session,
            change,
            now,
            f"asked by {by}: {', '.join(today) or 'no instance'} -> {', '.join(planned)} ({gpu.reason})",
        )
        out.append(Requested(gpu.node, gpu.index, cluster, today, planned, change=change.id))
    return out


def _refusal(
    node: str,
    index: int,
    action: str,
    cluster: str | None,
    adapter_of: Callable[[str], ClusterAdapter],
    reports: Mapping[str, NodeReport],
    busy: Mapping[tuple[str, int], str],
) -> tuple[str | None, str]:
    """Why the GPU cannot be changed (None: it can), and who would change it."""
    if (node, index) in busy:
        return busy[(node, index)], "agent"
    if action == "enable-mig":
        return (
            "MIG mode is off: switching it on resets the GPU, which gpush leaves to an administrator "
            f"(nvidia-smi -i {index} -mig 1 on {node}, with the GPU idle)"
        ), "agent"
    if cluster is None:
        return f"no cluster lists node {node}: register its cluster (gpush cluster add) first", "agent"
    try:
        adapter = adapter_of(cluster)
    except AdapterError as exc:
        return f"cluster {cluster} cannot be reached: {exc}", "agent"
    publisher = capability(adapter, MigPublisher)
    if publisher is None:
        how = (
            f"its config names no gres.conf to rewrite: gpush cluster add {cluster} --kind slurm --replace "
            "--config mig_gres_conf=/etc/slurm/gres.conf ... (README: Which clusters take a new layout)"
            if getattr(adapter, "kind", None) == "slurm"  # the pool's adapters say their kind
            else "apply the plan's config by hand (gpush mig plan)"
        )
        return f"cluster {cluster} cannot take a new MIG layout from gpush: {how}", "agent"
    if publisher.changes_gpus:
        return None, "cluster"
    if node not in reports:
        return f"no node agent reports {node}: start `gpush agent --node {node} --allow-mig-changes` there", "agent"
    return None, "agent"


# -- the changes in flight ----------------------------------------------------------------


def _holds_node():
    """The changes that keep their node fenced: under way past ``planned``, or failed (until
    an admin clears it)."""
    return (MigChange.ended_at.is_(None) & (MigChange.step != "planned")) | (MigChange.step == "failed")


def _others_hold(session: Session, change: MigChange) -> bool:
    """Whether another change keeps ``change``'s node fenced (then it stays fenced)."""
    return bool(
        session.scalar(
            select(func.count()).where(MigChange.node == change.node, MigChange.id != change.id, _holds_node())
        )
    )


def clear_change(
    session: Session, change: MigChange, adapter_of: Callable[[str], ClusterAdapter], *, by: str, now: datetime
) -> None:
    """An admin's word that a ``failed`` change's GPU is fine again: the change ends
    ``cleared`` and its node takes work again (unfenced where gpush fenced it)."""
    if change.step != "failed":
        raise InvalidRequest(
            f"MIG change {change.id} is {change.step}: only a failed change is cleared "
            "(one under way ends by itself, rolling back if it must)"
        )
    if not _others_hold(session, change):
        try:
            fencer = capability(adapter_of(change.cluster), NodeFencer)
        except AdapterError as exc:
            raise InvalidRequest(
                f"cluster {change.cluster} cannot be reached to unfence {change.node}: {exc}"
            ) from None
        if fencer is not None:
            fencer.unfence(change.node)
    change.step, change.step_at = "cleared", now
    _event(session, change, now, f"cleared by {by}: {change.node} takes work again")


def open_changes(session: Session) -> list[MigChange]:
    return list(session.execute(select(MigChange).where(MigChange.ended_at.is_(None)).order_by(MigChange.id)).scalars())


def wanted_by_agent(session: Session, node: str) -> list[dict[str, Any]]:
    """What the agent of ``node`` is to change now: the GPUs in step ``changing``, each
    with its target layout (the answer to its report)."""
    rows = session.execute(
        select(MigChange).where(
            MigChange.ended_at.is_(None),
            MigChange.node == node,
            MigChange.step == "changing",
            MigChange.changed_by == "agent",
        )
    ).scalars()
    return [{"change": c.id, "gpu": c.gpu, "layout": list(c.target)} for c in rows]


def events_of(session: Session, change_ids: Sequence[int]) -> dict[int, list[MigChangeEvent]]:
    out: dict[int, list[MigChangeEvent]] = {i: [] for i in change_ids}
    if change_ids:
        rows = session.execute(
            select(MigChangeEvent).where(MigChangeEvent.change_id.in_(change_ids)).order_by(MigChangeEvent.id)
        ).scalars()
        for event in rows:
            out[event.change_id].append(event)
    return out


def change_findings(session: Session, now: datetime, within: timedelta = timedelta(days=1)) -> list[Finding]:
    """Changes that ended badly: ``failed`` (critical, until an admin clears it: the node
    stays fenced) and, in the last ``within``, ``rolled-back`` (a warning: the GPU has its
    old layout)."""
    rows = session.execute(
        select(MigChange).where(
            (MigChange.step == "failed") | ((MigChange.step == "rolled-back") & (MigChange.ended_at >= now - within))
        )
    ).scalars()
    findings = []
    for c in rows:
        failed = c.step == "failed"
        findings.append(
            Finding(
                kind="mig_change_failed" if failed else "mig_change_rolled_back",
                severity=CRITICAL if failed else WARNING,
                cluster=c.cluster,
                node=c.node,
                gpu=c.gpu,
                what=f"MIG change {c.id} of {c.node} GPU {c.gpu} " + ("failed" if failed else "was rolled back"),
                why=(
                    "the GPU may hold neither layout, and gpush keeps the node fenced"
                    if failed
                    else "the GPU has its old layout; the waiting work the change was for still waits"
                ),
                fix=(
                    f"gpush mig changes {c.id} says which step ran out of time and why; once the GPU "
                    f"and {c.cluster} agree again (gpush inventory drift), gpush mig changes {c.id} --clear"
                    if failed
                    else f"gpush mig changes {c.id} says which step ran out of time and why"
                ),
            )
        )
    return findings


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
            rows = session.execute(select(MigChange).where(_holds_node())).scalars()
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
                select(Job).where(Job.cluster == change.cluster, Job.state.in_(_HOLDING))
            ).scalars()
            if job.placement
            and job.placement.get("node") == change.node
            and (whole or job.placement.get("mig_profile") in profiles)
        ]
        holders = [job.id for job in holding]
        if holding and self.policy is not None:
            self._preempt(session, change, holding, now)
        report = _report(session, change.node)
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
                f"still in use after {_span(self.limits.emptying)}: {what}; nothing was changed",
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
            _event(session, change, now, f"preempting job {job_id} (preemptible): {told}")

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
            gpu = _gpu(report, change.gpu)
            if gpu is not None and same_instances(reported_layout(gpu), change.target):
                return self._move(
                    session,
                    change,
                    "publishing",
                    now,
                    f"the agent of {change.node} reports the {_which(change)}",
                )
        if late:
            return self._late(
                session,
                change,
                now,
                f"the agent of {change.node} did not report the {'old' if change.rolling_back else 'new'} layout "
                f"in {_span(self.limits.changing)}",
            )
        return None

    def _publishing(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        publisher = capability(adapter, MigPublisher)
        if publisher is None:
            return self._late(session, change, now, f"cluster {change.cluster} cannot publish a MIG layout")
        if same_instances(publisher.mig_published(change.node, change.gpu) or (), change.target):
            return self._move(session, change, "confirming", now, f"{change.cluster} offers that layout already")
        report = _report(session, change.node)
        reported = _gpu(report, change.gpu) if report is not None else None
        publisher.publish_mig(change.node, change.gpu, list(change.target), reported)
        return self._move(session, change, "confirming", now, f"{change.cluster} told of the {_which(change)}")

    def _confirming(self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, late: bool):
        publisher = capability(adapter, MigPublisher)
        offered = publisher.mig_published(change.node, change.gpu) if publisher else None
        problems = []
        if offered is None or not same_instances(offered, change.target):
            problems.append(f"{change.cluster} offers {', '.join(offered or ()) or 'nothing'} yet")
        report = _report(session, change.node)
        if report is not None:
            gpu = _gpu(report, change.gpu)
            # A cluster that changes the GPU itself places the instances its own way
            # (mig-parted): its agent's report need only show the same profiles.
            exact = change.changed_by == "agent"
            if gpu is None or not same_instances(_shown(reported_layout(gpu), exact), _shown(change.target, exact)):
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
            _event(session, change, now, f"rollback failed: {why}; {change.node} stays fenced until an admin looks")
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
        _event(session, change, now, note, step=done)
        change.step, change.step_at = step, now
        limit = self.limits.of(step)
        change.deadline = now + limit if limit is not None else None
        return f"{done}: {note}"

    def _end(
        self, session: Session, change: MigChange, adapter: ClusterAdapter, now: datetime, ending: str, note: str
    ) -> str:
        fencer = capability(adapter, NodeFencer)
        if fencer is not None and not _others_hold(session, change):
            fencer.unfence(change.node)
        change.step, change.ended_at, change.deadline, change.step_at = ending, now, None, now
        _event(session, change, now, note)
        return f"{ending}: {note}"


def _shown(instances: Iterable[str], exact: bool) -> list[str]:
    return list(instances) if exact else [MigSlot.parse(text).profile for text in instances]


def _which(change: MigChange) -> str:
    return "old layout back" if change.rolling_back else "new layout"


def _span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def _event(session: Session, change: MigChange, at: datetime, note: str, *, step: str | None = None) -> None:
    session.add(MigChangeEvent(change_id=change.id, at=at, step=step or change.step, note=note))


def _report(session: Session, node: str) -> NodeReport | None:
    row = session.get(NodeReportRow, node)
    return NodeReport.model_validate(row.report) if row is not None else None


def _gpu(report: NodeReport, index: int) -> GpuReport | None:
    return next((g for g in report.gpus if g.index == index), None)
