"""Fencing the nodes of a simulated cluster, as Slurm drains a node or Kubernetes cordons one.

This module owns :class:`Fencing`: fence, unfence and the fenced nodes with their
reasons (see Fencing in the package docstring).
"""

from __future__ import annotations

from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import ClusterState


class Fencing:
    """The fences of one simulated cluster's nodes."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile) -> None:
        self.state = state
        self.engine = engine
        self.store = store

    def fence(self, node: str, reason: str) -> None:
        """Start no new job on ``node`` (its pools report no room); its running jobs go on.
        Fencing a fenced node only changes the reason."""
        with self.store.hold():
            self.engine.answer()
            state = self.state
            pools = state.node_pools[state.fleet_node(node).name]
            if state.fenced.get(node) != reason:
                state.fenced[node] = reason
                for pool in pools:
                    pool.set_fenced(reason)
                state.dirty = True
            self.store.save()

    def unfence(self, node: str) -> None:
        """Let new jobs start on ``node`` again: those waiting for it start at once if it
        has room. Unfencing a node not fenced is no error."""
        with self.store.hold():
            self.engine.answer()
            state = self.state
            pools = state.node_pools[state.fleet_node(node).name]
            if state.fenced.pop(node, None) is not None:
                for pool in pools:
                    pool.set_fenced(None)
                self.engine.dispatch(pools, state.now_us)
                state.dirty = True
            self.store.save()

    def fenced(self) -> dict[str, str]:
        """The nodes fenced now, with their reasons."""
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            return dict(self.state.fenced)
