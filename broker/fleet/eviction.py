"""Jobs preempted for a change of the fleet itself, and how any preempted job is told.

A MIG layout change (broker.fleet.mig_changes) or a node lent to another cluster
(broker.fleet.lending) empties a node by preempting the preemptible jobs on it: each gets a
``preemptions`` row, as a job preempted for a waiting one does, and from there the cycle's
preemption step (broker.scheduling.preemption) tells and stops it and the status sync
queues it again. What a victim is told (its checkpoint's signal and grace, else SIGTERM and
the policy's grace) is the same whichever preemption asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select

from broker.core.models import Job, JobEvent
from broker.core.models import Preemption as PreemptionRow
from broker.core.schemas import JobSpec
from broker.core.states import JobState
from broker.routing.evaluation import preemptible

S = JobState
ACTOR = "scheduler"
EVENT = "preemption"
DEFAULT_SIGNAL = "SIGTERM"


def how_told(spec: JobSpec, policy) -> tuple[str, int]:
    """The signal a victim gets and its grace in seconds: its checkpoint's, else SIGTERM
    and the policy's grace."""
    if spec.checkpoint is not None:
        return spec.checkpoint.signal, spec.checkpoint.grace
    return DEFAULT_SIGNAL, policy.preemption.grace


def preemption_event(job_id: int, state: JobState, reason: str, now: datetime) -> JobEvent:
    """A note on a job's events about its preemption (the job stays in ``state``)."""
    return JobEvent(
        job_id=job_id, at=now, type=EVENT, from_state=state.value, to_state=state.value, reason=reason, actor=ACTOR
    )


def preempt_for_fleet(
    session,
    policy,
    jobs: Sequence[Job],
    *,
    why: str,
    kind: str,
    now: datetime,
    mig_change_id: int | None = None,
) -> list[tuple[int, str, int]]:
    """Preempt the running, preemptible ``jobs`` for a change of the fleet rather than for a
    waiting job (a MIG layout change, a node lent to another cluster): a preemption row
    each (``kind``: ``mig-change`` or ``lending``; ``why`` its reason), which step 3 of the
    cycle tells and stops as any other, and the status sync queues again. Jobs already
    being preempted, not running, or not preemptible are left. Returns (job, signal,
    grace) of those asked."""
    asked = set(
        session.execute(
            select(PreemptionRow.victim_id).where(
                PreemptionRow.victim_id.in_([job.id for job in jobs]), PreemptionRow.ended_at.is_(None)
            )
        ).scalars()
    )
    out = []
    for job in jobs:
        if job.id in asked or job.state != S.RUNNING.value:
            continue
        spec = JobSpec.model_validate(job.spec)
        if not preemptible(policy, spec, job.tenant):
            continue
        signal, grace = how_told(spec, policy)
        session.add(
            PreemptionRow(
                victim_id=job.id,
                preemptor_id=None,
                mig_change_id=mig_change_id,
                why=kind,
                reason=why,
                signal=signal,
                grace_seconds=grace,
                gpu_equivalents=job.gpu_equivalents or 0.0,
                placement=job.placement,
                requested_at=now,
            )
        )
        session.add(preemption_event(job.id, S.RUNNING, f"{why}: to be told with {signal}", now))
        out.append((job.id, signal, grace))
    return out
