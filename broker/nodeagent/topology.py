"""How close this node's GPUs are, read through NVML: NVLink peers, PCIe and CPU affinity.

:func:`read_topology` makes these calls (pynvml's names, through broker.nodeagent.nvml):

1. Per GPU: ``nvmlDeviceGetNvLinkState(gpu, link)`` for links 0, 1, ... until NVML answers
   NVML_ERROR_INVALID_ARGUMENT (no such link) or NOT_SUPPORTED (no NVLink at all); for each
   link that is not down (0): ``nvmlDeviceGetNvLinkRemoteDeviceType`` (GPU, NVSwitch, other) and
   ``nvmlDeviceGetNvLinkRemotePciInfo`` (``.busId``: which GPU of this node it reaches).
   A driver without the device-type call leaves the peer found by bus id: a GPU of this
   node, else taken for a switch (the other non-GPU peer NVML names is IBM POWER's NPU).
2. Per GPU: ``nvmlDeviceGetNumaNodeId`` and ``nvmlDeviceGetCpuAffinity(gpu, 16)`` (the CPUs
   close to it, a bitmask of 16 64-bit words: up to 1,024 CPUs).
3. Per pair of GPUs: ``nvmlDeviceGetTopologyCommonAncestor`` (NVML_TOPOLOGY_INTERNAL, SINGLE,
   MULTIPLE, HOSTBRIDGE, NODE, SYSTEM).

From these, :class:`~broker.core.topology.GpuTopology` (source ``nvml``):

* **nvlink**: GPUs joined by a link, directly or through NVSwitches (every GPU with a link to
  a switch is in one island with the others that have one); a GPU without is an island of one.
* **pcie**: GPUs whose common ancestor is at most NVML_TOPOLOGY_MULTIPLE: one board or behind
  the same PCIe switches, without crossing a host bridge.
* **socket**: GPUs whose common ancestor is at most NVML_TOPOLOGY_NODE (one NUMA node); where
  NVML does not answer that, GPUs with the same NUMA node id. A socket the BIOS splits into
  several NUMA nodes (SNC, NPS) shows as several groups.

Any NVML error here (NOT_SUPPORTED, NO_PERMISSION, a GPU that is lost) leaves that piece
unknown, never ends the report: the GPU's own ``error`` is the GPU reader's business.
Tested against the synthetic NVML data of tests/data/nvml (DGX with NVSwitch, a PCIe server
with NVLink bridges in pairs, a PCIe server without NVLink), not against real GPUs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.core.topology import GpuTopology
from broker.inventory.agent_report import GpuGroups, NvLinkPeer
from broker.nodeagent.nvml import NvmlLibrary

NVLINK_MAX_LINKS = 36  # pynvml's NVML_NVLINK_MAX_LINKS; a GPU answers INVALID_ARGUMENT past its last
CPU_SET_WORDS = 16  # nvmlDeviceGetCpuAffinity's cpuSetSize: 16 x 64 bits, up to 1,024 CPUs
MAX_CPU_LIST = 1024  # characters, the report's bound; a longer list (no runs at all) is left out

# pynvml's constants, spelled out so reading a recording needs no NVML.
_INACTIVE = 0  # NVML_FEATURE_DISABLED / NVML_NVLINK_STATE_INACTIVE: a link that is down
_DEVICE_TYPE_GPU, _DEVICE_TYPE_SWITCH = 0, 2  # NVML_NVLINK_DEVICE_TYPE_*
TOPOLOGY_MULTIPLE = 20  # NVML_TOPOLOGY_MULTIPLE: behind PCIe switches, no host bridge crossed
TOPOLOGY_NODE = 40  # NVML_TOPOLOGY_NODE: one NUMA node
_ERROR_INVALID_ARGUMENT = 2
_ERROR_NOT_SUPPORTED = 3


@dataclass
class NodeTopology:
    """What :func:`read_topology` found: the node's groups, and per GPU what the report carries."""

    groups: GpuGroups | None = None
    numa_node: dict[int, int] = field(default_factory=dict)
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    nvlinks: dict[int, list[NvLinkPeer]] = field(default_factory=dict)


def read_topology(
    library: NvmlLibrary, indexes: Sequence[int], bus_ids: dict[int, str], nvml_error: type[Exception]
) -> NodeTopology:
    """The topology of GPUs ``indexes`` (those NVML could read), ``bus_ids`` their PCI bus ids."""
    reader = _Reader(library, nvml_error)
    handles = {i: h for i in indexes if (h := reader.ask(library.nvmlDeviceGetHandleByIndex, i)) is not None}
    by_bus = {normal_bus_id(bus): index for index, bus in bus_ids.items() if bus}
    out = NodeTopology()
    for index, handle in handles.items():
        out.nvlinks[index] = reader.nvlinks(handle, by_bus)
        numa = reader.ask(library.nvmlDeviceGetNumaNodeId, handle)
        if isinstance(numa, int) and 0 <= numa <= 4095:
            out.numa_node[index] = numa
        mask = reader.ask(library.nvmlDeviceGetCpuAffinity, handle, CPU_SET_WORDS)
        if mask is not None:
            cpus = cpu_list(mask)
            if cpus and len(cpus) <= MAX_CPU_LIST:
                out.cpu_affinity[index] = cpus
    ancestors: dict[tuple[int, int], int] = {}
    ordered = sorted(handles)
    for pos, a in enumerate(ordered):
        for b in ordered[pos + 1 :]:
            level = reader.ask(library.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])
            if isinstance(level, int):
                ancestors[(a, b)] = level
    if not handles:
        return out
    nvlink_pairs = [(i, p.gpu) for i, peers in out.nvlinks.items() for p in peers if p.gpu is not None]
    switched = sorted(i for i, peers in out.nvlinks.items() if any(p.kind == "switch" for p in peers))
    nvlink_pairs += [(switched[0], i) for i in switched[1:]]
    pcie = _components(ordered, [pair for pair, level in ancestors.items() if level <= TOPOLOGY_MULTIPLE])
    socket = _components(ordered, [pair for pair, level in ancestors.items() if level <= TOPOLOGY_NODE])
    if len(ancestors) < len(ordered) * (len(ordered) - 1) // 2:
        # NVML did not say for every pair: PCIe unknown, sockets by NUMA node where every GPU has one.
        pcie = []
        by_numa: dict[int, list[int]] = defaultdict(list)
        for index in ordered:
            by_numa[out.numa_node.get(index, -1)].append(index)
        socket = list(by_numa.values()) if -1 not in by_numa else []
    topology = GpuTopology.from_links(ordered, nvlink_pairs, pcie=pcie, socket=socket, source="nvml")
    out.groups = GpuGroups.model_validate(topology.to_dict())
    return out


@dataclass
class _Reader:
    library: NvmlLibrary
    nvml_error: type[Exception]

    def ask(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, or None for any NVML error: topology is best effort."""
        try:
            return call(*args)
        except self.nvml_error:
            return None

    def nvlinks(self, handle: Any, by_bus: dict[str, int]) -> list[NvLinkPeer]:
        lib = self.library
        peers: dict[tuple[str, int | None, str | None], int] = defaultdict(int)
        for link in range(NVLINK_MAX_LINKS):
            try:
                state = lib.nvmlDeviceGetNvLinkState(handle, link)
            except self.nvml_error as exc:
                if getattr(exc, "value", None) in (_ERROR_INVALID_ARGUMENT, _ERROR_NOT_SUPPORTED):
                    break  # past the last link, or no NVLink at all
                continue  # this link could not be read; the next may
            if state == _INACTIVE:
                continue  # down; newer drivers may answer 2 (asleep, still connected)
            remote = self.ask(lib.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            bus = _text(getattr(remote, "busId", None))
            gpu = by_bus.get(normal_bus_id(bus)) if bus else None
            kind_code = self._remote_type(handle, link)
            if kind_code is None:  # the driver cannot say: a GPU of this node by bus id, else a switch
                kind = "gpu" if gpu is not None else ("switch" if bus else "other")
            else:
                kind = {_DEVICE_TYPE_GPU: "gpu", _DEVICE_TYPE_SWITCH: "switch"}.get(kind_code, "other")
            peers[(kind, gpu if kind == "gpu" else None, bus)] += 1
        merged: dict[tuple[str, int | None, str | None], int] = defaultdict(int)
        for (kind, gpu, bus), count in peers.items():
            # All links to switches count as one peer: a GPU reaches several NVSwitch chips.
            merged[(kind, gpu, bus if kind != "switch" else None)] += count
        return [
            NvLinkPeer(kind=kind, gpu=gpu, pci_bus_id=bus, links=count)  # type: ignore[arg-type]
            for (kind, gpu, bus), count in sorted(merged.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1))
        ]

    def _remote_type(self, handle: Any, link: int) -> int | None:
        """NVML_NVLINK_DEVICE_TYPE_*, or None where the driver cannot say (NOT_SUPPORTED,
        FUNCTION_NOT_FOUND on an older driver) or reading failed."""
        code = self.ask(self.library.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        return code if isinstance(code, int) else None


def _text(value: Any) -> str | None:
    """A string NVML gave (pynvml's structures may hold bytes), or None."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return str(value) if value else None


def normal_bus_id(bus: str | None) -> str:
    """A PCI bus id in one spelling: NVML writes the domain with 8 digits or 4
    ("00000000:07:00.0", "0000:07:00.0"), upper case or lower."""
    if not bus:
        return ""
    parts = bus.strip().lower().split(":")
    if len(parts) == 3:
        try:
            parts[0] = f"{int(parts[0], 16):04x}"
        except ValueError:
            pass
    return ":".join(parts)


def cpu_list(mask: Iterable[int]) -> str:
    """A CPU bitmask (64-bit words, lowest CPUs first, as nvmlDeviceGetCpuAffinity fills it)
    as a Linux cpulist: ``0-31,64-95``."""
    cpus = [word_index * 64 + bit for word_index, word in enumerate(mask) for bit in range(64) if int(word) >> bit & 1]
    ranges: list[str] = []
    start = prev = None
    for cpu in cpus:
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:
            prev = cpu
        else:
            ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = cpu
    if start is not None:
        ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(ranges)


def _components(indexes: Sequence[int], pairs: Iterable[tuple[int, int]]) -> list[tuple[int, ...]]:
    joined = GpuTopology.from_links(indexes, pairs)
    return list(joined.nvlink)
