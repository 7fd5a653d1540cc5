"""A job's output (``gpush logs``): which cluster holds it, read through its adapter.

The broker keeps no copy of what jobs print: it asks the cluster that ran the job
(broker.core.adapter's ``LogReader``: Slurm's output files, Kubernetes' pod logs, the
simulator's story of the run) at the moment the user asks. When the cluster cannot be
read from here, the answer still says where the output is, so the user can look there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.adapter import AdapterError, ClusterAdapter, LogReader, Rejected, capability
from broker.core.auth import Principal
from broker.core.errors import Conflict, InvalidRequest, NotFound, Unavailable
from broker.core.models import JobEvent, Preemption
from broker.core.states import TERMINAL, JobState
from broker.intake.queue import get_job

STREAMS = ("stdout", "stderr")
MAX_TAIL = 100_000  # lines


def read_output(
    session: Session,
    job_id: int,
    principal: Principal,
    *,
    adapter_for: Callable[[str], ClusterAdapter],
    stream: str = "stdout",
    replica: int | None = None,
    offset: int = 0,
    tail: int | None = None,
) -> dict[str, Any]:
    """Job ``job_id``'s output from ``offset`` (or its last ``tail`` lines), with where it
    is and whether the job is over (``final``: no more will come)."""
    if stream not in STREAMS:
        raise InvalidRequest(f"stream must be stdout or stderr, not {stream!r}")
    if tail is not None and not 0 <= tail <= MAX_TAIL:
        raise InvalidRequest(f"tail must be between 0 and {MAX_TAIL:,} lines")
    if offset < 0 or (replica is not None and replica < 0):
        raise InvalidRequest("offset and replica count from 0")
    job = get_job(session, job_id, principal)
    state = JobState(job.state)
    answer: dict[str, Any] = {"job_id": job.id, "state": state.value, "final": state in TERMINAL}
    if not job.cluster or not job.backend_id:
        then = "" if state in TERMINAL else "; `gpush status` says what it waits for"
        earlier = _requeued_run(session, job, adapter_for, stream)
        if earlier is None:
            raise Conflict(f"job {job_id} is {state.value} and never reached a cluster: it has no output{then}")
        again = (
            "it did not run again"
            if state in TERMINAL
            else "it waits to run again: `gpush status` says what it waits for"
        )
        raise Conflict(f"job {job_id} is {state.value}: {earlier}; {again}")
    reader = capability(adapter_for(job.cluster), LogReader)
    if reader is None:
        return answer | {
            "location": f"cluster {job.cluster}, job {job.backend_id}",
            "text": "",
            "next_offset": offset,
            "readable": False,
            "note": f"cluster {job.cluster} does not let gpush read job output: look on the cluster itself",
        }
    try:
        output = reader.logs(job.id, job.backend_id, stream=stream, replica=replica, offset=offset, tail=tail)
    except Rejected as exc:
        raise Conflict(str(exc)) from None
    except AdapterError as exc:
        raise Unavailable(f"cannot read job {job_id}'s output from {job.cluster} now: {exc}") from None
    return answer | output.to_dict()


def _requeued_run(session: Session, job, adapter_for: Callable[[str], ClusterAdapter], stream: str) -> str | None:
    """How a job that is on no cluster now last ran, if it was requeued (preempted, or
    lost by its cluster): ``it was running on slurm-a node gpu-01 and was requeued (why)``,
    and where that run's output is while its cluster still says (a preemption keeps the
    run's placement); None if it never ran."""
    events = session.execute(
        select(JobEvent.to_state, JobEvent.reason)
        .where(JobEvent.job_id == job.id, JobEvent.type == "transition")
        .order_by(JobEvent.id.desc())
    ).all()
    requeued = next((i for i, e in enumerate(events) if e.to_state == JobState.REQUEUED.value), None)
    if requeued is None:
        return None
    ran = next((e for e in events[requeued + 1 :] if e.to_state in _RAN), None)
    words = f"it was {ran.reason}" if ran is not None and ran.reason else "it reached a cluster"
    words += f" and was requeued ({events[requeued].reason})" if events[requeued].reason else " and was requeued"
    placement = session.execute(
        select(Preemption.placement).where(Preemption.victim_id == job.id).order_by(Preemption.id.desc()).limit(1)
    ).scalar_one_or_none()
    cluster = (placement or {}).get("cluster")
    if cluster and job.backend_id:
        try:
            reader = capability(adapter_for(cluster), LogReader)
            if reader is not None:
                words += f"; its earlier output: {reader.logs(job.id, job.backend_id, stream=stream, tail=0).location}"
        except (AdapterError, NotFound):  # the cluster forgot that run, or is gone: where is not known
            pass
    return words


# The transitions that mean a cluster had the job: accepted it, or started it.
_RAN = (JobState.SUBMITTED.value, JobState.RUNNING.value)
