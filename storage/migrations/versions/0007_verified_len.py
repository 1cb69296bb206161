"""decision_events.verified_len: the draft tokens the engine verified, where the allocator verified
only a prefix of a cache draft

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

The label stays the whole draft's accepted length (what the predictor learns from); statistics count
the verified prefix: draft tokens verified_len, accepted min(label, verified_len). NULL for events
written before this revision (their cache decisions verified the whole draft). Hand-written and
frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("decision_events") as batch:
        batch.add_column(sa.Column("verified_len", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("decision_events") as batch:
        batch.drop_column("verified_len")
