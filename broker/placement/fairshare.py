"""Fair share and quotas: which tenant's job goes next, and whether a tenant may take more.

One rule, used by the scheduling cycle (:mod:`broker.scheduling.cycle`) and by replays
(:mod:`broker.simulation.replay`), so a simulation takes jobs in the order the broker would:

1. Priority first: a job of higher priority goes before any tenant's share is looked at.
2. Then the tenant furthest below its fair share. A tenant's *deficit* is its weighted
   share (its weight over the weights of the tenants contending: those holding GPUs
   and those with jobs waiting) minus its share of the GPU-equivalents all tenants
   hold now; the largest deficit goes next, and every placement changes every deficit.
   Shares are of what is in use, not of the whole fleet: tenants converge to their
   weights on whatever pool they contend for, however small a part of the fleet it is,
   and a tenant alone may use everything (a deficit only orders, it never holds a job
   back).
3. Then age: the oldest job first.

A quota caps what a tenant holds, whatever its share: a job that would take the
tenant over it waits, saying so, and goes once enough of the tenant's jobs end.

Usage is physical GPU-equivalents in one ledger across both tiers (see
:mod:`broker.placement.tenants`). The class is pure: callers bring weights, quotas and usage,
and tell it what they placed and what ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Usage is a sum of fractions (a 1g slice of 7 is 1/7): a tenant exactly at its quota
# must not count as over it by a rounding error.
EPSILON = 1e-9


class FairShare:
    """Tenants' weights (default 1), quotas in GPU-equivalents (none: no cap) and what
    each holds now.

    ``waiting`` names the tenants with jobs waiting; with those holding GPUs they are
    the tenants that share. The scheduler builds one per cycle; a replay keeps one and
    calls :meth:`contend` at each event.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        quotas: Mapping[str, float],
        usage: Mapping[str, float] | None = None,
        *,
        waiting: Iterable[str] = (),
    ) -> None:
        self.weights = dict(weights)
        self.quotas = dict(quotas)
        self.usage: dict[str, float] = dict(usage or {})
        self.in_use = sum(self.usage.values())
        self._weight_sum = 1.0
        self.contend(waiting)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def contend(self, waiting: Iterable[str]) -> None:
        """Set who shares: the tenants holding GPUs and those in ``waiting``. Fixed until
        the next call, as one scheduling cycle sees the tenants of its start."""
        self._contending = set(self.usage) | set(waiting)
        self._weight_sum = sum(self.weight(t) for t in self._contending) or 1.0

    def share(self, tenant: str) -> float:
        """The tenant's weighted share: its weight over the contending tenants' weights."""
        return self.weight(tenant) / self._weight_sum

    def deficit(self, tenant: str) -> float:
        """Weighted share minus share of the GPU-equivalents in use: the larger, the sooner."""
        return -self._surplus(tenant)

    def _surplus(self, tenant: str) -> float:
        return self.usage.get(tenant, 0.0) / (self.in_use or 1.0) - self.share(tenant)

    def gaps(self) -> dict[str, float]:
        """Each contending tenant's GPU-equivalents held minus its weighted share of all that
        is held (positive: above its share; a tenant that waits holding nothing is below):
        what fair-share reclaiming reads (broker.placement.preemption)."""
        return {t: self.usage.get(t, 0.0) - self.in_use * self.share(t) for t in self._contending | set(self.usage)}

    def key(self, tenant: str, priority: int, age: Any) -> tuple:
        """Sort key of a tenant's next job: the smallest goes first (priority, then the
        largest deficit, then ``age``, any value that orders older jobs first)."""
        return (-priority, self._surplus(tenant), age)

    def next_tenant(self, heads: Iterable[tuple[str, int, Any]]) -> str | None:
        """Of the tenants' next jobs, each given as ``(tenant, priority, age)``, the tenant
        whose job goes now; None when there are none."""
        best, best_key = None, None
        for tenant, priority, age in heads:
            key = self.key(tenant, priority, age)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best

    def over_quota(self, tenant: str, gpu_equivalents: float) -> str | None:
        """Why a job holding ``gpu_equivalents`` must wait for its tenant's quota; None
        when the tenant may take it."""
        quota = self.quotas.get(tenant)
        used = self.usage.get(tenant, 0.0)
        if quota is not None and used + gpu_equivalents > quota + EPSILON:
            return f"tenant {tenant} at quota ({used:g}/{quota:g} GPU)"
        return None

    def charge(self, tenant: str, gpu_equivalents: float) -> None:
        """The tenant now holds ``gpu_equivalents`` more (a job was placed)."""
        self.usage[tenant] = self.usage.get(tenant, 0.0) + gpu_equivalents
        self.in_use += gpu_equivalents

    def release(self, tenant: str, gpu_equivalents: float) -> None:
        """The tenant holds ``gpu_equivalents`` less (a job ended). A tenant left holding
        nothing no longer shares unless it has jobs waiting (see :meth:`contend`)."""
        left = self.usage.get(tenant, 0.0) - gpu_equivalents
        if left > EPSILON:
            self.usage[tenant] = left
        else:
            self.usage.pop(tenant, None)
        # Summed afresh (tenants are few), so the total never drifts from its parts.
        self.in_use = sum(self.usage.values())
