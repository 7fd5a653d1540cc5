"""Clusters, routing policy versions, tenants, and where each job was placed.

Why: the broker now decides where jobs run. Admins register clusters (kind and
adapter config), edit a routing policy kept as immutable versions with one active
(changed by compare-and-set, so two admins cannot both win silently), and set
tenants' fair-share weights and GPU quotas. Each job records its placement, its
backend id (so a crashed broker finds it again) and the GPU-equivalents it holds,
which fair share and quotas add up; (cluster, state) serves the status sync.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime(timezone=True)
Document = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cluster", sa.String(64), nullable=True))
        batch.add_column(sa.Column("placement", Document, nullable=True))
        batch.add_column(sa.Column("backend_id", sa.String(128), nullable=True))
        batch.add_column(sa.Column("gpu_equivalents", sa.Float(), nullable=True))
    op.create_index("ix_jobs_cluster_state", "jobs", ["cluster", "state"])
    op.create_table(
        "clusters",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("config", Document, nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("status_cursor", sa.Text(), nullable=True),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_clusters")),
    )
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("author", sa.String(64), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "active_policy",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("activated_by", sa.String(64), nullable=False),
        sa.Column("activated_at", Timestamp, nullable=False),
        sa.ForeignKeyConstraint(
            ["version"], ["policy_versions.version"], name=op.f("fk_active_policy_version_policy_versions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_active_policy")),
    )
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("gpu_quota", sa.Float(), nullable=True),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenants")),
    )


def downgrade() -> None:
    op.drop_table("tenants")
    op.drop_table("active_policy")
    op.drop_table("policy_versions")
    op.drop_table("clusters")
    op.drop_index("ix_jobs_cluster_state", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("gpu_equivalents")
        batch.drop_column("backend_id")
        batch.drop_column("placement")
        batch.drop_column("cluster")
