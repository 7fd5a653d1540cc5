"""Which running jobs to preempt for a waiting one, so that the least work is lost.

The scheduler asks this only for a job that waits for capacity (not for a quota or a
rule) and only among the running jobs that hold capacity on one of the job's routes. A
running job is a candidate when it may be preempted (:attr:`Running.preemptible`) and
stands lower than the waiting job:

- **priority**: its priority is lower by at least ``Terms.min_priority_gap``; or
- **reclaim**: the same priority, the waiting job's tenant is below its fair share and
  the running job's tenant above its own (capacity lent beyond a tenant's share is taken
  back), at most ``Terms.reclaims_per_hour`` such preemptions an hour, so the fleet does
  not thrash when shares shift.

Candidates are taken in the order that loses the least: lowest priority first, then the
tenant furthest above its fair share, then the least work since the job's last
checkpoint (since its start when it reported none). Victims are added in that order
until the waiting job fits (``fits``, given the victims' capacity as free), then any
victim the fit does not need is given back, latest first: never more than the waiting
job needs. A job that is not preemptible is never a candidate.

A multi-node job (a gang, ``nodes`` > 1 on whole GPUs) needs room for one rank on each
of ``nodes`` nodes, so its victims are chosen node by node (:func:`choose_gang_victims`):
for each node where a rank may go, the victims there that leave room for one, taken in
the order above; of those nodes, the one whose victims lose least (the highest priority
among them, then their GPU-seconds of work at risk; a running gang's shared among the
nodes it would free), until it has its nodes. Then only if the whole gang fits, and any
victim the fit does without is given back, as above. A running gang is a victim as a
whole: the fit is tried with every node it holds given back, and it is stopped on all
of them. A gang looks among ``Planner.CANDIDATES`` candidates per node it needs (at most
``Planner.MAX_CANDIDATES``), on whole GPUs only those on the nodes a rank may go to;
when that choice does not make it fit (or, on MIG slices, its nodes are not known
beforehand), it tries one by one as any job.

:class:`Planner` makes one cycle's preemptions, for the live scheduler
(:mod:`broker.scheduling.preemption`) and the replay (:mod:`broker.simulation.replay`)
alike: the waiting jobs in the order the cycle decided them, each among the running jobs
on its routes that no earlier job of the cycle took, its fit tried with the victims'
placements given back by the cycle's own decisions
(:meth:`broker.placement.decision.CycleDecisions.fit`), so it obeys their rule on gang
reservations: a job never preempts onto nodes reserved for a gang that starts before it
would end. The capacity a choice frees stays with the job it was freed for, so a later
job of the cycle cannot count it, and the reclaim budget is the fleet's, shared by the
cycle's choices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from broker.core.gangs import held_on
from broker.placement.capacity import Fit


@dataclass(frozen=True)
class Running:
    """A running job as preemption sees it."""

    job_id: int
    tenant: str
    priority: int
    preemptible: bool
    started_at: datetime
    checkpointed_at: datetime | None = None  # the last checkpoint it reported, if any
    placement: Any = field(default=None, compare=False)  # what it holds (broker.core.adapter.Placement)

    def work_at_risk(self, now: datetime) -> float:
        """Seconds of work lost if it stopped now: since its last checkpoint, else its start."""
        since = max(filter(None, (self.started_at, self.checkpointed_at)))
        return max((now - since).total_seconds(), 0.0)


@dataclass(frozen=True)
class Waiting:
    job_id: int
    tenant: str
    priority: int


@dataclass(frozen=True)
class Terms:
    """The policy's terms: how much higher a priority must be to preempt, whether capacity
    lent beyond a fair share is reclaimed, and how often."""

    min_priority_gap: int = 1
    reclaim: bool = False
    reclaims_per_hour: int = 6


@dataclass(frozen=True)
class Choice:
    victims: tuple[Running, ...]
    why: str  # "priority" or "reclaim": what gave the waiting job the right
    reclaims: int = 0  # victims taken by fair-share reclaim (they count against the hourly budget)

    def reason(self, waiting: Waiting) -> str:
        if self.why == "priority":
            return f"preempted by job {waiting.job_id} (priority {waiting.priority}, tenant {waiting.tenant})"
        return f"preempted by job {waiting.job_id}: tenant {waiting.tenant} reclaims its fair share"


def standing(waiting: Waiting, running: Running, terms: Terms, share_gap: dict[str, float]) -> str | None:
    """Why ``waiting`` may preempt ``running`` ("priority", "reclaim"), or None.
    ``share_gap``: each tenant's GPU use minus its fair share (positive: above it)."""
    if not running.preemptible or running.job_id == waiting.job_id:
        return None
    if waiting.priority - running.priority >= max(terms.min_priority_gap, 1):
        return "priority"
    if (
        terms.reclaim
        and running.priority <= waiting.priority
        and running.tenant != waiting.tenant
        and share_gap.get(waiting.tenant, 0.0) < 0
        and share_gap.get(running.tenant, 0.0) > 0
    ):
        return "reclaim"
    return None


def _loss_order(share_gap: dict[str, float], now: datetime) -> Callable[[Running], tuple]:
    """The order that loses the least: lowest priority, the tenant furthest above its
    fair share, the least work at risk."""
    return lambda r: (r.priority, -share_gap.get(r.tenant, 0.0), r.work_at_risk(now))


def _allowed(
    waiting: Waiting,
    running: Sequence[Running],
    terms: Terms,
    share_gap: dict[str, float],
    now: datetime,
    recent_reclaims: Sequence[datetime],
) -> tuple[list[tuple[Running, str]], int]:
    """The candidates ``waiting`` may preempt, with why, in the order that loses the
    least; and how many reclaims the hour's budget has left."""
    allowed = [(r, why) for r in running if (why := standing(waiting, r, terms, share_gap))]
    reclaim_budget = terms.reclaims_per_hour - sum(1 for t in recent_reclaims if now - t < timedelta(hours=1))
    if reclaim_budget <= 0:
        allowed = [(r, why) for r, why in allowed if why == "priority"]
    order = _loss_order(share_gap, now)
    allowed.sort(key=lambda item: order(item[0]))
    return allowed, reclaim_budget


def _minimal(victims: list[tuple[Running, str]], fits: Callable[[Sequence[Running]], bool]) -> Choice:
    """``victims`` (which make the job fit) less every one the fit does without, latest
    first, as a choice."""
    victims = list(victims)
    for item in reversed(list(victims)):
        rest = [v for v, _ in victims if v is not item[0]]
        if rest and fits(rest):
            victims.remove(item)
    reclaims = sum(w == "reclaim" for _, w in victims)
    return Choice(tuple(v for v, _ in victims), "reclaim" if reclaims else "priority", reclaims)


def choose_victims(
    waiting: Waiting,
    running: Sequence[Running],
    fits: Callable[[Sequence[Running]], bool],
    *,
    terms: Terms,
    share_gap: dict[str, float],
    now: datetime,
    recent_reclaims: Sequence[datetime] = (),
) -> Choice | None:
    """The victims that let ``waiting`` fit and lose the least work, or None when no set
    of allowed victims makes it fit (then nothing is preempted). ``recent_reclaims``: when
    earlier reclaiming preemptions happened (the rate limit counts the last hour's)."""
    allowed, reclaim_budget = _allowed(waiting, running, terms, share_gap, now, recent_reclaims)
    victims: list[tuple[Running, str]] = []
    for candidate in allowed:
        if candidate[1] == "reclaim" and sum(why == "reclaim" for _, why in victims) >= reclaim_budget:
            continue
        victims.append(candidate)
        if fits([v for v, _ in victims]):
            break
    else:
        return None
    return _minimal(victims, fits)


def units_on(placement: Any) -> dict[str, int]:
    """The units ``placement`` holds on each node it names (:func:`broker.core.gangs.held_on`:
    a gang's ``units`` on each of its nodes, a one-node job's every replica on its node)."""
    if placement is None:
        return {}
    per_node = placement.units if placement.nodes else placement.units * placement.replicas
    return dict.fromkeys(held_on(placement), per_node)


def lost_gpu_seconds(victims: Sequence[Running], now: datetime) -> float:
    """The work ``victims`` lose if stopped now, in GPU-seconds (a gang's on all its nodes)."""
    return sum(v.work_at_risk(now) * (v.placement.gpu_equivalents if v.placement is not None else 1.0) for v in victims)


def choose_gang_victims(
    waiting: Waiting,
    running: Sequence[Running],
    fits: Callable[[Sequence[Running]], bool],
    *,
    nodes: int,
    need: int,
    free: Mapping[str, int],
    terms: Terms,
    share_gap: dict[str, float],
    now: datetime,
    recent_reclaims: Sequence[datetime] = (),
) -> Choice | None:
    """The victims that let the multi-node ``waiting`` fit, ``need`` units on each of
    ``nodes`` nodes, and lose the least work across them, or None. ``free``: the nodes
    where a rank may go, with their units free now. Node by node: on each node the
    cheapest victims that leave room for a rank (its candidates in the order that loses
    the least, less any the room does without), and of the nodes the one whose victims
    lose least (the highest priority among them, then their GPU-seconds of work at
    risk, a victim's shared among the nodes still to pick that it holds), until
    ``nodes`` are picked; a victim taken for one node frees every node it holds (a gang
    is stopped whole). None unless the whole job then fits; of the set, any victim the
    fit does without is given back."""
    allowed, reclaim_budget = _allowed(waiting, running, terms, share_gap, now, recent_reclaims)
    on_node: dict[str, list[tuple[Running, str]]] = {}
    for candidate in allowed:
        for node in units_on(candidate[0].placement):
            if node in free:
                on_node.setdefault(node, []).append(candidate)
    chosen: list[tuple[Running, str]] = []
    taken: set[int] = set()
    freed: dict[str, int] = {}  # units the chosen victims free, by node
    picked: set[str] = set()
    for _ in range(nodes):
        best = None  # (cost, order, node, victims it adds)
        for order, (node, units) in enumerate(free.items()):
            if node in picked:
                continue
            room = units + freed.get(node, 0)
            adds: list[tuple[Running, str]] = []
            reclaims = sum(why == "reclaim" for _, why in chosen)
            for victim, why in on_node.get(node, ()):
                if room >= need:
                    break
                if victim.job_id in taken or (why == "reclaim" and reclaims >= reclaim_budget):
                    continue
                adds.append((victim, why))
                reclaims += why == "reclaim"
                room += units_on(victim.placement)[node]
            if room < need:
                continue
            for item in reversed(list(adds)):  # the node's own give-back: none it does without
                if room - units_on(item[0].placement)[node] >= need:
                    adds.remove(item)
                    room -= units_on(item[0].placement)[node]
            victims = [v for v, _ in adds]
            # A victim on several of the nodes still to pick (a gang) frees them all: its work counts shared among them.
            lost = sum(
                lost_gpu_seconds([v], now) / max(sum(n in free and n not in picked for n in units_on(v.placement)), 1)
                for v in victims
            )
            cost = (bool(victims), max((v.priority for v in victims), default=0), lost)
            if best is None or (cost, order) < best[:2]:
                best = (cost, order, node, adds)
        if best is None:
            return None
        picked.add(best[2])
        for victim, why in best[3]:
            chosen.append((victim, why))
            taken.add(victim.job_id)
            for node, units in units_on(victim.placement).items():
                freed[node] = freed.get(node, 0) + units
    if not chosen or not fits([v for v, _ in chosen]):
        return None
    return _minimal(chosen, fits)


class Capacity(Protocol):
    """A cycle's free capacity as the planner uses it (broker.placement.capacity.CapacityView)."""

    def undo(self, fit: Any) -> None: ...
    def give_back(self, placement: Any) -> None: ...
    def take(self, placement: Any) -> None: ...


class Decisions(Protocol):
    """The cycle's decisions as the planner uses them (broker.placement.decision.CycleDecisions):
    their capacity, and their fit, which keeps a job off the nodes reserved for a gang
    that starts before it would end, so a job preempts only where it may be placed."""

    @property
    def capacity(self) -> Capacity: ...
    def fit(self, job: Any, route: Any) -> Any: ...
    def gang_nodes(self, job: Any, route: Any) -> Mapping[str, int]: ...


@dataclass(frozen=True)
class Blocked:
    """A job that waits for capacity, as the planner reads it: who asks, what is fitted
    (``job.spec``, for :meth:`Decisions.fit`) and on which routes."""

    waiting: Waiting
    job: Any
    routes: Sequence[Any]


class Planner:
    """One cycle's preemptions (module docstring). ``running``: the cycle's running jobs
    that may be preempted, with their placements; ``recent_reclaims``: when the fleet's
    reclaiming preemptions of the last hour happened."""

    # At most this many waiting jobs a cycle look for victims, each among this many
    # candidates per node it needs, at most MAX_CANDIDATES (its fit is tried once per
    # victim added and given back).
    WAITING_PER_CYCLE = 8
    CANDIDATES = 32
    MAX_CANDIDATES = 256

    def __init__(
        self,
        running: Sequence[Running],
        *,
        terms: Terms,
        share_gap: dict[str, float],
        now: datetime,
        recent_reclaims: Sequence[datetime] = (),
    ) -> None:
        self.running = [r for r in running if r.preemptible]
        self.terms = terms
        self.share_gap = share_gap
        self.now = now
        self.recent_reclaims = list(recent_reclaims)
        self.taken: set[int] = set()

    def plan(self, blocked: Sequence[Blocked], decisions: Decisions) -> list[tuple[Blocked, Choice]]:
        """The victims for each of ``blocked`` (in the cycle's order) that only preemptible
        work of lower standing keeps waiting; ``decisions.capacity`` ends with each
        choice's victims given back and its job fitted."""
        if not self.running:
            return []
        lowest = min(r.priority for r in self.running)
        order = _loss_order(self.share_gap, self.now)
        chosen: list[tuple[Blocked, Choice]] = []
        tried = 0
        for item in blocked:
            if tried >= self.WAITING_PER_CYCLE:
                break
            if item.waiting.priority <= lowest and not self.terms.reclaim:
                continue
            nodes = max(item.job.spec.nodes, 1)
            # Where a gang's ranks may go on each route: victims elsewhere free nothing it can use.
            ranks = [(route, decisions.gang_nodes(item.job, route)) for route in item.routes] if nodes > 1 else []
            ranks = [(route, free) for route, free in ranks if free]
            where = {(route.cluster, node) for route, free in ranks for node in free}
            clusters = {route.cluster for route in item.routes}
            candidates = sorted(
                (
                    r
                    for r in self.running
                    if r.job_id not in self.taken
                    and r.placement is not None
                    and r.placement.cluster in clusters
                    and (not where or any((r.placement.cluster, node) in where for node in units_on(r.placement)))
                    and standing(item.waiting, r, self.terms, self.share_gap)
                ),
                key=order,
            )[: min(self.CANDIDATES * nodes, self.MAX_CANDIDATES)]
            if not candidates:
                continue
            tried += 1
            choice = self._choose(item, candidates, decisions, ranks)
            if choice is None:
                continue
            self._fits(item, choice.victims, decisions, keep=True)
            self.taken.update(v.job_id for v in choice.victims)
            self.recent_reclaims += [self.now] * choice.reclaims
            chosen.append((item, choice))
        return chosen

    def _choose(
        self, item: Blocked, candidates: list[Running], decisions: Decisions, ranks: list[tuple[Any, Mapping[str, int]]]
    ) -> Choice | None:
        """The victims for ``item``: a gang's node by node (:func:`choose_gang_victims`) on
        each route where its ranks' nodes are known (``ranks``: the route, and the nodes
        a rank may go to with their units free now), in the routes' order; else (a
        one-node job, or a gang no such choice makes fit) one by one (:func:`choose_victims`)."""

        def fits(victims: Sequence[Running]) -> bool:
            return self._fits(item, victims, decisions, keep=False) is not None

        spec = item.job.spec
        for route, free in ranks:
            choice = choose_gang_victims(
                item.waiting,
                [r for r in candidates if r.placement.cluster == route.cluster],
                fits,
                nodes=spec.nodes,
                need=spec.gpus,
                free=free,
                terms=self.terms,
                share_gap=self.share_gap,
                now=self.now,
                recent_reclaims=self.recent_reclaims,
            )
            if choice is not None:
                return choice
        return choose_victims(
            item.waiting,
            candidates,
            fits,
            terms=self.terms,
            share_gap=self.share_gap,
            now=self.now,
            recent_reclaims=self.recent_reclaims,
        )

    @staticmethod
    def _fits(item: Blocked, victims: Sequence[Running], decisions: Decisions, *, keep: bool) -> Any:
        """The fit ``item`` gets with ``victims``' capacity free, by the decision's own fit
        (reserved nodes kept to their rule), or None. Unless ``keep``, the capacity is
        left as it was."""
        capacity = decisions.capacity
        for victim in victims:
            capacity.give_back(victim.placement)
        for route in item.routes:
            fit = decisions.fit(item.job, route)
            if not isinstance(fit, Fit):
                continue
            if not keep:
                capacity.undo(fit)
                for victim in victims:
                    capacity.take(victim.placement)
            return fit
        for victim in victims:
            capacity.take(victim.placement)
        return None
