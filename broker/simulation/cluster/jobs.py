"""The job calls of a simulated cluster: submit, cancel, preempt, find and scale.

This module owns :class:`Jobs`: idempotent submission by job id (a preempted job's next
submission is a new run), cancelling a job running or waiting, a preemption as a
checkpointing program takes it, and changing a running job's replicas on its node.
"""

from __future__ import annotations

import dataclasses

from broker.core.adapter import BackendJob, BackendState, Placement, Rejected
from broker.core.schemas import JobSpec
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import FINISHED, ClusterState
from broker.simulation.cluster.status import Statuses
from broker.simulation.pools import Pool, SimJob


class Jobs:
    """Submits and changes the jobs of one simulated cluster."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile, statuses: Statuses) -> None:
        self.state = state
        self.engine = engine
        self.store = store
        self.statuses = statuses

    def submit(self, job_id: int, spec: JobSpec, placement: Placement) -> str:
        with self.store.hold():
            self.engine.answer()
            state = self.state
            known = state.jobs.get(job_id)
            # Idempotent by job id, but a job told of a preemption runs again when the
            # broker queues it again: that submission is a new run, as on Slurm.
            if known is None or (known.state in FINISHED and job_id in state.rerun):
                state.rerun.discard(job_id)
                job = state.admission.admit(job_id, spec, placement)
                job.seq = state.next_seq
                state.next_seq += 1
                state.jobs[job_id] = job
                self.engine.place(job)
                self.store.save()
            return state.backend_id(job_id)

    def cancel(self, job_id: int) -> None:
        with self.store.hold():
            self.engine.answer()
            state = self.state
            job = state.jobs.get(job_id)
            if job is None or job.state in FINISHED:
                return
            t = state.now_us
            if job.state is BackendState.RUNNING:
                pools = job.pools
                self.engine.finish(job, t, BackendState.CANCELLED, "cancelled while running", None)
                self.engine.dispatch(pools, t)
            else:
                state.pending -= 1
                job.state = BackendState.CANCELLED
                job.reason = "cancelled before it started"
                job.at_us = t
                state.record(job)
                if job.gang:
                    state.gangs.remove(job)
                    self.engine.dispatch(job.pools, t)  # gangs behind it may start now
                elif job.pinned:
                    job.pool.waiting_count -= 1
                    job.pool.refresh()
                    self.engine.dispatch([job.pool], t)
                else:
                    job.unit_class.waiting_count -= 1
                    self.engine.drain_classes([job.unit_class], t)
            self.store.save()

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        """A simulated job is a program that checkpoints: told of a preemption, it saves
        its state and exits 0 at once (a job not running yet is left waiting)."""
        with self.store.hold():
            self.engine.answer()
            state = self.state
            job = state.jobs.get(job_id)
            if job is None or job.state is not BackendState.RUNNING:
                return
            state.rerun.add(job_id)
            pools = job.pools
            t = state.now_us
            self.engine.finish(job, t, BackendState.SUCCEEDED, f"saved its state on {signal} and exited", 0)
            self.engine.dispatch(pools, t)
            self.store.save()

    def find(self, job_id: int) -> BackendJob | None:
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            job = self.state.jobs.get(job_id)
            return None if job is None else self.statuses.view(job)

    def scale(self, job_id: int, replicas: int) -> int:
        """Give a job ``replicas`` replicas on the node it runs on (replicas stay together,
        as the simulator places them): Rejected when the node has no room for more, or is
        fenced (a job may always shrink)."""
        with self.store.hold():
            self.engine.answer()
            state = self.state
            job = state.jobs.get(job_id)
            if job is None or job.state in FINISHED:
                raise Rejected(f"job {job_id} is not running on {state.name}")
            if replicas < 1:
                raise Rejected("a job keeps at least one replica")
            if job.gang:
                raise Rejected(f"job {job_id} runs on {len(job.pools)} nodes at once: a multi-node job does not scale")
            old = job.replicas
            if replicas == old:
                return old
            pool = job.pool if job.state is BackendState.RUNNING else None
            if pool is not None:
                pool.release(job)
            old_pins, old_placement = job.pins, job.placement
            self._set_replicas(job, replicas, pool)
            if pool is not None:
                if replicas > old and (not pool.fits(job) or self._would_overcommit(pool, job)):
                    self._set_replicas(job, old, None)
                    job.pins, job.placement = old_pins, old_placement
                    pool.take(job)
                    why = f" (fenced: {pool.fenced})" if pool.fenced is not None else ""
                    raise Rejected(
                        f"node {job.node} of {state.name}{why} has no room for {replicas} replicas of job {job_id} "
                        f"(it runs {old}); its replicas stay together on one node"
                    )
                pool.take(job)
                pool.refresh()
                if replicas < old:
                    self.engine.dispatch([pool], state.now_us)
            state.dirty = True  # no status changed, yet the replicas must outlive a restart
            self.store.save()
            return replicas

    @staticmethod
    def _set_replicas(job: SimJob, replicas: int, pool: Pool | None) -> None:
        """``replicas`` for ``job``; replicas pinned to GPUs keep theirs, and new ones go
        to the GPUs of ``pool`` (released of the job) with the most room."""
        gpus = job.placement.gpus
        if job.pins is not None and pool is not None:
            pins = list(job.pins if len(job.pins) == job.replicas else job.pins * job.replicas)[:replicas]
            room = list(pool.gpu_room)
            for pos, units in pins:
                room[pos] -= units
            while len(pins) < replicas:
                pos = max(range(len(room)), key=room.__getitem__)
                room[pos] -= job.units
                pins.append((pos, job.units))
            job.pins = tuple(pins)
            gpus = tuple(pool.gpus[pos] for pos, _ in pins)
        job.replicas = replicas
        job.need = job.units * replicas
        job.placement = dataclasses.replace(job.placement, replicas=replicas, gpus=gpus)

    @staticmethod
    def _would_overcommit(pool: Pool, job: SimJob) -> bool:
        """Whether taking ``job`` now would push a time-sliced GPU past its memory."""
        if pool.gpu_memory is None:
            return False
        over = pool.take(job)
        pool.release(job)
        return bool(over)
