"""TEXT for values with no natural bound

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Request ids come from clients and traces (the bundled can-ai-code ids are 189 characters), replica
and lease-holder names from hostnames, actors from replica names: VARCHAR limits on them made
PostgreSQL refuse whole event batches. Tenants and authors keep their stated limits
(storage.limits), enforced at the edge. Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, length before this revision)
WIDENED = (
    ("decision_events", "request_id", 128),
    ("tau_history", "replica", 64),
    ("replica_health", "replica", 128),
    ("leases", "holder", 128),
    ("predictor_versions", "created_by", 128),
    ("alias_events", "actor", 128),
)


def upgrade() -> None:
    for table, column, length in WIDENED:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, existing_type=sa.String(length=length), type_=sa.Text(),
                               existing_nullable=False)


def downgrade() -> None:
    # Longer values are cut to the old length (PostgreSQL would refuse the ALTER otherwise).
    for table, column, length in reversed(WIDENED):
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, existing_type=sa.Text(), type_=sa.String(length=length),
                               existing_nullable=False, postgresql_using=f"left({column}, {length})")
