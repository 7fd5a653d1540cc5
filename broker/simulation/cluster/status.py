"""What a simulated cluster reports of its jobs: status pages from a cursor, and a job's view.

This module owns :class:`Statuses`: a cursor (the cluster's epoch and an index into its
status log), reading every change since one, and the :class:`BackendJob` a job or a log
entry shows the broker (see Status in the package docstring).
"""

from __future__ import annotations

from broker.core.adapter import BackendJob, StatusPage
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import ClusterState, LogEntry, to_dt
from broker.simulation.pools import SimJob


class Statuses:
    """The status log of one simulated cluster, as the broker reads it."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile) -> None:
        self.state = state
        self.engine = engine
        self.store = store

    def statuses(self, cursor: str | None = None) -> StatusPage:
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            state = self.state
            end = len(state.log)
            start = self._cursor_position(cursor)
            if start is None:
                jobs = [self.view(job) for job in sorted(state.jobs.values(), key=lambda j: j.seq)]
            else:
                jobs = [self._entry_view(entry) for entry in state.log[start:end]]
            return StatusPage(jobs, f"{state.epoch}:{end}")

    def view(self, job: SimJob) -> BackendJob:
        """The broker's view of ``job`` now."""
        return BackendJob(
            job.job_id,
            self.state.backend_id(job.job_id),
            job.state,
            job.reason,
            job.node,
            job.exit_code,
            to_dt(job.at_us),
        )

    def _entry_view(self, entry: LogEntry) -> BackendJob:
        job_id, state, reason, node, exit_code, at_us = entry
        return BackendJob(job_id, self.state.backend_id(job_id), state, reason, node, exit_code, to_dt(at_us))

    def _cursor_position(self, cursor: str | None) -> int | None:
        """Where in the log a cursor points, or None for 'everything' (no cursor, or one
        from another incarnation of this cluster)."""
        if cursor is None:
            return None
        state = self.state
        epoch, sep, position = cursor.partition(":")
        if not sep or not position.isdigit():
            raise ValueError(f"{cursor!r} is not a status cursor of {state.name}: pass back the cursor statuses() gave")
        if epoch != state.epoch or int(position) > len(state.log):
            return None
        return int(position)
