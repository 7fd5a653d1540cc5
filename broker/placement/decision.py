"""The one placement decision: a job is placed now, waits (saying for what), or is held.

``gpush simulate`` is only worth what its agreement with the live scheduler is worth,
so this module is the only place that decides. The live cycle
(:mod:`broker.scheduling.cycle`) and every replay engine (:mod:`broker.simulation.replay`)
make one :class:`CycleDecisions` per scheduling cycle and call :meth:`CycleDecisions.decide`
for each job in the order fair share gives (:class:`broker.placement.fairshare.FairShare`);
what differs between them is only what they bring: the capacity (a
:class:`broker.placement.capacity.CapacityView` built from clusters' inventories, or
GPU-sharing nodes replayed from a trace) and what they do with the outcome.

The decision, for one job:

1. **Route** by the active policy (:func:`broker.routing.policy.evaluate`). No policy,
   or no rule matches: :class:`Held`, with the policy's reason.
2. **Fit** on the routes in order: the first route with room now takes the job.
3. **Quota**: the placement's GPU-equivalents against the tenant's quota. Over it:
   the fit is undone and the job waits (:class:`Waiting`, ``cause`` QUOTA), saying so.
   The quota is checked on what the fit would hold, so a job is never refused for a
   quota it would not exceed where it lands.
4. **Placed**: the tenant is charged, so the next job's fair-share order sees it.
5. Nothing has room: if no route could **ever** hold the job (no such GPUs, too large
   for any node), :class:`Held` with every route's reason; else :class:`Waiting` for
   the first route that could, with how many jobs of this cycle already wait for the
   same thing ahead of it ("…, 3 jobs ahead)").
6. **Reservations** (with a :class:`broker.placement.reservation.Reservations` book): a
   job never fits on nodes reserved for a gang that starts before the job would end
   (its time limit from now) and that it is behind in the queue (a job ahead of the gang
   is not delayed for it); a multi-node job that has waited long gets the nodes it will
   use reserved, and its reason says which and until when.

Outcomes are typed values, so callers cannot mistake one for another, and the reasons
are the user's words, as ``gpush status`` shows them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

from broker.core.adapter import Placement
from broker.core.schemas import JobSpec
from broker.placement.capacity import Fit, NoFit, replicas_of
from broker.placement.fairshare import FairShare
from broker.placement.reservation import Reservations, expected_end, utc_clock
from broker.routing.policy import Decision as RoutingDecision
from broker.routing.policy import Policy, Route, evaluate

NO_POLICY = "held: no routing policy is active (an admin runs `gpush policy apply`)"


class WaitCause(StrEnum):
    CAPACITY = "capacity"  # no route has room now; one could later
    QUOTA = "quota"  # it fits, but its tenant is at its quota


@dataclass(frozen=True, slots=True)
class Placed:
    """The job goes where ``fit`` put it; its tenant is already charged."""

    fit: Fit

    @property
    def placement(self) -> Placement:
        return self.fit.placement


@dataclass(frozen=True, slots=True)
class Waiting:
    """The job stays queued for now; ``reason`` says for what."""

    reason: str
    cause: WaitCause
    # What it waits for, so jobs behind it are counted (broker.placement.capacity.NoFit).
    waiting_for: tuple | None = None
    plain: str = ""  # the reason without the count of jobs ahead


@dataclass(frozen=True, slots=True)
class Held:
    """The job cannot run as asked: no rule routes it, or no route could ever hold it."""

    reason: str


Outcome = Placed | Waiting | Held


class Ask(Protocol):
    """A job as the decision reads it: whose it is, what it asked (the policy's rules
    match on it) and what is fitted (the same, but in a replay's whole-GPU comparison,
    which fits every job as whole GPUs wherever the rules send it as asked)."""

    tenant: str
    job_id: int  # what a reservation is held for
    waiting_since: Any  # datetime: when it joined the queue (how long a gang has waited)

    @property
    def asked(self) -> JobSpec: ...

    @property
    def spec(self) -> JobSpec: ...


class Capacity(Protocol):
    """Free capacity within one cycle: fitting a job onto a route takes what it holds."""

    def fit_route(self, job: Any, route: Route) -> Fit | NoFit:
        """Take room for ``job`` on ``route`` now, or say why not (``never``: not ever)."""
        ...

    def undo(self, fit: Fit) -> None:
        """Give back exactly what ``fit`` took (the job will not use it after all)."""
        ...

    def hiding(self, cluster: str, nodes: Any) -> Any:
        """A context within which ``nodes`` of ``cluster`` offer nothing (reserved)."""
        ...

    def gang_candidates(self, spec: JobSpec, route: Route) -> dict[str, int]:
        """Nodes of ``route`` that could ever hold a rank of ``spec``, with units free now."""
        ...

    def gang_domains(self, spec: JobSpec, route: Route) -> dict[str, str] | None:
        """For a gang that requires one network domain, each node's domain; else None."""
        ...


class CycleDecisions:
    """The decisions of one scheduling cycle, on ``capacity`` under ``policy``
    (None: no policy is active), with the tenants' shares and quotas in ``fair``.

    Within a cycle, jobs that look alike to the policy's rules share one evaluation, and
    jobs that wait for the same thing are counted, so each says how many are ahead."""

    def __init__(
        self,
        policy: Policy | None,
        capacity: Capacity,
        fair: FairShare,
        reservations: Reservations | None = None,
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.fair = fair
        # Nodes held for waiting gangs (None: the caller keeps none, as the trace replays).
        self.reservations = reservations
        self._routings: dict[tuple, RoutingDecision] = {}
        self._ahead: dict[tuple | None, int] = defaultdict(int)
        # GPUs that jobs pinned to a model (a route's gpu_model) wait for, by (cluster,
        # model): the caller hands them to the next cycle's capacity (CapacityView.pinned).
        self.pinned_waiting: dict[tuple[str, str], int] = defaultdict(int)

    def routing(self, spec: JobSpec, tenant: str) -> RoutingDecision:
        """The policy's decision for the job: the fields a rule can match on
        (broker.routing.policy.Match) are the key of one evaluation per cycle."""
        key = (
            spec.kind,
            spec.isolation,
            spec.gpus,
            spec.gpu_memory_gb,
            tenant,
            tuple(sorted(spec.labels.items())),
            spec.cluster,
        )
        decision = self._routings.get(key)
        if decision is None:
            decision = self._routings[key] = evaluate(self.policy, spec, tenant)
        return decision

    def decide(self, job: Ask) -> Outcome:
        """Where ``job`` runs now, or why it waits, or why it is held (module docstring)."""
        if self.policy is None:
            return Held(NO_POLICY)
        routing = self.routing(job.asked, job.tenant)
        book = self.reservations
        if not routing.routes:
            if book is not None:
                book.drop(job.job_id)
            return Held(f"held: {routing.message}")
        end = expected_end(book.now, job.spec.time_limit) if book is not None else None
        reasons: list[str] = []
        first_wait: NoFit | None = None
        first_route: Route | None = None
        for route in routing.routes:
            fit = self._fit(job, route, end)
            if isinstance(fit, Fit):
                over_quota = self.fair.over_quota(job.tenant, fit.placement.gpu_equivalents)
                if over_quota:
                    self.capacity.undo(fit)
                    if book is not None:
                        book.drop(job.job_id)  # a gang at its quota holds no nodes idle
                    return Waiting(over_quota, WaitCause.QUOTA)
                self.fair.charge(job.tenant, fit.placement.gpu_equivalents)
                if book is not None:
                    book.placed(job.job_id, fit.placement, end, job.spec.priority, job.waiting_since)
                return Placed(fit)
            reasons.append(fit.reason)
            if first_wait is None and not fit.never:
                first_wait, first_route = fit, route
        if first_wait is None:
            if book is not None:
                book.drop(job.job_id)
            # Which rule sent it there: a job that fell through to a catch-all (whole GPUs
            # for an inference job that asked to share) learns why it is on that route.
            by = f" (routed by rule '{routing.rule_name}': `gpush policy explain` shows every rule)"
            return Held("held: can never fit: " + "; ".join(reasons) + by)
        waiting_for = first_wait.waiting_for
        if waiting_for is not None and waiting_for[-1] is not None:  # (cluster, sharing, profile, model)
            self.pinned_waiting[(waiting_for[0], waiting_for[-1])] += (
                job.spec.gpus * replicas_of(job.spec) * job.spec.nodes
            )
        waiting = self.behind(Waiting(first_wait.reason, WaitCause.CAPACITY, waiting_for))
        if book is not None and job.spec.nodes > 1 and first_route is not None:
            reservation = book.reserve(
                job.job_id,
                job.waiting_since,
                first_route.cluster,
                job.spec.gpus,
                job.spec.nodes,
                self.capacity.gang_candidates(job.spec, first_route),
                job.spec.priority,
                self.capacity.gang_domains(job.spec, first_route) if job.spec.topology is not None else None,
            )
            if reservation is None:
                book.drop(job.job_id)
            else:
                waiting = Waiting(
                    f"{waiting.reason}; {reservation.words()}", waiting.cause, waiting.waiting_for, waiting.plain
                )
        return waiting

    def fit(self, job: Ask, route: Route) -> Fit | NoFit:
        """Fit ``job`` on ``route`` as :meth:`decide` does (steps 2 and 6: off the nodes
        reserved for a gang that starts before it would end), and nothing else: no quota,
        no charge, no reservation made. What preemption tries once victims' capacity is
        given back (:class:`broker.placement.preemption.Planner`), so a job preempts only
        where it may be placed."""
        book = self.reservations
        return self._fit(job, route, expected_end(book.now, job.spec.time_limit) if book is not None else None)

    def gang_nodes(self, job: Ask, route: Route) -> dict[str, int]:
        """The nodes of ``route`` a rank of the multi-node ``job`` may go to, with their
        units free now: those that could ever hold one, less those reserved for another
        gang that starts before ``job`` would end (step 6)."""
        nodes = self.capacity.gang_candidates(job.spec, route)
        book = self.reservations
        if book is None or not book.held or not nodes:
            return nodes
        blocked = set(self._reserved_against(job, route.cluster, expected_end(book.now, job.spec.time_limit)))
        return {node: units for node, units in nodes.items() if node not in blocked}

    def _reserved_against(self, job: Ask, cluster: str, end: Any) -> list[str]:
        """The nodes of ``cluster`` reserved for a gang that ``job`` (ending at ``end``) is
        behind in the queue and would run past the start of (step 6); none without a book."""
        book = self.reservations
        if book is None or not book.held:
            return []
        return book.blocked(job.job_id, cluster, end, job.spec.priority, job.waiting_since)

    def _fit(self, job: Ask, route: Route, end: Any) -> Fit | NoFit:
        """Fit ``job`` on ``route``, off the nodes reserved for gangs that start before it
        would end (``end``: its time limit from now; None: it has none)."""
        book = self.reservations
        nodes = self._reserved_against(job, route.cluster, end)
        if not nodes:
            return self.capacity.fit_route(job, route)
        with self.capacity.hiding(route.cluster, nodes):
            fit = self.capacity.fit_route(job, route)
        if isinstance(fit, NoFit) and not fit.never:  # say why the free GPUs there do not count
            until = min(r.start_by for r in (book.on_node(route.cluster, node) for node in nodes) if r is not None)
            named = ", ".join(nodes[:2]) + (f" and {len(nodes) - 2} more" if len(nodes) > 2 else "")
            what = "time limit" if end is not None else "lack of a time limit"
            fit = replace(
                fit,
                reason=f"{fit.reason}; {named} held for a multi-node job until ~{utc_clock(until)}, "
                f"which this job's {what} runs past",
            )
        return fit

    def behind(self, waiting: Waiting) -> Waiting:
        """``waiting`` as the next job waiting for the same thing says it: with the jobs of
        this cycle ahead of it. A replay that skips a job of a kind that already found no
        room in this cycle (capacity only shrinks within one) asks this instead of
        :meth:`decide`, and the job says what the scheduler would have said."""
        if waiting.cause is not WaitCause.CAPACITY:
            return waiting
        plain = waiting.plain or waiting.reason
        n = self._ahead[waiting.waiting_for]
        self._ahead[waiting.waiting_for] += 1
        reason = plain if n == 0 else _with_ahead(plain, n)
        return Waiting(reason, waiting.cause, waiting.waiting_for, plain)


def _ahead_suffix(n: int) -> str:
    return f", {n} job{'s' if n > 1 else ''} ahead)"


def _with_ahead(reason: str, n: int) -> str:
    if reason.endswith(")"):  # "(3 of 8 free)" -> "(3 of 8 free, 2 jobs ahead)"
        return reason.rstrip(")") + _ahead_suffix(n)
    return f"{reason} ({_ahead_suffix(n)[2:]}"
