"""Step 2 of a scheduling cycle: the clusters' status changes, replayed over their jobs'
states and written in bulk; each cluster's cursor moves once its changes are in."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, text

from broker.core.adapter import (
    AdapterError,
    BackendState,
    ClusterAdapter,
)
from broker.core.clock import Clock
from broker.core.clusters import ClusterInfo
from broker.core.models import Cluster, Job
from broker.core.states import JobState, set_reasons, set_states
from broker.scheduling.steps import CycleReport, rows_by_id, side_by_side, unplaced

S = JobState
ACTOR = "scheduler"
# A status page with this many jobs changing is written in two halves side by side.
_SYNC_SPLIT = 1000


@dataclass
class StatusChanges:
    """Step 2 of a cycle: the clusters' status changes, read, then written on a thread of
    their own beside steps 3 to 7 (which count them as made)."""

    # (cluster, chains of transitions per job, reasons of jobs still waiting there, new cursor)
    pages: list[tuple[str, dict, dict[int, str], str | None]] = field(default_factory=list)
    leaving_submitted: set[int] = field(default_factory=set)  # the cluster started or ended them
    finishing: set[int] = field(default_factory=set)  # their chains end in a final state
    # Their chains end back in the queue (a preemption ended, the cluster lost them): this
    # cycle's claim leaves them out, whether its read comes before their write or after.
    requeued: set[int] = field(default_factory=set)
    finished: dict[int, Any] = field(default_factory=dict)  # those jobs' tenant, ledger share, placement
    synced: int = 0
    seconds: float = 0.0
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, sync: StatusSync) -> None:
        if self.pages:
            self.thread = threading.Thread(target=self._write, args=(sync,), name="gpush-sync", daemon=True)
            self.thread.start()

    def _write(self, sync: StatusSync) -> None:
        begin = time.perf_counter()
        try:
            self.synced = sync.write_statuses(self)
        except BaseException as exc:  # raised again in the cycle's thread, by wait()
            self.error = exc
        self.seconds = time.perf_counter() - begin

    def wait(self, report: CycleReport, *, raise_error: bool = True) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            report.synced += self.synced
            report.seconds["sync"] = report.seconds.get("sync", 0.0) + self.seconds
        if self.error is not None and raise_error:
            error, self.error = self.error, None
            raise error


class StatusSync:
    """Step 2 of a scheduling cycle: each cluster's status changes since its cursor, read
    as the transitions they make, then written in bulk (:class:`StatusChanges` writes them
    on a thread of its own beside steps 3 to 7)."""

    def __init__(self, sessions, clock: Clock, adapter_of: Callable[[ClusterInfo], ClusterAdapter]):
        self.sessions = sessions
        self.clock = clock
        self._adapter = adapter_of

    def read_statuses(
        self, clusters: dict[str, ClusterInfo], report: CycleReport, *, preempting: dict[int, str] | None = None
    ) -> StatusChanges:
        """Each cluster's status changes since its cursor, as the transitions they make.
        ``preempting``: victims told of a preemption, with the reason they are requeued with
        (broker.scheduling.preemption): their end, however it comes, requeues them."""
        preempting = preempting or {}
        changes = StatusChanges()
        for name, info in clusters.items():
            with self.sessions() as session:
                cursor = session.execute(select(Cluster.status_cursor).where(Cluster.name == name)).scalar_one()
            try:
                page = self._adapter(info).statuses(cursor)
            except AdapterError as exc:
                report.errors.append(f"statuses of {name}: {exc}")
                continue
            chains, pending = self._chains(name, page.jobs, preempting) if page.jobs else ({}, {})
            changes.pages.append((name, chains, pending, page.cursor))
            for job_id, chain in chains.items():
                if chain[0][0] == S.SUBMITTED:
                    changes.leaving_submitted.add(job_id)
                if chain[-1][1] in _FINISHED or chain[-1][1] == S.QUEUED:  # it holds nothing any more
                    changes.finishing.add(job_id)
                if chain[-1][1] == S.QUEUED:
                    changes.requeued.add(job_id)
        if changes.finishing:
            with self.sessions() as session:
                changes.finished = {
                    row.id: row for row in rows_by_id(session, _FINISHED_ROWS, sorted(changes.finishing))
                }
        return changes

    def write_statuses(self, changes: StatusChanges) -> int:
        """Write the changes; each cluster's cursor moves once its changes are in (a crash in
        between replays the page, and the compare-and-set of each change makes the replay
        a no-op)."""
        synced = 0
        for name, chains, pending, cursor in changes.pages:
            if chains:
                synced += self._apply_chains(chains)
            with self.sessions() as session, session.begin():
                # A reason is only for a job still waiting in the cluster (set_reasons checks the state).
                set_reasons(session, S.SUBMITTED, pending)
                session.execute(Cluster.__table__.update().where(Cluster.name == name).values(status_cursor=cursor))
        return synced

    def _chains(
        self, cluster: str, changes, preempting: dict[int, str]
    ) -> tuple[dict[int, list[tuple[JobState, JobState, str]]], dict[int, str]]:
        """A cluster's status changes replayed, in order, over its jobs' states: per job, the
        chain of transitions they make; and what jobs still waiting in the cluster wait for."""
        ids = list(dict.fromkeys(b.job_id for b in changes))
        with self.sessions() as session:
            rows = {r.id: r for r in _sync_rows(session, cluster, ids)}
        current = {job_id: S(row.state) for job_id, row in rows.items()}
        chains: dict[int, list[tuple[JobState, JobState, str]]] = defaultdict(list)
        pending: dict[int, str] = {}
        for backend in changes:
            row = rows.get(backend.job_id)
            if row is None:
                continue
            state = current[backend.job_id]
            if backend.state == BackendState.PENDING:
                if state == S.RUNNING:  # the cluster requeued it itself: it waits there again
                    waiting = backend.reason or f"requeued by {cluster}"
                    chains[backend.job_id].append((S.RUNNING, S.SUBMITTED, waiting))
                    current[backend.job_id] = S.SUBMITTED
                elif state == S.SUBMITTED and backend.reason and backend.reason != row.state_reason:
                    pending[backend.job_id] = backend.reason
                continue
            if backend.state == BackendState.LOST:
                if state in (S.SUBMITTED, S.RUNNING):  # the cluster forgot it: run it again, wherever it now fits
                    lost = backend.reason or f"{cluster} lost the job"
                    chains[backend.job_id] += [(state, S.REQUEUED, lost), (S.REQUEUED, S.QUEUED, "queued again")]
                    current[backend.job_id] = S.QUEUED
                continue
            target = _BACKEND_TARGETS.get(backend.state)
            if target is None or target == state or state not in (S.SUBMITTED, S.RUNNING):
                continue
            preempted = preempting.get(backend.job_id)
            if preempted and state == S.RUNNING and target in _FINISHED and not row.cancel_requested:
                # Told to stop for another job: however it ended, it runs again later.
                chains[backend.job_id] += [
                    (S.RUNNING, S.REQUEUED, f"{preempted}; ended {_ended(target, backend)}"),
                    (S.REQUEUED, S.QUEUED, "queued again after its preemption: routing places it afresh"),
                ]
                current[backend.job_id] = S.QUEUED
                continue
            chains[backend.job_id].append((state, target, _status_reason(target, cluster, row, backend)))
            current[backend.job_id] = target
        return chains, pending

    def _apply_chains(self, chains: dict[int, list[tuple[JobState, JobState, str]]]) -> int:
        """Apply the chains link by link, in bulk; a page of thousands of changes is split
        in two halves written side by side, each in its own transaction."""
        if len(chains) < _SYNC_SPLIT:
            return self._apply_links(chains)
        ids = sorted(chains)
        halves = [{i: chains[i] for i in ids[: len(ids) // 2]}, {i: chains[i] for i in ids[len(ids) // 2 :]}]
        return sum(side_by_side(self._apply_links, halves))

    def _apply_links(self, chains: dict[int, list[tuple[JobState, JobState, str]]]) -> int:
        moved = 0
        broken: set[int] = set()  # moved by someone else: the rest of its chain does not apply
        with self.sessions() as session, session.begin():
            for link in range(max((len(c) for c in chains.values()), default=0)):
                by_edge: dict[tuple[JobState, JobState], list[tuple[int, str]]] = defaultdict(list)
                for job_id, chain in chains.items():
                    if link < len(chain) and job_id not in broken:
                        frm, to, reason = chain[link]
                        by_edge[(frm, to)].append((job_id, reason))
                for (frm, to), items in by_edge.items():
                    done = set(
                        set_states(
                            session,
                            [job_id for job_id, _ in items],
                            frm,
                            to,
                            reasons=[reason for _, reason in items],
                            now=self.clock(),
                            actor=ACTOR,
                            # Back in the queue: the placement it had is void.
                            values=unplaced(len(items)) if to == S.QUEUED else None,
                        )
                    )
                    moved += len(done)
                    broken.update(job_id for job_id, _ in items if job_id not in done)
        return moved


_BACKEND_TARGETS = {
    BackendState.RUNNING: S.RUNNING,
    BackendState.SUCCEEDED: S.SUCCEEDED,
    BackendState.FAILED: S.FAILED,
    BackendState.CANCELLED: S.CANCELLED,
}


def _ended(target: JobState, backend) -> str:
    if target == S.SUCCEEDED:
        return "after saving its state (exit 0)"
    if target == S.FAILED:
        return backend.reason or f"exit {backend.exit_code}"
    return "stopped by its cluster"


def _status_reason(target: JobState, cluster: str, row, backend) -> str:
    if target == S.CANCELLED:
        return "cancelled as requested" if row.cancel_requested else (backend.reason or "cancelled on the cluster")
    if target == S.RUNNING:
        if not backend.node:
            return f"running on {cluster}"
        # A multi-node job's node is its list: Slurm's "gpu[01-02]", a simulated "gpu-01,gpu-02".
        several = any(c in backend.node for c in ",[")
        return f"running on {cluster} {'nodes' if several else 'node'} {backend.node}"
    if target == S.FAILED:
        return backend.reason or f"exited {backend.exit_code}"
    return "completed" + (f" (exit {backend.exit_code})" if backend.exit_code is not None else "")


def _sync_rows(session, cluster: str, ids: list[int]):
    """State, reason and cancel intent of the jobs ``ids`` that ``cluster`` has. PostgreSQL
    gets the ids as one array joined to the jobs by primary key; SQLite binds them, a
    thousand at a time."""
    if session.get_bind().dialect.name == "postgresql":
        return session.execute(_SYNC_ROWS_POSTGRESQL, {"ids": "{" + ",".join(map(str, ids)) + "}", "cluster": cluster})
    query = select(
        Job.id, Job.state, Job.state_reason, Job.cancel_requested_at.is_not(None).label("cancel_requested")
    ).where(Job.cluster == cluster)
    return rows_by_id(session, query, ids)


_FINISHED_ROWS = select(Job.id, Job.tenant, Job.gpu_equivalents, Job.placement)


_FINISHED = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})


_SYNC_ROWS_POSTGRESQL = text(
    """SELECT jobs.id, jobs.state, jobs.state_reason, jobs.cancel_requested_at IS NOT NULL AS cancel_requested
    FROM jobs JOIN unnest(CAST(:ids AS bigint[])) AS wanted(id) ON jobs.id = wanted.id
    WHERE jobs.cluster = :cluster"""
)
