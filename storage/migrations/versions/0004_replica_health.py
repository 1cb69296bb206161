"""replica health heartbeat

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "replica_health",
        sa.Column("replica", sa.String(length=128), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("queue_depth", sa.Integer(), nullable=False),
        sa.Column("events_written", sa.Integer(), nullable=False),
        sa.Column("events_dropped", sa.Integer(), nullable=False),
        sa.Column("flush_ms", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("replica", name=op.f("pk_replica_health")),
    )


def downgrade() -> None:
    op.drop_table("replica_health")
