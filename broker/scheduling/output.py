"""A job's output (``gpush logs``): which cluster holds it, read through its adapter.

The broker keeps no copy of what jobs print: it asks the cluster that ran the job
(broker.core.adapter's ``LogReader``: Slurm's output files, Kubernetes' pod logs, the
simulator's story of the run) at the moment the user asks. When the cluster cannot be
read from here, the answer still says where the output is, so the user can look there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from broker.core.adapter import AdapterError, ClusterAdapter, LogReader, Rejected, capability
from broker.core.auth import Principal
from broker.core.errors import Conflict, InvalidRequest, Unavailable
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
        raise Conflict(
            f"job {job_id} is {state.value} and never reached a cluster: it has no output"
            + ("" if state in TERMINAL else "; `gpush status` says what it waits for")
        )
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
