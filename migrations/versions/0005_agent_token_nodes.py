"""Agent tokens bound to the nodes they may report for.

Why: an agent token lives on every GPU node it serves, and any agent token could post
the GPU report of any node, so one taken from a node could rewrite the inventory (and
the drift findings that keep the scheduler off slices) of the whole fleet. ``nodes``
holds the node names or globs (``gpu-*``) a token may report for; the report route
refuses the others (broker.core.auth.check_may_report). Tokens stored before this
revision keep NULL, which means any node, so agents already deployed keep reporting;
new agent tokens must name their nodes (``['*']`` for any, on purpose).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

Document = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("nodes", Document, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("nodes")
