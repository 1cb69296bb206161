"""predictor versions, aliases and alias audit events

Revision ID: 0001
Revises:
Create Date: 2024-01-01

Hand-written and frozen: it must not import storage.models, because models
will keep evolving while this revision describes the schema as of 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "predictor_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("feature_schema_hash", sa.String(length=64), nullable=False),
        sa.Column("blob", sa.LargeBinary(), nullable=False),
        sa.Column("blob_sha256", sa.String(length=64), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("training_summary", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["predictor_versions.id"],
            name="fk_predictor_versions_parent_id_predictor_versions",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_predictor_versions"),
    )
    op.create_table(
        "aliases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["predictor_versions.id"],
            name="fk_aliases_version_id_predictor_versions",
        ),
        sa.PrimaryKeyConstraint("name", name="pk_aliases"),
    )
    op.create_table(
        "alias_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("alias_name", sa.String(length=64), nullable=False),
        sa.Column("from_version_id", sa.Integer(), nullable=True),
        sa.Column("to_version_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["from_version_id"],
            ["predictor_versions.id"],
            name="fk_alias_events_from_version_id_predictor_versions",
        ),
        sa.ForeignKeyConstraint(
            ["to_version_id"],
            ["predictor_versions.id"],
            name="fk_alias_events_to_version_id_predictor_versions",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_alias_events"),
    )
    op.create_index("ix_alias_events_alias_name", "alias_events", ["alias_name"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_alias_events_alias_name", table_name="alias_events")
    op.drop_table("alias_events")
    op.drop_table("aliases")
    op.drop_table("predictor_versions")
