"""decision events (labelled drafts from the runtime)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "decision_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("drafter", sa.String(length=16), nullable=False),
        sa.Column("decision", sa.String(length=16), nullable=False),
        sa.Column("draft_len", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("predicted", sa.Float(), nullable=True),
        sa.Column("tau", sa.Float(), nullable=True),
        sa.Column("predictor_version_id", sa.Integer(), nullable=True),
        sa.Column("features", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_decision_events")),
    )
    with op.batch_alter_table("decision_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_decision_events_at"), ["at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("decision_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_decision_events_at"))
    op.drop_table("decision_events")
