"""Node reports: the newest report of each node's GPU agent.

Why: the reconciled inventory (broker.inventory.reconcile) compares what Slurm and Kubernetes
say about a node's GPUs with what the GPUs themselves say through NVML; ``gpush
agent`` posts that view every interval, and the broker keeps the newest one per node
(a row per node, replaced), so every broker process and ``gpush inventory drift``
read the same facts. ``changed_at`` moves only when the GPU facts change, so the
scheduler reconciles when something changed rather than on every report.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "node_reports",
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column(
            "report", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=False
        ),
        sa.Column("collected_at", Timestamp, nullable=False),
        sa.Column("received_at", Timestamp, nullable=False),
        sa.Column("changed_at", Timestamp, nullable=False),
        sa.Column("reported_by", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("node", name=op.f("pk_node_reports")),
    )


def downgrade() -> None:
    op.drop_table("node_reports")
