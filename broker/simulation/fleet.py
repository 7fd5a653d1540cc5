"""The simulated fleet: the fleet file, YAML describing Slurm-like and Kubernetes-like
clusters that run in virtual time.

This module owns the fleet file's format, its validation (errors name the cluster, node
or pool and GPU entry, and say what to write instead) and what it loads into:
:class:`Fleet`, its :class:`FleetCluster` s, their :class:`FleetNode` s and
:class:`FleetGpu` s, nodes replicated and numbered, every GPU checked against the model
catalog. :class:`broker.simulation.cluster.SimulatedCluster` runs one cluster of a fleet
behind the adapter protocol. CPU and host memory of nodes are read and reported, not
enforced.

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

Topology (issue 35; optional, per Slurm node entry or Kubernetes pool): ``gpu_topology``
groups each node's GPUs (``nvswitch``: one NVLink island of all, PCIe switches of two;
``nvlink-pairs``: NVLink pairs, PCIe switches of four; ``pcie``: no NVLink, PCIe switches
of four; a CPU socket per half), and the network level ``block`` places the nodes:
``block: b1`` puts them all in block b1, ``blocks: 8`` spreads them in order over blocks
b1 to b8 (entries that name the same blocks share them); a node of an entry with neither,
in a cluster where others have blocks, has no block (``gpush inventory drift``'s
``network_level_missing``). The simulated cluster reports
both on its units (``gpu_topology``, ``topology``) with the free GPUs of each node
(``free_gpus``), and picks a job's GPUs as its placement names them, else as
:func:`broker.core.topology.choose_gpus` would::

          - {name: h100, nodes: 16, gpus_per_node: 8, model: H100-SXM5-80GB,
             gpu_topology: nvswitch, blocks: 4}
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from broker.core.errors import InvalidRequest
from broker.core.gpus import MODELS, GpuModel, gpu_model, mig_layout_problem
from broker.core.spec_values import parse_memory_mib
from broker.core.topology import GpuTopology, Position
from broker.core.yamltext import excerpt, load_yaml

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


GpuTopologyKind = Literal["nvswitch", "nvlink-pairs", "pcie"]


class _Placed(_Strict):
    """Where a node entry's nodes sit (see the module docstring's Topology)."""

    gpu_topology: GpuTopologyKind | None = None
    block: Name | None = None
    blocks: int | None = Field(None, ge=1, le=100_000)

    @model_validator(mode="after")
    def _one_block_rule(self) -> _Placed:
        if self.block is not None and self.blocks is not None:
            raise ValueError("give block (all nodes in one) or blocks (spread over N), not both")
        return self


class SlurmNodeConfig(_Placed):
    name: Name
    count: int = Field(1, ge=1, le=100_000)
    cpus: int | None = Field(None, ge=1)
    memory: HostMemory = None
    gpus: list[SlurmGpuConfig] = Field(min_length=1)


class K8sPoolConfig(_Placed):
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
    gpu_topology: GpuTopology | None = None  # how its GPUs are grouped (None: not said)
    position: Position = ()  # its network block, (("block", name),), or none


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
                f"{self.source} has no cluster {excerpt(name)}: it has {', '.join(self.clusters)}; "
                "set cluster: to one of them"
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
    if "\x00" in str(path):
        # Path() takes it; opening it raised ValueError ("embedded null byte"), a 500.
        raise InvalidRequest(f"fleet file {str(path)!r} holds a NUL character, which no file name holds: remove it")
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
        where.append(f"cluster {excerpt(cluster, quote=False)}")
        model = ClusterConfig
        body = _get(raw, "clusters", cluster)
        rest = loc[2:]
        if len(rest) > 1 and rest[0] in ("nodes", "pools") and isinstance(rest[1], int):
            item = _get(body, rest[0], rest[1])
            name = item.get("name") if isinstance(item, dict) else None
            kind = "node" if rest[0] == "nodes" else "pool"
            where.append(f"{kind} {excerpt(name, quote=False)}" if name else f"{kind} #{rest[1] + 1}")
            model = SlurmNodeConfig if kind == "node" else K8sPoolConfig
            rest = rest[2:]
            if len(rest) > 1 and rest[0] == "gpus" and isinstance(rest[1], int):
                where.append(f"GPU entry {rest[1] + 1}")
                model = SlurmGpuConfig
                rest = rest[2:]
        loc = rest
    field_name = excerpt(".".join(str(part) for part in loc), quote=False)
    kind = err.get("type")
    message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if kind == "extra_forbidden" and loc:
        known = list(model.model_fields)
        written = str(loc[-1])
        close = difflib.get_close_matches(written, known, n=1) if len(written) <= 64 else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = f"unknown field{hint} (fields here: {', '.join(known)})"
    elif kind == "too_short" and loc == ["clusters"]:
        message = "list at least one cluster, such as slurm-a: {flavor: slurm, nodes: [...]}"
    elif kind == "too_short" and loc == ["gpus"]:
        message = "a node needs at least one GPU entry, such as {model: A100-SXM4-80GB, count: 4}"
    elif kind == "missing":
        message = "required: add it"
    elif kind == "string_pattern_mismatch":
        message = f"{excerpt(err.get('input'))} is not a valid name: use {_NAME_WORDS} characters"
    elif "input" in err and not isinstance(err["input"], dict | list) and kind != "value_error":
        message = f"{excerpt(err['input'])}: {message}"
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
            topology = gpu_topology_of(template.gpu_topology, len(gpus))
            for i, node_name in enumerate(_numbered(template.name, template.count)):
                position = _position(template, i, template.count)
                nodes.append(
                    FleetNode(node_name, tuple(gpus), template.cpus, template.memory, None, {}, topology, position)
                )
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
            topology = gpu_topology_of(pool.gpu_topology, pool.gpus_per_node)
            for i, node_name in enumerate(_numbered(pool.name, pool.nodes)):
                position = _position(pool, i, pool.nodes)
                nodes.append(FleetNode(node_name, gpus, pool.cpus, pool.memory, pool.name, labels, topology, position))
    if any(node.position for node in nodes):
        # The cluster has blocks: a node left out of them has none (a drift finding), as a
        # Kubernetes node without the level's label does.
        nodes = [node if node.position else replace(node, position=(("block", None),)) for node in nodes]
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise InvalidRequest(
                f"{source}: cluster {name} has two nodes called {node.name}: rename one "
                "(count: N names nodes <name>-01 ... <name>-N)"
            )
        seen.add(node.name)
    return FleetCluster(name, config.flavor, tuple(nodes))


def _position(entry: _Placed, i: int, count: int) -> Position:
    """The network position of the ``i``-th of ``count`` nodes of a node entry or pool."""
    if entry.block is not None:
        return (("block", entry.block),)
    if entry.blocks is not None:
        return (("block", f"b{i * entry.blocks // count + 1}"),)
    return ()


def gpu_topology_of(kind: str | None, gpus: int) -> GpuTopology | None:
    """The GPU groups of a node of ``gpus`` GPUs of topology ``kind`` (the module
    docstring's Topology); None without one."""
    if kind is None:
        return None
    indexes = range(gpus)
    half = max(gpus // 2, 1)
    sockets = [range(0, half), range(half, gpus)]
    if kind == "nvswitch":
        links = [(i, i + 1) for i in range(gpus - 1)]
        pcie = [range(i, min(i + 2, gpus)) for i in range(0, gpus, 2)]
    else:
        links = [(i, i + 1) for i in range(0, gpus - 1, 2)] if kind == "nvlink-pairs" else []
        pcie = [range(i, min(i + 4, gpus)) for i in range(0, gpus, 4)]
    return GpuTopology.from_links(indexes, links, pcie=pcie, socket=sockets, source="simulated")


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
