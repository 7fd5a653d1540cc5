"""Virtual time of a simulated cluster as a replay or a test drives it, and its outage switch.

This module owns :class:`VirtualTime`: running the cluster up to a moment, the moment
anything next changes, the moment reached, and making the cluster stop answering (see
Virtual time in the package docstring).
"""

from __future__ import annotations

import heapq
from datetime import datetime

from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import ClusterState, to_dt, to_us


class VirtualTime:
    """The test and replay hooks on one simulated cluster's clock."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile) -> None:
        self.state = state
        self.engine = engine
        self.store = store

    def advance(self, to: datetime) -> None:
        """Run the cluster up to virtual time ``to`` (no-op if it is already past it)."""
        with self.store.hold():
            self.engine.advance(to_us(to))
            self.store.save()

    def next_event_time(self) -> datetime | None:
        """When the next running job ends (the next moment anything changes), or None."""
        with self.store.hold():
            ends = self.state.ends
            while ends and not self.engine.is_live(ends[0]):
                heapq.heappop(ends)
            return to_dt(ends[0][0]) if ends else None

    def now(self) -> datetime:
        return to_dt(self.state.now_us)

    def simulate_outage(self, reason: str | None) -> None:
        """Make every call but health() raise Unreachable with ``reason`` (None ends the
        outage), to test how the broker copes with a cluster that stops answering."""
        with self.store.hold():
            self.state.outage = reason
