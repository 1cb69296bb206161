"""learner_checks: the online learner's judgements that changed or kept what serves (a win awaiting
confirmation, confirmed or refused; probation looks; calibration trials)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "learner_checks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("subject", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("gain", sa.Float(), nullable=False),
        sa.Column("drafts", sa.Integer(), nullable=False),
        sa.Column("predictor_version_id", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("replica", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_learner_checks")),
    )
    op.create_index(op.f("ix_learner_checks_at"), "learner_checks", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_learner_checks_at"), table_name="learner_checks")
    op.drop_table("learner_checks")
