"""The plan's promises: decision_events.promised, and its sums per drafter in stat_buckets and stat_hours

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07

decision_events.promised: what the allocator's plan expected the target to accept of the draft
tokens the engine verified (the draft's survival curve, or the model drafter's, summed over them);
NULL where nothing was verified, no allocator planned the step, or the event is older. The
statistics sum it per drafter in thousandths of a token, beside the tokens accepted among those
verified drafts: their ratio says whether the plan over-promises on the drafts it acts on. Rows
written before this revision count 0 (no promise known). Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SUMS = ("cache_promised_milli", "cache_promise_kept", "model_promised_milli", "model_promise_kept")


def upgrade() -> None:
    with op.batch_alter_table("decision_events") as batch:
        batch.add_column(sa.Column("promised", sa.Float(), nullable=True))
    for table, kept_type in (("stat_buckets", sa.Integer()), ("stat_hours", sa.BigInteger())):
        with op.batch_alter_table(table) as batch:
            for name in SUMS:
                column_type = sa.BigInteger() if name.endswith("_milli") else kept_type
                batch.add_column(sa.Column(name, column_type, nullable=False, server_default="0"))


def downgrade() -> None:
    for table in ("stat_hours", "stat_buckets"):
        with op.batch_alter_table(table) as batch:
            for name in reversed(SUMS):
                batch.drop_column(name)
    with op.batch_alter_table("decision_events") as batch:
        batch.drop_column("promised")
