"""64-bit ids and counters (decision_events, dead_letter_events, stat_buckets, replica_health)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04

A fleet writing 5-10k events/s reaches 2^31 ids in days, and the statistics upsert takes a sequence
value on every attempt, even one that updates. On PostgreSQL each serial id becomes BIGINT and so does
its sequence: a serial's sequence is `AS integer` (MAXVALUE 2^31-1), so widening only the column
would still stop at 2^31-1 (SQLSTATE 2200H). The sequence is found with pg_get_serial_sequence, so
the statement works in whatever schema search_path names, and from the offline SQL script too (no
query at migration time). Widening rewrites the table under an exclusive lock: seconds per million
rows (decision_events holds at most 2M, the serving stack's retention).

On SQLite an INTEGER PRIMARY KEY is the 64-bit rowid already (a BIGINT one would stop being the
rowid alias and lose its autoincrement), so only the counters change there.

The replica_health counters become BIGINT on both, and replica_health gains `dead_letters_pruned`:
how many dead letters that replica's writer deleted to keep the table within its cap
(storage.events.KEEP_DEAD_LETTERS).

Downgrade narrows back; PostgreSQL refuses it (nothing is changed) once an id or counter exceeds
2^31-1. Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SERIAL_IDS = ("decision_events", "dead_letter_events", "stat_buckets")  # PostgreSQL only
COUNTERS = ("events_written", "events_dropped", "events_dead_lettered")  # replica_health, every backend


def _alter_sequence(table: str, type_name: str) -> str:
    """The statement setting the type of `table`.id's sequence, named by the server at run time."""
    # No '%' and no ':' in it: the text passes through the driver's parameter syntax unchanged.
    return (f"DO $$ BEGIN EXECUTE 'ALTER SEQUENCE ' || pg_get_serial_sequence('{table}', 'id') "
            f"|| ' AS {type_name}'; END $$")


def _postgresql() -> bool:
    return op.get_context().dialect.name == "postgresql"


def upgrade() -> None:
    if _postgresql():
        for table in SERIAL_IDS:
            op.alter_column(table, "id", existing_type=sa.Integer(), type_=sa.BigInteger(),
                            existing_nullable=False)
            op.execute(_alter_sequence(table, "bigint"))
    with op.batch_alter_table("replica_health") as batch:
        for column in COUNTERS:
            batch.alter_column(column, existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)
        batch.add_column(sa.Column("dead_letters_pruned", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("replica_health") as batch:
        batch.drop_column("dead_letters_pruned")
        for column in reversed(COUNTERS):
            batch.alter_column(column, existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
    if _postgresql():
        for table in reversed(SERIAL_IDS):
            op.execute(_alter_sequence(table, "integer"))
            op.alter_column(table, "id", existing_type=sa.BigInteger(), type_=sa.Integer(),
                            existing_nullable=False)
