"""The simulated cluster's adapter class: the protocol's entry points, each handed to its concern.

:class:`SimulatedCluster` itself is thin: it reads its settings, declares its
capabilities and hands each call to the part that owns it, each given the cluster's
shared state (broker.simulation.cluster.state): submission (jobs), status pages
(status), fencing (nodes), MIG layouts (mig_publish), output (logs), inventory and
health (capacity), the replay's hooks on virtual time (virtual_time), all on one event
engine (engine) and one state file (persistence). What a caller may rely on: the package
docstring.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from broker.core.adapter import (
    BackendJob,
    CapacityUnit,
    Health,
    JobOutput,
    LogReader,
    MigPublisher,
    NodeFencer,
    Owner,
    Placement,
    Preemptor,
    Scaler,
    StatusPage,
)
from broker.core.clock import Clock
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.core.spec_values import short_text
from broker.simulation.cluster.capacity import Capacity
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.jobs import Jobs
from broker.simulation.cluster.logs import JobLogs
from broker.simulation.cluster.mig_publish import MigPublishing
from broker.simulation.cluster.nodes import Fencing
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import ClusterState
from broker.simulation.cluster.status import Statuses
from broker.simulation.cluster.virtual_time import VirtualTime
from broker.simulation.fleet import Fleet, FleetCluster, load_fleet, load_fleet_file


class SimulatedCluster:
    """One simulated cluster of a fleet file, behind the adapter protocol, in virtual time.

    ``config``: ``{"fleet": path}`` or ``{"fleet_yaml": text}``; optionally ``"cluster"``
    (the cluster's name in the file, default ``name``) and ``"state_file"`` (JSON the
    simulator persists to and reloads from). See the package docstring for behaviour.
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
        for setting in ("fleet", "state_file"):
            path = config.get(setting)
            if path is not None and (not isinstance(path, str) or not path or "\x00" in path):
                raise InvalidRequest(
                    f"simulated cluster {name}: {setting} {short_text(path)} is no file path: "
                    "give the path as text, without NUL characters",
                    details=[{"field": f"config.{setting}", "value": path}],
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
        state = self._state = ClusterState(name, layout, clock)
        engine = EventEngine(state)
        store = StateFile(state, engine, Path(state_file) if state_file else None)
        self._statuses = Statuses(state, engine, store)
        self._jobs = Jobs(state, engine, store, self._statuses)
        self._fencing = Fencing(state, engine, store)
        self._mig = MigPublishing(state, engine, store)
        self._logs = JobLogs(state, engine, store)
        self._capacity = Capacity(state, engine, store)
        self._time = VirtualTime(state, engine, store)
        store.open()

    @property
    def layout(self) -> FleetCluster:
        """The fleet file's cluster with the MIG layouts published since."""
        return self._state.layout

    # -- jobs (broker.simulation.cluster.jobs, .status, .logs) ----------------------------

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        # A simulated cluster runs no one's processes: whose job it is changes nothing.
        return self._jobs.submit(job_id, spec, placement)

    def cancel(self, job_id: int) -> None:
        self._jobs.cancel(job_id)

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        self._jobs.preempt(job_id, signal, grace_seconds)

    def find(self, job_id: int) -> BackendJob | None:
        return self._jobs.find(job_id)

    def scale(self, job_id: int, replicas: int) -> int:
        return self._jobs.scale(job_id, replicas)

    def statuses(self, cursor: str | None = None) -> StatusPage:
        return self._statuses.statuses(cursor)

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
        return self._logs.logs(job_id, stream, replica, offset, tail)  # the simulator knows its jobs by gpush id

    # -- the cluster (broker.simulation.cluster.capacity, .nodes, .mig_publish) -----------

    def inventory(self) -> list[CapacityUnit]:
        return self._capacity.inventory()

    def health(self) -> Health:
        return self._capacity.health()

    def fence(self, node: str, reason: str) -> None:
        self._fencing.fence(node, reason)

    def unfence(self, node: str) -> None:
        self._fencing.unfence(node)

    def fenced(self) -> dict[str, str]:
        return self._fencing.fenced()

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        self._mig.publish_mig(node, gpu, instances, reported)

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        return self._mig.mig_published(node, gpu)

    def mig_in_use(self, node: str) -> dict[str, int]:
        return self._mig.mig_in_use(node)

    # -- virtual time and test hooks (broker.simulation.cluster.virtual_time) -------------

    def advance(self, to: datetime) -> None:
        self._time.advance(to)

    def next_event_time(self) -> datetime | None:
        return self._time.next_event_time()

    @property
    def now(self) -> datetime:
        """The virtual time the cluster has reached."""
        return self._time.now()

    def simulate_outage(self, reason: str | None) -> None:
        self._time.simulate_outage(reason)
