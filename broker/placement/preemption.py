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

:class:`Planner` makes one cycle's preemptions, for the live scheduler
(:mod:`broker.scheduling.preemption`) and the replay (:mod:`broker.simulation.replay`)
alike: the waiting jobs in the order the cycle decided them, each among the running jobs
on its routes that no earlier job of the cycle took, its fit tried on the cycle's
capacity with the victims' placements given back. The capacity a choice frees stays with
the job it was freed for, so a later job of the cycle cannot count it, and the reclaim
budget is the fleet's, shared by the cycle's choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

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
    allowed = [(r, why) for r in running if (why := standing(waiting, r, terms, share_gap))]
    reclaim_budget = terms.reclaims_per_hour - sum(1 for t in recent_reclaims if now - t < timedelta(hours=1))
    if reclaim_budget <= 0:
        allowed = [(r, why) for r, why in allowed if why == "priority"]
    allowed.sort(key=lambda item: (item[0].priority, -share_gap.get(item[0].tenant, 0.0), item[0].work_at_risk(now)))
    victims: list[tuple[Running, str]] = []
    for candidate in allowed:
        if candidate[1] == "reclaim" and sum(why == "reclaim" for _, why in victims) >= reclaim_budget:
            continue
        victims.append(candidate)
        if fits([v for v, _ in victims]):
            break
    else:
        return None
    # Give back, latest first, every victim the fit does without.
    for item in reversed(list(victims)):
        rest = [v for v, _ in victims if v is not item[0]]
        if rest and fits(rest):
            victims.remove(item)
    reclaims = sum(w == "reclaim" for _, w in victims)
    return Choice(tuple(v for v, _ in victims), "reclaim" if reclaims else "priority", reclaims)


class Capacity(Protocol):
    """A cycle's free capacity as the planner uses it (broker.placement.capacity.CapacityView)."""

    def fit_route(self, job: Any, route: Any) -> Any: ...
    def undo(self, fit: Any) -> None: ...
    def give_back(self, placement: Any) -> None: ...
    def take(self, placement: Any) -> None: ...


@dataclass(frozen=True)
class Blocked:
    """A job that waits for capacity, as the planner reads it: who asks, what is fitted
    (``job.spec``, for :meth:`Capacity.fit_route`) and on which routes."""

    waiting: Waiting
    job: Any
    routes: Sequence[Any]


class Planner:
    """One cycle's preemptions (module docstring). ``running``: the cycle's running jobs
    that may be preempted, with their placements; ``recent_reclaims``: when the fleet's
    reclaiming preemptions of the last hour happened."""

    # At most this many waiting jobs a cycle look for victims, each among this many
    # candidates (its fit is tried once per victim added and given back).
    WAITING_PER_CYCLE = 8
    CANDIDATES = 32

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

    def plan(self, blocked: Sequence[Blocked], capacity: Capacity) -> list[tuple[Blocked, Choice]]:
        """The victims for each of ``blocked`` (in the cycle's order) that only preemptible
        work of lower standing keeps waiting; ``capacity`` ends with each choice's victims
        given back and its job fitted."""
        if not self.running:
            return []
        lowest = min(r.priority for r in self.running)
        chosen: list[tuple[Blocked, Choice]] = []
        tried = 0
        for item in blocked:
            if tried >= self.WAITING_PER_CYCLE:
                break
            if item.waiting.priority <= lowest and not self.terms.reclaim:
                continue
            clusters = {route.cluster for route in item.routes}
            candidates = sorted(
                (
                    r
                    for r in self.running
                    if r.job_id not in self.taken
                    and r.placement is not None
                    and r.placement.cluster in clusters
                    and standing(item.waiting, r, self.terms, self.share_gap)
                ),
                key=lambda r: (r.priority, -self.share_gap.get(r.tenant, 0.0), r.work_at_risk(self.now)),
            )[: self.CANDIDATES]
            if not candidates:
                continue
            tried += 1
            choice = choose_victims(
                item.waiting,
                candidates,
                lambda victims, item=item: self._fits(item, victims, capacity, keep=False) is not None,
                terms=self.terms,
                share_gap=self.share_gap,
                now=self.now,
                recent_reclaims=self.recent_reclaims,
            )
            if choice is None:
                continue
            self._fits(item, choice.victims, capacity, keep=True)
            self.taken.update(v.job_id for v in choice.victims)
            self.recent_reclaims += [self.now] * choice.reclaims
            chosen.append((item, choice))
        return chosen

    @staticmethod
    def _fits(item: Blocked, victims: Sequence[Running], capacity: Capacity, *, keep: bool) -> Any:
        """The fit ``item`` gets with ``victims``' capacity free, or None. Unless ``keep``,
        the capacity is left as it was."""
        for victim in victims:
            capacity.give_back(victim.placement)
        for route in item.routes:
            fit = capacity.fit_route(item.job, route)
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
