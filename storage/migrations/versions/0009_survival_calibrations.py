"""survival_calibrations: the fast per-position correction of the champion's survival curves per
workload (and per tenant's workload), shared by every replica

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "survival_calibrations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("predictor_version_id", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_survival_calibrations")),
        sa.UniqueConstraint("workload", "tenant", name=op.f("uq_survival_calibrations_workload")),
    )


def downgrade() -> None:
    op.drop_table("survival_calibrations")
