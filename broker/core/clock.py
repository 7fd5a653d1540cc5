"""The broker's clock: what "now" is, and the type of a clock that is injected.

Everything that reads the time takes a :data:`Clock` (the scheduler, the adapter pool,
adapters, the API, the node agent), so tests and replays run on a clock of their own
and a simulated cluster on virtual time (broker.simulation.cluster). :func:`utcnow` is
the wall clock they default to: timezone-aware UTC, as every timestamp gpush stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

Clock = Callable[[], datetime]


@dataclass(frozen=True)
class ScaledClock:
    """A clock that runs ``speed`` times as fast as ``base`` from ``epoch`` on: a simulated
    cluster's virtual time (its config's ``speed``). :meth:`wall` turns one of its times
    back into the wall-clock time it happens at, for what people read beside other times."""

    base: Clock
    epoch: datetime
    speed: float

    def __call__(self) -> datetime:
        return self.epoch + (self.base() - self.epoch) * self.speed

    def wall(self, moment: datetime) -> datetime:
        return self.epoch + (moment - self.epoch) / self.speed


def wall_time(clock: Clock, moment: datetime) -> datetime:
    """When ``moment`` of ``clock`` happens on the wall clock: itself, unless ``clock`` is
    a :class:`ScaledClock`."""
    return clock.wall(moment) if isinstance(clock, ScaledClock) else moment


def speed_of(clock: Clock) -> float:
    """How many times as fast as the wall clock ``clock`` runs (1 unless scaled)."""
    return clock.speed if isinstance(clock, ScaledClock) else 1.0


def utcnow() -> datetime:
    """The wall-clock time, in UTC."""
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime (a naive one is taken to be UTC already)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# The times gpush takes from users (a window's ends, a node report's time), in UTC. Python's
# datetime ends at year 9999, so 9999-12-31T23:59:59-14:00 has no UTC; gpush records nothing
# before the Unix epoch.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


def within_supported_years(value: datetime) -> datetime:
    """``value`` as given, if its UTC (a naive one is UTC) is within 1970..9999; else a
    ValueError that says the range."""
    try:
        fits = EARLIEST <= as_utc(value) <= LATEST
    except OverflowError:  # its UTC is before year 1 or after 9999
        fits = False
    if not fits:
        raise ValueError(
            f"{value.isoformat()} is outside the times gpush takes: give one from 1970-01-01T00:00:00Z "
            "to 9999-12-31T23:59:59Z (in UTC)"
        )
    return value
