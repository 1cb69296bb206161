"""learning_room: at each of the learner's checks, a perfect predictor's counterfactual gain over the
serving version (the headroom) beside the challenger's

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "learning_room",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("predictor_version_id", sa.Integer(), nullable=False),
        sa.Column("drafts", sa.Integer(), nullable=False),
        sa.Column("headroom", sa.Float(), nullable=False),
        sa.Column("challenger_gain", sa.Float(), nullable=True),
        sa.Column("replica", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_learning_room")),
    )
    op.create_index(op.f("ix_learning_room_at"), "learning_room", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_learning_room_at"), table_name="learning_room")
    op.drop_table("learning_room")
