"""The broker's clock: what "now" is, and the type of a clock that is injected.

Everything that reads the time takes a :data:`Clock` (the scheduler, the adapter pool,
adapters, the API, the node agent), so tests and replays run on a clock of their own
and a simulated cluster on virtual time (broker.simulation.cluster). :func:`utcnow` is
the wall clock they default to: timezone-aware UTC, as every timestamp gpush stores.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    """The wall-clock time, in UTC."""
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime (a naive one is taken to be UTC already)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
