"""The shared state of one simulated cluster, which every concern of the package reads and changes.

This module owns :class:`ClusterState`: the fleet file's cluster and the MIG layouts
published since, the pools and unit classes built from them, the jobs, the event heap of
job ends, the status log, the fences, the virtual time reached, and the status-log
append every state change goes through. It also owns the conversion between datetimes
and the integer microseconds of virtual time, and how the fleet file's cluster is laid
out with published MIG layouts (:func:`laid_out`).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from broker.core.adapter import BackendState, Rejected
from broker.core.clock import Clock
from broker.mig.layouts import MigSlot, layout_problem
from broker.simulation.admission import Admission
from broker.simulation.fleet import FleetCluster, FleetNode
from broker.simulation.pools import Pool, SimJob, UnitClass, UnitKey, pools_of

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
FINISHED = (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.CANCELLED)

# A status-log entry: (job_id, state, reason, node, exit_code, at); a cursor is an index into the log.
LogEntry = tuple[int, BackendState, str | None, str | None, int | None, int]


def to_us(moment: datetime) -> int:
    # Integer microseconds keep virtual times exact: a job of 600 s started at t ends at t + 600 s.
    if moment.tzinfo is None:
        raise ValueError(f"the simulator's clock returned {moment!r} without a time zone: return an aware datetime")
    return (moment - _EPOCH) // _MICROSECOND


def to_dt(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def mig_slot(text: str) -> MigSlot:
    """A MIG instance as publish_mig takes it, ``"3g.20gb@0"``: the profile at its first memory slot."""
    try:
        return MigSlot.parse(text)
    except ValueError as exc:
        raise Rejected(str(exc)) from None


def laid_out(layout: FleetCluster, overrides: Mapping[tuple[str, int], tuple[str, ...]]) -> FleetCluster:
    """The fleet file's cluster ``layout`` with the MIG layouts ``overrides`` in place of its
    GPUs' own; one its GPU cannot take (the fleet file changed since) is left out."""
    if not overrides:
        return layout
    nodes = []
    for node in layout.nodes:
        gpus = []
        for gpu in node.gpus:
            instances = overrides.get((node.name, gpu.index))
            if instances is not None and gpu.mode == "mig":
                slots = [mig_slot(text) for text in instances]
                if layout_problem(gpu.model, slots) is None:
                    gpu = dataclasses.replace(gpu, mig=tuple(s.profile for s in slots))
            gpus.append(gpu)
        nodes.append(dataclasses.replace(node, gpus=tuple(gpus)))
    return dataclasses.replace(layout, nodes=tuple(nodes))


class ClusterState:
    """What one simulated cluster holds; :meth:`build` lays it out empty (state is loaded on top)."""

    def __init__(self, name: str, layout: FleetCluster, clock: Clock) -> None:
        self.name = name
        self.file_layout = layout  # as the fleet file has it; self.layout has the MIG layouts published since
        self.file_nodes = {node.name: node for node in layout.nodes}
        # (node, GPU index) -> the instances published there, where they differ from the fleet file.
        self.mig_overrides: dict[tuple[str, int], tuple[str, ...]] = {}
        self.clock = clock
        self.outage: str | None = None

    def build(self) -> None:
        """The cluster empty, as its fleet file lays it out with the MIG layouts published
        since (state is loaded on top)."""
        self.layout = layout = laid_out(self.file_layout, self.mig_overrides)
        name, clock = self.name, self.clock
        self.pools: list[Pool] = []
        self.node_pools: dict[str, list[Pool]] = {}
        node_pools = self.node_pools
        for node in layout.nodes:
            pools = pools_of(node, layout.flavor)
            self.pools.extend(pools)
            node_pools[node.name] = pools
        self.pool_by_key = {(p.node, p.sharing, p.profile, p.model.name): p for p in self.pools}
        members: dict[UnitKey, list[Pool]] = {}
        for pool in self.pools:
            for key in ((pool.sharing, pool.profile, pool.model.name), (pool.sharing, pool.profile, None)):
                members.setdefault(key, []).append(pool)
        self.classes = {key: UnitClass(key, pools) for key, pools in members.items()}
        self.admission = Admission(name, layout, node_pools, self.classes)
        for unit_class in self.classes.values():
            for slot, pool in enumerate(unit_class.pools):
                pool.slots.append((unit_class, slot))
        for pool in self.pools:
            pool.refresh()

        self.jobs: dict[int, SimJob] = {}
        self.ends: list[tuple[int, int, SimJob]] = []  # (end time, tie-breaker, job): the event heap
        self.ticket = 0
        self.next_seq = 1
        self.log: list[LogEntry] = []
        self.rerun: set[int] = set()  # jobs told of a preemption: their next submission is a new run
        # Multi-node jobs waiting for room on all their nodes at once, oldest first.
        self.gangs: deque[SimJob] = deque()
        self.fenced: dict[str, str] = {}  # node -> why it takes no new job
        # A cursor from another incarnation of this cluster (its state lost) must not be
        # read as an index into this one's log.
        self.epoch = secrets.token_hex(4)
        self.now_us = to_us(clock())
        self.running = 0
        self.pending = 0
        self.dirty = False

    def record(self, job: SimJob) -> None:
        """Append ``job``'s state now to the status log."""
        self.log.append((job.job_id, job.state, job.reason, job.node, job.exit_code, job.at_us))
        self.dirty = True

    def backend_id(self, job_id: int) -> str:
        return f"sim-{self.name}-{job_id}"

    def clock_us(self) -> int:
        return to_us(self.clock())

    def fleet_node(self, node: str) -> FleetNode:
        """The fleet file's node ``node``, or Rejected naming it."""
        found = self.file_nodes.get(node)
        if found is None:
            names = list(self.file_nodes)
            shown = ", ".join(names[:8]) + (f" ... ({len(names)} nodes)" if len(names) > 8 else "")
            raise Rejected(f"simulated cluster {self.name} has no node {node}: its nodes are {shown}")
        return found
