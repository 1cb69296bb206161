"""exactly-once learning and fenced leadership: decision_events.txid (the inserting transaction on
PostgreSQL), learner_cursor and learner_rounds, leases.epoch

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04

PostgreSQL hands out ids at insert but commits in any order, so a reader going by id alone skips a
chunk that commits after a later one was read. New rows carry their transaction's id (a default,
so no writer changes); the learner reads in (txid, id) order below the oldest transaction still
running. Existing rows get 0 (read first). Adding a NOT NULL column with a constant default does
not rewrite a filled table (PostgreSQL >= 11); the transaction-id default is set afterwards.
Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("decision_events") as batch:
        batch.add_column(sa.Column("txid", sa.BigInteger(), nullable=False, server_default="0"))
    if op.get_context().dialect.name == "postgresql":
        op.execute("ALTER TABLE decision_events ALTER COLUMN txid SET DEFAULT (pg_current_xact_id()::text::bigint)")
    op.create_index("ix_decision_events_txid_id", "decision_events", ["txid", "id"])
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "learner_cursor",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("txid", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_learner_cursor")),
    )
    op.create_table(
        "learner_rounds",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("after_txid", sa.BigInteger(), nullable=False),
        sa.Column("after_id", sa.BigInteger(), nullable=False),
        sa.Column("last_txid", sa.BigInteger(), nullable=False),
        sa.Column("last_id", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_learner_rounds")),
    )


def downgrade() -> None:
    op.drop_table("learner_rounds")
    op.drop_table("learner_cursor")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("epoch")
    op.drop_index("ix_decision_events_txid_id", table_name="decision_events")
    with op.batch_alter_table("decision_events") as batch:
        batch.drop_column("txid")
