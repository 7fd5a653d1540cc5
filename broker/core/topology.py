"""Which GPUs of a node, and which nodes of a cluster, are close: the vocabulary of
topology that the inventory reports and the one placement decision reads.

Two kinds of closeness, each a list of levels:

* **Inside a node** (:class:`GpuTopology`): GPUs grouped, narrowest level first, by an
  NVLink island (GPUs joined by NVLink, directly or through an NVSwitch), a PCIe switch
  (or one board), a CPU socket (NUMA node). The node agent reads them from NVML; a Slurm
  cluster's gres.conf says them with ``Links=`` and ``Cores=``. A level with no groups is
  unknown for that node.
* **Between nodes** (a unit's ``topology``, :data:`Position`): the node's domain at each of
  its cluster's network levels, widest first, as Kueue's Topology names them (for example
  ``block``, ``rack``). A Slurm cluster says them through topology/block (level ``block``)
  or topology/tree (its switches, leaf level ``switch``, the levels above ``switch2``,
  ``switch3``, ...); a Kubernetes cluster through node labels whose keys its admin names.
  A domain of None: the cluster names the level and the node has none (a drift finding).

A job may ask for closeness (:class:`broker.core.schemas.TopologyAsk`): a level, from
either list, and whether it is ``required`` (the job waits until it fits within one domain
of that level) or ``preferred`` (the fewest domains possible now). Without one, placement
still prefers the closest fit (:func:`choose_gpus`, :func:`choose_nodes`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

# Inside a node, narrowest first.
GPU_LEVELS = ("nvlink", "pcie", "socket")
GPU_LEVEL_WORDS = {"nvlink": "NVLink island", "pcie": "PCIe switch", "socket": "CPU socket"}

# A node's place in its cluster's network: (level, domain) pairs, widest level first.
Position = tuple[tuple[str, str | None], ...]

K = TypeVar("K")


@dataclass(frozen=True)
class GpuTopology:
    """One node's GPUs grouped by closeness (see the module docstring). Each level's groups
    are disjoint tuples of device indexes; a GPU with no NVLink is an island of one.
    ``source``: where it was read (``nvml``, ``gres.conf``)."""

    nvlink: tuple[tuple[int, ...], ...] = ()
    pcie: tuple[tuple[int, ...], ...] = ()
    socket: tuple[tuple[int, ...], ...] = ()
    source: str = ""

    def groups(self, level: str) -> tuple[tuple[int, ...], ...]:
        return getattr(self, level)

    @property
    def known(self) -> bool:
        return bool(self.nvlink or self.pcie or self.socket)

    def closeness(self, gpus: Iterable[int]) -> int:
        """The index in :data:`GPU_LEVELS` of the narrowest level with one group holding all
        of ``gpus``; ``len(GPU_LEVELS)`` when none does (or the topology is unknown)."""
        chosen = set(gpus)
        for index, level in enumerate(GPU_LEVELS):
            if any(chosen <= set(group) for group in self.groups(level)):
                return index
        return len(GPU_LEVELS)

    def islands(self) -> list[tuple[int, ...]]:
        """The NVLink islands of more than one GPU."""
        return [group for group in self.nvlink if len(group) > 1]

    def to_dict(self) -> dict[str, Any]:
        return {level: [list(g) for g in self.groups(level)] for level in GPU_LEVELS} | {"source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuTopology:
        return cls(
            **{level: tuple(tuple(int(i) for i in g) for g in data.get(level) or ()) for level in GPU_LEVELS},
            source=str(data.get("source") or ""),
        )

    @classmethod
    def from_links(
        cls,
        gpus: Iterable[int],
        nvlinks: Iterable[tuple[int, int]] = (),
        pcie: Iterable[Iterable[int]] = (),
        socket: Iterable[Iterable[int]] = (),
        source: str = "",
    ) -> GpuTopology:
        """Islands from NVLink pairs (their connected components; a GPU with none is an
        island of one), with the PCIe and socket groups as given."""
        indexes = sorted(set(gpus))
        parent = {i: i for i in indexes}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for a, b in nvlinks:
            if a in parent and b in parent and a != b:
                parent[root(a)] = root(b)
        islands: dict[int, list[int]] = defaultdict(list)
        for i in indexes:
            islands[root(i)].append(i)
        return cls(
            nvlink=_ordered(islands.values()),
            pcie=_ordered(pcie),
            socket=_ordered(socket),
            source=source,
        )


def _ordered(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted((tuple(sorted(set(g))) for g in groups if g), key=lambda g: g[0]))


def choose_gpus(topology: GpuTopology | None, free: Iterable[int], count: int) -> tuple[int, ...] | None:
    """``count`` of the ``free`` GPUs of one node, as close as the node allows: within one
    NVLink island when one has them free, else one PCIe switch, else one socket, else the
    fewest groups. Among groups that hold them, the one with the fewest free (best fit),
    so that whole islands stay whole for the jobs that need them; ties go to the group
    whose wider groups have the fewest free, then to the lowest index. None: fewer than
    ``count`` are free."""
    free_set = set(free)
    if count <= 0 or len(free_set) < count:
        return None
    if topology is None or not topology.known:
        return tuple(sorted(free_set)[:count])
    for index, level in enumerate(GPU_LEVELS):
        fits = [free_set.intersection(g) for g in topology.groups(level)]
        fits = [g for g in fits if len(g) >= count]
        if fits:
            best = min(fits, key=lambda g: (len(g), *_wider_free(topology, index, g, free_set), min(g)))
            return _take(topology, index, best, count)
    return _take(topology, len(GPU_LEVELS), free_set, count)


def _wider_free(topology: GpuTopology, index: int, group: set[int], free: set[int]) -> list[int]:
    """Free GPUs in the groups of wider levels that hold ``group``'s first GPU."""
    first = min(group)
    out = []
    for level in GPU_LEVELS[index + 1 :]:
        holder = next((g for g in topology.groups(level) if first in g), ())
        out.append(len(free.intersection(holder)))
    return out


def _take(topology: GpuTopology, index: int, pool: set[int], count: int) -> tuple[int, ...]:
    """``count`` GPUs of ``pool``, keeping together those a narrower level groups: GPUs of
    the narrower groups with the most of ``pool`` first."""

    def key(gpu: int) -> tuple:
        parts: list[int] = []
        for level in GPU_LEVELS[:index]:
            holder = next((g for g in topology.groups(level) if gpu in g), (gpu,))
            parts += [-len(pool.intersection(holder)), min(holder)]
        return (*parts, gpu)

    return tuple(sorted(sorted(pool, key=key)[:count]))


def domain_of(position: Position, level: str) -> str | None:
    """The node's domain at ``level``, or None (no such level, or the node has none)."""
    for name, value in position:
        if name == level:
            return value
    return None


def levels_of(positions: Iterable[Position]) -> list[str]:
    """The network levels the positions name, widest first, in the order they give them."""
    out: list[str] = []
    for position in positions:
        for name, _value in position:
            if name not in out:
                out.append(name)
    return out


@dataclass(frozen=True)
class NodeChoice:
    """Nodes for a gang: ``nodes`` in the caller's order of preference within each domain;
    ``domains``: how many domains of ``level`` they span (1: all in one)."""

    nodes: tuple
    level: str | None
    domains: int


def choose_nodes(
    candidates: Sequence[K],
    n: int,
    position: Mapping[K, Position],
    *,
    level: str | None = None,
    required: bool = False,
) -> NodeChoice | None:
    """``n`` of ``candidates`` (the caller's order: best first), as close as the network
    allows, or None when ``required`` and no one domain of ``level`` has ``n``.

    With a ``level`` (the job asked): the nodes of one domain of that level when one has
    ``n`` (the one with the fewest: best fit, so larger domains stay whole), else, when only
    preferred, the fewest domains (the fullest first, as Slurm's tree plugin minimises
    switches). Without one: the narrowest level at which one domain has ``n``, else the
    fewest domains of the widest level. A node with no domain at the level counts as a
    domain of its own. Fewer than ``n`` candidates: None."""
    if len(candidates) < n:
        return None
    levels = levels_of(position.get(c, ()) for c in candidates)
    if not levels:
        return NodeChoice(tuple(candidates[:n]), None, 1 if n <= 1 else 0)
    tried = [level] if level else list(reversed(levels))  # narrowest first
    for name in tried:
        groups = _by_domain(candidates, position, name)
        fits = [members for key, members in groups.items() if key[0] is not None and len(members) >= n]
        if fits:
            best = min(fits, key=len)  # dicts keep first-seen order: ties go to the best candidate's domain
            return NodeChoice(tuple(best[:n]), name, 1)
    if required:
        return None
    widest = level or levels[0]
    groups = _by_domain(candidates, position, widest)
    chosen: list[K] = []
    used = 0
    for members in sorted(groups.values(), key=len, reverse=True):  # stable: ties keep candidate order
        chosen += members[: n - len(chosen)]
        used += 1
        if len(chosen) >= n:
            break
    return NodeChoice(tuple(chosen), widest, used)


def _by_domain(candidates: Sequence[K], position: Mapping[K, Position], level: str) -> dict[tuple, list[K]]:
    groups: dict[tuple, list[K]] = {}
    for c in candidates:
        value = domain_of(position.get(c, ()), level)
        key = (value,) if value is not None else (None, id(c))
        groups.setdefault(key, []).append(c)
    return groups


def most_in_one(candidates: Iterable[K], position: Mapping[K, Position], level: str) -> int:
    """The most candidates in one domain of ``level`` (nodes with none count alone)."""
    groups = _by_domain(list(candidates), position, level)
    return max((len(m) if key[0] is not None else 1 for key, m in groups.items()), default=0)


def fewest_domains(counts: Iterable[int], n: int) -> int:
    """The fewest domains whose free nodes (``counts``, one per domain) hold ``n``: the
    fullest first. 0 when they cannot."""
    total = 0
    for used, count in enumerate(sorted(counts, reverse=True), start=1):
        total += count
        if total >= n:
            return used
    return 0


def position_words(position: Position) -> str:
    """``block b1, rack r3`` (``rack (none)`` for a level the node lacks)."""
    return ", ".join(f"{name} {value if value is not None else '(none)'}" for name, value in position)
