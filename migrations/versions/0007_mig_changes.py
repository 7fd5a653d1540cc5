"""MIG layout changes and lent nodes: each GPU's change from one layout to another, and each
node's move from one cluster to the other, step by step.

Why: ``gpush mig apply`` and the cycle change MIG layouts (broker.mig.reconfigure). A
preemption may now be for such a change (``preemptions.mig_change_id``; its
``preemptor_id`` empty), when preemptible work holds an instance the change destroys.
``node_moves``: a node both clusters list lent from one to the other (broker.scheduling.lending),
written before it is fenced, so a restarted broker finishes the move. Each
change is written before anything is touched and moves one step at a time (fence the node,
empty the GPU, change it through the node agent, publish it to the tier, confirm, admit),
each step an event, so a broker that dies mid-way resumes from the step it reached, and a
step that runs out of time rolls the GPU back to the layout it had.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

Document = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "mig_changes",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("cluster", sa.String(128), nullable=False),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("from_layout", Document, nullable=False),
        sa.Column("to_layout", Document, nullable=False),
        sa.Column("target", Document, nullable=False),
        sa.Column("step", sa.String(16), nullable=False),
        sa.Column("rolling_back", sa.Boolean(), nullable=False),
        sa.Column("changed_by", sa.String(8), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.String(64), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("step_at", Timestamp, nullable=False),
        sa.Column("deadline", Timestamp, nullable=True),
        sa.Column("ended_at", Timestamp, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mig_changes")),
    )
    op.create_index(
        "ix_mig_changes_open",
        "mig_changes",
        ["id"],
        postgresql_where=sa.text("ended_at IS NULL"),
        sqlite_where=sa.text("ended_at IS NULL"),
    )
    op.create_index("ix_mig_changes_node", "mig_changes", ["node", "gpu"])
    op.create_table(
        "mig_change_events",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("change_id", Id, nullable=False),
        sa.Column("at", Timestamp, nullable=False),
        sa.Column("step", sa.String(16), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["change_id"],
            ["mig_changes.id"],
            name=op.f("fk_mig_change_events_change_id_mig_changes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mig_change_events")),
    )
    op.create_index(op.f("ix_mig_change_events_change_id"), "mig_change_events", ["change_id"])
    op.create_table(
        "node_moves",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("target", sa.String(128), nullable=False),
        sa.Column("step", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("step_at", Timestamp, nullable=False),
        sa.Column("ended_at", Timestamp, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_moves")),
    )
    op.create_index(
        "ix_node_moves_open",
        "node_moves",
        ["id"],
        postgresql_where=sa.text("ended_at IS NULL"),
        sqlite_where=sa.text("ended_at IS NULL"),
    )
    op.create_index("ix_node_moves_node", "node_moves", ["node", "ended_at"])
    op.create_table(
        "node_move_events",
        sa.Column("id", Id, autoincrement=True, nullable=False),
        sa.Column("move_id", Id, nullable=False),
        sa.Column("at", Timestamp, nullable=False),
        sa.Column("step", sa.String(16), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["move_id"],
            ["node_moves.id"],
            name=op.f("fk_node_move_events_move_id_node_moves"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_move_events")),
    )
    op.create_index(op.f("ix_node_move_events_move_id"), "node_move_events", ["move_id"])
    # A preemption may be for a MIG change rather than a waiting job.
    with op.batch_alter_table("preemptions") as batch:
        batch.alter_column("preemptor_id", existing_type=Id, nullable=True)
        batch.add_column(sa.Column("mig_change_id", Id, nullable=True))
        batch.create_foreign_key(
            op.f("fk_preemptions_mig_change_id_mig_changes"),
            "mig_changes",
            ["mig_change_id"],
            ["id"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    with op.batch_alter_table("preemptions") as batch:
        batch.drop_constraint(op.f("fk_preemptions_mig_change_id_mig_changes"), type_="foreignkey")
        batch.drop_column("mig_change_id")
        batch.alter_column("preemptor_id", existing_type=Id, nullable=False)
    op.drop_table("node_move_events")
    op.drop_table("node_moves")
    op.drop_table("mig_change_events")
    op.drop_table("mig_changes")
