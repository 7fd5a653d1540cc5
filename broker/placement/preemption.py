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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta


@dataclass(frozen=True)
class Running:
    """A running job as preemption sees it."""

    job_id: int
    tenant: str
    priority: int
    preemptible: bool
    started_at: datetime
    checkpointed_at: datetime | None = None  # the last checkpoint it reported, if any

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
    why = "priority" if all(w == "priority" for _, w in victims) else "reclaim"
    return Choice(tuple(v for v, _ in victims), why)
