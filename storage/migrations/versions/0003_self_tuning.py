"""overrides, tau history, statistics buckets, drift events, leases

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tau_overrides",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=True),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("tau", sa.Float(), nullable=True),
        sa.Column("tau_min", sa.Float(), nullable=True),
        sa.Column("tau_max", sa.Float(), nullable=True),
        sa.Column("expires_at", TZ, nullable=True),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("cleared_at", TZ, nullable=True),
        sa.Column("cleared_by", sa.String(length=128), nullable=True),
        sa.Column("clear_reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tau_overrides")),
    )
    with op.batch_alter_table("tau_overrides") as b:
        b.create_index(b.f("ix_tau_overrides_tenant"), ["tenant"], unique=False)
    op.create_table(
        "tau_history",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", TZ, nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("tau", sa.Float(), nullable=False),
        sa.Column("rule_tau", sa.Float(), nullable=False),
        sa.Column("correction", sa.Float(), nullable=False),
        sa.Column("model_mean_accepted", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("replica", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tau_history")),
    )
    with op.batch_alter_table("tau_history") as b:
        b.create_index(b.f("ix_tau_history_at"), ["at"], unique=False)
    op.create_table(
        "stat_buckets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("bucket_start", TZ, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("predictor_version_id", sa.Integer(), nullable=False),
        *[sa.Column(name, sa.Integer(), nullable=False) for name in
          ("cache_drafts", "cache_verified", "model_drafts", "draft_tokens", "accepted_tokens")],
        sa.Column("accepted_hist", sa.JSON(), nullable=False),
        *[sa.Column(name, sa.Integer(), nullable=False) for name in
          ("tp", "fp", "fn", "tn", "tokens", "cycles", "dropped_events")],
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stat_buckets")),
        sa.UniqueConstraint("bucket_start", "tenant", "workload", "predictor_version_id",
                            name=op.f("uq_stat_buckets_bucket_start")),
    )
    with op.batch_alter_table("stat_buckets") as b:
        b.create_index(b.f("ix_stat_buckets_bucket_start"), ["bucket_start"], unique=False)
    op.create_table(
        "drift_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", TZ, nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("detector", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("predictor_version_id", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_drift_events")),
    )
    with op.batch_alter_table("drift_events") as b:
        b.create_index(b.f("ix_drift_events_at"), ["at"], unique=False)
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("expires_at", TZ, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leases")),
    )


def downgrade() -> None:
    op.drop_table("leases")
    with op.batch_alter_table("drift_events") as b:
        b.drop_index(b.f("ix_drift_events_at"))
    op.drop_table("drift_events")
    with op.batch_alter_table("stat_buckets") as b:
        b.drop_index(b.f("ix_stat_buckets_bucket_start"))
    op.drop_table("stat_buckets")
    with op.batch_alter_table("tau_history") as b:
        b.drop_index(b.f("ix_tau_history_at"))
    op.drop_table("tau_history")
    with op.batch_alter_table("tau_overrides") as b:
        b.drop_index(b.f("ix_tau_overrides_tenant"))
    op.drop_table("tau_overrides")
