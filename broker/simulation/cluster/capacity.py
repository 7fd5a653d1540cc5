"""What a simulated cluster offers and whether it answers: its inventory and its health.

This module owns :class:`Capacity`: the capacity units of every pool (whole GPUs and MIG
instances per node and kind, MPS and time-slicing per GPU; see
:mod:`broker.simulation.pools`), and the health line, which answers even during a
simulated outage.
"""

from __future__ import annotations

from broker.core.adapter import CapacityUnit, Health
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import ClusterState


class Capacity:
    """The inventory and health of one simulated cluster."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile) -> None:
        self.state = state
        self.engine = engine
        self.store = store

    def inventory(self) -> list[CapacityUnit]:
        """Whole GPUs and MIG instances per node and kind; MPS and time-slicing per GPU."""
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            state = self.state
            units: list[CapacityUnit] = []
            for pool in state.pools:
                units.extend(pool.inventory(state.name))
            return units

    def health(self) -> Health:
        with self.store.hold():
            state = self.state
            if state.outage is not None:
                return Health(False, f"simulated outage: {state.outage}", "sim")
            self.engine.advance(state.clock_us())
            self.store.save()
            return Health(
                True,
                f"simulated {state.layout.flavor} cluster {state.name}: {len(state.layout.nodes)} nodes, "
                f"{state.layout.gpu_count} GPUs; {state.running} jobs running, {state.pending} pending",
                "sim",
            )
