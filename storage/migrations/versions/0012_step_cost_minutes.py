"""step_cost_minutes: per replica and minute, what the engine's steps cost by part (target, hvd,
drafter, rest, total: sum, p50 and p90 in milliseconds)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "step_cost_minutes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("replica", sa.Text(), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("batch_mean", sa.Float(), nullable=False),
        sa.Column("query_tokens_mean", sa.Float(), nullable=False),
        sa.Column("drafter_steps", sa.Integer(), nullable=False),
        sa.Column("target_ms_sum", sa.Float(), nullable=False),
        sa.Column("target_ms_p50", sa.Float(), nullable=False),
        sa.Column("target_ms_p90", sa.Float(), nullable=False),
        sa.Column("hvd_ms_sum", sa.Float(), nullable=False),
        sa.Column("hvd_ms_p50", sa.Float(), nullable=False),
        sa.Column("hvd_ms_p90", sa.Float(), nullable=False),
        sa.Column("drafter_ms_sum", sa.Float(), nullable=False),
        sa.Column("drafter_ms_p50", sa.Float(), nullable=False),
        sa.Column("drafter_ms_p90", sa.Float(), nullable=False),
        sa.Column("rest_ms_sum", sa.Float(), nullable=False),
        sa.Column("rest_ms_p50", sa.Float(), nullable=False),
        sa.Column("rest_ms_p90", sa.Float(), nullable=False),
        sa.Column("total_ms_sum", sa.Float(), nullable=False),
        sa.Column("total_ms_p50", sa.Float(), nullable=False),
        sa.Column("total_ms_p90", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_cost_minutes")),
        sa.UniqueConstraint("replica", "minute", name=op.f("uq_step_cost_minutes_replica")),
    )
    op.create_index(op.f("ix_step_cost_minutes_minute"), "step_cost_minutes", ["minute"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_step_cost_minutes_minute"), table_name="step_cost_minutes")
    op.drop_table("step_cost_minutes")
