"""The event engine of a simulated cluster: when jobs start and end in virtual time.

This module owns :class:`EventEngine`: catching up with the clock (or failing while the
cluster is 'down'), ending running jobs at their exact end times, placing a submitted
job or queueing it, and starting the jobs that wait for the units that just freed, in
the order the package docstring describes (Queueing, Time-slicing OOM).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

from broker.core.adapter import BackendState, Unreachable
from broker.core.spec_values import format_duration
from broker.simulation.cluster.state import ClusterState
from broker.simulation.pools import Pool, SimJob, UnitClass

# What a job killed for over-committing a time-sliced GPU exits with: the code a
# container killed by SIGKILL reports, which is what Kubernetes shows with OOMKilled.
OOM_EXIT_CODE = 137


class EventEngine:
    """Runs the jobs of one :class:`ClusterState` through virtual time."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def answer(self) -> None:
        """What every public call does first: fail if the cluster is 'down', else catch up with the clock."""
        state = self.state
        if state.outage is not None:
            raise Unreachable(f"{state.name}: {state.outage}")
        self.advance(state.clock_us())

    # -- submission --------------------------------------------------------------------

    def place(self, job: SimJob) -> None:
        """Start a newly submitted job now if it may, else queue it."""
        state = self.state
        t = state.now_us
        if job.gang:
            if not state.gangs and self._gang_fits(job):
                self._start(job, job.pool, t)
                return
            job.reason = self._gang_reason(job)
            state.gangs.append(job)
        elif job.pinned:
            pool = job.pool
            if pool.fits(job) and (pool.waiting_count == 0 or not pool.blocked(job)):
                self._start(job, pool, t)
                return
            job.reason = pool.waiting_reason(job)
            pool.waiting.append(job)
            pool.waiting_count += 1
            pool.refresh()
        else:
            unit_class = job.unit_class
            pool = unit_class.find_room(job) if unit_class.waiting_count == 0 else None
            if pool is not None:
                self._start(job, pool, t)
                return
            job.reason = unit_class.waiting_reason(job, state.name)
            unit_class.waiting.append(job)
            unit_class.waiting_count += 1
        job.at_us = t
        state.pending += 1
        state.record(job)

    # -- multi-node jobs: every node at once, or none ------------------------------------

    @staticmethod
    def _gang_fits(job: SimJob) -> bool:
        """Whether every node of a gang can start its rank now, with no one-node job waiting
        there first (a gang passes no one; it is never started on part of its nodes)."""
        return all(pool.fits(job) and not pool.waiting_count for pool in job.pools)

    def _gang_reason(self, job: SimJob) -> str:
        ready = sum(pool.fits(job) and not pool.waiting_count for pool in job.pools)
        behind = len(self.state.gangs)
        ahead = f"; {behind} earlier multi-node job(s) waiting first" if behind else ""
        return (
            f"waiting for all {len(job.pools)} nodes at once ({ready} have room now{ahead}); "
            "no rank starts before every node has room"
        )

    def _drain_gangs(self, t: int) -> None:
        """Start the waiting gangs, oldest first, while the oldest has room on every node."""
        gangs = self.state.gangs
        while gangs:
            job = gangs[0]
            if job.state is not BackendState.PENDING:
                gangs.popleft()
                continue
            if not self._gang_fits(job):
                return
            gangs.popleft()
            self.state.pending -= 1
            self._start(job, job.pool, t)

    # -- running and ending ------------------------------------------------------------

    def _start(self, job: SimJob, pool: Pool, t: int) -> None:
        state = self.state
        over = pool.take(job)
        for other in job.gang:  # whole GPUs and MIG slices only: nothing to over-commit
            other.take(job)
            other.refresh()
        job.pool = pool
        job.node = ",".join(p.node for p in job.pools) if job.gang else pool.node
        job.state = BackendState.RUNNING
        job.reason = None
        job.started_us = job.at_us = t
        state.running += 1
        state.record(job)
        if over:
            gpu = pool.gpus[over[0]]
            used = pool.gpu_memory[over[0]]
            self.finish(
                job,
                t,
                BackendState.FAILED,
                "OOMKilled: time-sliced GPU memory over-committed "
                f"(jobs on GPU {gpu} of {pool.node} ask {used:g} GB of its {pool.model.memory_gb:g} GB)",
                OOM_EXIT_CODE,
            )
            return
        duration = job.duration_us
        if job.limit_us is not None and duration > job.limit_us:
            duration = job.limit_us
        job.ends_us = t + duration
        state.ticket += 1
        heapq.heappush(state.ends, (job.ends_us, state.ticket, job))
        pool.refresh()

    def finish(self, job: SimJob, t: int, end: BackendState, reason: str | None, exit_code: int | None) -> None:
        """``job``, running, ends at ``t`` in state ``end``, giving its units back."""
        state = self.state
        pool = job.pool
        pool.release(job)
        for other in job.gang:  # a gang's ranks end together
            other.release(job)
            other.refresh()
        state.running -= 1
        job.state = end
        job.reason = reason
        job.exit_code = exit_code
        job.ends_us = None
        job.at_us = t
        state.record(job)
        pool.refresh()

    def _end(self, job: SimJob, t: int) -> None:
        """A running job reached its end time."""
        if job.limit_us is not None and job.duration_us > job.limit_us:
            limit = format_duration(job.limit_us // 1_000_000)
            self.finish(job, t, BackendState.FAILED, f"TIMEOUT: ran past its time limit of {limit}", None)
        elif job.exit_at_end:
            self.finish(job, t, BackendState.FAILED, f"exited with code {job.exit_at_end}", job.exit_at_end)
        else:
            self.finish(job, t, BackendState.SUCCEEDED, None, 0)

    @staticmethod
    def is_live(event: tuple[int, int, SimJob]) -> bool:
        """Whether an event of the heap still ends its job (not one cancelled, preempted or rescheduled since)."""
        job = event[2]
        return job.state is BackendState.RUNNING and job.ends_us == event[0]

    def advance(self, to_us: int) -> None:
        """End the jobs due by virtual time ``to_us`` and start those waiting for their units."""
        state = self.state
        ends = state.ends
        while ends and ends[0][0] <= to_us:
            t = ends[0][0]
            freed: dict[Pool, None] = {}  # ordered, and O(1) when thousands end at once
            # Every job ending at the same instant frees its units before anyone starts,
            # so a job waiting for four GPUs sees all four that free at once.
            while ends and ends[0][0] == t:
                event = heapq.heappop(ends)
                if self.is_live(event):
                    job = event[2]
                    for pool in job.pools:
                        freed[pool] = None
                    self._end(job, t)
            if t > state.now_us:
                state.now_us = t
            self.dispatch(freed, t)
        if to_us > state.now_us:
            state.now_us = to_us

    def dispatch(self, pools: Iterable[Pool], t: int) -> None:
        """Start waiting jobs on ``pools`` whose units just freed: jobs pinned there first,
        then the cluster-wide queues those pools serve, then the multi-node jobs waiting."""
        classes: list[UnitClass] = []
        for pool in pools:
            if pool.waiting_count:
                self._drain_pool(pool, t)
                pool.refresh()  # unmask the pool if its queue emptied
            for unit_class, _slot in pool.slots:
                if unit_class.waiting_count and unit_class not in classes:
                    classes.append(unit_class)
        if classes:
            self.drain_classes(classes, t)
        if self.state.gangs:
            self._drain_gangs(t)

    def _drain_pool(self, pool: Pool, t: int) -> None:
        waiting = pool.waiting
        kept: deque[SimJob] = deque()
        held: set[int] = set()  # GPUs that jobs still waiting are pinned to
        while waiting:
            job = waiting[0]
            if job.state is not BackendState.PENDING:
                waiting.popleft()
                continue
            pins = job.pins
            if (pins is None or not any(pos in held for pos, _ in pins)) and pool.fits(job):
                waiting.popleft()
                pool.waiting_count -= 1
                self.state.pending -= 1
                self._start(job, pool, t)
                continue
            if pins is None:
                break  # FIFO without backfill: nothing passes a job that may take any GPU
            # A job pinned to GPUs holds up only the jobs that want those GPUs.
            kept.append(waiting.popleft())
            held.update(pos for pos, _ in pins)
        waiting.extendleft(reversed(kept))

    def drain_classes(self, classes: list[UnitClass], t: int) -> None:
        """Start the jobs at the heads of the cluster-wide queues ``classes``, oldest first, while they fit."""
        blocked: list[UnitClass] = []
        while True:
            best: UnitClass | None = None
            best_head: SimJob | None = None
            for unit_class in classes:
                if not unit_class.waiting_count or unit_class in blocked:
                    continue
                head = unit_class.head()
                if head is not None and (best_head is None or head.seq < best_head.seq):
                    best, best_head = unit_class, head
            if best is None:
                return
            pool = best.find_room(best_head)
            if pool is None:
                blocked.append(best)
                continue
            best.waiting.popleft()
            best.waiting_count -= 1
            self.state.pending -= 1
            self._start(best_head, pool, t)
