"""Partial indexes for claiming queued jobs and finding cancel requests.

Why: with a million jobs queued, the scheduler's claim (a tenant's queued jobs of one
priority, oldest first) read every queued row of the tenant and sorted them, tens of
milliseconds per tenant and cycle; an index on (tenant, priority, created_at, id) of
queued rows only turns it into a range scan of the rows it takes, and stays small
because jobs leave it when they are placed. Cancel requests for jobs a cluster runs
were found by reading every active job; a partial index on the few rows with
``cancel_requested_at`` set reads only those. Both are partial on PostgreSQL and
SQLite alike.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

QUEUED = sa.text("state = 'queued'")
CANCEL_REQUESTED = sa.text("cancel_requested_at IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_jobs_queued_claim",
        "jobs",
        ["tenant", "priority", "created_at", "id"],
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )
    op.create_index(
        "ix_jobs_cancel_requested",
        "jobs",
        ["id"],
        postgresql_where=CANCEL_REQUESTED,
        sqlite_where=CANCEL_REQUESTED,
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_cancel_requested", table_name="jobs")
    op.drop_index("ix_jobs_queued_claim", table_name="jobs")
