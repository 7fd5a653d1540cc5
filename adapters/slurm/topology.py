"""What a Slurm cluster says of closeness (broker.core.topology's vocabulary): its network
from ``scontrol show topology``, a node's GPUs from gres.conf ``Links=`` and ``Cores=``,
which GPUs are free from ``GresUsed``, and what sbatch is asked for so that Slurm keeps a
gang as close as gpush placed it.

- **Network** (:func:`parse_topology`): topology/tree's switches (``SwitchName= Level=
  Nodes= Switches=``): a node's leaf switch (Level 0) is level ``switch``, the switches
  above it ``switch2``, ``switch3``... (Slurm's Level + 1), widest first; topology/block's
  blocks (``BlockName= Nodes=``): level ``block``. A node in no switch or block has the
  domain None at each of the cluster's levels.
- **GPUs of a node** (:func:`read_gres_conf`, :func:`gpu_topology`): the node's ``Name=gpu``
  lines in file order give Slurm's device indexes (the ``IDX`` of GresUsed); ``Links=`` values
  above 0 between two GPUs join them in one NVLink island; ``Cores=`` puts a GPU on a socket
  when all its cores lie on one (the node's cores per socket from Slurm). Lines with
  ``NodeName=`` ranges (``gpu[01-04]``) hold for each node named.
- **Asked of sbatch** (:meth:`Network.sbatch_closeness`): ``--switches=1`` when a gang's
  nodes share one leaf switch on topology/tree, ``--segment=<nodes>`` when they lie in one
  block on topology/block (sbatch has ``--segment`` from Slurm 24.11); nothing when they
  span several, since Slurm would then refuse the job or let it wait for ever.

Tested against recorded output and the real Slurm test cluster (integration/
test_slurm_topology.py: 22.05 with topology/tree, 24.11 and 26.05 with topology/block).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from adapters.slurm.mig import expand
from broker.core.topology import GpuTopology, Position

_WORD = re.compile(r"(\w+)=(\S*)")
# A MIG instance's device (its access capability): not a whole GPU's.
_CAP = re.compile(r"nvidia-cap\d+\Z")


def _names(text: str) -> list[str]:
    if not text or text == "(null)":
        return []
    try:
        return expand(text)
    except ValueError:
        return [text]


@dataclass(frozen=True)
class Network:
    """A cluster's network as its topology plugin says it. ``plugin``: ``tree``, ``block``
    or ``""`` (none known); ``levels`` widest first; ``domains``: node -> level -> domain."""

    plugin: str = ""
    levels: tuple[str, ...] = ()
    domains: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def position(self, node: str) -> Position:
        mine = self.domains.get(node, {})
        return tuple((level, mine.get(level)) for level in self.levels)

    def sbatch_closeness(self, nodes: Sequence[str], version: tuple[int, int]) -> dict[str, int]:
        """``{"switches": 1}`` or ``{"segment": n}`` for a gang on ``nodes`` that lies in one
        leaf switch or one block (see the module docstring); ``{}`` otherwise."""
        if len(nodes) < 2:
            return {}
        level = {"tree": "switch", "block": "block"}.get(self.plugin)
        if level is None:
            return {}
        domains = {self.domains.get(node, {}).get(level) for node in nodes}
        if len(domains) != 1 or None in domains:
            return {}
        if self.plugin == "tree":
            return {"switches": 1}
        return {"segment": len(nodes)} if version >= (24, 11) else {}


def parse_topology(text: str) -> Network:
    """``scontrol show topology``'s lines (see the module docstring); no switch or block
    line (no topology plugin, or another one): an empty :class:`Network`."""
    switches: dict[str, dict[str, str]] = {}
    blocks: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = dict(_WORD.findall(line))
        if "SwitchName" in words:
            switches[words["SwitchName"]] = words
        elif "BlockName" in words:
            blocks[words["BlockName"]] = _names(words.get("Nodes", ""))
    if blocks:
        domains = {node: {"block": name} for name, nodes in blocks.items() for node in nodes}
        return Network("block", ("block",), domains)
    if not switches:
        return Network()
    parent = {child: name for name, words in switches.items() for child in _names(words.get("Switches", ""))}
    level_of = {name: int(words.get("Level") or 0) for name, words in switches.items()}
    tree: dict[str, dict[str, str]] = {}
    for name, words in switches.items():
        if level_of[name] != 0:
            continue
        for node in _names(words.get("Nodes", "")):
            chain, seen = name, set()
            while chain is not None and chain not in seen:
                seen.add(chain)
                tree.setdefault(node, {})[_switch_level(level_of[chain])] = chain
                chain = parent.get(chain)
    levels = tuple(_switch_level(n) for n in sorted(set(level_of.values()), reverse=True))
    return Network("tree", levels, tree)


def _switch_level(level: int) -> str:
    return "switch" if level == 0 else f"switch{level + 1}"


@dataclass(frozen=True)
class GresGpu:
    """One GPU device of a node in gres.conf: Slurm's ``index`` on the node, its GRES type,
    ``links`` (one count per GPU of the node, -1 itself; empty: not said), ``cores``."""

    index: int
    type: str | None
    links: tuple[int, ...] = ()
    cores: frozenset[int] = frozenset()
    mig: bool = False


def read_gres_conf(text: str) -> dict[str, list[GresGpu]]:
    """node -> its GPU devices in Slurm's index order (see the module docstring). Lines
    without ``NodeName=`` or device files are left out: they say no index."""
    found: dict[str, list[GresGpu]] = defaultdict(list)
    for raw in text.splitlines():
        words = {k.lower(): v for k, v in _WORD.findall(raw.partition("#")[0])}
        if words.get("name") != "gpu" or "nodename" not in words:
            continue
        devices = words.get("file") or words.get("multiplefiles")
        if not devices:
            continue
        try:
            files = [devices] if "multiplefiles" in words else expand(devices)
        except ValueError:
            continue
        links = tuple(_ints(words.get("links", "")))
        cores = frozenset(_ranges(words.get("cores", "")))
        for node in _names(words["nodename"]):
            for file in files:
                gpus = found[node]
                mig = bool(_CAP.search(file)) or "multiplefiles" in words
                gpus.append(GresGpu(len(gpus), words.get("type") or None, links, cores, mig))
    return dict(found)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return []


def _ranges(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out += range(int(low), int(high or low) + 1)
    return out


def gpu_topology(gpus: Sequence[GresGpu], cores_per_socket: int = 0) -> GpuTopology | None:
    """The NVLink islands and sockets of a node's whole GPUs, or None when gres.conf says
    neither (no ``Links=``, no ``Cores=`` or no cores per socket)."""
    whole = [g for g in gpus if not g.mig]
    indexes = {g.index for g in whole}
    pairs = [
        (g.index, other)
        for g in whole
        for other, count in enumerate(g.links)
        if count > 0 and other != g.index and other in indexes
    ]
    sockets: dict[int, list[int]] = defaultdict(list)
    if cores_per_socket > 0:
        for g in whole:
            on = {core // cores_per_socket for core in g.cores}
            if len(on) == 1:
                sockets[on.pop()].append(g.index)
    if not any(g.links for g in whole):
        # No Links=: gres.conf says nothing of NVLink, which is not "none" (islands of one).
        return GpuTopology(socket=_groups(sockets.values()), source="gres.conf") if sockets else None
    return GpuTopology.from_links(indexes, pairs, socket=sockets.values(), source="gres.conf")


def _groups(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted((tuple(sorted(g)) for g in groups if g), key=lambda g: g[0]))


def free_indexes(held: Iterable[int], indexes: Iterable[int]) -> tuple[int, ...]:
    """``indexes`` less the ``held`` ones, in order."""
    taken = set(held)
    return tuple(sorted(i for i in indexes if i not in taken))
