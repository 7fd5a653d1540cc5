"""SQLAlchemy ORM models: the tables of the global queue.

Schemas that cross the API live in ``broker.core.schemas``; these classes are storage.
Every schema change is an Alembic revision in ``migrations/versions`` and a test
proves that ``upgrade head`` equals this metadata on SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    types,
)
from sqlalchemy import text as sql_text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Big integer keys on PostgreSQL (a queue may see billions of events); SQLite's
# INTEGER PRIMARY KEY is already 64-bit and is the only type it autoincrements.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Document = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(types.TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Job(Base):
    """One GPU job of the global queue: what the user asked for and where it stands."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str | None] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(64))
    user: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    isolation: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16))
    state_reason: Mapped[str | None] = mapped_column(Text)
    # The validated, normalised job spec (broker.core.schemas.JobSpec) as submitted.
    spec: Mapped[dict[str, Any]] = mapped_column(Document)
    # sha256 of the canonical spec, to tell an idempotent retry from a reused key.
    spec_hash: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    # Set when a user cancels a job the cluster already has; the adapter acts on it.
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Where the scheduler placed it (broker.core.adapter.Placement as a dict) and what the
    # cluster calls it; gpu_equivalents is what it counts in its tenant's ledger.
    cluster: Mapped[str | None] = mapped_column(String(64))
    placement: Mapped[dict[str, Any] | None] = mapped_column(Document)
    backend_id: Mapped[str | None] = mapped_column(String(128))
    gpu_equivalents: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (
        # The scheduler claims queued jobs by priority then age.
        Index("ix_jobs_state_priority_created", "state", "priority", "created_at"),
        # A tenant's view of its queue, and fair-share counting per tenant.
        Index("ix_jobs_tenant_state", "tenant", "state"),
        Index("ix_jobs_tenant_id", "tenant", "id"),
        Index("ix_jobs_user_id", "user", "id"),
        # Status sync and capacity: a cluster's jobs by state.
        Index("ix_jobs_cluster_state", "cluster", "state"),
        # The claim: a tenant's queued jobs of one priority, oldest first (migration 0003).
        Index(
            "ix_jobs_queued_claim",
            "tenant",
            "priority",
            "created_at",
            "id",
            postgresql_where=sql_text("state = 'queued'"),
            sqlite_where=sql_text("state = 'queued'"),
        ),
        # Cancel requests for jobs a cluster still runs: the few rows that have one.
        Index(
            "ix_jobs_cancel_requested",
            "id",
            postgresql_where=sql_text("cancel_requested_at IS NOT NULL"),
            sqlite_where=sql_text("cancel_requested_at IS NOT NULL"),
        ),
        # Idempotent submission: one job per key within a tenant.
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )


class JobEvent(Base):
    """One entry of a job's history: a state change, or an intent such as a cancel request."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigId, ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    # "transition" for a state change, "cancel_requested" for a recorded intent.
    type: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(String(128))


class GangReservation(Base):
    """Nodes reserved for a waiting multi-node job (broker.placement.reservation): they
    take no work that would end after ``start_by``. Kept from cycle to cycle (the cycle
    rewrites them after deciding); a row whose job no longer waits is ignored and dropped."""

    __tablename__ = "gang_reservations"

    job_id: Mapped[int] = mapped_column(BigId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    cluster: Mapped[str] = mapped_column(String(64))
    nodes: Mapped[list[str]] = mapped_column(Document)
    # When the last of its nodes is expected to have room (their jobs' placed time + limit).
    start_by: Mapped[datetime] = mapped_column(UTCDateTime)
    made_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Preemption(Base):
    """One preemption: a running job (``victim_id``) stopped so that a waiting one
    (``preemptor_id``) can run. Written when the scheduler chooses the victim, before any
    cluster is asked (broker.scheduling.preemption); ``signalled_at`` once the victim got
    its checkpoint signal, ``stopped_at`` once its grace ran out and its cluster was told to
    stop it, ``ended_at`` once it left ``running`` (requeued, or ended on its own first)."""

    __tablename__ = "preemptions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    victim_id: Mapped[int] = mapped_column(BigId, ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # The waiting job it is for, or (``mig_change_id``) the MIG layout change that empties
    # the victim's GPU (broker.fleet.mig_changes).
    preemptor_id: Mapped[int | None] = mapped_column(BigId, ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    mig_change_id: Mapped[int | None] = mapped_column(BigId, ForeignKey("mig_changes.id", ondelete="CASCADE"))
    # "priority" or "reclaim" (broker.placement.preemption.Choice.why; reclaims are
    # rate-limited), or "mig-change".
    why: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    signal: Mapped[str] = mapped_column(String(8))
    grace_seconds: Mapped[int] = mapped_column(Integer)
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime)
    signalled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    gpu_equivalents: Mapped[float] = mapped_column(Float)  # what the victim held
    # The victim's placement in the run it stopped (the job's own is cleared when it is
    # queued again): accounting charges that run to it (broker.accounting.usage).
    placement: Mapped[dict[str, Any]] = mapped_column(Document)
    # GPU-equivalent seconds of work since the victim's last checkpoint (its start if none), at its end.
    lost_gpu_seconds: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        # The preemptions in flight: the few rows each cycle reads.
        Index(
            "ix_preemptions_open",
            "id",
            postgresql_where=sql_text("ended_at IS NULL"),
            sqlite_where=sql_text("ended_at IS NULL"),
        ),
        # The reclaim rate limit: the last hour's.
        Index("ix_preemptions_requested_at", "requested_at"),
    )


class ApiToken(Base):
    """An API token: only its sha256 is stored; the secret is shown once, at creation."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The first characters of the token, so an admin can tell tokens apart.
    prefix: Mapped[str] = mapped_column(String(16))
    user: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # An agent token's node names or globs (gpu-*) it may report for; NULL: any node
    # (user and admin tokens, and agent tokens from before revision 0005).
    nodes: Mapped[list[str] | None] = mapped_column(Document)


class Cluster(Base):
    """A cluster an admin registered: its kind picks the adapter, its config feeds it."""

    __tablename__ = "clusters"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict[str, Any]] = mapped_column(Document)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # Where the status sync left off (the adapter's StatusPage cursor).
    status_cursor: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class PolicyVersion(Base):
    """One immutable version of the routing policy, as its author wrote it."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    text: Mapped[str] = mapped_column(Text)
    author: Mapped[str] = mapped_column(String(64))
    comment: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ActivePolicy(Base):
    """The one active policy version (a single row, id 1), changed by compare-and-set."""

    __tablename__ = "active_policy"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(Integer, ForeignKey("policy_versions.version"))
    activated_by: Mapped[str] = mapped_column(String(64))
    activated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Tenant(Base):
    """A tenant's fair-share weight and GPU quota, in physical GPU-equivalents."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    gpu_quota: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class NodeReport(Base):
    """The newest report of each node's agent (broker.inventory.agent_report): what NVML saw there.

    One row per node, replaced by each report; broker.inventory.reconcile merges them with what
    the clusters say. ``reported_by`` is the agent token's user, for the audit trail.
    Agents report every half minute with mostly the same facts; ``changed_at`` moves only
    when the facts do (see broker.inventory.report_store.facts_of)."""

    __tablename__ = "node_reports"

    node: Mapped[str] = mapped_column(String(253), primary_key=True)
    report: Mapped[dict[str, Any]] = mapped_column(Document)
    collected_at: Mapped[datetime] = mapped_column(UTCDateTime)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # When what the report says of the GPUs last changed (not its time or process list):
    # the scheduler reconciles again when this moves, not on every report.
    changed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    reported_by: Mapped[str] = mapped_column(String(64))


class MigChange(Base):
    """One GPU's MIG layout change (broker.fleet.mig_changes): from ``from_layout`` to
    ``to_layout`` (instances as ``"3g.20gb@0"``), one step at a time, each step an event
    (:class:`MigChangeEvent`). ``target`` is the layout the GPU is being brought to now:
    ``to_layout``, or ``from_layout`` once a step ran out of time and the change rolls back.
    ``step`` is where it is (``planned`` ... ``admitting``) or how it ended (``done``,
    ``rolled-back``, ``failed``, ``cancelled``); ``deadline`` is when the step runs out."""

    __tablename__ = "mig_changes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    cluster: Mapped[str] = mapped_column(String(128))
    node: Mapped[str] = mapped_column(String(253))
    gpu: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(64))
    from_layout: Mapped[list[str]] = mapped_column(Document)
    to_layout: Mapped[list[str]] = mapped_column(Document)
    target: Mapped[list[str]] = mapped_column(Document)
    step: Mapped[str] = mapped_column(String(16))
    rolling_back: Mapped[bool] = mapped_column(Boolean, default=False)
    # Who changes the GPU: "agent" (the node's agent, then the cluster is told) or "cluster"
    # (publishing makes the cluster change it: the simulator, Kubernetes' MIG manager).
    changed_by: Mapped[str] = mapped_column(String(8))
    reason: Mapped[str] = mapped_column(Text)  # why it was asked (the plan's gain)
    requested_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    step_at: Mapped[datetime] = mapped_column(UTCDateTime)
    deadline: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        # The changes in flight: the few rows each cycle reads.
        Index(
            "ix_mig_changes_open",
            "id",
            postgresql_where=sql_text("ended_at IS NULL"),
            sqlite_where=sql_text("ended_at IS NULL"),
        ),
        Index("ix_mig_changes_node", "node", "gpu"),
    )


class MigChangeEvent(Base):
    """A step of a :class:`MigChange`, with what happened in the user's words."""

    __tablename__ = "mig_change_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    change_id: Mapped[int] = mapped_column(BigId, ForeignKey("mig_changes.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    step: Mapped[str] = mapped_column(String(16))
    note: Mapped[str] = mapped_column(Text)


class NodeMove(Base):
    """A lendable node moving from ``source`` to ``target`` (broker.fleet.lending):
    fenced on the source, emptied there, then offered by the target. ``step`` is where it
    is (``draining``, ``joining``) or how it ended (``done``, ``called-off``, ``failed``);
    each step is a :class:`NodeMoveEvent`."""

    __tablename__ = "node_moves"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(253))
    source: Mapped[str] = mapped_column(String(128))
    target: Mapped[str] = mapped_column(String(128))
    step: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    step_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        Index(
            "ix_node_moves_open",
            "id",
            postgresql_where=sql_text("ended_at IS NULL"),
            sqlite_where=sql_text("ended_at IS NULL"),
        ),
        Index("ix_node_moves_node", "node", "ended_at"),
    )


class NodeMoveEvent(Base):
    """A step of a :class:`NodeMove`, with what happened."""

    __tablename__ = "node_move_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    move_id: Mapped[int] = mapped_column(BigId, ForeignKey("node_moves.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    step: Mapped[str] = mapped_column(String(16))
    note: Mapped[str] = mapped_column(Text)
