"""dead_letter_events: decision events the database can never store, with the reason; and in
replica_health, the count set aside and every background service's state

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

The event writer sets such rows aside here (or in a file when this table itself refuses them)
instead of retrying their batch forever. Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dead_letter_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replica", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letter_events")),
    )
    with op.batch_alter_table("replica_health") as batch:
        batch.add_column(sa.Column("events_dead_lettered", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("services", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replica_health") as batch:
        batch.drop_column("services")
        batch.drop_column("events_dead_lettered")
    op.drop_table("dead_letter_events")
