"""indexes for the dashboard's queries at many tenants and days: stat_buckets (tenant, bucket_start)
and (workload, bucket_start), tau_history (workload, id)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04

Hand-written and frozen, like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# stat_buckets by tenant then time: a tenant's buckets (the selection), the dropped-events rows
# (tenant "*") and the tenant search read a range of this index instead of every bucket; by workload
# then time likewise for a workload's buckets and the list of workloads (one probe per workload).
# tau_history by workload then id: each workload's newest row (live tau, learned correction) is one
# index probe, not a scan of the history.
INDEXES = (
    ("ix_stat_buckets_tenant_start", "stat_buckets", ["tenant", "bucket_start"]),
    ("ix_stat_buckets_workload_start", "stat_buckets", ["workload", "bucket_start"]),
    ("ix_tau_history_workload_id", "tau_history", ["workload", "id"]),
)


def upgrade() -> None:
    for name, table, columns in INDEXES:
        op.create_index(name, table, columns, unique=False)


def downgrade() -> None:
    for name, table, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
