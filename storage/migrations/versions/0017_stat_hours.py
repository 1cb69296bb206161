"""stat_hours: stat_buckets summed over tenants into hours, for the dashboard's all-tenant views over days

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04

Filled from the stored minutes (their hours, every tenant summed; the histograms summed here, in
Python, since neither database sums JSON arrays in one statement), so the views read the same
totals before and after. Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
COUNTERS = ("cache_drafts", "cache_verified", "model_drafts", "draft_tokens", "accepted_tokens", "tp", "fp", "fn",
            "tn", "tokens", "cycles", "dropped_events")
HIST_BINS = 25
BATCH = 50_000


def upgrade() -> None:
    hours = op.create_table(
        "stat_hours",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("bucket_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("workload", sa.String(length=32), nullable=False),
        sa.Column("predictor_version_id", sa.Integer(), nullable=False),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in COUNTERS[:5]),
        sa.Column("accepted_hist", sa.JSON(), nullable=False),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in COUNTERS[5:]),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stat_hours")),
        sa.UniqueConstraint("bucket_start", "workload", "predictor_version_id",
                            name=op.f("uq_stat_hours_bucket_start")),
    )
    op.create_index(op.f("ix_stat_hours_bucket_start"), "stat_hours", ["bucket_start"], unique=False)
    if op.get_context().as_sql:  # offline SQL (a fresh schema): nothing stored to sum
        return
    bind = op.get_bind()
    minutes = sa.table("stat_buckets", sa.column("id"), sa.column("bucket_start", sa.DateTime(timezone=True)),
                       sa.column("workload"), sa.column("predictor_version_id"), sa.column("accepted_hist", sa.JSON()),
                       *(sa.column(c) for c in COUNTERS))
    summed: dict[tuple, list] = {}
    last = None
    while True:  # keyset pages: a filled table is read once, in bounded memory per page
        stmt = sa.select(minutes).order_by(minutes.c.id).limit(BATCH)
        if last is not None:
            stmt = stmt.where(minutes.c.id > last)
        rows = bind.execute(stmt).mappings().all()
        if not rows:
            break
        last = rows[-1]["id"]
        for r in rows:
            start = r["bucket_start"]
            hour = start.replace(minute=0, second=0, microsecond=0) if not isinstance(start, str) else start[:13] + ":00:00"
            acc = summed.setdefault((hour, r["workload"], r["predictor_version_id"]),
                                    [[0] * len(COUNTERS), [0] * HIST_BINS])
            for i, c in enumerate(COUNTERS):
                acc[0][i] += int(r[c] or 0)
            for i, n in enumerate((r["accepted_hist"] or [])[:HIST_BINS]):
                acc[1][i] += int(n)
    out = [{"bucket_start": hour, "workload": w, "predictor_version_id": v, "accepted_hist": hist,
            **dict(zip(COUNTERS, counts))} for (hour, w, v), (counts, hist) in summed.items()]
    for i in range(0, len(out), BATCH):
        bind.execute(sa.insert(hours), out[i:i + BATCH])


def downgrade() -> None:
    op.drop_index(op.f("ix_stat_hours_bucket_start"), table_name="stat_hours")
    op.drop_table("stat_hours")
