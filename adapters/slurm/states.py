"""Slurm's jobs as gpush states: a job squeue lists, or the record of one that left it
(accounting, the job completion log), as a :class:`BackendJob`, with the reason a job
waits or ended in the user's terms.

A pending job's reason counts what it waits for across the cluster (``2 of 7 busy``):
the nodes' GRES in use, and for MPS the running jobs' requests
(:func:`adapters.slurm.capacity.mps_in_use`), read once per status page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from adapters.slurm.capacity import mps_in_use
from adapters.slurm.context import SlurmContext
from adapters.slurm.limits import limit_reason
from adapters.slurm.records import MIG_TYPE, FinishedRecord, Gres, SlurmJob, SlurmNode
from adapters.slurm.records import PENDING_STATES as _PENDING
from broker.core.adapter import AdapterError, BackendJob, BackendState


class JobStates:
    """Slurm's states and reasons in gpush's terms, for one cluster."""

    def __init__(self, ctx: SlurmContext):
        self.ctx = ctx

    def backend(self, job_id: int, job: SlurmJob, usage: Callable[[], GresUsage | None] | None = None) -> BackendJob:
        state, reason = self._state(job, usage)
        at = job.end_time if state in (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.CANCELLED) else None
        at = at or (job.start_time if state == BackendState.RUNNING else None)
        exit_code = job.exit_code if state in (BackendState.SUCCEEDED, BackendState.FAILED) else None
        return BackendJob(job_id, job.job_id, state, reason=reason, node=job.nodes or None, exit_code=exit_code, at=at)

    def finished(self, job_id: int, record: FinishedRecord) -> BackendJob:
        state, reason = _final_state(record.state, record.exit_code)
        return BackendJob(
            job_id,
            record.job_id,
            state,
            reason=reason,
            node=record.nodes or None,
            exit_code=record.exit_code,
            at=record.end_time,
        )

    def _state(
        self, job: SlurmJob, usage: Callable[[], GresUsage | None] | None = None
    ) -> tuple[BackendState, str | None]:
        state = job.state
        if state in _PENDING:
            return BackendState.PENDING, self.pending_reason(job, usage)
        if state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING"):
            if state == "SUSPENDED":
                return BackendState.RUNNING, f"suspended by Slurm on {job.nodes}"
            return BackendState.RUNNING, None
        return _final_state(state, job.exit_code, job.reason)

    def pending_reason(self, job: SlurmJob, usage: Callable[[], GresUsage | None] | None = None) -> str:
        """Why a job waits in Slurm, in the user's terms. ``usage``: the cluster's GRES use,
        read once for a whole status page (by default read now)."""
        waiting = self._pending_reason(job, usage)
        if job.restarts:
            # Requeued by Slurm itself (its node failed, it was preempted, scontrol requeue).
            times = "once" if job.restarts == 1 else f"{job.restarts} times"
            return f"requeued by {self.ctx.name} (it started there {times} before); {waiting}"
        return waiting

    def _pending_reason(self, job: SlurmJob, usage: Callable[[], GresUsage | None] | None) -> str:
        reason = job.reason
        if reason == "Resources" and "DOWN, DRAINED" in job.description:
            # 22.05 keeps the reason Resources when the job's only nodes are drained
            # or down, and says so in state_description.
            reason = "ReqNodeNotAvail"
        wanted = next((g for g in job.tres_per_node if g.name in ("gpu", "mps")), None)
        what = _describe(wanted) if wanted else "its resources"
        if reason in ("Resources", "Priority", "None") and wanted is not None:
            total, busy = _gres_use(wanted, (usage or self.usage)())
            if reason == "Priority" and total and busy < total:
                return f"waiting in {self.ctx.name}'s queue for {what} ({busy} of {total} busy)"
            if reason == "Priority":
                return f"waiting in {self.ctx.name} for {what}, behind higher-priority jobs: all {total} busy"
            if total and busy >= total:
                return f"waiting in {self.ctx.name} for {what}: all {total} busy"
            if total:
                return f"waiting in {self.ctx.name} for {what} ({busy} of {total} busy)"
            return f"waiting in {self.ctx.name} for {what}"
        explained = {
            "BadConstraints": f"no node of {self.ctx.name} offers {what}",
            "ReqNodeNotAvail": f"the nodes of {self.ctx.name} that have {what} are down, drained or reserved",
            "Reservation": f"waiting for a reservation on {self.ctx.name}",
            "PartitionDown": f"partition {job.partition} of {self.ctx.name} is down",
            "PartitionInactive": f"partition {job.partition} of {self.ctx.name} is inactive",
            "PartitionNodeLimit": f"partition {job.partition} of {self.ctx.name} has too few nodes for the job",
            "PartitionTimeLimit": f"the time limit is over partition {job.partition}'s maximum",
            "JobHeldAdmin": f"held by a {self.ctx.name} administrator (scontrol release)",
            "JobHeldUser": "held by its user (scontrol release)",
            "Dependency": "waiting for the jobs it depends on",
            "BeginTime": "waiting for its begin time"
            + (f" ({job.eligible_time:%Y-%m-%d %H:%M:%S} UTC)" if job.eligible_time else ""),
            "NodeDown": f"a node it needs on {self.ctx.name} is down",
        }
        if reason in explained:
            return explained[reason]
        if (limit := limit_reason(reason, cluster=self.ctx.name, account=job.account, qos=job.qos)) is not None:
            return limit
        return f"waiting in {self.ctx.name}: {reason}"

    def usage(self, jobs: Sequence[SlurmJob] | None = None) -> GresUsage | None:
        """The nodes and MPS in use now, for reasons; None when Slurm does not answer."""
        try:
            nodes = self.ctx.nodes()
            return GresUsage(nodes, mps_in_use(self.ctx.jobs() if jobs is None else jobs))
        except AdapterError:
            return None


@dataclass(frozen=True)
class GresUsage:
    """What the cluster's GRES are doing, as pending reasons count it."""

    nodes: Sequence[SlurmNode]
    mps_used: dict[str, int]  # MPS units held per node by running jobs


def _gres_use(wanted: Gres, usage: GresUsage | None) -> tuple[int, int]:
    """(total, busy) of a GRES kind across the cluster, for reasons."""
    if usage is None:
        return 0, 0
    total = busy = 0
    if wanted.name == "mps":
        for node in usage.nodes:
            have = sum(g.count for g in node.gres if g.name == "mps")
            total += have
            busy += min(usage.mps_used.get(node.name, 0), have)
        return total, busy
    for node in usage.nodes:
        total += sum(g.count for g in node.gres if g.name == "gpu" and g.type == wanted.type)
        busy += sum(g.count for g in node.gres_used if g.name == "gpu" and g.type == wanted.type)
    return total, busy


def _describe(gres: Gres) -> str:
    if gres.name == "mps":
        return f"an MPS share of {gres.count}"
    if gres.type and MIG_TYPE.match(gres.type):
        return f"a {gres.type} slice" if gres.count == 1 else f"{gres.count} {gres.type} slices"
    kind = f"{gres.type} " if gres.type else ""
    return f"{gres.count} whole {kind}GPU{'s' if gres.count > 1 else ''}"


def _final_state(state: str, exit_code: int | None, reason: str | None = None) -> tuple[BackendState, str | None]:
    if state == "COMPLETED":
        return BackendState.SUCCEEDED, None
    if state == "CANCELLED":
        return BackendState.CANCELLED, "cancelled in Slurm"
    why = {
        "TIMEOUT": "reached its time limit",
        "OUT_OF_MEMORY": "ran out of memory (Slurm OUT_OF_MEMORY)",
        "NODE_FAIL": "its node failed",
        "BOOT_FAIL": "its node failed to boot",
        "DEADLINE": "missed its deadline",
        "PREEMPTED": "preempted",
    }.get(state)
    if state == "FAILED" and reason == "BadConstraints":
        return BackendState.FAILED, "Slurm refused it at submission: no node offers what it asks for"
    if state == "FAILED" and reason == "JobLaunchFailure":
        # Seen on 22.05 when the directory of --output or --error is missing on the node.
        return BackendState.FAILED, (
            "Slurm could not start it on its node (JobLaunchFailure): is the cluster's log_dir, "
            "or the job's working directory, missing there? Slurm creates neither"
        )
    if why is None:
        why = f"exited with code {exit_code}" if exit_code else f"Slurm state {state}"
        if reason and reason not in ("None", "NonZeroExitCode"):
            why += f" ({reason})"
    return BackendState.FAILED, why
