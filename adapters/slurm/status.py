"""Following gpush's jobs in Slurm: the pages of :meth:`StatusTracker.statuses` (the
guarantees: "Statuses" in adapters.slurm.adapter's docstring), what each page has
reported, and the jobs that left squeue with no record (:meth:`StatusTracker._vanished`).
What a restarted slurmctld left behind is cleared on the way (adapters.slurm.restarts)."""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime
from typing import NamedTuple

from adapters.slurm.context import SlurmContext
from adapters.slurm.records import FINAL_STATES as _FINAL
from adapters.slurm.records import SLACK as _SLACK
from adapters.slurm.records import SlurmJob
from adapters.slurm.restarts import RestartRecovery
from adapters.slurm.states import JobStates
from broker.core.adapter import BackendJob, BackendState, StatusPage


class StatusTracker:
    """What changed in one Slurm cluster's gpush jobs since a cursor (see the module docstring)."""

    def __init__(self, ctx: SlurmContext, states: JobStates, restarts: RestartRecovery):
        self.ctx = ctx
        self.states = states
        self.restarts = restarts
        self._read_finished = False  # the first status read after a start also reads finished jobs
        # What the last page said of each gpush job: the run (its Slurm job id), its state and
        # why. The run is part of it: a job preempted and queued again runs as a new Slurm job,
        # and a rerun that squeue first lists ended as its previous run did is news all the same.
        self._reported: dict[int, _Said] = {}
        # gpush id -> (when squeue last listed it unfinished (monotonic), its Slurm job id)
        self._seen: dict[int, tuple[float, str]] = {}

    def statuses(self, cursor: str | None = None) -> StatusPage:
        since = _cursor_time(cursor)
        jobs = self.ctx.jobs(fresh=True)
        self.restarts.release_placeholders(jobs)
        phantoms = self.restarts.phantoms(jobs)
        tagged = self.ctx.tagged(jobs)
        usage = functools.cache(lambda: self.states.usage(jobs))  # read once, if a job is pending
        with self.ctx.lock:
            reported = dict(self._reported)
            cancelled = self.restarts.cancelled()
        now_reported: dict[int, _Said] = {}
        read_at = time.monotonic()
        out: list[BackendJob] = []
        latest = since
        current: dict[int, str] = {}  # unfinished gpush jobs -> their Slurm job ids
        ended_runs: dict[str, datetime] = {}
        own_phantoms: list[tuple[int, SlurmJob]] = []
        for job_id, records in tagged.items():
            job = self.ctx.real(records)
            if job is None:
                continue
            if job.job_id in phantoms or job.job_id in cancelled:
                # It ended before slurmctld restarted: say how it ended if the broker may not
                # know yet (from the record of its end), never that it runs (see RestartRecovery.phantoms).
                record = phantoms.get(job.job_id)
                if job.job_id in phantoms and job.job_id not in cancelled:
                    own_phantoms.append((job_id, job))
                seen = reported.get(job_id)
                if record is not None:
                    backend = self.states.finished(job_id, record)
                    if seen != _said(backend):
                        out.append(backend)
                    now_reported[job_id] = _said(backend)
                elif seen is not None:
                    now_reported[job_id] = seen
                continue
            if job.state in _FINAL and job.start_time is not None:
                ended_runs[job.job_id] = job.start_time
            changed = job.last_change
            if changed is not None and (latest is None or changed > latest):
                latest = changed
            if job.state not in _FINAL:
                current[job_id] = job.job_id
            backend = self.states.backend(job_id, job, usage)
            seen = reported.get(job_id)
            if seen is not None:
                # Seen by this process: report it when its run, state or reason moved.
                if seen != _said(backend):
                    out.append(backend)
            elif since is None or changed is None or changed >= since - _SLACK:
                out.append(backend)
            now_reported[job_id] = _said(backend)
        with self.ctx.lock:
            vanished = self.ctx.active - set(tagged)
            # After a start, jobs that ended since the cursor may have left squeue already.
            catch_up = not self._read_finished and since is not None
            self._read_finished = True
        if vanished or catch_up:
            lost = 0
            records = {}
            for record in self.ctx.client.finished(None if vanished else since - _SLACK):
                job_id = self.ctx.gpush_id(record)
                if job_id is None or job_id in tagged:
                    continue
                ended_since = catch_up and (record.end_time is None or record.end_time >= since - _SLACK)
                if job_id in vanished or ended_since:
                    records[job_id] = record
            for job_id, record in records.items():
                out.append(self.states.finished(job_id, record))
            for job_id in vanished - set(records):
                seen_at, backend_id = self._seen.get(job_id) or (None, self.ctx.known.get(job_id, "?"))
                last = reported.get(job_id)
                state, why = self._vanished(last.state if last is not None else None, seen_at, read_at)
                if state == BackendState.LOST:
                    with self.ctx.lock:
                        self.ctx.known.pop(job_id, None)  # a resubmission must reach Slurm
                    if backend_id.isdigit():
                        lost = max(lost, int(backend_id))
                out.append(BackendJob(job_id, backend_id, state, reason=why))
            if lost:
                self.restarts.lost(lost)
        for job_id, job in own_phantoms:
            self.restarts.cancel_phantom(job_id, job)
        with self.ctx.lock:
            self.restarts.ended(ended_runs)
            self.ctx.active = set(current)
            self._reported = now_reported
            self._seen = {job_id: (read_at, backend_id) for job_id, backend_id in current.items()}
        cursor_out = f"t={int(latest.timestamp())}" if latest is not None else cursor
        return StatusPage(out, cursor_out)

    def _vanished(self, last: BackendState | None, seen: float | None, now: float) -> tuple[BackendState, str]:
        """A job squeue no longer lists and no record explains: lost by slurmctld, or ended
        with nothing left to say how.

        slurmctld keeps a finished job in squeue for MinJobAge seconds. One that is gone
        sooner after it was last seen unfinished did not end: slurmctld lost it, crashing
        before it saved its state (every few seconds), and on restart it forgot the job and
        ended its processes as orphans. It can run again, as Slurm's own requeue after a
        node failure would run it (JobRequeue=1, Slurm's default). ``last``: the state the
        last page reported; ``seen``: when squeue last listed it unfinished (monotonic).
        """
        if last in (None, BackendState.PENDING):
            return BackendState.LOST, (
                f"{self.ctx.name} lost the job before it was seen running (slurmctld restarted without it)"
            )
        if seen is not None and now - seen < self.ctx.settings.min_job_age:
            return BackendState.LOST, (
                f"{self.ctx.name} lost the job while it ran (slurmctld restarted without it "
                "and ended its processes); it runs again from the start"
            )
        return BackendState.FAILED, (
            f"left {self.ctx.name}'s queue with no record of how it ended "
            "(no accounting, no readable job completion log: set jobcomp_file)"
        )


class _Said(NamedTuple):
    """What a page said of a gpush job."""

    run: str  # its Slurm job id
    state: BackendState
    reason: str | None


def _said(backend: BackendJob) -> _Said:
    return _Said(backend.backend_id, backend.state, backend.reason)


def _cursor_time(cursor: str | None) -> datetime | None:
    if not cursor or not cursor.startswith("t="):
        return None
    try:
        return datetime.fromtimestamp(int(cursor[2:]), UTC)
    except ValueError:
        return None
