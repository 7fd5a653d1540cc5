"""The state file of a simulated cluster, and the hold every call takes on the cluster.

This module owns :class:`StateFile`: the lock one call holds (in the process and, with a
state file, across processes through ``<state_file>.lock``), reloading the file when
another instance wrote it, writing it after a call that changed the cluster, and
rebuilding the cluster from what it holds (see Persistence, shared, in the package
docstring).
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from broker.core.adapter import BackendState, Placement, Rejected
from broker.core.errors import InvalidRequest
from broker.core.gpus import gpu_model
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.state import ClusterState
from broker.simulation.pools import SHARED_SHARINGS, SimJob, gpu_pins

STATE_FORMAT = 1


class StateFile:
    """Where one simulated cluster persists (``path``; None: nowhere), and its lock."""

    def __init__(self, state: ClusterState, engine: EventEngine, path: Path | None) -> None:
        self.state = state
        self.engine = engine
        self.path = path
        self._lock = threading.RLock()
        # The version of the state file this instance last read or wrote: each save
        # writes a new random one into the lock file (file times and inodes are too coarse
        # to tell two quick saves apart).
        self._seen: str | None = None
        self._lock_fd: int | None = None

    def open(self) -> None:
        """The cluster as the state file has it, or empty when there is none yet."""
        if self.path is not None and self.path.exists():
            self.load()
        else:
            self.state.build()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """One call's hold on the cluster: this process's lock and, with a state file, the
        file's lock across processes, with the file reloaded first when another instance
        wrote it (see the package docstring)."""
        with self._lock:
            if self.path is None:
                yield
                return
            fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._lock_fd = fd
                version = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or None
                if version is not None and version != self._seen and self.path.exists():
                    self.load()
                    self._seen = version
                yield
            finally:
                self._lock_fd = None
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def save(self) -> None:
        """Write the state file if the cluster changed since it was last written."""
        if self.path is None or not self.state.dirty:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.snapshot(), separators=(",", ":")))
        if self._lock_fd is not None:
            # A new version for the other instances (see hold), before the file: killed
            # in between, they reload the old file, which is then still the truth.
            self._seen = secrets.token_hex(8)
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, self._seen.encode("ascii"), 0)
        os.replace(tmp, self.path)  # a crash mid-write leaves the previous state whole
        self.state.dirty = False

    def snapshot(self) -> dict[str, Any]:
        """The cluster's state as the state file holds it (JSON-ready)."""
        state = self.state
        return {
            "format": STATE_FORMAT,
            "cluster": state.name,
            "epoch": state.epoch,
            "now_us": state.now_us,
            "next_seq": state.next_seq,
            "jobs": [self._job_record(job) for job in state.jobs.values()],
            "log": [[job_id, job_state.value, *rest] for job_id, job_state, *rest in state.log],
            "rerun": sorted(state.rerun),
            "fenced": dict(state.fenced),
            "mig": [[node, gpu, list(instances)] for (node, gpu), instances in state.mig_overrides.items()],
        }

    @staticmethod
    def _job_record(job: SimJob) -> dict[str, Any]:
        pool = job.pool
        return {
            "job_id": job.job_id,
            "seq": job.seq,
            "placement": job.placement.to_dict(),
            "memory_gb": job.memory_gb,
            "duration_us": job.duration_us,
            "limit_us": job.limit_us,
            "exit_at_end": job.exit_at_end,
            "state": job.state.value,
            "reason": job.reason,
            "node": job.node,
            "exit_code": job.exit_code,
            "at_us": job.at_us,
            "pool": [pool.node, pool.sharing.value, pool.profile, pool.model.name] if pool else None,
            "holdings": [list(h) for h in job.holdings],
            "started_us": job.started_us,
            "ends_us": job.ends_us,
            "gang": [[p.node, p.sharing.value, p.profile, p.model.name] for p in job.gang],
            "tasks": job.tasks,
        }

    def load(self) -> None:
        """The cluster rebuilt as the state file has it: its MIG layouts, then its jobs."""
        path, state = self.path, self.state
        try:
            saved = json.loads(path.read_text())
            if saved.get("format") != STATE_FORMAT:
                raise ValueError(f"format {saved.get('format')!r}, expected {STATE_FORMAT}")
            if saved["cluster"] != state.name:
                raise InvalidRequest(
                    f"state file {path} holds the jobs of simulated cluster {saved['cluster']}, not {state.name}: "
                    "give each simulated cluster its own state_file"
                )
            state.mig_overrides = {(node, gpu): tuple(instances) for node, gpu, instances in saved.get("mig", [])}
            state.build()
            self.restore(saved)
        except InvalidRequest:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise InvalidRequest(
                f"cannot read the simulator's state file {path}: {exc}; delete it to start the cluster empty"
            ) from None

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Put the jobs, status log and fences of ``saved`` (what :meth:`snapshot` gave)
        into the freshly built cluster, and start the waiting jobs that have room now."""
        state = self.state
        state.epoch = saved["epoch"]
        # The saved virtual time, not the clock's: jobs that ended while the broker was
        # down end on the next call, at their own end times, as on a real cluster.
        state.now_us = saved["now_us"]
        state.next_seq = saved["next_seq"]
        state.log = [(e[0], BackendState(e[1]), *e[2:]) for e in saved["log"]]
        state.rerun = set(saved.get("rerun", []))
        records = sorted(saved["jobs"], key=lambda r: r["seq"])
        jobs = [self._restore_job(record) for record in records]
        state.running = sum(job.state is BackendState.RUNNING for job in jobs)
        state.pending = sum(job.state is BackendState.PENDING for job in jobs)
        for node, reason in saved.get("fenced", {}).items():
            if node in state.node_pools:  # a node gone from the fleet file is fenced no more
                state.fenced[node] = reason
                for pool in state.node_pools[node]:
                    pool.set_fenced(reason)
        # The fleet file may have grown since: let waiting jobs take what is free now.
        self.engine.dispatch(state.pools, state.now_us)

    def _restore_job(self, record: dict[str, Any]) -> SimJob:
        state = self.state
        placement = Placement.from_dict(record["placement"])
        model_name = gpu_model(placement.gpu_model).name if placement.gpu_model else None
        unit_class = state.classes.get((placement.sharing, placement.mig_profile, model_name))
        job = SimJob(record["job_id"], record["seq"], placement, unit_class)
        for name in ("memory_gb", "duration_us", "limit_us", "exit_at_end", "reason", "node", "exit_code", "at_us"):
            setattr(job, name, record[name])
        job.state = BackendState(record["state"])
        job.started_us, job.ends_us = record["started_us"], record["ends_us"]
        job.holdings = tuple((pos, units) for pos, units in record["holdings"])
        state.jobs[job.job_id] = job
        pool = state.pool_by_key.get(tuple(record["pool"])) if record["pool"] else None
        job.pool = pool
        job.tasks = record.get("tasks", 1)
        gang = [state.pool_by_key.get(tuple(key)) for key in record.get("gang", [])]
        job.gang = tuple(p for p in gang if p is not None)
        if len(job.gang) < len(gang):
            pool = job.pool = None  # a node of the gang left the fleet file
        if pool is not None and placement.gpus and placement.sharing in SHARED_SHARINGS:
            try:
                job.pins = gpu_pins(pool, job)
            except (Rejected, ValueError):
                pool = job.pool = None  # the fleet file changed under it: no such GPU any more
        if job.state is BackendState.RUNNING:
            if pool is None:
                # The node left the fleet file while the job ran: what Slurm calls NODE_FAIL.
                self._lost(job, f"node {job.node} is no longer in the fleet file")
            else:
                for held in job.pools:
                    held.restore(job)
                state.ticket += 1
                heapq.heappush(state.ends, (job.ends_us, state.ticket, job))
        elif job.state is BackendState.PENDING:
            if record.get("gang") and pool is not None:
                state.gangs.append(job)
            elif record.get("gang"):
                self._lost(job, "a node of the multi-node job is no longer in the fleet file")
            elif job.pinned and pool is not None:
                pool.waiting.append(job)
                pool.waiting_count += 1
            elif not job.pinned and unit_class is not None:
                unit_class.waiting.append(job)
                unit_class.waiting_count += 1
            else:
                self._lost(job, "no node of the fleet file offers what it waits for any more")
        return job

    def _lost(self, job: SimJob, reason: str) -> None:
        job.state, job.reason, job.exit_code, job.ends_us = BackendState.FAILED, reason, None, None
        job.holdings = ()
        job.at_us = self.state.now_us
        self.state.record(job)
