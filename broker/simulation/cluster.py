"""The simulated cluster: one cluster of a fleet file behind the adapter protocol, in virtual time.

This module owns :class:`SimulatedCluster`, the first implementation of the adapter
protocol (:mod:`broker.core.adapter`): when jobs start and end, their status log, and
the state file. It drives the embedded demo, the tests and trace replays, so from the
broker's side it behaves like a real cluster, only far faster than real time. The
fleet file it is built from is :mod:`broker.simulation.fleet`; what a submission must
satisfy, and how long a job runs, is :mod:`broker.simulation.admission`; how units are
counted, handed out and reported is :mod:`broker.simulation.pools`.

How a simulated cluster behaves (what a broker or a test may rely on):

- **Virtual time.** Every public call first advances the cluster to ``clock()``. Jobs
  end at their exact virtual end time, and waiting jobs start at the virtual time the
  units they wait for freed, not at the time of the call. :meth:`SimulatedCluster.advance`
  and :meth:`SimulatedCluster.next_event_time` let a replay jump from event to event.
- **Node choice.** A placement's ``node`` is honoured (the job waits there if the node
  is busy). Without one, the job takes the first node, in fleet-file order, with room.
  Under MPS and time-slicing a placement's ``gpus`` (one device index per replica, or
  one for all of them; only with a ``node``) are honoured too: each replica runs on its
  GPU, and the job waits in the node's queue until those GPUs have room, behind the
  jobs there that want the same GPUs (or any GPU), not behind those pinned to others.
  Whole GPUs and MIG instances are counted per node, not per device, so ``gpus`` is
  ignored there.
- **Queueing.** Jobs wait in FIFO order, without backfill: per node for jobs pinned to a
  node, and per unit kind across the cluster for the others. Units on a node where
  pinned jobs wait go to no unpinned job until those have started, so a large job is
  not starved by small ones. A multi-unit job takes all its units on one node at once, or waits.
  Replicas (``placement.replicas``) are placed together on one node.
- **Time-slicing OOM.** There is no memory isolation: when the ``gpu_memory_gb`` of the
  jobs on one physical GPU adds up to more than the GPU has, the job that pushed it over
  fails with ``OOMKilled: time-sliced GPU memory over-committed`` (exit code 137), as a
  CUDA allocation would; the jobs already there keep running.
- **Status.** ``statuses(cursor)`` returns every change since the cursor, in order, each
  at its virtual time; without a cursor (or with one from a cluster whose state was
  lost) it returns every known job's current state.
- **Persistence, shared.** With ``state_file``, jobs, allocations and the status log are
  written there (JSON) after every call that changed them and reloaded on start, so a
  simulated cluster outlives a broker restart as a real one does. The file is the
  cluster: several broker processes on one database (API replicas, the leader and the
  one that takes over when it dies) each have an instance, and every call holds an
  exclusive lock on ``<state_file>.lock`` and first reloads the file when another
  instance wrote it since, so no instance acts on, or writes back, a stale view. Without
  that, an API replica's health check overwrote the leader's jobs and a new leader
  never learnt of the jobs the old one had submitted (they stayed ``submitted`` for
  good, holding their tenant's share).
- **Preemption.** A simulated job told of a preemption (:meth:`SimulatedCluster.preempt`)
  saves its state and exits 0 at once, as a program that checkpoints on its signal does.
- **Fencing.** A fenced node (:meth:`SimulatedCluster.fence`, Slurm's drain) starts no
  new job: jobs pinned to it wait there, saying so, and the others go to other nodes or
  wait; its running jobs go on, and its inventory shows its units taken, with why (as a
  drained Slurm node or a cordoned Kubernetes one). Unfenced, it takes the
  jobs that wait for it at once.
- **MIG layouts.** As Slurm is told of a GPU a node agent re-cut:
  :meth:`SimulatedCluster.publish_mig` gives a GPU in MIG mode a new layout at once, and
  waiting jobs may start on the new instances. As MIG instances are counted per node and
  profile (see Node choice), a change is refused while the node's running jobs hold more
  instances of a profile than the node would have, or while jobs wait for a profile no
  node would have any more. Published layouts and fences are kept in the state file, so
  they outlive a restart.
- **Not simulated:** CPU and host memory on nodes (reported in the file, not enforced),
  partitions, node failures.
"""

from __future__ import annotations

import dataclasses
import fcntl
import heapq
import json
import os
import secrets
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

from broker.core.adapter import (
    MAX_LOG_CHUNK,
    BackendJob,
    BackendState,
    CapacityUnit,
    Health,
    JobOutput,
    LogReader,
    MigPublisher,
    NodeFencer,
    Owner,
    Placement,
    Preemptor,
    Rejected,
    Scaler,
    StatusPage,
    Unreachable,
)
from broker.core.clock import Clock
from broker.core.errors import InvalidRequest
from broker.core.gpus import gpu_model
from broker.core.schemas import JobSpec, format_duration
from broker.mig.layouts import MigSlot, layout_problem, place_instances, same_layout
from broker.simulation.admission import Admission
from broker.simulation.fleet import Fleet, FleetCluster, FleetGpu, FleetNode, load_fleet, load_fleet_file
from broker.simulation.pools import SHARED_SHARINGS, Pool, SimJob, UnitClass, UnitKey, gpu_pins, pools_of

# What a job killed for over-committing a time-sliced GPU exits with: the code a
# container killed by SIGKILL reports, which is what Kubernetes shows with OOMKilled.
OOM_EXIT_CODE = 137
STATE_FORMAT = 1

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_FINISHED = (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.CANCELLED)


def _to_us(moment: datetime) -> int:
    # Integer microseconds keep virtual times exact: a job of 600 s started at t ends at t + 600 s.
    if moment.tzinfo is None:
        raise ValueError(f"the simulator's clock returned {moment!r} without a time zone: return an aware datetime")
    return (moment - _EPOCH) // _MICROSECOND


def _to_dt(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


class SimulatedCluster:
    """One simulated cluster of a fleet file, behind the adapter protocol, in virtual time.

    ``config``: ``{"fleet": path}`` or ``{"fleet_yaml": text}``; optionally ``"cluster"``
    (the cluster's name in the file, default ``name``) and ``"state_file"`` (JSON the
    simulator persists to and reloads from). See the module docstring for behaviour.
    """

    # Of the optional ones (broker.core.adapter): the job output, scaling a running
    # job's replicas (as a Kubernetes Deployment scales), fencing nodes and changing MIG
    # layouts. Calls are in-process and take microseconds, so one submit after another is
    # as fast as a batch; nothing to close.
    capabilities: ClassVar[frozenset[type]] = frozenset({LogReader, MigPublisher, NodeFencer, Preemptor, Scaler})
    # The GPUs are the node agents' (a fake NVML where tests run one): an agent changes a
    # GPU first, then the simulator offers the new instances, as Slurm does.
    changes_gpus: ClassVar[bool] = False

    def __init__(self, name: str, config: Mapping[str, Any], *, clock: Clock) -> None:
        unknown = set(config) - {"fleet", "fleet_yaml", "cluster", "state_file", "kind"}
        if unknown:
            raise InvalidRequest(
                f"simulated cluster {name}: unknown setting {', '.join(sorted(unknown))}: "
                "use fleet (a file) or fleet_yaml (text), and optionally cluster and state_file"
            )
        if ("fleet" in config) == ("fleet_yaml" in config):
            raise InvalidRequest(
                f"simulated cluster {name}: give exactly one of fleet (path to a fleet file) or fleet_yaml (its text)"
            )
        if "fleet" in config:
            fleet = load_fleet_file(config["fleet"])
        else:
            fleet = load_fleet(config["fleet_yaml"], f"fleet_yaml of {name}")
        self._setup(name, fleet.cluster(config.get("cluster") or name), clock, config.get("state_file"))

    @classmethod
    def from_fleet(
        cls,
        fleet: Fleet,
        cluster: str,
        *,
        clock: Clock,
        name: str | None = None,
        state_file: str | os.PathLike[str] | None = None,
    ) -> SimulatedCluster:
        """A simulated cluster from a loaded fleet (tests and the replay driver)."""
        self = cls.__new__(cls)
        self._setup(name or cluster, fleet.cluster(cluster), clock, state_file)
        return self

    def _setup(self, name: str, layout: FleetCluster, clock: Clock, state_file: str | os.PathLike[str] | None) -> None:
        self.name = name
        self._file_layout = layout  # as the fleet file has it; self.layout has the MIG layouts published since
        self._file_nodes = {node.name: node for node in layout.nodes}
        # (node, GPU index) -> the instances published there, where they differ from the fleet file.
        self._mig_overrides: dict[tuple[str, int], tuple[str, ...]] = {}
        self._clock = clock
        self._lock = threading.RLock()
        self._state_file = Path(state_file) if state_file else None
        self._outage: str | None = None
        # The version of the state file this instance last read or wrote: each save
        # writes a new random one into the lock file (file times and inodes are too coarse
        # to tell two quick saves apart).
        self._seen: str | None = None
        self._lock_fd: int | None = None
        if self._state_file is not None and self._state_file.exists():
            self._load(self._state_file)
        else:
            self._fresh()

    def _fresh(self) -> None:
        """The cluster empty, as its fleet file lays it out with the MIG layouts published
        since (state is loaded on top)."""
        self.layout = layout = self._laid_out(self._mig_overrides)
        name, clock = self.name, self._clock
        self._pools: list[Pool] = []
        self._node_pools: dict[str, list[Pool]] = {}
        node_pools = self._node_pools
        for node in layout.nodes:
            pools = pools_of(node, layout.flavor)
            self._pools.extend(pools)
            node_pools[node.name] = pools
        self._pool_by_key = {(p.node, p.sharing, p.profile, p.model.name): p for p in self._pools}
        members: dict[UnitKey, list[Pool]] = {}
        for pool in self._pools:
            for key in ((pool.sharing, pool.profile, pool.model.name), (pool.sharing, pool.profile, None)):
                members.setdefault(key, []).append(pool)
        self._classes = {key: UnitClass(key, pools) for key, pools in members.items()}
        self._admission = Admission(name, layout, node_pools, self._classes)
        for unit_class in self._classes.values():
            for slot, pool in enumerate(unit_class.pools):
                pool.slots.append((unit_class, slot))
        for pool in self._pools:
            pool.refresh()

        self._jobs: dict[int, SimJob] = {}
        self._ends: list[tuple[int, int, SimJob]] = []  # (end time, tie-breaker, job): the event heap
        self._ticket = 0
        self._next_seq = 1
        # The status log: (job_id, state, reason, node, exit_code, at); a cursor is an index into it.
        self._log: list[tuple[int, BackendState, str | None, str | None, int | None, int]] = []
        self._rerun: set[int] = set()  # jobs told of a preemption: their next submission is a new run
        self._fenced: dict[str, str] = {}  # node -> why it takes no new job
        # A cursor from another incarnation of this cluster (its state lost) must not be
        # read as an index into this one's log.
        self._epoch = secrets.token_hex(4)
        self._now_us = _to_us(clock())
        self._running = 0
        self._pending = 0
        self._dirty = False

    @contextmanager
    def _shared(self) -> Iterator[None]:
        """One call's hold on the cluster: this process's lock and, with a state file, the
        file's lock across processes, with the file reloaded first when another instance
        wrote it (see the module docstring)."""
        with self._lock:
            if self._state_file is None:
                yield
                return
            fd = os.open(self._state_file.with_name(self._state_file.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._lock_fd = fd
                version = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or None
                if version is not None and version != self._seen and self._state_file.exists():
                    self._load(self._state_file)
                    self._seen = version
                yield
            finally:
                self._lock_fd = None
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    # -- the adapter protocol ----------------------------------------------------------

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        # A simulated cluster runs no one's processes: whose job it is changes nothing.
        with self._shared():
            self._answer()
            known = self._jobs.get(job_id)
            # Idempotent by job id, but a job told of a preemption runs again when the
            # broker queues it again: that submission is a new run, as on Slurm.
            if known is None or (known.state in _FINISHED and job_id in self._rerun):
                self._rerun.discard(job_id)
                job = self._admission.admit(job_id, spec, placement)
                job.seq = self._next_seq
                self._next_seq += 1
                self._jobs[job_id] = job
                self._place(job)
                self._save()
            return self._backend_id(job_id)

    def cancel(self, job_id: int) -> None:
        with self._shared():
            self._answer()
            job = self._jobs.get(job_id)
            if job is None or job.state in _FINISHED:
                return
            t = self._now_us
            if job.state is BackendState.RUNNING:
                pool = job.pool
                self._finish(job, t, BackendState.CANCELLED, "cancelled while running", None)
                self._dispatch([pool], t)
            else:
                self._pending -= 1
                job.state = BackendState.CANCELLED
                job.reason = "cancelled before it started"
                job.at_us = t
                self._record(job)
                if job.pinned:
                    job.pool.waiting_count -= 1
                    job.pool.refresh()
                    self._dispatch([job.pool], t)
                else:
                    job.unit_class.waiting_count -= 1
                    self._drain_classes([job.unit_class], t)
            self._save()

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        """A simulated job is a program that checkpoints: told of a preemption, it saves
        its state and exits 0 at once (a job not running yet is left waiting)."""
        with self._shared():
            self._answer()
            job = self._jobs.get(job_id)
            if job is None or job.state is not BackendState.RUNNING:
                return
            self._rerun.add(job_id)
            pool = job.pool
            t = self._now_us
            self._finish(job, t, BackendState.SUCCEEDED, f"saved its state on {signal} and exited", 0)
            self._dispatch([pool], t)
            self._save()

    def find(self, job_id: int) -> BackendJob | None:
        with self._shared():
            self._answer()
            self._save()
            job = self._jobs.get(job_id)
            return None if job is None else self._view(job)

    def scale(self, job_id: int, replicas: int) -> int:
        """Give a job ``replicas`` replicas on the node it runs on (replicas stay together,
        as the simulator places them): Rejected when the node has no room for more, or is
        fenced (a job may always shrink)."""
        with self._shared():
            self._answer()
            job = self._jobs.get(job_id)
            if job is None or job.state in _FINISHED:
                raise Rejected(f"job {job_id} is not running on {self.name}")
            if replicas < 1:
                raise Rejected("a job keeps at least one replica")
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
                        f"node {job.node} of {self.name}{why} has no room for {replicas} replicas of job {job_id} "
                        f"(it runs {old}); its replicas stay together on one node"
                    )
                pool.take(job)
                pool.refresh()
                if replicas < old:
                    self._dispatch([pool], self._now_us)
            self._save()
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

    def logs(
        self,
        job_id: int,
        backend_id: str,
        *,
        stream: str = "stdout",
        replica: int | None = None,
        offset: int = 0,
        tail: int | None = None,
    ) -> JobOutput:
        """The simulated job's output: the simulator runs no program, so its output is the
        story of the run in virtual time (where it started, on what, how it ended), what
        a program's own log lines would sit between."""
        with self._shared():
            self._answer()
            self._save()
            job = self._jobs.get(job_id)
            if job is None:
                raise Rejected(f"simulated cluster {self.name} has no job {job_id}")
            if job.started_us is None:
                raise Rejected(f"job {job_id} has not started on {self.name} yet: no output")
            if replica and replica >= job.replicas:
                raise Rejected(f"job {job_id} has {job.replicas} replica(s) on {self.name}: no replica {replica}")
            text = self._output(job, replica or 0, stream)
        location = f"simulated cluster {self.name}, node {job.node} (in memory: the simulator writes no files)"
        if tail is not None:
            lines = text.splitlines(keepends=True)
            return JobOutput(location, "".join(lines[-tail:]) if tail else "", len(text))
        return JobOutput(location, text[offset : offset + MAX_LOG_CHUNK], min(len(text), offset + MAX_LOG_CHUNK))

    def _output(self, job: SimJob, replica: int, stream: str) -> str:
        def at(us: int) -> str:
            return _to_dt(us).strftime("%Y-%m-%dT%H:%M:%SZ")

        if stream == "stderr":
            if job.state is BackendState.FAILED and job.reason:
                return f"{at(job.at_us)} {job.reason}\n"
            return ""
        what = job.placement.mig_profile or job.sharing.value.split("/", 1)[-1]
        lines = [
            f"{at(job.started_us)} [simulated] job {job.job_id} replica {replica} started on {job.node} "
            f"({job.units} x {what}), {self.name}: virtual time; the simulator runs no program",
        ]
        # Only lines that stay once written: ``gpush logs -f`` reads on from an offset.
        if job.state in _FINISHED:
            ran = (job.at_us - job.started_us) // 1_000_000
            how = job.state.value + (f" (exit {job.exit_code})" if job.exit_code is not None else "")
            why = f": {job.reason}" if job.reason else ""
            lines.append(f"{at(job.at_us)} [simulated] {how} after {format_duration(ran)}{why}")
        return "".join(line + "\n" for line in lines)

    def statuses(self, cursor: str | None = None) -> StatusPage:
        with self._shared():
            self._answer()
            self._save()
            end = len(self._log)
            start = self._cursor_position(cursor)
            if start is None:
                jobs = [self._view(job) for job in sorted(self._jobs.values(), key=lambda j: j.seq)]
            else:
                jobs = [self._entry_view(entry) for entry in self._log[start:end]]
            return StatusPage(jobs, f"{self._epoch}:{end}")

    def inventory(self) -> list[CapacityUnit]:
        """Whole GPUs and MIG instances per node and kind; MPS and time-slicing per GPU."""
        with self._shared():
            self._answer()
            self._save()
            units: list[CapacityUnit] = []
            for pool in self._pools:
                units.extend(pool.inventory(self.name))
            return units

    def health(self) -> Health:
        with self._shared():
            if self._outage is not None:
                return Health(False, f"simulated outage: {self._outage}", "sim")
            self._advance(self._clock_us())
            self._save()
            return Health(
                True,
                f"simulated {self.layout.flavor} cluster {self.name}: {len(self.layout.nodes)} nodes, "
                f"{self.layout.gpu_count} GPUs; {self._running} jobs running, {self._pending} pending",
                "sim",
            )

    # -- fencing and MIG layouts -------------------------------------------------------

    def fence(self, node: str, reason: str) -> None:
        """Start no new job on ``node`` (its pools report no room); its running jobs go on.
        Fencing a fenced node only changes the reason."""
        with self._shared():
            self._answer()
            pools = self._node_pools[self._fleet_node(node).name]
            if self._fenced.get(node) != reason:
                self._fenced[node] = reason
                for pool in pools:
                    pool.set_fenced(reason)
                self._dirty = True
            self._save()

    def unfence(self, node: str) -> None:
        """Let new jobs start on ``node`` again: those waiting for it start at once if it
        has room. Unfencing a node not fenced is no error."""
        with self._shared():
            self._answer()
            pools = self._node_pools[self._fleet_node(node).name]
            if self._fenced.pop(node, None) is not None:
                for pool in pools:
                    pool.set_fenced(None)
                self._dispatch(pools, self._now_us)
                self._dirty = True
            self._save()

    def fenced(self) -> dict[str, str]:
        """The nodes fenced now, with their reasons."""
        with self._shared():
            self._answer()
            self._save()
            return dict(self._fenced)

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Give GPU ``gpu`` of ``node`` the MIG layout ``instances`` (``"3g.20gb@0"``) at
        once: the node's pools and inventory change, and jobs waiting for the new
        instances start. Rejected when the layout is not one the GPU can hold, the GPU is
        not in MIG mode, or the change would take instances from running or waiting jobs
        (see the module docstring). Publishing the layout the GPU has is no error."""
        with self._shared():
            self._answer()
            fleet_gpu = self._mig_gpu(node, gpu)
            slots = sorted((_mig_slot(text) for text in instances), key=lambda s: (s.start, s.profile))
            problem = layout_problem(fleet_gpu.model, slots)
            if problem:
                raise Rejected(f"GPU {gpu} of node {node} cannot hold {', '.join(instances)}: {problem}")
            if same_layout(slots, map(_mig_slot, self._published(node, fleet_gpu))):
                self._save()
                return
            overrides = dict(self._mig_overrides)
            overrides.pop((node, gpu), None)
            if not same_layout(slots, map(_mig_slot, _placed(fleet_gpu))):
                overrides[(node, gpu)] = tuple(map(str, slots))
            problem = self._mig_change_problem(node, overrides)
            if problem:
                raise Rejected(f"cannot change the MIG layout of GPU {gpu} of node {node} now: {problem}")
            # Rebuild the pools with the new layout and put every job back where it was.
            state = self._state()
            self._mig_overrides = overrides
            self._fresh()
            self._restore_state(state)
            self._dirty = True
            self._save()

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances GPU ``gpu`` of ``node`` offers now: never None, the simulator
        takes a change in at once."""
        with self._shared():
            self._answer()
            self._save()
            return self._published(node, self._mig_gpu(node, gpu))

    def mig_in_use(self, node: str) -> dict[str, int]:
        """MIG instances of ``node`` that jobs hold now, by profile (the simulator counts
        them per node, not per GPU)."""
        with self._shared():
            self._answer()
            self._save()
            pools = self._node_pools[self._fleet_node(node).name]
            return {p.profile: p.capacity - p.free for p in pools if p.profile is not None and p.capacity > p.free}

    def _published(self, node: str, gpu: FleetGpu) -> tuple[str, ...]:
        """The instances ``gpu`` of ``node`` offers now: as published, else as the fleet file has them."""
        published = self._mig_overrides.get((node, gpu.index))
        return _placed(gpu) if published is None else published

    def _fleet_node(self, node: str) -> FleetNode:
        """The fleet file's node ``node``, or Rejected naming it."""
        found = self._file_nodes.get(node)
        if found is None:
            names = list(self._file_nodes)
            shown = ", ".join(names[:8]) + (f" ... ({len(names)} nodes)" if len(names) > 8 else "")
            raise Rejected(f"simulated cluster {self.name} has no node {node}: its nodes are {shown}")
        return found

    def _mig_gpu(self, node: str, gpu: int) -> FleetGpu:
        """GPU ``gpu`` of ``node`` as the fleet file has it, or Rejected unless it is in MIG mode."""
        gpus = self._fleet_node(node).gpus
        if not 0 <= gpu < len(gpus):
            raise Rejected(f"node {node} of {self.name} has no GPU {gpu}: its GPUs are 0 to {len(gpus) - 1}")
        if gpus[gpu].mode != "mig":
            raise Rejected(
                f"GPU {gpu} of node {node} is not in MIG mode ({gpus[gpu].mode}, {gpus[gpu].model.name}): "
                "only a GPU the fleet file gives a mig layout can change it"
            )
        return gpus[gpu]

    def _mig_change_problem(self, node: str, overrides: Mapping[tuple[str, int], tuple[str, ...]]) -> str | None:
        """What the MIG layouts ``overrides`` would take from jobs on ``node``, or None:
        instances its running jobs hold (counted per pool, as the simulator counts them),
        or the last instances of a kind that jobs wait for."""
        laid_out = self._laid_out(overrides)
        new_node = next(n for n in laid_out.nodes if n.name == node)
        capacity = {(p.sharing, p.profile, p.model.name): p.capacity for p in pools_of(new_node, laid_out.flavor)}
        for pool in self._node_pools[node]:
            if pool.profile is None:
                continue
            left = capacity.get((pool.sharing, pool.profile, pool.model.name), 0)
            held = pool.capacity - pool.free
            if held > left:
                return (
                    f"its running jobs hold {held} {pool.profile} instance(s) there, and the node would have {left}; "
                    "wait for them to end, or keep enough of them"
                )
            if left:
                continue
            if pool.waiting_count:
                return f"{pool.waiting_count} job(s) wait there for {pool.profile}, and the node would have none"
            for unit_class, _slot in pool.slots:
                others = [p for p in unit_class.pools if p.node != node]
                if unit_class.waiting_count and not others:
                    return f"{unit_class.waiting_count} job(s) wait for {pool.profile}, and no node would have any"
        return None

    def _laid_out(self, overrides: Mapping[tuple[str, int], tuple[str, ...]]) -> FleetCluster:
        """The fleet file's cluster with the MIG layouts ``overrides`` in place of its
        GPUs' own; one its GPU cannot take (the fleet file changed since) is left out."""
        layout = self._file_layout
        if not overrides:
            return layout
        nodes = []
        for node in layout.nodes:
            gpus = []
            for gpu in node.gpus:
                instances = overrides.get((node.name, gpu.index))
                if instances is not None and gpu.mode == "mig":
                    slots = [_mig_slot(text) for text in instances]
                    if layout_problem(gpu.model, slots) is None:
                        gpu = dataclasses.replace(gpu, mig=tuple(s.profile for s in slots))
                gpus.append(gpu)
            nodes.append(dataclasses.replace(node, gpus=tuple(gpus)))
        return dataclasses.replace(layout, nodes=tuple(nodes))

    # -- virtual time and test hooks ---------------------------------------------------

    def advance(self, to: datetime) -> None:
        """Run the cluster up to virtual time ``to`` (no-op if it is already past it)."""
        with self._shared():
            self._advance(_to_us(to))
            self._save()

    def next_event_time(self) -> datetime | None:
        """When the next running job ends (the next moment anything changes), or None."""
        with self._shared():
            ends = self._ends
            while ends and not self._is_live(ends[0]):
                heapq.heappop(ends)
            return _to_dt(ends[0][0]) if ends else None

    @property
    def now(self) -> datetime:
        """The virtual time the cluster has reached."""
        return _to_dt(self._now_us)

    def simulate_outage(self, reason: str | None) -> None:
        """Make every call but health() raise Unreachable with ``reason`` (None ends the
        outage), to test how the broker copes with a cluster that stops answering."""
        with self._shared():
            self._outage = reason

    # -- submission --------------------------------------------------------------------

    def _place(self, job: SimJob) -> None:
        t = self._now_us
        if job.pinned:
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
            job.reason = unit_class.waiting_reason(job, self.name)
            unit_class.waiting.append(job)
            unit_class.waiting_count += 1
        job.at_us = t
        self._pending += 1
        self._record(job)

    # -- running and ending ------------------------------------------------------------

    def _start(self, job: SimJob, pool: Pool, t: int) -> None:
        over = pool.take(job)
        job.pool = pool
        job.node = pool.node
        job.state = BackendState.RUNNING
        job.reason = None
        job.started_us = job.at_us = t
        self._running += 1
        self._record(job)
        if over:
            gpu = pool.gpus[over[0]]
            used = pool.gpu_memory[over[0]]
            self._finish(
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
        self._ticket += 1
        heapq.heappush(self._ends, (job.ends_us, self._ticket, job))
        pool.refresh()

    def _finish(self, job: SimJob, t: int, state: BackendState, reason: str | None, exit_code: int | None) -> None:
        pool = job.pool
        pool.release(job)
        self._running -= 1
        job.state = state
        job.reason = reason
        job.exit_code = exit_code
        job.ends_us = None
        job.at_us = t
        self._record(job)
        pool.refresh()

    def _end(self, job: SimJob, t: int) -> None:
        """A running job reached its end time."""
        if job.limit_us is not None and job.duration_us > job.limit_us:
            limit = format_duration(job.limit_us // 1_000_000)
            self._finish(job, t, BackendState.FAILED, f"TIMEOUT: ran past its time limit of {limit}", None)
        elif job.exit_at_end:
            self._finish(job, t, BackendState.FAILED, f"exited with code {job.exit_at_end}", job.exit_at_end)
        else:
            self._finish(job, t, BackendState.SUCCEEDED, None, 0)

    def _is_live(self, event: tuple[int, int, SimJob]) -> bool:
        job = event[2]
        return job.state is BackendState.RUNNING and job.ends_us == event[0]

    def _advance(self, to_us: int) -> None:
        ends = self._ends
        while ends and ends[0][0] <= to_us:
            t = ends[0][0]
            freed: dict[Pool, None] = {}  # ordered, and O(1) when thousands end at once
            # Every job ending at the same instant frees its units before anyone starts,
            # so a job waiting for four GPUs sees all four that free at once.
            while ends and ends[0][0] == t:
                event = heapq.heappop(ends)
                if self._is_live(event):
                    job = event[2]
                    freed[job.pool] = None
                    self._end(job, t)
            if t > self._now_us:
                self._now_us = t
            self._dispatch(freed, t)
        if to_us > self._now_us:
            self._now_us = to_us

    def _dispatch(self, pools: Iterable[Pool], t: int) -> None:
        """Start waiting jobs on ``pools`` whose units just freed: jobs pinned there first,
        then the cluster-wide queues those pools serve."""
        classes: list[UnitClass] = []
        for pool in pools:
            if pool.waiting_count:
                self._drain_pool(pool, t)
                pool.refresh()  # unmask the pool if its queue emptied
            for unit_class, _slot in pool.slots:
                if unit_class.waiting_count and unit_class not in classes:
                    classes.append(unit_class)
        if classes:
            self._drain_classes(classes, t)

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
                self._pending -= 1
                self._start(job, pool, t)
                continue
            if pins is None:
                break  # FIFO without backfill: nothing passes a job that may take any GPU
            # A job pinned to GPUs holds up only the jobs that want those GPUs.
            kept.append(waiting.popleft())
            held.update(pos for pos, _ in pins)
        waiting.extendleft(reversed(kept))

    def _drain_classes(self, classes: list[UnitClass], t: int) -> None:
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
            self._pending -= 1
            self._start(best_head, pool, t)

    # -- status ------------------------------------------------------------------------

    def _record(self, job: SimJob) -> None:
        self._log.append((job.job_id, job.state, job.reason, job.node, job.exit_code, job.at_us))
        self._dirty = True

    def _backend_id(self, job_id: int) -> str:
        return f"sim-{self.name}-{job_id}"

    def _view(self, job: SimJob) -> BackendJob:
        return BackendJob(
            job.job_id,
            self._backend_id(job.job_id),
            job.state,
            job.reason,
            job.node,
            job.exit_code,
            _to_dt(job.at_us),
        )

    def _entry_view(self, entry: tuple[int, BackendState, str | None, str | None, int | None, int]) -> BackendJob:
        job_id, state, reason, node, exit_code, at_us = entry
        return BackendJob(job_id, self._backend_id(job_id), state, reason, node, exit_code, _to_dt(at_us))

    def _cursor_position(self, cursor: str | None) -> int | None:
        """Where in the log a cursor points, or None for 'everything' (no cursor, or one
        from another incarnation of this cluster)."""
        if cursor is None:
            return None
        epoch, sep, position = cursor.partition(":")
        if not sep or not position.isdigit():
            raise ValueError(f"{cursor!r} is not a status cursor of {self.name}: pass back the cursor statuses() gave")
        if epoch != self._epoch or int(position) > len(self._log):
            return None
        return int(position)

    def _clock_us(self) -> int:
        return _to_us(self._clock())

    def _answer(self) -> None:
        """What every public call does first: fail if the cluster is 'down', else catch up with the clock."""
        if self._outage is not None:
            raise Unreachable(f"{self.name}: {self._outage}")
        self._advance(self._clock_us())

    # -- persistence -------------------------------------------------------------------

    def _save(self) -> None:
        if self._state_file is None or not self._dirty:
            return
        tmp = self._state_file.with_name(self._state_file.name + ".tmp")
        tmp.write_text(json.dumps(self._state(), separators=(",", ":")))
        if self._lock_fd is not None:
            # A new version for the other instances (see _shared), before the file: killed
            # in between, they reload the old file, which is then still the truth.
            self._seen = secrets.token_hex(8)
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, self._seen.encode("ascii"), 0)
        os.replace(tmp, self._state_file)  # a crash mid-write leaves the previous state whole
        self._dirty = False

    def _state(self) -> dict[str, Any]:
        """The cluster's state as the state file holds it (JSON-ready)."""
        return {
            "format": STATE_FORMAT,
            "cluster": self.name,
            "epoch": self._epoch,
            "now_us": self._now_us,
            "next_seq": self._next_seq,
            "jobs": [self._job_state(job) for job in self._jobs.values()],
            "log": [[job_id, state.value, *rest] for job_id, state, *rest in self._log],
            "rerun": sorted(self._rerun),
            "fenced": dict(self._fenced),
            "mig": [[node, gpu, list(instances)] for (node, gpu), instances in self._mig_overrides.items()],
        }

    def _job_state(self, job: SimJob) -> dict[str, Any]:
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
        }

    def _load(self, path: Path) -> None:
        """The cluster rebuilt as the state file at ``path`` has it: its MIG layouts, then its jobs."""
        try:
            state = json.loads(path.read_text())
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}, expected {STATE_FORMAT}")
            if state["cluster"] != self.name:
                raise InvalidRequest(
                    f"state file {path} holds the jobs of simulated cluster {state['cluster']}, not {self.name}: "
                    "give each simulated cluster its own state_file"
                )
            self._mig_overrides = {(node, gpu): tuple(instances) for node, gpu, instances in state.get("mig", [])}
            self._fresh()
            self._restore_state(state)
        except InvalidRequest:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise InvalidRequest(
                f"cannot read the simulator's state file {path}: {exc}; delete it to start the cluster empty"
            ) from None

    def _restore_state(self, state: Mapping[str, Any]) -> None:
        """Put the jobs, status log and fences of ``state`` (what :meth:`_state` gave) into
        the freshly built cluster, and start the waiting jobs that have room now."""
        self._epoch = state["epoch"]
        # The saved virtual time, not the clock's: jobs that ended while the broker was
        # down end on the next call, at their own end times, as on a real cluster.
        self._now_us = state["now_us"]
        self._next_seq = state["next_seq"]
        self._log = [(e[0], BackendState(e[1]), *e[2:]) for e in state["log"]]
        self._rerun = set(state.get("rerun", []))
        records = sorted(state["jobs"], key=lambda r: r["seq"])
        jobs = [self._restore(record) for record in records]
        self._running = sum(job.state is BackendState.RUNNING for job in jobs)
        self._pending = sum(job.state is BackendState.PENDING for job in jobs)
        for node, reason in state.get("fenced", {}).items():
            if node in self._node_pools:  # a node gone from the fleet file is fenced no more
                self._fenced[node] = reason
                for pool in self._node_pools[node]:
                    pool.set_fenced(reason)
        # The fleet file may have grown since: let waiting jobs take what is free now.
        self._dispatch(self._pools, self._now_us)

    def _restore(self, record: dict[str, Any]) -> SimJob:
        placement = Placement.from_dict(record["placement"])
        model_name = gpu_model(placement.gpu_model).name if placement.gpu_model else None
        unit_class = self._classes.get((placement.sharing, placement.mig_profile, model_name))
        job = SimJob(record["job_id"], record["seq"], placement, unit_class)
        for name in ("memory_gb", "duration_us", "limit_us", "exit_at_end", "reason", "node", "exit_code", "at_us"):
            setattr(job, name, record[name])
        job.state = BackendState(record["state"])
        job.started_us, job.ends_us = record["started_us"], record["ends_us"]
        job.holdings = tuple((pos, units) for pos, units in record["holdings"])
        self._jobs[job.job_id] = job
        pool = self._pool_by_key.get(tuple(record["pool"])) if record["pool"] else None
        job.pool = pool
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
                pool.restore(job)
                self._ticket += 1
                heapq.heappush(self._ends, (job.ends_us, self._ticket, job))
        elif job.state is BackendState.PENDING:
            if job.pinned and pool is not None:
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
        job.at_us = self._now_us
        self._record(job)


def _mig_slot(text: str) -> MigSlot:
    """A MIG instance as publish_mig takes it, ``"3g.20gb@0"``: the profile at its first memory slot."""
    try:
        return MigSlot.parse(text)
    except ValueError as exc:
        raise Rejected(str(exc)) from None


def _placed(gpu: FleetGpu) -> tuple[str, ...]:
    """The instances of a GPU as the fleet file lays it out (profiles only), placed where
    they fit: largest first, lowest start first."""
    return tuple(map(str, place_instances(gpu.model, [MigSlot(profile) for profile in gpu.mig])))
