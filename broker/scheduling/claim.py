"""Step 5 of a scheduling cycle: claiming queued jobs in order, per tenant and priority,
with a LIMIT, so a cycle reads the jobs it decides and never the whole queue."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import DateTime, Text, cast, literal_column, select, text, type_coerce

from broker.core.models import Job
from broker.core.schemas import JobSpec
from broker.core.states import JobState
from broker.scheduling.steps import CycleReport, side_by_side

S = JobState
ACTOR = "scheduler"
# Connections that read tenants' queues side by side at the start of a claim.
_CLAIM_READERS = 2
# created_at as the database returns it: the claim only orders by it, so the conversion
# of every row to an aware UTC datetime (models.UTCDateTime) is skipped.
_CREATED_AT = type_coerce(Job.created_at, DateTime(timezone=True))


@dataclass(slots=True)
class Candidate:
    job_id: int
    tenant: str
    priority: int
    created_at: datetime
    state_reason: str | None
    document: str  # the stored spec's JSON text, parsed into ``spec`` when the job is decided
    spec_hash: str
    idempotency_key: str | None
    spec: JobSpec | None = None
    user: str = ""  # who submitted it (their token's user): the identity it runs as

    @property
    def asked(self) -> JobSpec:  # what the policy's rules match on: the spec itself
        return self.spec

    @property
    def waiting_since(self) -> datetime:  # how long a gang has waited (its reservation)
        # The claim reads created_at as the database gives it: naive UTC on SQLite.
        at = self.created_at
        return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


class Claim:
    """The queued jobs of one cycle, per tenant, read as the cycle's order reaches them.

    Each tenant's queue is its jobs by priority (highest first), then age, then id, and
    at most ``limit`` of them are claimed a cycle: a tenant whose jobs all wait (at its
    quota, or for a kind of GPU that is full) holds up only its own. The queue is read
    one priority level at a time with the level and the age in the query and a LIMIT of
    what is left of the tenant's claim (``ix_jobs_state_priority_created``, or
    ``ix_jobs_tenant_state`` for tenants with few jobs), so a cycle reads the jobs it
    decides and no others. The first read runs on a thread of its own from creation to
    :meth:`wait`, beside the steps that do not touch queued jobs.
    """

    def __init__(self, sessions, limit: int):
        self.sessions = sessions
        self.limit = limit
        self.tenants: list[str] = []
        self.queues: dict[str, TenantQueue] = {}
        self._seconds = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="gpush-claim", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        begin = time.perf_counter()
        try:
            with self.sessions() as session:
                self.tenants = list(session.execute(_TENANTS_WITH_QUEUED, {"queued": S.QUEUED.value}).scalars())
                levels = list(session.execute(_PRIORITY_LEVELS, {"queued": S.QUEUED.value}).scalars())
            self.queues = {t: TenantQueue(t, levels, self.limit) for t in self.tenants}
            # Tenants' first reads side by side, a few connections at a time: each is an
            # index walk of its own, and the cycle needs every tenant's head to begin.
            queues = list(self.queues.values())
            groups = [queues[n::_CLAIM_READERS] for n in range(min(_CLAIM_READERS, len(queues)))]
            side_by_side(self._fill, groups)
        except BaseException as exc:  # raised again in the cycle's thread, by wait()
            self._error = exc
        self._seconds = time.perf_counter() - begin

    def _fill(self, queues: list[TenantQueue]) -> None:
        with self.sessions() as session:
            for queue in queues:
                queue.fill(session)

    def wait(self, report: CycleReport, *, raise_error: bool = True) -> None:
        self._thread.join()
        report.seconds["claim"] = report.seconds.get("claim", 0.0) + self._seconds
        self._seconds = 0.0
        if self._error is not None and raise_error:
            error, self._error = self._error, None
            raise error

    def leave_out(self, job_ids: set[int], report: CycleReport) -> None:
        """Leave ``job_ids`` out of this claim (the jobs this cycle's status sync puts back in
        the queue: its write runs beside the claim's read, so whether the read sees them
        would be down to the threads' timing; they are claimed from the next cycle on). They
        count against a tenant's claim when they were read."""
        if not job_ids:
            return
        emptied = set()
        with report.timing("claim"), self.sessions() as session:
            for queue in self.queues.values():
                queue.skip = job_ids
                kept = deque(job for job in queue.buffer if job.job_id not in job_ids)
                if len(kept) < len(queue.buffer):
                    queue.buffer = kept
                    queue.fill(session)
                    if not queue.buffer:
                        emptied.add(queue.tenant)
        # A tenant queued only through them waits from the next cycle on, as they do.
        self.tenants = [tenant for tenant in self.tenants if tenant not in emptied]
        for tenant in emptied:
            del self.queues[tenant]

    def pop(self, tenant: str, report: CycleReport) -> Candidate:
        """The tenant's next job; the next priority level is read when this was the last
        one read of its level."""
        queue = self.queues[tenant]
        job = queue.buffer.popleft()
        if not queue.buffer and not queue.done:
            with report.timing("claim"), self.sessions() as session:
                queue.fill(session)
        return job


class TenantQueue:
    """One tenant's part of a claim: its jobs read so far, and where to read on."""

    __slots__ = ("tenant", "levels", "level", "left", "buffer", "done", "skip")

    def __init__(self, tenant: str, levels: list[int], limit: int):
        self.tenant = tenant
        self.levels = levels
        self.level = 0  # index into levels
        self.left = limit  # of the tenant's claim this cycle
        self.buffer: deque[Candidate] = deque()
        self.done = not levels or limit <= 0
        self.skip: set[int] = set()  # left out of this claim (Claim.leave_out)

    def fill(self, session) -> None:
        """Read the tenant's jobs of its next priority level that has any, up to what is
        left of its claim (nothing when it is done)."""
        while not self.buffer and not self.done:
            rows = session.execute(
                select(
                    Job.id,
                    Job.priority,
                    _CREATED_AT,
                    Job.state_reason,
                    cast(Job.spec, Text),
                    Job.spec_hash,
                    Job.idempotency_key,
                    Job.user,
                )
                .where(Job.tenant == self.tenant, _IS_QUEUED, Job.priority == self.levels[self.level])
                .order_by(Job.created_at, Job.id)
                .limit(self.left)
            ).all()
            self.buffer.extend(
                Candidate(r[0], self.tenant, r[1], r[2], r[3], r[4], r[5], r[6], user=r[7])
                for r in rows
                if r[0] not in self.skip
            )
            self.left -= len(rows)
            self.level += 1
            self.done = self.left <= 0 or self.level >= len(self.levels)


# A literal, not a bound parameter: the planner can then use the partial index of queued
# jobs (ix_jobs_queued_claim, migration 0003) whatever plan a prepared statement gets.
_IS_QUEUED = Job.state == literal_column(f"'{S.QUEUED.value}'")


# Loose index scans: each step of the recursion is one probe of an index, so finding
# the few tenants and priority levels of a queue of a million jobs reads a few entries
# per tenant or level, not the queue. Every tenant that has jobs is visited (the index
# on (tenant, ...) has no state first), and each asked whether it has a queued one.
_TENANTS_WITH_QUEUED = text(
    """WITH RECURSIVE tenants(name) AS (
        SELECT (SELECT tenant FROM jobs ORDER BY tenant LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant FROM jobs j WHERE j.tenant > tenants.name ORDER BY j.tenant LIMIT 1)
        FROM tenants WHERE tenants.name IS NOT NULL
    )
    SELECT name FROM tenants
    WHERE name IS NOT NULL AND EXISTS (SELECT 1 FROM jobs q WHERE q.tenant = tenants.name AND q.state = :queued)"""
)


_PRIORITY_LEVELS = text(
    """WITH RECURSIVE levels(priority) AS (
        SELECT (SELECT priority FROM jobs WHERE state = :queued ORDER BY priority DESC LIMIT 1)
        UNION ALL
        SELECT (
            SELECT j.priority FROM jobs j WHERE j.state = :queued AND j.priority < levels.priority
            ORDER BY j.priority DESC LIMIT 1
        )
        FROM levels WHERE levels.priority IS NOT NULL
    )
    SELECT priority FROM levels WHERE priority IS NOT NULL"""
)
