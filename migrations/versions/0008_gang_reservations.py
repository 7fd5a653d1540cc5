"""Reservations for multi-node jobs: the nodes held for a gang that waited long.

Why: a stream of small jobs must not keep a large gang waiting for ever (issue 34). After
the policy's ``scheduling.gang_reservation_after`` the decision reserves the nodes the gang
will use; they take no work that would end after the gang could start. A reservation keeps
its nodes from one cycle to the next, and across a broker restart, so it is stored.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

Document = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "gang_reservations",
        sa.Column("job_id", Id, nullable=False),
        sa.Column("cluster", sa.String(64), nullable=False),
        sa.Column("nodes", Document, nullable=False),
        sa.Column("start_by", Timestamp, nullable=False),
        sa.Column("made_at", Timestamp, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_gang_reservations_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_gang_reservations")),
    )


def downgrade() -> None:
    op.drop_table("gang_reservations")
