"""event_receipts: each event writer's last committed chunk, written in the chunk's transaction, so
a chunk whose commit answer was lost with the connection is looked up instead of stored twice

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

One row per writer (a serving process), updated with every chunk. Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "event_receipts",
        sa.Column("writer", sa.String(length=40), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("writer", name=op.f("pk_event_receipts")),
    )


def downgrade() -> None:
    op.drop_table("event_receipts")
