"""stat_hours: the minutes summed over tenants into hours, written with them, filled by migration
0017 from what was stored, pruned with them, and read by the dashboard for all tenants over days."""
from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

from sqlalchemy import Engine, select

from storage.dashboard_queries import (Scope, _counts, accepted_histograms, bucket_resolution, overview_by_bucket,
                                       overview_totals, quality_by_workload, quality_totals)
from storage.engine import make_engine, session_scope
from storage.migrate import downgrade, upgrade
from storage.models import StatBucket, StatHour
from storage.stats import ALL, COUNTERS, HIST_BINS, BucketDelta, prune_buckets, upsert_buckets

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


def deltas(seed: int, days: float = 3.0, n: int = 400) -> dict:
    """Random minute deltas over `days`, 40 tenants, two workloads, two versions, some dropped rows."""
    rng = random.Random(seed)
    out: dict = {}
    for _ in range(n):
        start = T0 + timedelta(minutes=rng.randrange(int(days * 1440)))
        tenant, workload = (ALL, ALL) if rng.random() < 0.05 else (f"t{rng.randrange(40)}", rng.choice(["sql", "chat"]))
        d = BucketDelta(**{c: rng.randrange(50) for c in COUNTERS})
        d.accepted_hist = [rng.randrange(5) for _ in range(HIST_BINS)]
        out.setdefault((start, tenant, workload, rng.choice([0, 1, 2])), BucketDelta()).merge(d)
    return out


def hourly(minutes: list[StatBucket]) -> dict:
    sums: dict = {}
    for b in minutes:
        key = (b.bucket_start.replace(minute=0), b.workload, b.predictor_version_id)
        acc = sums.setdefault(key, ([0] * len(COUNTERS), [0] * HIST_BINS))
        for i, c in enumerate(COUNTERS):
            acc[0][i] += getattr(b, c)
        for i, v in enumerate(b.accepted_hist):
            acc[1][i] += v
    return sums


def stored_hours(session) -> dict:
    return {(h.bucket_start, h.workload, h.predictor_version_id): ([getattr(h, c) for c in COUNTERS],
                                                                    list(h.accepted_hist))
            for h in session.scalars(select(StatHour))}


def test_the_hours_are_the_minutes_summed_over_tenants(db: Engine) -> None:
    with session_scope(db) as s:  # two writers' flushes, overlapping keys: both add up
        upsert_buckets(s, deltas(1))
    with session_scope(db) as s:
        upsert_buckets(s, deltas(2))
    with session_scope(db) as s:
        minutes = list(s.scalars(select(StatBucket)))
        assert len(minutes) > 700
        assert stored_hours(s) == hourly(minutes)
        prune_buckets(s, T0 + timedelta(days=1, minutes=30))  # an hour goes once all its minutes went
    with session_scope(db) as s:
        assert stored_hours(s) == hourly(list(s.scalars(select(StatBucket)))) | {
            k: v for k, v in stored_hours(s).items() if k[0] == T0 + timedelta(days=1)}
        assert min(h.bucket_start for h in s.scalars(select(StatHour))) == T0 + timedelta(days=1)


def test_the_dashboard_reads_hours_for_all_tenants_over_days_with_the_same_totals(db: Engine) -> None:
    with session_scope(db) as s:
        upsert_buckets(s, deltas(3, days=3.0, n=600))
    days, one_tenant, short = Scope(), Scope(tenant="t1"), Scope(since=T0 + timedelta(days=2, hours=12))
    with session_scope(db) as s:
        assert _counts(s, days) is StatHour and _counts(s, one_tenant) is StatBucket and _counts(s, short) is StatBucket
        assert bucket_resolution(s, days) >= timedelta(hours=1)
        totals = overview_totals(s, days)
        minutes = list(s.scalars(select(StatBucket)))
        assert totals["tokens"] == sum(b.tokens for b in minutes) and totals["cycles"] == sum(b.cycles for b in minutes)
        assert quality_totals(s, days)["tp"] == sum(b.tp for b in minutes)
        assert {r["workload"]: r["labelled"] for r in quality_by_workload(s, days)} == {
            w: sum(b.tp + b.fp + b.fn + b.tn for b in minutes if b.workload == w) for w in ("chat", "sql")}
        hist = {(r["workload"], r["accepted"]): r["drafts"] for r in accepted_histograms(s, days)}
        assert hist[("sql", 3)] == sum(b.accepted_hist[3] for b in minutes if b.workload == "sql")
        series = overview_by_bucket(s, days)
        assert sum(r["tokens"] for r in series) == totals["tokens"] and len(series) <= 3 * 24 + 1


def test_migration_0017_fills_the_hours_from_the_stored_minutes(tmp_path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/m.db")
    upgrade(engine)
    with session_scope(engine) as s:
        upsert_buckets(s, deltas(4))
    downgrade(engine, "0016")
    upgrade(engine)
    with session_scope(engine) as s:
        assert stored_hours(s) == hourly(list(s.scalars(select(StatBucket)))) != {}
