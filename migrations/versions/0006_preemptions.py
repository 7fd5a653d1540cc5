"""Preemptions: which running job was stopped for which waiting one, and how far it got.

Why: the scheduler preempts (broker.scheduling.preemption). Each preemption is written
when the victim is chosen, before its cluster is asked, so a broker that dies between
the choice and the signal, or during the victim's grace, picks it up where it was; the
reclaim rate limit counts the last hour's rows; ``lost_gpu_seconds`` is what it cost.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

Document = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "preemptions",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("victim_id", Id, nullable=False),
        sa.Column("preemptor_id", Id, nullable=False),
        sa.Column("why", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("signal", sa.String(8), nullable=False),
        sa.Column("grace_seconds", sa.Integer(), nullable=False),
        sa.Column("requested_at", Timestamp, nullable=False),
        sa.Column("signalled_at", Timestamp, nullable=True),
        sa.Column("stopped_at", Timestamp, nullable=True),
        sa.Column("ended_at", Timestamp, nullable=True),
        sa.Column("gpu_equivalents", sa.Float(), nullable=False),
        sa.Column("placement", Document, nullable=False),
        sa.Column("lost_gpu_seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["victim_id"], ["jobs.id"], name=op.f("fk_preemptions_victim_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["preemptor_id"], ["jobs.id"], name=op.f("fk_preemptions_preemptor_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_preemptions")),
    )
    op.create_index(op.f("ix_preemptions_victim_id"), "preemptions", ["victim_id"])
    op.create_index(op.f("ix_preemptions_preemptor_id"), "preemptions", ["preemptor_id"])
    op.create_index(op.f("ix_preemptions_requested_at"), "preemptions", ["requested_at"])
    op.create_index(
        "ix_preemptions_open",
        "preemptions",
        ["id"],
        postgresql_where=sa.text("ended_at IS NULL"),
        sqlite_where=sa.text("ended_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_table("preemptions")
