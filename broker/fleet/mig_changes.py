"""MIG layout changes, one GPU at a time, recorded and resumable (``gpush mig apply``).

This module owns the broker's half of changing a GPU's MIG layout; the node agent's half
(the NVML calls) is broker.nodeagent.mig_apply. A change is a :class:`MigChange` row,
written before anything is touched, that moves through these steps, each an event
(:class:`MigChangeEvent`) with what happened:

1. ``planned``: asked for (``gpush mig apply``), from the plan of broker.mig.plan. It waits
   while ``max_at_once`` other GPUs are changing.
2. ``draining``: no new work lands on the GPU's node: the scheduler places nothing there
   (:meth:`broker.fleet.mig_steps.Reconfigurations.fenced`, its units marked unavailable)
   and a cluster that can fence a node (:class:`broker.core.adapter.NodeFencer`: Slurm drains, Kubernetes cordons)
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

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.core.adapter import AdapterError, ClusterAdapter, MigPublisher, NodeFencer, capability
from broker.core.errors import InvalidRequest
from broker.core.models import MigChange, MigChangeEvent
from broker.core.models import NodeReport as NodeReportRow
from broker.core.states import JobState
from broker.inventory.agent_report import GpuReport, NodeReport
from broker.inventory.view import CRITICAL, WARNING, Finding
from broker.mig.layouts import MigSlot
from broker.mig.plan import MigPlan

STEPS = ("planned", "draining", "emptying", "changing", "publishing", "confirming", "admitting")
ENDINGS = ("done", "rolled-back", "cancelled", "failed")
# Jobs that hold their units on the node until they end.
HOLDING = (JobState.SUBMITTED.value, JobState.RUNNING.value)


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
        record_event(
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


def holds_node():
    """The changes that keep their node fenced: under way past ``planned``, or failed (until
    an admin clears it)."""
    return (MigChange.ended_at.is_(None) & (MigChange.step != "planned")) | (MigChange.step == "failed")


def others_hold(session: Session, change: MigChange) -> bool:
    """Whether another change keeps ``change``'s node fenced (then it stays fenced)."""
    return bool(
        session.scalar(
            select(func.count()).where(MigChange.node == change.node, MigChange.id != change.id, holds_node())
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
    if not others_hold(session, change):
        try:
            fencer = capability(adapter_of(change.cluster), NodeFencer)
        except AdapterError as exc:
            raise InvalidRequest(
                f"cluster {change.cluster} cannot be reached to unfence {change.node}: {exc}"
            ) from None
        if fencer is not None:
            fencer.unfence(change.node)
    change.step, change.step_at = "cleared", now
    record_event(session, change, now, f"cleared by {by}: {change.node} takes work again")


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


def shown(instances: Iterable[str], exact: bool) -> list[str]:
    return list(instances) if exact else [MigSlot.parse(text).profile for text in instances]


def which_gpu(change: MigChange) -> str:
    return "old layout back" if change.rolling_back else "new layout"


def span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def record_event(session: Session, change: MigChange, at: datetime, note: str, *, step: str | None = None) -> None:
    session.add(MigChangeEvent(change_id=change.id, at=at, step=step or change.step, note=note))


def node_report(session: Session, node: str) -> NodeReport | None:
    row = session.get(NodeReportRow, node)
    return NodeReport.model_validate(row.report) if row is not None else None


def gpu_of(report: NodeReport, index: int) -> GpuReport | None:
    return next((g for g in report.gpus if g.index == index), None)
