"""alias pins (an operator's pin holds a champion against the learner)

alias_pins: one row per pinned alias (deleted on unpin); alias_pin_events: every pin and unpin,
with who and why. The moves themselves stay in alias_events.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alias_pins",
        sa.Column("alias_name", sa.String(length=64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["alias_name"], ["aliases.name"], name="fk_alias_pins_alias_name_aliases"),
        sa.ForeignKeyConstraint(["version_id"], ["predictor_versions.id"],
                                name="fk_alias_pins_version_id_predictor_versions"),
        sa.PrimaryKeyConstraint("alias_name", name="pk_alias_pins"),
    )
    op.create_table(
        "alias_pin_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("alias_name", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=8), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["version_id"], ["predictor_versions.id"],
                                name="fk_alias_pin_events_version_id_predictor_versions"),
        sa.PrimaryKeyConstraint("id", name="pk_alias_pin_events"),
    )
    op.create_index("ix_alias_pin_events_alias_name", "alias_pin_events", ["alias_name"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_alias_pin_events_alias_name", table_name="alias_pin_events")
    op.drop_table("alias_pin_events")
    op.drop_table("alias_pins")
