"""What a slurmctld restarted from an older state (a crash between two of its saves, a state
restored from a copy) leaves behind, and how the adapter clears it:

- **job ids given out again**: the first submission after slurmctld lost jobs skips them
  with held placeholder jobs, cancelled once the nodes have registered
  (:meth:`RestartRecovery.skip_reused_ids`, :meth:`RestartRecovery.release_placeholders`);
- **phantom runs**: runs it lists as running though they had ended, found by their end in
  the records (:meth:`RestartRecovery.phantoms`); gpush's own are cancelled
  (:meth:`RestartRecovery.cancel_phantom`), other owners' reported by ``health``
  (:meth:`RestartRecovery.stale_foreign_runs`, :func:`phantom_words`).

The status read (adapters.slurm.status) says when to look: it finds the jobs slurmctld lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta

from adapters.slurm.context import SlurmContext
from adapters.slurm.records import FINAL_STATES as _FINAL
from adapters.slurm.records import SLACK as _SLACK
from adapters.slurm.records import FinishedRecord, SlurmJob, Submission
from broker.core.adapter import AdapterError, Rejected

_log = logging.getLogger(__name__)
# The most job ids skipped after slurmctld lost jobs (about as many as it lost).
_MAX_SKIPPED = 1000
# How long a held placeholder (see RestartRecovery.skip_reused_ids) waits for nodes that have not
# registered with the restarted slurmctld before it is cancelled anyway.
_PLACEHOLDER_HOLD = 300.0
# Runs of gpush jobs this process saw end, remembered to know them again (see RestartRecovery.phantoms).
_MAX_ENDED_RUNS = 10_000
# What a restarted slurmctld lists such a run as. Not COMPLETING: the end of a run that is
# completing is in the records already, and that run is no phantom.
_UNFINISHED_RUN = frozenset({"RUNNING", "SUSPENDED"})


class RestartRecovery:
    """Reused job ids and phantom runs of one Slurm cluster (see the module docstring)."""

    def __init__(self, ctx: SlurmContext):
        self.ctx = ctx
        self._skipping = threading.Lock()  # one pass of skip_reused_ids at a time
        # After slurmctld lost jobs: the highest job id it may give out again (see skip_reused_ids)
        self._reused_up_to: int | None = None
        self._held_since: dict[str, float] = {}  # placeholder Slurm id -> when first seen held (monotonic)
        # Runs slurmctld lists as unfinished though they ended before it restarted (phantoms):
        self._check_phantoms = True  # look in the finished records at the next status read
        self._ended_runs: dict[str, datetime] = {}  # Slurm id -> start time, of gpush runs seen ended
        self._cancelled_phantoms: set[str] = set()  # gpush's own, cancelled here: their record is not news
        self._foreign_phantoms: dict[str, SlurmJob] = {}  # other users' or brokers', reported by health

    def lost(self, up_to: int) -> None:
        """slurmctld lost jobs up to Slurm id ``up_to``: skip those ids, look for phantoms."""
        with self.ctx.lock:
            self._reused_up_to = max(up_to, self._reused_up_to or 0)
            # A controller that lost jobs restarted from an older state, in which
            # runs that had ended since may still run: look for them next time.
            self._check_phantoms = True

    def ended(self, runs: dict[str, datetime]) -> None:
        """Remember runs of gpush jobs seen ended (Slurm id -> start), to know them again."""
        with self.ctx.lock:
            self._ended_runs.update(runs)
            while len(self._ended_runs) > _MAX_ENDED_RUNS:
                del self._ended_runs[next(iter(self._ended_runs))]

    def cancelled(self) -> set[str]:
        """The Slurm ids of gpush's phantom runs cancelled here (their record is not news)."""
        with self.ctx.lock:
            return set(self._cancelled_phantoms)

    def stale_foreign_runs(self) -> list[SlurmJob]:
        """Other owners' runs found ended (phantoms) that slurmctld still lists unfinished."""
        with self.ctx.lock:
            found = dict(self._foreign_phantoms)
        if not found:
            return []
        try:
            listed = {j.job_id: j for j in self.ctx.jobs()}
        except AdapterError:
            return []
        still = [
            j
            for i, j in found.items()
            if i in listed and listed[i].state in _UNFINISHED_RUN and _same_run(listed[i], j.start_time)
        ]
        with self.ctx.lock:
            self._foreign_phantoms = {j.job_id: j for j in still}
        return still

    def skip_reused_ids(self) -> None:
        """After slurmctld lost jobs, move its job ids past theirs before submitting again.

        A restarted slurmctld that lost its latest state gives the lost jobs' ids out
        again. The nodes still remember the ids they launched (slurmd keeps them until
        slurmctld tells it the job ended, which the new one never does), so a new job with
        such an id is refused as "already running, do not launch second copy": Slurm
        requeues it held and drains the node ("Duplicate jobid"). Seen on the test
        cluster, Slurm 22.05. So the first submission after a loss asks for those ids as
        held placeholder jobs that run nothing, until Slurm's ids have reached the highest
        lost one (at most ``_MAX_SKIPPED`` of them).

        The placeholders stay held until every node has registered with the restarted
        slurmctld (:meth:`release_placeholders`). A node that reports a lost job's id
        while a pending job holds it has the lost run aborted ("Registered PENDING JobId=N
        on node"); one that reports it within MessageTimeout after the job holding the id
        ended is taken for a job that has just ended ("Registered newly completed", a debug
        line) and the lost run goes on. Cancelled at once, before the nodes registered,
        the placeholders let every lost run finish beside its rerun (seen on 22.05: all
        seven of seven).
        """
        with self._skipping:
            with self.ctx.lock:
                target, self._reused_up_to = self._reused_up_to, None
            if target is None:
                return
            placeholder = Submission(
                name=f"{self.ctx.settings.tag}-skip",
                comment=f"{self.ctx.settings.tag}: a job id {self.ctx.name} gave out again after losing its state; "
                "never runs",
                script="#!/bin/sh\ntrue\n",
                gres="",
                cpus_per_task=1,
                memory_mb=None,
                time_limit_minutes=1,
                partition=self.ctx.settings.partition,
                account=self.ctx.settings.account,
                qos=self.ctx.settings.qos,
                workdir=self.ctx.settings.workdir,
                output="/dev/null",
                error="/dev/null",
                environment={"PATH": "/usr/bin:/bin"},  # slurmrestd refuses a job without one
                hold=True,
            )
            for _ in range(_MAX_SKIPPED):
                try:
                    skipped = self.ctx.client.submit(placeholder)
                except Rejected as exc:
                    # The site refuses even a held job of ours: submit as before, and say why.
                    _log.warning("%s: could not skip the job ids slurmctld gives out again: %s", self.ctx.name, exc)
                    break
                except AdapterError:
                    with self.ctx.lock:  # try again with the next submission
                        self._reused_up_to = max(target, self._reused_up_to or 0)
                    raise
                with self.ctx.lock:
                    self._held_since.setdefault(skipped, time.monotonic())
                if not skipped.isdigit() or int(skipped) >= target:
                    break
        try:
            self.release_placeholders(self.ctx.jobs(fresh=True))
        except AdapterError:
            pass  # the next status read releases them

    def release_placeholders(self, jobs: Sequence[SlurmJob]) -> None:
        """Cancel the held placeholders of :meth:`skip_reused_ids` (this process's or an
        earlier one's, known by their name) once no node waits to register with slurmctld
        (state UNKNOWN after its restart), or once they have waited ``_PLACEHOLDER_HOLD``."""
        # Submitted with the service identity: a job another user named so is not one to cancel.
        held = [
            j
            for j in jobs
            if j.name == f"{self.ctx.settings.tag}-skip" and j.user == self.ctx.slurm_user() and j.state not in _FINAL
        ]
        if not held:
            return
        now = time.monotonic()
        with self.ctx.lock:
            since = {j.job_id: self._held_since.setdefault(j.job_id, now) for j in held}
        try:
            unregistered = [n.name for n in self.ctx.nodes() if "UNKNOWN" in n.states]
        except AdapterError:
            return
        for job in held:
            if unregistered and now - since[job.job_id] < _PLACEHOLDER_HOLD:
                continue
            try:
                self.ctx.client.cancel(job.job_id)
            except AdapterError:
                return  # the next status read tries again
            with self.ctx.lock:
                self._held_since.pop(job.job_id, None)

    def phantoms(self, jobs: Sequence[SlurmJob]) -> dict[str, FinishedRecord | None]:
        """Runs slurmctld lists as unfinished that had ended before it restarted, by Slurm
        id, with the record of their end (None: this process saw them end).

        A slurmctld restarted from a state saved before a job ended (it saves every few
        seconds; its crash, or a state restored from a copy) lists the job as running on
        its node again and holds its GRES. The node, asked to register, does not report
        it, but Slurm 22.05 lets such a job go only when the node registers more than
        BatchStartTimeout + MessageTimeout after the job was last heard of, and the nodes
        register once, at once: the GRES stay held for good (seen on the test cluster: 7
        of 7 slices for minutes, until ``scontrol reconfigure``, after which Slurm requeues
        the jobs and runs them again). Such a run is known by its end: a record of it
        (the job completion log or accounting) with the same job id, name and start, or
        a run of gpush's own that this process saw end. Looked for after a start, after
        slurmctld lost jobs, and whenever one of gpush's ended runs is listed unfinished.
        """
        unfinished = [j for j in jobs if j.state in _UNFINISHED_RUN and j.start_time is not None]
        if not unfinished:
            return {}
        with self.ctx.lock:
            ended = dict(self._ended_runs)
            check = self._check_phantoms
        found: dict[str, FinishedRecord | None] = {
            j.job_id: None for j in unfinished if j.job_id in ended and _same_run(j, ended[j.job_id])
        }
        if not (found or check):
            return found
        earliest = min(j.start_time for j in unfinished if j.start_time is not None)
        try:
            records = self.ctx.client.finished(earliest - _SLACK)
        except AdapterError:
            return found  # looked for again at the next read
        by_run = {(r.job_id, r.name): r for r in records if r.start_time is not None}
        for job in unfinished:
            record = by_run.get((job.job_id, job.name))
            if record is not None and _same_run(job, record.start_time):
                found[job.job_id] = record
        with self.ctx.lock:
            self._check_phantoms = False
            foreign = {i: j for j in unfinished if (i := j.job_id) in found and self.ctx.gpush_id(j) is None}
            new = sorted(set(foreign) - set(self._foreign_phantoms), key=_numeric)
            self._foreign_phantoms.update(foreign)
        if new:
            _log.warning("%s: %s", self.ctx.name, phantom_words([foreign[i] for i in new]))
        return found

    def cancel_phantom(self, job_id: int, job: SlurmJob) -> None:
        """Cancel a run of gpush's own that ended before slurmctld restarted (phantoms): it
        runs nowhere, and the cancel gives its GRES back (its node answers that it has no
        such job and Slurm lets it go)."""
        try:
            self.ctx.client.cancel(job.job_id)
        except AdapterError:
            return  # found again at the next read
        with self.ctx.lock:
            self._cancelled_phantoms.add(job.job_id)
        _log.warning(
            "%s: Slurm job %s (gpush job %d) had ended before slurmctld restarted from an older state, "
            "which listed it as running on %s and held its GRES; cancelled it there",
            self.ctx.name,
            job.job_id,
            job_id,
            job.nodes or "its node",
        )


def _same_run(job: SlurmJob, start: datetime | None) -> bool:
    """Whether ``job`` is the run that started at ``start`` (Slurm's times: 1 s apart at most)."""
    return job.start_time is not None and start is not None and abs(job.start_time - start) <= timedelta(seconds=1)


def _numeric(job_id: str) -> tuple[int, str]:
    return (int(job_id), "") if job_id.isdigit() else (0, job_id)


def phantom_words(jobs: Sequence[SlurmJob]) -> str:
    """Runs that ended before slurmctld restarted and that it lists as running, in an admin's words."""
    ids = sorted({j.job_id for j in jobs}, key=_numeric)
    nodes = sorted({j.nodes for j in jobs if j.nodes})
    gres = defaultdict(int)
    for job in jobs:
        for g in job.tres_per_node:
            gres[g.spec().rsplit(":", 1)[0]] += g.count
    held = ", ".join(f"{name}:{count}" for name, count in sorted(gres.items())) or "their resources"
    return (
        f"slurmctld lists {len(ids)} job{'s' if len(ids) > 1 else ''} as running on {', '.join(nodes) or 'its nodes'} "
        f"that ended before it restarted from an older state (Slurm job {' '.join(ids)}, per the job "
        f"completion log or accounting); they hold {held} until an administrator cancels them "
        f"(scancel {' '.join(ids)}): `scontrol reconfigure` would run them again"
    )
