"""Topology in the one placement decision (issue 35): which node's GPUs are closest for a
one-node whole-GPU job, which nodes for a gang, what a job that asks for closeness
(:class:`broker.core.job_parts.TopologyAsk`) waits for or is held for, and which of a
node's GPUs a fit takes.

The rules, as :class:`broker.placement.capacity.CapacityView` applies them:

- **One node, whole GPUs.** Among the nodes with room, the one where
  :func:`broker.core.topology.choose_gpus` gives the closest set (NVLink island, then PCIe
  switch, then socket: :meth:`GpuTopology.closeness`), then best fit as before. A node
  whose free GPUs are unknown (``CapacityUnit.free_gpus`` None, and not all free) makes
  no closeness claim: it ranks after every level. The scan is bounded: at most
  :data:`CANDIDATES` best-fit nodes per shape, stopping at the first whose GPUs are on
  one island; only shapes whose units say their topology or free GPUs are looked at.
  A job that *requires* a GPU level looks at every node with room, and takes only one
  where the chosen set is within that level.
- **Which GPUs.** When the unit says which GPUs are free, the placement names the chosen
  ones (``Placement.gpus``) and the view's free set shrinks; a fit that names none (a
  gang's rank, a placement not chosen by topology) takes the ones the node's cluster
  would, :func:`choose_gpus`'s, so the free set stays the size of ``free``.
- **Gangs.** :func:`broker.core.topology.choose_nodes` over the candidates in best-fit
  order: one domain when one has room, else the fewest domains of the widest level
  (Slurm's tree plugin minimises switches alike). A required network level waits for one
  domain with room, held when no domain could ever hold the gang.
- **Keeping whole what others need.** :func:`choose_gpus` best-fits islands within a
  node and :func:`choose_nodes` best-fits domains; best fit across nodes stays the
  tie-break, so whole islands and whole blocks stay free. A one-node job does not look
  for blocks already partly used: best fit by free units already packs nodes, and a
  per-block count kept in step with every change was not worth its cost here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from functools import lru_cache

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.topology import GPU_LEVEL_WORDS, GPU_LEVELS, GpuTopology, choose_gpus, most_in_one
from broker.placement.slots import Shape, Slot, SlotGroup

CANDIDATES = 32  # best-fit nodes per shape a one-node job's topology is scored on
UNKNOWN = len(GPU_LEVELS)  # the rank of a node that makes no closeness claim
WHOLE = (Sharing.SLURM_EXCLUSIVE, Sharing.K8S_EXCLUSIVE)
# The short name of a GPU level's group in a waiting reason: "the most free in one island".
GROUP_WORD = {"nvlink": "island", "pcie": "PCIe switch", "socket": "socket"}
ARTICLE = {"nvlink": "an", "pcie": "a", "socket": "a"}


def ask_of(spec) -> tuple[str | None, bool]:
    """The job's topology ask as (level, required); (None, False) without one."""
    ask = getattr(spec, "topology", None)
    if ask is None:
        return None, False
    return ask.level, ask.mode == "required"


def known_free(slot: Slot) -> tuple[int, ...] | None:
    """The free GPUs of a whole-GPU slot: what its unit said (kept in step), else all of
    its GPUs when it is all free; None when unknown."""
    if slot.free_gpus is not None:
        return slot.free_gpus
    unit = slot.unit
    if slot.free and slot.free == unit.capacity and len(unit.gpus) == unit.capacity:
        return tuple(unit.gpus)
    return None


def initial_free_gpus(unit: CapacityUnit) -> tuple[int, ...] | None:
    """What a view keeps of ``unit.free_gpus``: for whole GPUs, when they are as many as its
    free units (otherwise the report is taken as unknown)."""
    if unit.free_gpus is None or unit.sharing not in WHOLE or len(set(unit.free_gpus)) != unit.free:
        return None
    return tuple(sorted(set(unit.free_gpus)))


def take_gpus(slot: Slot, units: int, named: Iterable[int] = ()) -> tuple[int, ...]:
    """Take ``units`` GPUs off ``slot``'s free set: those ``named`` when all are free, else
    the ones its cluster would pick (choose_gpus); returns them (empty when unknown)."""
    free = slot.free_gpus
    if free is None:
        return ()
    named = tuple(named or ())
    if named and len(named) == units and set(named) <= set(free):
        chosen = named
    else:
        chosen = _choose(slot.unit.gpu_topology, free, min(units, len(free)))[1] or ()
    gone = set(chosen)
    slot.free_gpus = tuple(g for g in free if g not in gone)
    return tuple(chosen)


def return_gpus(slot: Slot, units: int, named: Iterable[int] = ()) -> None:
    """Give ``units`` GPUs back to ``slot``'s free set: those ``named`` (the busy ones among
    them), else the lowest-indexed busy ones (which a placement that named none held is
    not known)."""
    free = slot.free_gpus
    if free is None:
        return
    free_set = set(free)
    busy = [g for g in slot.unit.gpus if g not in free_set]
    named = tuple(named)
    back = [g for g in named if g in busy] if named else busy[:units]
    slot.free_gpus = tuple(sorted({*free, *back}))


def strip_topology(units: Iterable[CapacityUnit]) -> list[CapacityUnit]:
    """``units`` with their topology fields cleared (free GPUs unknown, no GPU topology, no
    network position): what placement sees of a cluster that reports none, to measure
    what topology-aware placement changes (integration/bench/topology.py)."""
    from dataclasses import replace

    return [replace(u, free_gpus=None, gpu_topology=None, topology=()) for u in units]


# -- one node ------------------------------------------------------------------------


# Nodes of one kind repeat few free sets, so a cycle's fits mostly find theirs cached.
@lru_cache(maxsize=65_536)
def _choose(topology: GpuTopology | None, free: tuple[int, ...], units: int) -> tuple[int, tuple[int, ...] | None]:
    """(closeness rank, the GPUs choose_gpus picks) of ``units`` of ``free``."""
    gpus = choose_gpus(topology, free, units)
    return (UNKNOWN if gpus is None or topology is None else topology.closeness(gpus)), gpus


def rank_of(slot: Slot, units: int) -> tuple[int, tuple[int, ...] | None]:
    """(closeness rank, the GPUs choose_gpus picks) of ``units`` GPUs on ``slot``'s node;
    (:data:`UNKNOWN`, None) when its free GPUs or topology are unknown."""
    topology = slot.unit.gpu_topology
    free = known_free(slot)
    if free is None or topology is None or not topology.known:
        return UNKNOWN, None
    return _choose(topology, free, units)


def closest(
    group: SlotGroup, able: Iterable[Shape], units: int, spoken_for: frozenset[str], limit: int | None
) -> tuple[tuple, int, tuple[int, ...]] | None:
    """The node for ``units`` whole GPUs: (key, position, GPUs to name) with the key
    (model spoken for, closeness rank, best-fit entry), or None when no node with room
    qualifies. ``limit``: the widest rank allowed (a required GPU level), which looks
    at every node with room; without one, :data:`CANDIDATES` per shape at most."""
    slots = group.slots
    best = None
    for shape in able:
        order = shape.order
        start = bisect_left(order, (units,))
        stop = len(order) if limit is not None else min(len(order), start + CANDIDATES)
        late = shape.model_name in spoken_for
        for i in range(start, stop):
            entry = order[i]
            slot = slots[entry[-1]]
            rank, gpus = rank_of(slot, units)
            if limit is not None and rank > limit:
                continue
            key = (late, rank, *entry)
            if best is None or key < best[0]:
                best = (key, entry[-1], (gpus or ()) if slot.free_gpus is not None else ())
            if rank == 0:
                break  # the first on one island in best-fit order is this shape's best
    return best


def most_in_group(group: SlotGroup, able: Iterable[Shape], level: str) -> tuple[int, int]:
    """(the most free GPUs in one group of ``level`` on any node now, the most GPUs one
    such group has on any node): for the waiting and held reasons of a required GPU level."""
    now = ever = 0
    for shape in able:
        for entry in shape.order:
            slot = group.slots[entry[-1]]
            topology = slot.unit.gpu_topology
            if topology is None:
                continue
            groups = topology.groups(level)
            if groups:
                ever = max(ever, max(len(g) for g in groups))
            free = known_free(slot) if slot.free else ()
            if free:
                have = set(free)
                now = max(now, max((len(have.intersection(g)) for g in groups), default=0))
    return now, ever


def gpu_level_reason(level: str, units: int, cluster: str, now: int, ever: int) -> tuple[str, bool]:
    """The reason a job that requires ``units`` GPUs in one group of GPU ``level`` does not
    fit, and whether it never will."""
    word = GPU_LEVEL_WORDS[level]
    if ever < units:
        if ever == 0:
            return f"needs {units} GPUs in one {word}; no node of {cluster} reports its {word}s", True
        return (
            f"needs {units} GPUs in one {word}; no node of {cluster} has {ARTICLE[level]} {word} of more than "
            f"{ever} GPUs",
            True,
        )
    group = GROUP_WORD[level]
    return f"waiting for {units} GPUs in one {word} on {cluster}: the most free in one {group} is {now}", False


def unknown_level(level: str, cluster: str, levels: list[str], required: bool = True) -> str:
    """The held reason of a job that asks for a level its cluster does not have (required or
    preferred alike: a level no node has is a mistake in the ask, as Kueue takes it)."""
    has = ", ".join([*GPU_LEVELS, *levels])
    plural = "s" * (len(levels) != 1)
    network = f"network level{plural} {', '.join(levels)}" if levels else "no network levels"
    return (
        f"{'requires' if required else 'prefers'} topology level {level!r}, which {cluster} does not have: it "
        f"has the GPU levels {', '.join(GPU_LEVELS)} and {network}; ask for one of {has}"
    )


def gpu_level_unkept(level: str, units: int, cluster: str, sharing: str, replicas: int) -> str | None:
    """The held reason of a job that requires its GPUs in one group of a GPU ``level`` where
    gpush does not keep it: only whole GPUs of one replica (a gang's ranks each) are placed by
    island, switch or socket; None where it does."""
    word = GPU_LEVEL_WORDS[level]
    if sharing not in ("slurm/exclusive", "k8s/exclusive"):
        return (
            f"requires its {units} GPUs in one {word}, which gpush keeps for whole GPUs, not for {sharing} on "
            f"{cluster}; ask for isolation exclusive, or for topology {level}:preferred"
        )
    if replicas > 1:
        return (
            f"requires each of its {replicas} replicas' GPUs in one {word}, which gpush keeps only for a job of "
            f"one replica; ask for topology {level}:preferred, or for one replica"
        )
    return None


# -- gangs ---------------------------------------------------------------------------


def gang_domain_reason(
    n: int, level: str, cluster: str, what: str, now: list[tuple], ever: dict[str, tuple]
) -> tuple[str, bool]:
    """The reason a gang that requires ``n`` nodes in one domain of network ``level`` does
    not fit, and whether it never will. ``now``: the nodes with room, as (node, position);
    ``ever``: node -> position of every node that could ever hold a rank."""
    most_ever = most_in_one(list(ever), ever, level)
    if most_ever < n:
        return (
            f"needs {n} nodes with {what.replace(' free', '')} in one {level}; the most in one {level} of "
            f"{cluster} is {most_ever}",
            True,
        )
    positions = dict(now)
    most = most_in_one(list(positions), positions, level)
    return (
        f"waiting for {n} nodes with {what} in one {level} of {cluster}: at most {most} in one {level} "
        f"{'has' if most == 1 else 'have'} them now",
        False,
    )
