"""Reservations for multi-node jobs: a gang that waited long gets the nodes it will use
held for it, so a stream of small jobs cannot keep it waiting for ever.

The rule, as Slurm's backfill keeps it:

- A gang (``nodes`` > 1) that has waited for capacity at least the policy's
  ``scheduling.gang_reservation_after`` (:attr:`broker.routing.rules.Policy.gang_reservation_after`)
  gets a :class:`Reservation`: the ``nodes`` nodes of its route that can hold one of its
  ranks soonest, by the expected ends of what runs there (when each job was placed plus its
  time limit; a job without one never ends, so its node is chosen only when nothing else
  is), and ``start_by``, when the last of them is expected to have room. A node its
  cluster offers nothing of now (drained or cordoned: being lent, or fenced for a MIG
  change; :meth:`broker.placement.capacity.CapacityView.gang_candidates`) is never one;
  a reservation that held it picks others. The other way round, lending and the MIG
  planner leave a reserved node alone (broker.core.gangs).
- While it holds, a reserved node takes no job behind the gang in the queue that would end
  after ``start_by`` (a job without a time limit always would); a job that ends by then is
  **backfilled** there. The gang itself, and the jobs that came before it at no lower
  priority, may use its nodes at any time: as Slurm's backfill plans reservations in
  queue order, a gang's reservation never delays the jobs ahead of it (it would keep their
  GPUs idle for a job that came later), only those after it, whatever their priority.
- A reservation keeps its nodes from cycle to cycle (the live scheduler stores them,
  ``gang_reservations``; a replay keeps them in memory); ``start_by`` is computed again
  each cycle from what runs on them. It ends when the gang is placed (anywhere), held or
  leaves the queue.

:class:`Reservations` is one cycle's book, handed to
:class:`broker.placement.decision.CycleDecisions`, so the live cycle and ``gpush simulate``
reserve and backfill alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from broker.core.adapter import Placement
from broker.core.gangs import held_on
from broker.core.spec_values import parse_time_limit

# Expected ends of what runs on each node: (cluster, node) -> [(units, end or None)].
Running = Mapping[tuple[str, str], list[tuple[int, datetime | None]]]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Nodes held for a waiting gang (``job_id``) on ``cluster`` until it starts."""

    job_id: int
    cluster: str
    nodes: tuple[str, ...]
    start_by: datetime  # when the last of its nodes is expected to have room
    made_at: datetime
    # The gang's place in the queue (its priority, and since when it waits): the jobs that
    # came before it are not held back by its reservation (holds_back).
    priority: int = 0
    since: datetime | None = None

    def holds_back(self, job_id: int, priority: int, since: datetime | None) -> bool:
        """Whether job ``job_id`` of ``priority``, in the queue since ``since``, is kept off
        the gang's nodes: unless it came before the gang (then by id, as the queue orders
        jobs of the same age) at no lower priority. As Slurm's backfill plans reservations
        in queue order, a gang's reservation does not delay the jobs that came before it;
        a job that came after it waits, whatever its priority (preemption is what serves
        urgent work: :mod:`broker.placement.preemption`)."""
        if since is None or self.since is None:
            return True
        came_before = (since, job_id) < (self.since, self.job_id)
        return not (came_before and priority >= self.priority)

    def words(self) -> str:
        """What ``gpush status`` says of it."""
        start = utc_clock(self.start_by)
        return f"reserved {', '.join(self.nodes)} on {self.cluster}; starts by ~{start} when their jobs end"

    def to_dict(self) -> dict:
        return {
            "job_id": self.job_id,
            "cluster": self.cluster,
            "nodes": list(self.nodes),
            "start_by": self.start_by.isoformat(),
            "made_at": self.made_at.isoformat(),
        }


def utc_clock(at: datetime) -> str:
    """``at`` as a reason says it: the hour and minute in UTC, named so, since whoever reads
    the reason (``gpush status``, the dashboard) may be in another time zone than the broker."""
    return f"{at.astimezone(UTC):%H:%M} UTC"


def expected_end(placed_at: datetime, time_limit: str | None) -> datetime | None:
    """When a job placed at ``placed_at`` ends at the latest: its time limit later (None:
    it has none, and may run for ever)."""
    if not time_limit:
        return None
    return placed_at + timedelta(seconds=parse_time_limit(time_limit))


def running_ends(placed: Iterable[tuple[Placement, datetime | None]]) -> dict[tuple[str, str], list]:
    """:data:`Running` from the placements that hold capacity and their expected ends."""
    out: dict[tuple[str, str], list] = defaultdict(list)
    for placement, end in placed:
        for node in held_on(placement):
            out[(placement.cluster, node)].append((placement.units * placement.replicas, end))
    return out


class Reservations:
    """One cycle's reservations: those carried from the last cycle (``held``, by job id),
    the expected ends of what runs (``running``), and the wait after which a gang gets
    one (``after``; None: never). After the cycle, ``held`` is what to keep."""

    def __init__(
        self,
        after: timedelta | None,
        now: datetime,
        held: Mapping[int, Reservation] = {},  # noqa: B006 - copied
        running: Running | Callable[[], Running] = {},  # noqa: B006 - copied
    ) -> None:
        self.after = after
        self.now = now
        self.held: dict[int, Reservation] = dict(held)
        # Read on first need (a reservation to make or renew): most cycles have none.
        self._source = running
        self._running: dict[tuple[str, str], list] | None = None
        self._fresh: list[tuple[tuple[str, str], int, datetime | None]] = []  # placed this cycle
        # Jobs placed this cycle on nodes reserved for a gang (ending before it starts), by
        # job id, with the units they took there: what the simulation reports as backfilled.
        self.backfilled: dict[int, int] = {}
        self._by_node: dict[tuple[str, str], Reservation] = {}
        self._index()

    @property
    def running(self) -> dict[tuple[str, str], list]:
        if self._running is None:
            source = self._source() if callable(self._source) else self._source
            self._running = defaultdict(list)
            for key, ends in source.items():
                self._running[key].extend(ends)
        for key, units, end in self._fresh:
            self._running[key].append((units, end))
        self._fresh.clear()
        return self._running

    def _index(self) -> None:
        self._by_node = {(r.cluster, node): r for r in self.held.values() for node in r.nodes}

    def blocked(
        self,
        job_id: int,
        cluster: str,
        end: datetime | None,
        priority: int = 0,
        since: datetime | None = None,
    ) -> list[str]:
        """The nodes of ``cluster`` that job ``job_id``, ending at ``end``, may not use:
        reserved for another gang that starts before the job would end and that the job
        is behind in the queue (``priority``, and when it joined the queue, ``since``:
        :meth:`Reservation.holds_back`)."""
        return [
            node
            for (c, node), r in self._by_node.items()
            if c == cluster
            and r.job_id != job_id
            and (end is None or end > r.start_by)
            and r.holds_back(job_id, priority, since)
        ]

    def placed(
        self,
        job_id: int,
        placement: Placement,
        end: datetime | None,
        priority: int = 0,
        since: datetime | None = None,
    ) -> None:
        """Job ``job_id`` was placed: its own reservation ends; what it holds counts as
        running (until ``end``) for the reservations made later this cycle. On a node
        reserved for a gang it is behind in the queue (``priority``, ``since``), it was
        backfilled there."""
        if self.held.pop(job_id, None) is not None:
            self._index()
        units = placement.units * placement.replicas
        for node in held_on(placement):
            self._fresh.append(((placement.cluster, node), units, end))
            r = self._by_node.get((placement.cluster, node))
            if r is not None and r.holds_back(job_id, priority, since):
                self.backfilled[job_id] = self.backfilled.get(job_id, 0) + units

    def drop(self, job_id: int) -> None:
        """Job ``job_id`` no longer waits (held, or gone): its reservation ends."""
        if self.held.pop(job_id, None) is not None:
            self._index()

    def reserve(
        self,
        job_id: int,
        waiting_since: datetime,
        cluster: str,
        need: int,
        nodes: int,
        candidates: Mapping[str, int],
        priority: int = 0,
        domains: Mapping[str, str] | None = None,
    ) -> Reservation | None:
        """The reservation of gang ``job_id`` that waits for ``nodes`` nodes with ``need``
        units each on ``cluster``: its nodes kept, with ``start_by`` computed again, or new
        ones picked when it has waited ``after`` (None: it has none, and does not wait
        long enough yet). ``candidates``: the nodes that could ever hold one of its ranks,
        with their units free now; ``priority`` and ``waiting_since``: its place in the
        queue (what its reservation holds back: :meth:`Reservation.holds_back`).
        ``domains``: for a gang that requires one network domain (``JobSpec.topology``), each
        candidate's domain: the nodes held are all of one domain, the one whose nodes have
        room soonest (none when no domain has enough candidates)."""
        held = self.held.get(job_id)
        if domains is not None:
            candidates = {node: free for node, free in candidates.items() if node in domains}
        if held is not None and held.cluster == cluster and all(n in candidates for n in held.nodes):
            rooms = [self._room_at(cluster, node, need, candidates[node]) for node in held.nodes]
            if all(at is not None for at in rooms):
                start_by = max(rooms)
                kept = replace(held, start_by=start_by, priority=priority, since=waiting_since)
                if kept != held:
                    held = self.held[job_id] = kept
                    self._index()
                return held
        # none yet, or its nodes cannot hold it any more (gone, or work without an end on
        # them): picked afresh
        if self.after is None or self.now - waiting_since < self.after:
            return None
        taken = {key for key, r in self._by_node.items() if r.job_id != job_id}
        soonest = sorted(
            (at, order, node)
            for order, (node, free) in enumerate(candidates.items())
            if (cluster, node) not in taken and (at := self._room_at(cluster, node, need, free)) is not None
        )
        if domains is not None:  # the one domain whose nodes have room soonest
            by_domain: dict[str, list[tuple]] = defaultdict(list)
            for pick in soonest:
                by_domain[domains[pick[2]]].append(pick)
            able = [members[:nodes] for members in by_domain.values() if len(members) >= nodes]
            soonest = min(able, key=lambda members: (members[-1][0], members[0][1])) if able else []
        if len(soonest) < nodes:
            return None
        picks = soonest[:nodes]
        chosen = tuple(node for _, _, node in sorted(picks, key=lambda p: p[1]))
        start_by = max(at for at, _, _ in picks)
        reservation = Reservation(job_id, cluster, chosen, start_by, self.now, priority, waiting_since)
        self.held[job_id] = reservation
        self._index()
        return reservation

    def _room_at(self, cluster: str, node: str, need: int, free: int) -> datetime | None:
        """When ``node`` is expected to have ``need`` units free, having ``free`` now: as
        its jobs end, soonest first (None: not while a job without an end holds it)."""
        if free >= need:
            return self.now
        for units, end in sorted(self.running.get((cluster, node), ()), key=lambda e: (e[1] is None, e[1] or self.now)):
            if end is None:
                return None
            free += units
            if free >= need:
                return max(end, self.now)
        return None

    def on_node(self, cluster: str, node: str) -> Reservation | None:
        return self._by_node.get((cluster, node))
