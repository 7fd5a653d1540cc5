"""The simulated fleet: Slurm-like and Kubernetes-like clusters that run in virtual time.

This module owns the fleet file (YAML describing simulated clusters), its validation,
and :class:`SimulatedCluster`, the first implementation of the adapter protocol
(:mod:`broker.core.adapter`). It drives the embedded demo, the tests and trace replays, so
from the broker's side it behaves like a real cluster, only far faster than real time.

A fleet file::

    clusters:
      slurm-a:
        flavor: slurm                  # bare-metal nodes, GPUs as typed GRES
        nodes:
          - name: mig                  # count: 2 names them mig-01, mig-02
            count: 2
            cpus: 64
            memory: 512G
            gpus:
              - {model: A100-SXM4-40GB, mig: [3g.20gb, 3g.20gb]}   # one GPU in MIG mode
              - {model: A100-SXM4-40GB, mps: true}                  # one MPS GPU
              - {model: A100-SXM4-80GB, count: 4}                   # four whole GPUs
      k8s-a:
        flavor: k8s                    # node pools under the NVIDIA GPU Operator
        pools:
          - {name: t4, nodes: 4, gpus_per_node: 4, model: T4, timeslice_replicas: 4}
          - {name: a100, nodes: 1, gpus_per_node: 8, model: A100-SXM4-40GB, mig: [3g.20gb, 2g.10gb, 1g.5gb, 1g.5gb]}
          - {name: h100, nodes: 1, gpus_per_node: 8, model: H100-SXM5-80GB}

How a simulated cluster behaves (what a broker or a test may rely on):

- **Virtual time.** Every public call first advances the cluster to ``clock()``. Jobs
  end at their exact virtual end time, and waiting jobs start at the virtual time the
  units they wait for freed, not at the time of the call. :meth:`SimulatedCluster.advance`
  and :meth:`SimulatedCluster.next_event_time` let a replay jump from event to event.
- **Durations.** ``labels["sim-duration"]`` in seconds; else half of ``time_limit``;
  else 300 s. ``labels["sim-exit"]`` = ``failed`` (exit code 1) or an exit code makes the
  job fail at its end. A ``sim-duration`` longer than the ``time_limit`` is killed at
  the limit, as Slurm and ``activeDeadlineSeconds`` do.
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
- **Inventory.** Whole GPUs and MIG instances: one unit per node and kind. MPS and
  time-slicing: one unit per physical GPU (``gpus=(index,)``, capacity 100 or the GPU's
  replicas), time-sliced ones with the memory their jobs asked (``memory_allocated_gb``).
- **MPS.** Units are percent of one GPU; each replica's share lives on one GPU: the
  one its placement names, else the lowest-indexed GPU with room.
- **Time-slicing.** Replicas go to the GPUs their placement names; without, they are
  handed out least-loaded first (the physical GPU with the most free replicas, lowest
  index on ties), so jobs spread over the GPUs. There is
  no memory isolation: when the ``gpu_memory_gb`` of the jobs on one physical GPU adds up
  to more than the GPU has, the job that pushed it over fails with
  ``OOMKilled: time-sliced GPU memory over-committed`` (exit code 137), as a CUDA
  allocation would; the jobs already there keep running.
- **Status.** ``statuses(cursor)`` returns every change since the cursor, in order, each
  at its virtual time; without a cursor (or with one from a cluster whose state was
  lost) it returns every known job's current state.
- **Persistence.** With ``state_file``, jobs, allocations and the status log are
  written there (JSON) after every call that changed them and reloaded on start, so a
  simulated cluster outlives a broker restart as a real one does.
- **Not simulated:** CPU and host memory on nodes (reported in the file, not enforced),
  partitions, node failures, preemption.
"""

from __future__ import annotations

import difflib
import heapq
import json
import math
import os
import secrets
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from broker.core.adapter import (
    BackendJob,
    BackendState,
    CapacityUnit,
    Health,
    Placement,
    Rejected,
    Sharing,
    StatusPage,
    Unreachable,
)
from broker.core.clock import Clock
from broker.core.errors import InvalidRequest
from broker.core.gpus import MODELS, GpuModel, gpu_model, mig_layout_problem
from broker.core.schemas import JobSpec, format_duration, parse_memory_mib, parse_time_limit
from broker.core.yamltext import load_yaml

DEFAULT_DURATION_S = 300
# What a job killed for over-committing a time-sliced GPU exits with: the code a
# container killed by SIGKILL reports, which is what Kubernetes shows with OOMKilled.
OOM_EXIT_CODE = 137
STATE_FORMAT = 1


# -- the fleet file --------------------------------------------------------------------

_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
_NAME_WORDS = "letters, digits, '-', '.' and '_', starting and ending with a letter or digit, at most 63"
Name = Annotated[str, Field(pattern=_NAME_PATTERN)]
HostMemory = Annotated[int | None, BeforeValidator(lambda v: None if v is None else parse_memory_mib(v))]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SlurmGpuConfig(_Strict):
    """One GPU (or ``count`` identical GPUs) of a Slurm node: whole, MIG or MPS."""

    model: str
    count: int = Field(1, ge=1, le=64)
    mig: list[str] | None = None  # the MIG instances this GPU is partitioned into
    mps: bool = False


class SlurmNodeConfig(_Strict):
    name: Name
    count: int = Field(1, ge=1, le=100_000)
    cpus: int | None = Field(None, ge=1)
    memory: HostMemory = None
    gpus: list[SlurmGpuConfig] = Field(min_length=1)


class K8sPoolConfig(_Strict):
    """A node pool: ``nodes`` identical nodes of ``gpus_per_node`` GPUs of one model."""

    name: Name
    nodes: int = Field(1, ge=1, le=100_000)
    gpus_per_node: int = Field(ge=1, le=64)
    model: str
    timeslice_replicas: int | None = Field(None, ge=2, le=1024)
    mig: list[str] | None = None  # per-GPU layout, advertised under the mixed strategy
    cpus: int | None = Field(None, ge=1)
    memory: HostMemory = None


class ClusterConfig(_Strict):
    flavor: Literal["slurm", "k8s"]
    nodes: list[SlurmNodeConfig] | None = None
    pools: list[K8sPoolConfig] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape_for_flavor(cls, data: Any) -> Any:
        # Checked before the fields, so a k8s cluster written with Slurm's `nodes:` gets
        # one sentence about the shape instead of a list of field errors.
        if not isinstance(data, dict):
            return data
        flavor = data.get("flavor")
        if flavor == "slurm" and "pools" in data:
            raise ValueError("a slurm cluster lists nodes (name, count, gpus), not pools: pools are for flavor k8s")
        if flavor == "k8s" and "nodes" in data:
            raise ValueError(
                "a k8s cluster lists node pools under pools (name, nodes, gpus_per_node, model), "
                "not nodes: nodes are for flavor slurm"
            )
        if flavor == "slurm" and not data.get("nodes"):
            raise ValueError("a slurm cluster needs nodes: a list of {name, count, gpus}")
        if flavor == "k8s" and not data.get("pools"):
            raise ValueError("a k8s cluster needs pools: a list of {name, nodes, gpus_per_node, model}")
        return data


class FleetConfig(_Strict):
    clusters: dict[Name, ClusterConfig] = Field(min_length=1)


@dataclass(frozen=True)
class FleetGpu:
    """One physical GPU of a node and how it is shared."""

    index: int  # device index on the node
    model: GpuModel
    mode: Literal["whole", "mig", "mps", "timeslice"]
    mig: tuple[str, ...] = ()  # MIG instances, for mode "mig"
    replicas: int = 1  # time-slicing replicas, for mode "timeslice"


@dataclass(frozen=True)
class FleetNode:
    name: str
    gpus: tuple[FleetGpu, ...]
    cpus: int | None = None
    memory_mib: int | None = None
    pool: str | None = None  # the Kubernetes node pool
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetCluster:
    name: str
    flavor: Literal["slurm", "k8s"]
    nodes: tuple[FleetNode, ...]

    @property
    def gpu_count(self) -> int:
        return sum(len(node.gpus) for node in self.nodes)


@dataclass(frozen=True)
class Fleet:
    """The simulated clusters of one fleet file, nodes expanded and validated."""

    source: str
    clusters: Mapping[str, FleetCluster]

    def cluster(self, name: str) -> FleetCluster:
        try:
            return self.clusters[name]
        except KeyError:
            raise InvalidRequest(
                f"{self.source} has no cluster {name!r}: it has {', '.join(self.clusters)}; set cluster: to one of them"
            ) from None


def load_fleet(text: str, source: str) -> Fleet:
    """A :class:`Fleet` from fleet-file YAML; :class:`InvalidRequest` says what is wrong and where."""
    raw = load_yaml(text, source=source)
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{source}: expected a mapping with clusters: (one entry per simulated cluster)")
    try:
        config = FleetConfig.model_validate(raw)
    except ValidationError as exc:
        details = [_describe_error(err, raw) for err in exc.errors()]
        message = "; ".join(f"{d['where']}: {d['message']}" for d in details)
        raise InvalidRequest(f"{source}: {message}", details=details) from None
    return Fleet(source, {name: _expand(name, cluster, source) for name, cluster in config.clusters.items()})


def load_fleet_file(path: str | os.PathLike[str]) -> Fleet:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read fleet file {str(path)!r}: {exc.strerror or exc}") from None
    return load_fleet(text, str(path))


def _describe_error(err: Mapping[str, Any], raw: Any) -> dict[str, Any]:
    """A pydantic error as {where, message}: where names the cluster, node or pool, and GPU entry."""
    loc = list(err.get("loc", ()))
    where: list[str] = []
    model: type[BaseModel] = FleetConfig
    if loc[:1] == ["clusters"] and len(loc) > 1:
        cluster = loc[1]
        where.append(f"cluster {cluster}")
        model = ClusterConfig
        body = _get(raw, "clusters", cluster)
        rest = loc[2:]
        if len(rest) > 1 and rest[0] in ("nodes", "pools") and isinstance(rest[1], int):
            item = _get(body, rest[0], rest[1])
            name = item.get("name") if isinstance(item, dict) else None
            kind = "node" if rest[0] == "nodes" else "pool"
            where.append(f"{kind} {name}" if name else f"{kind} #{rest[1] + 1}")
            model = SlurmNodeConfig if kind == "node" else K8sPoolConfig
            rest = rest[2:]
            if len(rest) > 1 and rest[0] == "gpus" and isinstance(rest[1], int):
                where.append(f"GPU entry {rest[1] + 1}")
                model = SlurmGpuConfig
                rest = rest[2:]
        loc = rest
    field_name = ".".join(str(part) for part in loc)
    kind = err.get("type")
    message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if kind == "extra_forbidden" and loc:
        known = list(model.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = f"unknown field{hint} (fields here: {', '.join(known)})"
    elif kind == "too_short" and loc == ["clusters"]:
        message = "list at least one cluster, such as slurm-a: {flavor: slurm, nodes: [...]}"
    elif kind == "too_short" and loc == ["gpus"]:
        message = "a node needs at least one GPU entry, such as {model: A100-SXM4-80GB, count: 4}"
    elif kind == "missing":
        message = "required: add it"
    elif kind == "string_pattern_mismatch":
        message = f"{err.get('input')!r} is not a valid name: use {_NAME_WORDS} characters"
    elif "input" in err and not isinstance(err["input"], dict | list) and kind != "value_error":
        message = f"{err['input']!r}: {message}"
    if field_name:
        where.append(field_name)
    return {"where": ", ".join(where) or "(file)", "message": message}


def _get(data: Any, *path: Any) -> Any:
    for key in path:
        if isinstance(data, dict):
            data = data.get(key)
        elif isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            data = data[key]
        else:
            return None
    return data


def _model(name: str, where: str) -> GpuModel:
    try:
        return gpu_model(name)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}") from None


def _check_mig_layout(model: GpuModel, layout: list[str], where: str) -> None:
    if not model.mig_capable:
        capable = ", ".join(m.name for m in MODELS if m.mig_capable)
        raise InvalidRequest(
            f"{where}: {model.name} is not MIG-capable: remove mig, or use a MIG-capable model ({capable})"
        )
    if not layout:
        raise InvalidRequest(f"{where}: mig: [] leaves the GPU with no MIG instances: list them, or remove mig")
    problem = mig_layout_problem(model, layout)
    if problem and any(profile not in model.mig_profiles for profile in layout):
        raise InvalidRequest(f"{where}: {problem}")
    if problem:
        offered = ", ".join(
            f"{p.name} ({p.compute_slices}/{model.compute_slices})" for p in model.mig_profiles.values()
        )
        raise InvalidRequest(
            f"{where}: MIG layout [{', '.join(layout)}] is not possible: {problem}. "
            f"Choose instances that fit one GPU together; {model.name} offers {offered} "
            "(NVIDIA MIG User Guide, 'Supported MIG Profiles')"
        )


def _numbered(name: str, count: int) -> list[str]:
    if count == 1:
        return [name]
    width = max(2, len(str(count)))
    return [f"{name}-{i:0{width}d}" for i in range(1, count + 1)]


def _expand(name: str, config: ClusterConfig, source: str) -> FleetCluster:
    """Nodes of one cluster, replicated and numbered, every GPU checked against the model catalog."""
    nodes: list[FleetNode] = []
    if config.flavor == "slurm":
        for template in config.nodes or []:
            gpus: list[FleetGpu] = []
            for number, entry in enumerate(template.gpus, 1):
                where = f"{source}: cluster {name}, node {template.name}, GPU entry {number} ({entry.model})"
                model = _model(entry.model, where)
                if entry.mig is not None and entry.mps:
                    raise InvalidRequest(f"{where}: a GPU runs either MIG or MPS, not both: remove mig or mps")
                if entry.mig is not None:
                    _check_mig_layout(model, entry.mig, where)
                mode = "mig" if entry.mig is not None else "mps" if entry.mps else "whole"
                for _ in range(entry.count):
                    gpus.append(FleetGpu(len(gpus), model, mode, tuple(entry.mig or ())))
            for node_name in _numbered(template.name, template.count):
                nodes.append(FleetNode(node_name, tuple(gpus), template.cpus, template.memory))
    else:
        for pool in config.pools or []:
            where = f"{source}: cluster {name}, pool {pool.name} ({pool.model})"
            model = _model(pool.model, where)
            if pool.mig is not None and pool.timeslice_replicas:
                raise InvalidRequest(
                    f"{where}: choose MIG or time-slicing for a pool, not both: remove mig or timeslice_replicas"
                )
            if pool.mig is not None:
                _check_mig_layout(model, pool.mig, where)
            mode = "mig" if pool.mig is not None else "timeslice" if pool.timeslice_replicas else "whole"
            replicas = pool.timeslice_replicas or 1
            gpus = tuple(FleetGpu(i, model, mode, tuple(pool.mig or ()), replicas) for i in range(pool.gpus_per_node))
            labels = MappingProxyType(_feature_labels(model, mode, pool.gpus_per_node, replicas, pool.mig or []))
            for node_name in _numbered(pool.name, pool.nodes):
                nodes.append(FleetNode(node_name, gpus, pool.cpus, pool.memory, pool.name, labels))
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise InvalidRequest(
                f"{source}: cluster {name} has two nodes called {node.name}: rename one "
                "(count: N names nodes <name>-01 ... <name>-N)"
            )
        seen.add(node.name)
    return FleetCluster(name, config.flavor, tuple(nodes))


def _feature_labels(model: GpuModel, mode: str, gpus: int, replicas: int, mig: list[str]) -> dict[str, str]:
    """Node labels as GPU Feature Discovery sets them (product names are gpush's canonical ones)."""
    labels = {
        "nvidia.com/gpu.product": model.name,
        "nvidia.com/gpu.memory": str(int(model.memory_gb * 1024)),
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": "time-slicing" if mode == "timeslice" else "none",
        "nvidia.com/mig.capable": "true" if model.mig_capable else "false",
        "nvidia.com/mig.strategy": "mixed",
    }
    for profile in dict.fromkeys(mig):
        labels[f"nvidia.com/mig-{profile}.count"] = str(mig.count(profile) * gpus)
        labels[f"nvidia.com/mig-{profile}.memory"] = str(int(model.profile(profile).memory_gb * 1024))
    return labels


# -- the simulator ---------------------------------------------------------------------

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_MIG = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
_SHARING_BY_MODE = {
    ("slurm", "whole"): Sharing.SLURM_EXCLUSIVE,
    ("slurm", "mig"): Sharing.SLURM_MIG,
    ("slurm", "mps"): Sharing.SLURM_MPS,
    ("k8s", "whole"): Sharing.K8S_EXCLUSIVE,
    ("k8s", "mig"): Sharing.K8S_MIG,
    ("k8s", "timeslice"): Sharing.K8S_TIMESLICE,
}
_SHARED = (Sharing.SLURM_MPS, Sharing.K8S_TIMESLICE)  # units per physical GPU
_FINISHED = (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.CANCELLED)


def _to_us(moment: datetime) -> int:
    # Integer microseconds keep virtual times exact: a job of 600 s started at t ends at t + 600 s.
    if moment.tzinfo is None:
        raise ValueError(f"the simulator's clock returned {moment!r} without a time zone: return an aware datetime")
    return (moment - _EPOCH) // _MICROSECOND


def _to_dt(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


class _FirstFit:
    """A max segment tree over the pools of one unit kind: the first pool with room for
    ``need`` units in O(log pools), so placing a job does not scan every node."""

    __slots__ = ("_size", "_tree")

    def __init__(self, count: int) -> None:
        size = 1
        while size < count:
            size *= 2
        self._size = size
        self._tree = [0] * (2 * size)

    @property
    def most(self) -> int:
        """The most room any one pool has."""
        return self._tree[1]

    def set(self, slot: int, room: int) -> None:
        tree = self._tree
        i = slot + self._size
        if tree[i] == room:
            return
        tree[i] = room
        i >>= 1
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            top = left if left >= right else right
            if tree[i] == top:
                return
            tree[i] = top
            i >>= 1

    def first(self, need: int, after: int = -1) -> int:
        """The lowest slot after ``after`` with room for ``need``, or -1."""
        tree, size = self._tree, self._size
        if after < 0:
            if tree[1] < need:
                return -1
            i = 1
            while i < size:
                i *= 2
                if tree[i] < need:
                    i += 1
            return i - size
        # Only MPS jobs with several replicas get here (room fits one share, not all): rare.
        for slot in range(after + 1, size):
            if tree[slot + size] >= need:
                return slot
        return -1


class _Job:
    __slots__ = (
        "job_id",
        "seq",
        "placement",
        "sharing",
        "units",
        "replicas",
        "need",
        "memory_gb",
        "duration_us",
        "limit_us",
        "exit_at_end",
        "pinned",
        "pins",
        "state",
        "reason",
        "node",
        "exit_code",
        "at_us",
        "pool",
        "unit_class",
        "holdings",
        "started_us",
        "ends_us",
    )

    def __init__(self, job_id: int, seq: int, placement: Placement, unit_class: _UnitClass) -> None:
        self.job_id = job_id
        self.seq = seq
        self.placement = placement
        self.sharing = placement.sharing
        self.units = placement.units
        self.replicas = placement.replicas
        self.need = placement.units * placement.replicas
        self.memory_gb = 0.0
        self.duration_us = DEFAULT_DURATION_S * 1_000_000
        self.limit_us: int | None = None
        self.exit_at_end = 0
        self.pinned = placement.node is not None
        # (GPU position in its pool, units) per replica its placement pins to a GPU, or None.
        self.pins: tuple[tuple[int, int], ...] | None = None
        self.state = BackendState.PENDING
        self.reason: str | None = None
        self.node: str | None = placement.node
        self.exit_code: int | None = None
        self.at_us = 0
        self.pool: _Pool | None = None  # where it runs, or waits if pinned
        self.unit_class = unit_class  # the cluster-wide queue it waits in if not pinned
        self.holdings: tuple[tuple[int, int], ...] = ()  # (GPU position in pool, units) for MPS, time-slicing
        self.started_us: int | None = None
        self.ends_us: int | None = None


class _Pool:
    """One kind of unit on one node (whole GPUs of a model, one MIG profile, MPS GPUs,
    time-sliced GPUs) with its free counters and the FIFO of jobs pinned to it."""

    __slots__ = (
        "node",
        "sharing",
        "model",
        "profile",
        "gpus",
        "capacity",
        "free",
        "per_gpu",
        "gpu_room",
        "gpu_memory",
        "labels",
        "waiting",
        "waiting_count",
        "slots",
        "_units",
    )

    def __init__(
        self,
        node: FleetNode,
        sharing: Sharing,
        model: GpuModel,
        profile: str | None,
        gpus: tuple[int, ...],
        units: int,
        per_gpu: int,
    ) -> None:
        self.node = node.name
        self.sharing = sharing
        self.model = model
        self.profile = profile
        self.gpus = gpus
        self.capacity = units
        self.free = units
        self.per_gpu = per_gpu
        shared = sharing in (Sharing.SLURM_MPS, Sharing.K8S_TIMESLICE)
        self.gpu_room = [per_gpu] * len(gpus) if shared else None
        self.gpu_memory = [0.0] * len(gpus) if sharing is Sharing.K8S_TIMESLICE else None
        self.labels = node.labels
        self.waiting: deque[_Job] = deque()
        self.waiting_count = 0
        self.slots: list[tuple[_UnitClass, int]] = []
        self._units: list[CapacityUnit] | None = None  # what inventory() reports, until it changes

    def inventory(self, cluster: str) -> list[CapacityUnit]:
        """This pool's inventory records: one per physical GPU for MPS and time-slicing,
        one for the pool otherwise. Kept until an allocation changes them."""
        if self._units is not None:
            return self._units
        model, sharing = self.model, self.sharing
        if sharing in _MIG:
            memory, equivalent = model.profile(self.profile).memory_gb, model.gpu_equivalent(self.profile)
        elif sharing is Sharing.SLURM_MPS:
            memory, equivalent = model.memory_gb / 100, 0.01
        elif sharing is Sharing.K8S_TIMESLICE:
            # Nothing stops a replica from using the whole GPU's memory; the guard
            # against over-commit is gpu_memory_gb, summed over the GPU's jobs.
            memory, equivalent = float(model.memory_gb), 1 / self.per_gpu
        else:
            memory, equivalent = float(model.memory_gb), 1.0
        common = {
            "cluster": cluster,
            "node": self.node,
            "sharing": sharing,
            "gpu_model": model.name,
            "unit_memory_gb": memory,
            "gpu_equivalent": equivalent,
            "gpu_memory_gb": float(model.memory_gb),
            "labels": self.labels,
        }
        if self.gpu_room is not None:
            # A share or a replica lives on one GPU: one record per physical GPU.
            self._units = [
                CapacityUnit(
                    **common,
                    capacity=self.per_gpu,
                    allocated=self.per_gpu - self.gpu_room[pos],
                    gpus=(gpu,),
                    memory_allocated_gb=None if self.gpu_memory is None else self.gpu_memory[pos],
                )
                for pos, gpu in enumerate(self.gpus)
            ]
        else:
            self._units = [
                CapacityUnit(
                    **common,
                    capacity=self.capacity,
                    allocated=self.capacity - self.free,
                    mig_profile=self.profile,
                    gpus=self.gpus,
                    in_mig_mode=sharing in _MIG,
                )
            ]
        return self._units

    def refresh(self) -> None:
        """Tell the unit classes this pool serves how much room unpinned jobs may use
        here now: none while jobs pinned to this pool wait, so they are not starved."""
        if self.waiting_count:
            room = 0
        elif self.gpu_room is not None and self.sharing is Sharing.SLURM_MPS:
            room = max(self.gpu_room)
        else:
            room = self.free
        for unit_class, slot in self.slots:
            unit_class.tree.set(slot, room)

    def blocked(self, job: _Job) -> bool:
        """Whether a job waiting here first could take what ``job`` needs: any job not
        pinned to GPUs (FIFO), or one pinned to a GPU ``job`` is pinned to."""
        if job.pins is None:
            return self.waiting_count > 0
        wanted = {pos for pos, _ in job.pins}
        for other in self.waiting:
            if other.state is not BackendState.PENDING:
                continue
            if other.pins is None or any(pos in wanted for pos, _ in other.pins):
                return True
        return False

    def could_ever_hold(self, job: _Job) -> bool:
        if job.pins is not None:
            if len(job.pins) == 1:
                return job.pins[0][1] <= self.per_gpu
            return all(units <= self.per_gpu for units in _pinned_units(job.pins).values())
        if self.sharing is Sharing.SLURM_MPS:
            return job.units <= 100 and job.replicas <= len(self.gpus) * (100 // job.units)
        return job.need <= self.capacity

    def fits(self, job: _Job) -> bool:
        if job.pins is not None:
            room = self.gpu_room
            if len(job.pins) == 1:
                pos, units = job.pins[0]
                return room[pos] >= units
            return all(room[pos] >= units for pos, units in _pinned_units(job.pins).items())
        if self.sharing is not Sharing.SLURM_MPS:
            return self.free >= job.need
        if job.replicas == 1:
            return max(self.gpu_room) >= job.units
        return sum(room // job.units for room in self.gpu_room) >= job.replicas

    def take(self, job: _Job) -> list[int]:
        """Allocate ``job``'s units; returns the GPU positions whose memory it over-committed."""
        self._units = None
        self.free -= job.need
        room = self.gpu_room
        if room is None:
            return []
        held: dict[int, int] = {}
        if job.pins is not None:
            for pos, units in job.pins:
                room[pos] -= units
                held[pos] = held.get(pos, 0) + units
        elif self.sharing is Sharing.SLURM_MPS:
            for _ in range(job.replicas):
                pos = next(p for p, r in enumerate(room) if r >= job.units)
                room[pos] -= job.units
                held[pos] = held.get(pos, 0) + job.units
        else:
            for _ in range(job.need):
                pos = max(range(len(room)), key=room.__getitem__)  # least loaded, lowest index
                room[pos] -= 1
                held[pos] = held.get(pos, 0) + 1
        job.holdings = tuple(held.items())
        return self._charge_memory(job)

    def _charge_memory(self, job: _Job) -> list[int]:
        if self.gpu_memory is None:
            return []
        over = []
        for pos, units in job.holdings:
            self.gpu_memory[pos] += units * job.memory_gb
            if self.gpu_memory[pos] > self.model.memory_gb + 1e-9:
                over.append(pos)
        return over

    def restore(self, job: _Job) -> None:
        """Re-take a running job's recorded allocation (after a reload)."""
        self._units = None
        self.free -= job.need
        if self.gpu_room is not None:
            for pos, units in job.holdings:
                self.gpu_room[pos] -= units
            self._charge_memory(job)

    def release(self, job: _Job) -> None:
        self._units = None
        self.free += job.need
        if self.gpu_room is not None:
            for pos, units in job.holdings:
                self.gpu_room[pos] += units
                if self.gpu_memory is not None:
                    self.gpu_memory[pos] = max(self.gpu_memory[pos] - units * job.memory_gb, 0.0)
        job.holdings = ()


def _pins(pool: _Pool, job: _Job) -> tuple[tuple[int, int], ...]:
    """(GPU position in ``pool``, units) per replica for the GPUs ``job.placement.gpus``
    names: one per replica, or one for them all; Rejected otherwise."""
    gpus = job.placement.gpus
    if len(gpus) == 1:
        gpus = gpus * job.replicas
    if len(gpus) != job.replicas:
        raise Rejected(
            f"placement names {len(job.placement.gpus)} GPUs for {job.replicas} replicas: "
            "name one GPU per replica, or one for all of them"
        )
    return tuple((pool.gpus.index(g), job.units) for g in gpus)


def _pinned_units(pins: tuple[tuple[int, int], ...]) -> dict[int, int]:
    """Units per GPU position of a job's pins (two replicas may share a GPU)."""
    units: dict[int, int] = {}
    for pos, n in pins:
        units[pos] = units.get(pos, 0) + n
    return units


class _UnitClass:
    """The pools that can serve one kind of request, (sharing, MIG profile, model or any
    model), with the cluster-wide FIFO of unpinned jobs waiting for it."""

    __slots__ = ("key", "pools", "tree", "waiting", "waiting_count", "max_capacity", "max_gpus", "model_name")

    def __init__(self, key: tuple[Sharing, str | None, str | None], pools: list[_Pool]) -> None:
        self.key = key
        self.pools = pools
        self.tree = _FirstFit(len(pools))
        self.waiting: deque[_Job] = deque()
        self.waiting_count = 0
        self.max_capacity = max(p.capacity for p in pools)
        self.max_gpus = max(len(p.gpus) for p in pools)
        models = {p.model.name for p in pools}
        self.model_name = models.pop() if len(models) == 1 else None  # to name it in reasons

    def head(self) -> _Job | None:
        while self.waiting and self.waiting[0].state is not BackendState.PENDING:
            self.waiting.popleft()
        return self.waiting[0] if self.waiting else None

    def could_ever_hold(self, job: _Job) -> bool:
        if job.sharing is Sharing.SLURM_MPS:
            return job.units <= 100 and job.replicas <= self.max_gpus * (100 // job.units)
        return job.need <= self.max_capacity


def _pools_of(node: FleetNode, flavor: str) -> list[_Pool]:
    """A node's GPUs grouped into pools by (sharing, model, MIG profile); a MIG GPU joins
    one pool per instance it holds."""
    groups: dict[tuple[Sharing, str, str | None], list[FleetGpu]] = {}
    for gpu in node.gpus:
        sharing = _SHARING_BY_MODE[(flavor, gpu.mode)]
        for profile in gpu.mig if gpu.mode == "mig" else (None,):
            groups.setdefault((sharing, gpu.model.name, profile), []).append(gpu)
    pools = []
    for (sharing, _model_name, profile), members in groups.items():
        first = members[0]
        if sharing is Sharing.SLURM_MPS:
            per_gpu = 100  # percent of one GPU, as Slurm counts gres/mps
        elif sharing is Sharing.K8S_TIMESLICE:
            per_gpu = first.replicas
        else:
            per_gpu = 1
        gpus = tuple(dict.fromkeys(gpu.index for gpu in members))
        pools.append(_Pool(node, sharing, first.model, profile, gpus, len(members) * per_gpu, per_gpu))
    return pools


def _what(sharing: Sharing, profile: str | None, model: str | None, units: int, replicas: int) -> str:
    """A request in the user's terms: 'a 1g.5gb slice', '4 whole A100-SXM4-80GB GPUs'."""
    n = units * replicas
    gpu = f"{model} GPU" if model else "GPU"
    if sharing in _MIG:
        return f"a {profile} slice" if n == 1 else f"{n} {profile} slices"
    if sharing is Sharing.SLURM_MPS:
        share = f"{units}% of an MPS {gpu}"
        return share if replicas == 1 else f"{replicas} shares of {share}"
    if sharing is Sharing.K8S_TIMESLICE:
        return f"a time-slice replica of a {gpu}" if n == 1 else f"{n} time-slice replicas of {gpu}s"
    return f"a whole {gpu}" if n == 1 else f"{n} whole {gpu}s"


class SimulatedCluster:
    """One simulated cluster of a fleet file, behind the adapter protocol, in virtual time.

    ``config``: ``{"fleet": path}`` or ``{"fleet_yaml": text}``; optionally ``"cluster"``
    (the cluster's name in the file, default ``name``) and ``"state_file"`` (JSON the
    simulator persists to and reloads from). See the module docstring for behaviour.
    """

    # None of the optional ones (broker.core.adapter): calls are in-process and take
    # microseconds, so one submit after another is as fast as a batch; nothing to close.
    capabilities: ClassVar[frozenset[type]] = frozenset()

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
        self.layout = layout
        self._clock = clock
        self._lock = threading.RLock()
        self._state_file = Path(state_file) if state_file else None
        self._outage: str | None = None

        self._pools: list[_Pool] = []
        self._node_pools: dict[str, list[_Pool]] = {}
        for node in layout.nodes:
            pools = _pools_of(node, layout.flavor)
            self._pools.extend(pools)
            self._node_pools[node.name] = pools
        self._pool_by_key = {(p.node, p.sharing, p.profile, p.model.name): p for p in self._pools}
        members: dict[tuple[Sharing, str | None, str | None], list[_Pool]] = {}
        for pool in self._pools:
            for key in ((pool.sharing, pool.profile, pool.model.name), (pool.sharing, pool.profile, None)):
                members.setdefault(key, []).append(pool)
        self._classes = {key: _UnitClass(key, pools) for key, pools in members.items()}
        self._sharings = {key[0] for key in self._classes}
        self._pinned_candidates: dict[tuple[str, tuple[Sharing, str | None, str | None]], list[_Pool]] = {}
        self._where = f"{name} (simulated {layout.flavor} cluster)"
        for unit_class in self._classes.values():
            for slot, pool in enumerate(unit_class.pools):
                pool.slots.append((unit_class, slot))
        for pool in self._pools:
            pool.refresh()

        self._jobs: dict[int, _Job] = {}
        self._ends: list[tuple[int, int, _Job]] = []  # (end time, tie-breaker, job): the event heap
        self._ticket = 0
        self._next_seq = 1
        # The status log: (job_id, state, reason, node, exit_code, at); a cursor is an index into it.
        self._log: list[tuple[int, BackendState, str | None, str | None, int | None, int]] = []
        # A cursor from another incarnation of this cluster (its state lost) must not be
        # read as an index into this one's log.
        self._epoch = secrets.token_hex(4)
        self._now_us = _to_us(clock())
        self._running = 0
        self._pending = 0
        self._dirty = False
        if self._state_file is not None and self._state_file.exists():
            self._load(self._state_file)

    # -- the adapter protocol ----------------------------------------------------------

    def submit(self, job_id: int, spec: JobSpec, placement: Placement) -> str:
        with self._lock:
            self._answer()
            if job_id not in self._jobs:
                job = self._accept(job_id, spec, placement)
                self._jobs[job_id] = job
                self._place(job)
                self._save()
            return self._backend_id(job_id)

    def cancel(self, job_id: int) -> None:
        with self._lock:
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

    def find(self, job_id: int) -> BackendJob | None:
        with self._lock:
            self._answer()
            self._save()
            job = self._jobs.get(job_id)
            return None if job is None else self._view(job)

    def statuses(self, cursor: str | None = None) -> StatusPage:
        with self._lock:
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
        with self._lock:
            self._answer()
            self._save()
            units: list[CapacityUnit] = []
            for pool in self._pools:
                units.extend(pool.inventory(self.name))
            return units

    def health(self) -> Health:
        with self._lock:
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

    # -- virtual time and test hooks ---------------------------------------------------

    def advance(self, to: datetime) -> None:
        """Run the cluster up to virtual time ``to`` (no-op if it is already past it)."""
        with self._lock:
            self._advance(_to_us(to))
            self._save()

    def next_event_time(self) -> datetime | None:
        """When the next running job ends (the next moment anything changes), or None."""
        with self._lock:
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
        with self._lock:
            self._outage = reason

    # -- submission --------------------------------------------------------------------

    def _accept(self, job_id: int, spec: JobSpec, placement: Placement) -> _Job:
        """A job for ``placement``, or Rejected saying why this cluster can never run it."""
        sharing = Sharing(placement.sharing)
        if placement.sharing is not sharing:  # a plain string from a caller that built the placement by hand
            placement = replace(placement, sharing=sharing)
        if sharing not in self._sharings:
            offered = ", ".join(sorted(s.value for s in self._sharings))
            raise Rejected(
                f"{self._where} offers {offered}, not {sharing.value}: route the job to a cluster that has it"
            )
        profile = placement.mig_profile
        if sharing in _MIG and not profile:
            raise Rejected(f"{sharing.value} needs a mig_profile (such as 1g.5gb) in the placement")
        if sharing not in _MIG and profile:
            raise Rejected(f"mig_profile {profile} makes no sense with {sharing.value}: use slurm/mig or k8s/mig")
        model_name = None
        if placement.gpu_model:
            try:
                model_name = gpu_model(placement.gpu_model).name
            except ValueError as exc:
                raise Rejected(str(exc)) from None
        unit_class = self._classes.get((sharing, profile, model_name))
        if unit_class is None:
            raise Rejected(self._missing_units(sharing, profile, model_name))
        if placement.units < 1 or placement.replicas < 1:
            raise Rejected(f"placement asks {placement.units} units × {placement.replicas} replicas: both must be ≥ 1")
        if sharing is Sharing.SLURM_MPS and placement.units > 100:
            raise Rejected(f"an MPS share is a percent of one GPU: {placement.units} is more than 100")

        if placement.gpus and placement.node is None:
            raise Rejected(
                f"placement names GPU {', '.join(map(str, placement.gpus))} but no node: "
                "device indexes are per node, so give the node as well"
            )
        job = _Job(job_id, 0, placement, unit_class)
        if placement.node is not None:
            job.pool = self._pinned_pool(job, unit_class, model_name)
        elif not unit_class.could_ever_hold(job):
            asked = _what(sharing, profile, unit_class.model_name, job.units, job.replicas)
            raise Rejected(
                f"no node of {self.name} can hold {asked} at once: the largest has "
                f"{unit_class.max_capacity} units of that kind; ask for fewer, or split the job"
            )
        self._read_spec(job, spec, placement)
        job.seq = self._next_seq
        self._next_seq += 1
        return job

    def _pinned_pool(self, job: _Job, unit_class: _UnitClass, model_name: str | None) -> _Pool:
        """The pool on ``placement.node`` the job runs or waits in; Rejected if it can never run there."""
        node = job.placement.node
        pools = self._node_pools.get(node)
        if pools is None:
            names = [n.name for n in self.layout.nodes]
            shown = ", ".join(names[:8]) + (f" ... ({len(names)} nodes)" if len(names) > 8 else "")
            raise Rejected(f"{self._where} has no node {node}: its nodes are {shown}")
        candidates = self._pinned_candidates.get((node, unit_class.key))
        if candidates is None:
            candidates = [pool for pool in pools if any(c is unit_class for c, _slot in pool.slots)]
            self._pinned_candidates[(node, unit_class.key)] = candidates
        asked = _what(job.sharing, job.placement.mig_profile, model_name, job.units, job.replicas)
        if not candidates:
            offers = ", ".join(_what(p.sharing, p.profile, p.model.name, 1, 1) for p in pools)
            raise Rejected(f"node {node} of {self.name} has no {asked}: it offers {offers}; pick another node")
        if job.placement.gpus and job.sharing in _SHARED:
            return self._pinned_gpus(job, candidates, asked)
        holding = [pool for pool in candidates if pool.could_ever_hold(job)]
        if not holding:
            raise Rejected(
                f"node {node} of {self.name} can never hold {asked}: "
                f"it has {candidates[0].capacity} units of that kind; ask for fewer, or pick another node"
            )
        return next((pool for pool in holding if pool.fits(job)), holding[0])

    def _pinned_gpus(self, job: _Job, candidates: list[_Pool], asked: str) -> _Pool:
        """The pool holding the GPUs ``placement.gpus`` names (a GPU is in one pool), with
        the job pinned to them; Rejected if they are not there or can never hold it."""
        node, gpus = job.placement.node, job.placement.gpus
        pool = next((p for p in candidates if all(g in p.gpus for g in gpus)), None)
        if pool is None:
            offered = ", ".join(str(g) for p in candidates for g in p.gpus)
            raise Rejected(
                f"node {node} of {self.name} has no {asked} on GPU {', '.join(map(str, gpus))}: "
                f"its GPUs for {job.sharing.value} are {offered}; name one of them, or leave gpus out"
            )
        job.pins = _pins(pool, job)
        if not pool.could_ever_hold(job):
            raise Rejected(
                f"GPU {', '.join(map(str, gpus))} of node {node} can never hold {asked}: a GPU there has "
                f"{pool.per_gpu} units of that kind; ask for less, or spread the replicas over GPUs"
            )
        return pool

    def _missing_units(self, sharing: Sharing, profile: str | None, model_name: str | None) -> str:
        offers = sorted(
            {
                f"{key[1]} on {key[2]}" if key[1] else str(key[2])
                for key in self._classes
                if key[0] is sharing and key[2]
            }
        )
        if sharing in _MIG:
            asked = f"MIG slices {profile}" + (f" on {model_name}" if model_name else "")
        else:
            asked = f"{model_name} GPUs"
        return (
            f"{self._where} has no {asked} under {sharing.value}: it offers {', '.join(offers)}; "
            "route the job to one of these, or to another cluster"
        )

    def _read_spec(self, job: _Job, spec: JobSpec, placement: Placement) -> None:
        labels = spec.labels
        limit_s = parse_time_limit(spec.time_limit) if spec.time_limit else None
        job.limit_us = limit_s * 1_000_000 if limit_s else None
        duration = labels.get("sim-duration")
        if duration is not None:
            try:
                seconds = float(duration)
            except ValueError:
                seconds = math.nan
            if not math.isfinite(seconds) or seconds < 0:
                raise Rejected(f"label sim-duration={duration!r} is not a number of seconds: write, say, 600")
            job.duration_us = round(seconds * 1_000_000)
        elif job.limit_us:
            job.duration_us = job.limit_us // 2
        outcome = labels.get("sim-exit")
        if outcome in (None, "succeeded", "0"):
            job.exit_at_end = 0
        elif outcome == "failed":
            job.exit_at_end = 1
        elif outcome.isdigit() and int(outcome) < 256:
            job.exit_at_end = int(outcome)
        else:
            raise Rejected(f"label sim-exit={outcome!r}: use succeeded, failed, or an exit code 0-255")
        job.memory_gb = placement.gpu_memory_gb or spec.gpu_memory_gb or 0.0

    def _place(self, job: _Job) -> None:
        t = self._now_us
        if job.pinned:
            pool = job.pool
            if pool.fits(job) and (pool.waiting_count == 0 or not pool.blocked(job)):
                self._start(job, pool, t)
                return
            job.reason = self._pinned_reason(job, pool)
            pool.waiting.append(job)
            pool.waiting_count += 1
            pool.refresh()
        else:
            unit_class = job.unit_class
            pool = self._find_room(unit_class, job) if unit_class.waiting_count == 0 else None
            if pool is not None:
                self._start(job, pool, t)
                return
            job.reason = self._unpinned_reason(job, unit_class)
            unit_class.waiting.append(job)
            unit_class.waiting_count += 1
        job.at_us = t
        self._pending += 1
        self._record(job)

    def _pinned_reason(self, job: _Job, pool: _Pool) -> str:
        p = job.placement
        head = (
            f"waiting for {_what(job.sharing, p.mig_profile, pool.model.name, job.units, job.replicas)} on {pool.node}"
        )
        if pool.fits(job) and pool.waiting_count:
            return f"{head}: {pool.waiting_count} earlier job(s) waiting first"
        if job.pins is not None:
            on = _pinned_units(job.pins)
            gpus = ", ".join(str(pool.gpus[pos]) for pos in on)
            room = min(pool.gpu_room[pos] for pos in on)
            if pool.sharing is Sharing.SLURM_MPS:
                return f"{head}, GPU {gpus}: {room}% free there"
            return f"{head}, GPU {gpus}: {room} of {pool.per_gpu} replicas free there"
        if pool.sharing is Sharing.SLURM_MPS:
            return f"{head}: at most {max(pool.gpu_room)}% free on one GPU"
        if pool.free == 0:
            return f"{head}: all {pool.capacity} busy"
        return f"{head}: {pool.free} of {pool.capacity} free"

    def _unpinned_reason(self, job: _Job, unit_class: _UnitClass) -> str:
        p = job.placement
        head = f"waiting for {_what(job.sharing, p.mig_profile, unit_class.model_name, job.units, job.replicas)}"
        if unit_class.waiting_count:
            return f"{head}: {unit_class.waiting_count} earlier job(s) waiting first"
        most = unit_class.tree.most
        if most == 0:
            return f"{head}: all busy on every node of {self.name}"
        unit = "%" if job.sharing is Sharing.SLURM_MPS else ""
        return f"{head}: at most {most}{unit} free on any one node of {self.name}"

    def _find_room(self, unit_class: _UnitClass, job: _Job) -> _Pool | None:
        need = job.units if job.sharing is Sharing.SLURM_MPS else job.need
        slot = unit_class.tree.first(need)
        while slot >= 0:
            pool = unit_class.pools[slot]
            if pool.fits(job):
                return pool
            slot = unit_class.tree.first(need, slot)
        return None

    # -- running and ending ------------------------------------------------------------

    def _start(self, job: _Job, pool: _Pool, t: int) -> None:
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

    def _finish(self, job: _Job, t: int, state: BackendState, reason: str | None, exit_code: int | None) -> None:
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

    def _end(self, job: _Job, t: int) -> None:
        """A running job reached its end time."""
        if job.limit_us is not None and job.duration_us > job.limit_us:
            limit = format_duration(job.limit_us // 1_000_000)
            self._finish(job, t, BackendState.FAILED, f"TIMEOUT: ran past its time limit of {limit}", None)
        elif job.exit_at_end:
            self._finish(job, t, BackendState.FAILED, f"exited with code {job.exit_at_end}", job.exit_at_end)
        else:
            self._finish(job, t, BackendState.SUCCEEDED, None, 0)

    def _is_live(self, event: tuple[int, int, _Job]) -> bool:
        job = event[2]
        return job.state is BackendState.RUNNING and job.ends_us == event[0]

    def _advance(self, to_us: int) -> None:
        ends = self._ends
        while ends and ends[0][0] <= to_us:
            t = ends[0][0]
            freed: dict[_Pool, None] = {}  # ordered, and O(1) when thousands end at once
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

    def _dispatch(self, pools: Iterable[_Pool], t: int) -> None:
        """Start waiting jobs on ``pools`` whose units just freed: jobs pinned there first,
        then the cluster-wide queues those pools serve."""
        classes: list[_UnitClass] = []
        for pool in pools:
            if pool.waiting_count:
                self._drain_pool(pool, t)
                pool.refresh()  # unmask the pool if its queue emptied
            for unit_class, _slot in pool.slots:
                if unit_class.waiting_count and unit_class not in classes:
                    classes.append(unit_class)
        if classes:
            self._drain_classes(classes, t)

    def _drain_pool(self, pool: _Pool, t: int) -> None:
        waiting = pool.waiting
        kept: deque[_Job] = deque()
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

    def _drain_classes(self, classes: list[_UnitClass], t: int) -> None:
        blocked: list[_UnitClass] = []
        while True:
            best: _UnitClass | None = None
            best_head: _Job | None = None
            for unit_class in classes:
                if not unit_class.waiting_count or unit_class in blocked:
                    continue
                head = unit_class.head()
                if head is not None and (best_head is None or head.seq < best_head.seq):
                    best, best_head = unit_class, head
            if best is None:
                return
            pool = self._find_room(best, best_head)
            if pool is None:
                blocked.append(best)
                continue
            best.waiting.popleft()
            best.waiting_count -= 1
            self._pending -= 1
            self._start(best_head, pool, t)

    # -- status ------------------------------------------------------------------------

    def _record(self, job: _Job) -> None:
        self._log.append((job.job_id, job.state, job.reason, job.node, job.exit_code, job.at_us))
        self._dirty = True

    def _backend_id(self, job_id: int) -> str:
        return f"sim-{self.name}-{job_id}"

    def _view(self, job: _Job) -> BackendJob:
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
        state = {
            "format": STATE_FORMAT,
            "cluster": self.name,
            "epoch": self._epoch,
            "now_us": self._now_us,
            "next_seq": self._next_seq,
            "jobs": [self._job_state(job) for job in self._jobs.values()],
            "log": [[job_id, state.value, *rest] for job_id, state, *rest in self._log],
        }
        tmp = self._state_file.with_name(self._state_file.name + ".tmp")
        tmp.write_text(json.dumps(state, separators=(",", ":")))
        os.replace(tmp, self._state_file)  # a crash mid-write leaves the previous state whole
        self._dirty = False

    def _job_state(self, job: _Job) -> dict[str, Any]:
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
        try:
            state = json.loads(path.read_text())
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}, expected {STATE_FORMAT}")
            if state["cluster"] != self.name:
                raise InvalidRequest(
                    f"state file {path} holds the jobs of simulated cluster {state['cluster']}, not {self.name}: "
                    "give each simulated cluster its own state_file"
                )
            self._epoch = state["epoch"]
            # The saved virtual time, not the clock's: jobs that ended while the broker was
            # down end on the next call, at their own end times, as on a real cluster.
            self._now_us = state["now_us"]
            self._next_seq = state["next_seq"]
            self._log = [(e[0], BackendState(e[1]), *e[2:]) for e in state["log"]]
            records = sorted(state["jobs"], key=lambda r: r["seq"])
            jobs = [self._restore(record) for record in records]
        except InvalidRequest:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise InvalidRequest(
                f"cannot read the simulator's state file {path}: {exc}; delete it to start the cluster empty"
            ) from None
        self._running = sum(job.state is BackendState.RUNNING for job in jobs)
        self._pending = sum(job.state is BackendState.PENDING for job in jobs)
        # The fleet file may have grown since: let waiting jobs take what is free now.
        self._dispatch(self._pools, self._now_us)

    def _restore(self, record: dict[str, Any]) -> _Job:
        placement = Placement.from_dict(record["placement"])
        model_name = gpu_model(placement.gpu_model).name if placement.gpu_model else None
        unit_class = self._classes.get((placement.sharing, placement.mig_profile, model_name))
        job = _Job(record["job_id"], record["seq"], placement, unit_class)
        for name in ("memory_gb", "duration_us", "limit_us", "exit_at_end", "reason", "node", "exit_code", "at_us"):
            setattr(job, name, record[name])
        job.state = BackendState(record["state"])
        job.started_us, job.ends_us = record["started_us"], record["ends_us"]
        job.holdings = tuple((pos, units) for pos, units in record["holdings"])
        self._jobs[job.job_id] = job
        pool = self._pool_by_key.get(tuple(record["pool"])) if record["pool"] else None
        job.pool = pool
        if pool is not None and placement.gpus and placement.sharing in _SHARED:
            try:
                job.pins = _pins(pool, job)
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

    def _lost(self, job: _Job, reason: str) -> None:
        job.state, job.reason, job.exit_code, job.ends_us = BackendState.FAILED, reason, None, None
        job.holdings = ()
        job.at_us = self._now_us
        self._record(job)
