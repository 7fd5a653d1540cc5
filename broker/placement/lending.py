"""Lending nodes between two clusters that share them, as the waiting work calls for it.

A *lendable* node runs both tiers' node software (slurmd and a kubelet) and is offered by
one of them at a time, its *owner*: the other keeps it fenced (Slurm drained, Kubernetes
cordoned), so no GPU is ever offered by both. This module decides which nodes move
(:func:`plan_moves`); the live cycle and the replay (broker.simulation.layouts) carry the
moves out: fence the node on its owner, wait for its work there to end, change its
sharing mode, unfence it on the other side.

The rule, for each direction from cluster A to cluster B, every time it is asked:

- B's *waiting* work that a lent node would serve, in GPU-equivalents, must exceed A's by
  ``threshold`` (hysteresis on demand: equal queues move nothing);
- the nodes that move are A's that have stayed at least ``hold`` seconds since their
  last move (hysteresis in time), idle ones first, then the least busy (their work ends
  before they move: draining), at most ``max_moving`` in flight at once;
- a node a multi-node job keeps (``LendableNode.kept``: reserved for a waiting gang, or
  running a rank of a placed one; broker.core.gangs) does not move, however idle;
- A keeps at least ``minimum[A]`` lendable nodes and B gets at most ``maximum[B]``;
- as many move as B's waiting work needs (whole nodes, by their GPUs), no more.

A move whose reason went away while its node drained (A's work came back) is called off
by :func:`called_off`, so a node is not taken from work that needs it where it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker.core.adapter import Sharing
from broker.core.gpus import GpuModel
from broker.core.schemas import JobSpec


@dataclass(frozen=True)
class LendableNode:
    """A node both clusters know: who offers it now (``owner``), what runs there now
    (``busy``: GPU-equivalents), its GPUs, and when it last moved (seconds)."""

    name: str
    owner: str
    gpus: int
    busy: float = 0.0
    since: float = 0.0
    moving_to: str | None = None  # a move under way: fenced on its owner, draining
    kept: str | None = None  # why it may not move now (a gang keeps it: broker.core.gangs)


@dataclass(frozen=True)
class LendingTerms:
    """How a pool of lendable nodes may move between its two ``clusters``."""

    clusters: tuple[str, str]
    minimum: Mapping[str, int] = field(default_factory=dict)
    maximum: Mapping[str, int] = field(default_factory=dict)
    hold: float = 1800.0  # seconds a node stays where it moved before it may move again
    threshold: float = 1.0  # GPU-equivalents of waiting work one side must have over the other
    max_moving: int = 2  # moves under way at once

    def __post_init__(self) -> None:
        if len(set(self.clusters)) != 2:
            raise ValueError(f"a lending pool joins two clusters, not {self.clusters}")
        if self.threshold <= 0 or self.hold < 0 or self.max_moving < 1:
            raise ValueError("threshold must be positive, hold not negative, max_moving at least 1")


@dataclass(frozen=True)
class Move:
    node: str
    source: str
    target: str
    reason: str


def plan_moves(
    terms: LendingTerms, nodes: Sequence[LendableNode], waiting: Mapping[str, float], now: float
) -> list[Move]:
    """The nodes to start moving now (see the module docstring)."""
    a, b = terms.clusters
    moving = sum(1 for n in nodes if n.moving_to is not None)
    room = terms.max_moving - moving
    if room <= 0:
        return []
    for source, target in ((a, b), (b, a)):
        gap = waiting.get(target, 0.0) - waiting.get(source, 0.0)
        if gap < terms.threshold:
            continue
        owned = [n for n in nodes if n.owner == source and n.moving_to is None]
        going = sum(n.gpus for n in nodes if n.moving_to == target)
        at_target = sum(1 for n in nodes if n.owner == target) + sum(1 for n in nodes if n.moving_to == target)
        keep = terms.minimum.get(source, 0)
        cap = terms.maximum.get(target, len(nodes))
        need = waiting.get(target, 0.0) - going
        moves: list[Move] = []
        movable = (n for n in owned if now - n.since >= terms.hold and n.kept is None)
        for node in sorted(movable, key=lambda n: (n.busy, n.name)):
            if need <= 0 or len(moves) >= room:
                break
            if len(owned) - len(moves) <= keep or at_target + len(moves) >= cap:
                break
            how = "idle" if node.busy <= 0 else f"runs {_eq(node.busy)} GPU-eq of work, to drain"
            moves.append(
                Move(
                    node.name,
                    source,
                    target,
                    f"{_eq(waiting[target])} GPU-eq wait for {target} against {_eq(waiting.get(source, 0.0))} "
                    f"for {source}; {node.name} {how}",
                )
            )
            need -= node.gpus
        return moves  # one direction at a time: demand points one way
    return []


def called_off(terms: LendingTerms, node: LendableNode, waiting: Mapping[str, float]) -> bool:
    """Whether a move under way should stop and the node stay with its owner: the side
    it was going to no longer waits for more than its owner does."""
    if node.moving_to is None:
        return False
    return waiting.get(node.moving_to, 0.0) - waiting.get(node.owner, 0.0) < terms.threshold


def need(spec: JobSpec, sharing: Sharing, model: GpuModel, replicas_per_gpu: int = 1) -> float:
    """GPU-equivalents a waiting job would hold in ``sharing`` on ``model``: the smallest
    MIG slice that holds its memory, a time-slice replica, or whole GPUs, on each of its
    nodes (what :func:`plan_moves`'s ``waiting`` adds up)."""
    copies = spec.gpus * max(spec.elastic.min_replicas if spec.elastic is not None else 1, 1) * spec.nodes
    if sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG) and spec.gpu_memory_gb is not None:
        fits = [p for p in model.mig_profiles.values() if p.memory_gb >= spec.gpu_memory_gb]
        if fits:
            return copies * model.gpu_equivalent(min(fits, key=lambda p: p.memory_gb).name)
    if sharing is Sharing.K8S_TIMESLICE:
        return copies / max(replicas_per_gpu, 1)
    return float(copies)


def _eq(value: float) -> str:
    """GPU-equivalents as people read them: 4, 0.43, 1.5."""
    return f"{value:.2f}".rstrip("0").rstrip(".")
