"""10,000 tenants: every per-tenant structure stays within its bound (issue 28). The calibration's
tenant scopes, tau_history's retention, the dashboard's queries (their row counts, not their time:
bench/tenants_at_scale.py times them) and the learner's tenant state reaching the Health page and
the Prometheus metrics."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import numpy as np
from prometheus_client import CollectorRegistry
from sqlalchemy import func, insert, select

from controller.core.metrics import HvdMetrics
from predictor.gate.mlp import SURVIVAL_K
from predictor.online.calibrator import CalibrationConfig, Calibrator
from storage import dashboard_queries as q
from storage.engine import session_scope
from storage.models import StatBucket, TauHistory, TauOverride
from storage.stats import ALL, COUNTERS, HIST_BINS, BucketDelta, add_dropped
from storage.tau_history import TauRetention, prune_tau_history
from storage.versions import add_tau_history
from storage.workloads import WORKLOADS

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
TENANTS = 10_000


def name(i: int) -> str:
    return f"tenant-{i:05d}"


def tau_row(s, at: datetime, workload: str = "chat", tau: float = 2.0) -> None:
    add_tau_history(s, at=at, workload=workload, tau=tau, rule_tau=tau, correction=0.0, model_mean_accepted=1.0,
                    reason="t", replica="r")


def test_tau_history_keeps_30_days_and_at_most_its_row_cap(db):
    with session_scope(db) as s:
        for days in (40, 31, 29, 1):
            tau_row(s, NOW - timedelta(days=days))
        for k in range(5):
            tau_row(s, NOW - timedelta(minutes=5 - k), tau=float(k))
    with session_scope(db) as s:
        assert prune_tau_history(s, NOW) == 2  # 40 and 31 days old
        assert prune_tau_history(s, NOW, keep_rows=4) == 3  # then only the newest 4 rows
    with session_scope(db) as s:
        assert [r["tau"] for r in q.tau_history(s)] == [1.0, 2.0, 3.0, 4.0]
        assert q.latest_tau(s) == {"chat": 4.0}


def test_tau_retention_prunes_at_the_first_write_and_every_n_rows_after(db):
    retention = TauRetention(every=10, keep_rows=3)
    with session_scope(db) as s:
        for k in range(6):
            tau_row(s, NOW - timedelta(minutes=10 - k), tau=float(k))
        assert retention.wrote(s, NOW, 6) == 3  # the first write prunes: the newest 3 stay
        for k in range(6, 15):
            tau_row(s, NOW, tau=float(k))
            assert retention.wrote(s, NOW, 1) == 0  # 9 rows since: not yet
        tau_row(s, NOW, tau=15.0)
        assert retention.wrote(s, NOW, 1) == 10  # the 10th: pruned to 3 again
        assert retention.pruned == 13 and retention.wrote(s, NOW, 0) == 0
        assert s.scalars(select(TauHistory.tau).order_by(TauHistory.id)).all() == [13.0, 14.0, 15.0]


def hist(i: int) -> list[int]:
    return [(i + b) % 3 for b in range(HIST_BINS)]


def fill_tenants(engine) -> dict[str, int]:
    """10,000 tenants with one bucket each 30 days ago (tokens 1), the first 150 with a bucket a
    minute over the last 2 days too (tokens 1000 + i: tenant 149 busiest), dropped events, 3 active
    overrides. Returns the tokens per workload."""
    old = NOW - timedelta(days=30)
    deltas = {}
    for i in range(TENANTS):
        deltas[(old, name(i), WORKLOADS[i % len(WORKLOADS)], 1)] = BucketDelta(tokens=1, cycles=1, cache_drafts=1,
                                                                               accepted_hist=hist(i))
    for i in range(150):
        for m in range(0, 2 * 1440, 7):
            deltas[(NOW - timedelta(minutes=m), name(i), WORKLOADS[i % len(WORKLOADS)], 2)] = BucketDelta(
                tokens=1000 + i, cycles=500, accepted_hist=hist(i))
    add_dropped(deltas, NOW.timestamp(), 7)
    rows = [{"bucket_start": k[0], "tenant": k[1], "workload": k[2], "predictor_version_id": k[3],
             **{c: getattr(d, c) for c in COUNTERS}, "accepted_hist": d.accepted_hist} for k, d in deltas.items()]
    with session_scope(engine) as s:
        s.execute(insert(StatBucket), rows)  # one executemany: the upsert's merge is not what is tested here
        s.add_all(TauOverride(tenant=t, workload=None, mode="fixed", tau=3.0, author="a", reason="r", created_at=NOW)
                  for t in ("zz-quiet", name(9999), name(3)))
        for k in range(300):
            tau_row(s, NOW - timedelta(minutes=300 - k), WORKLOADS[k % 2], float(k))
    tokens: dict[str, int] = {}
    for (_, tenant, workload, _), d in deltas.items():
        if tenant != ALL:
            tokens[workload] = tokens.get(workload, 0) + d.tokens
    return tokens


def test_dashboard_queries_return_bounded_rows_with_10000_tenants(db):
    tokens = fill_tenants(db)
    with session_scope(db) as s:
        busiest = q.tenants(s)
        assert len(busiest) == q.TENANT_LIST_LIMIT == 100
        # the busiest of the last day first, then the active overrides not among them
        assert busiest[:3] == [name(149), name(148), name(147)] and busiest[-4:] == [name(53), name(3), name(9999), "zz-quiet"]
        assert q.tenants(s, search="tenant-0999") == [name(i) for i in range(9990, 10_000)]
        assert q.tenants(s, search="zz") == ["zz-quiet"] and q.tenants(s, search="nobody") == []
        assert len(q.tenants(s, search="tenant-")) == 100
        assert q.tenant_known(s, name(5000)) and q.tenant_known(s, "zz-quiet") and not q.tenant_known(s, "nobody")
        assert q.workloads(s) == sorted(WORKLOADS)
        assert len(q.effective_taus(s, WORKLOADS)) == 100 * len(WORKLOADS)

        # 30 days of buckets are drawn in at most MAX_POINTS bins, summed exactly
        assert q.bucket_resolution(s) == timedelta(hours=1)
        assert q.bucket_resolution(s, q.Scope(since=NOW - timedelta(days=1))) == timedelta(minutes=1)
        rows = q.overview_by_bucket(s)
        assert len(rows) <= q.MAX_POINTS and rows[0]["bucket_start"] == (NOW - timedelta(days=30))
        assert sum(r["tokens"] for r in rows) == q.overview_totals(s)["tokens"] == sum(tokens.values())
        assert len(q.quality_by_bucket(s)) == len(rows)
        day = q.overview_by_bucket(s, q.Scope(since=NOW - timedelta(days=1)))
        assert day[-1]["bucket_start"] == NOW and len(day) == 1440 // 7 + 1

        expected: dict[str, list[int]] = {}
        for b in s.scalars(select(StatBucket).where(StatBucket.workload != ALL)):
            acc = expected.setdefault(b.workload, [0] * HIST_BINS)
            for k, n in enumerate(b.accepted_hist):
                acc[k] += n
        got: dict[str, list[int]] = {}
        for r in q.accepted_histograms(s):
            got.setdefault(r["workload"], []).append(r["drafts"])
        assert got == expected

        assert q.health(s)["dropped_events"] == 7
        assert len(q.tau_history(s, limit=50)) == 50 and q.tau_history(s, limit=50)[-1]["tau"] == 299.0
        recent = q.tau_history(s, since=NOW - timedelta(minutes=10), workload=WORKLOADS[1])
        assert [r["tau"] for r in recent] == [291.0, 293.0, 295.0, 297.0, 299.0]
        assert s.scalar(select(func.count()).select_from(StatBucket)) > 60_000  # what they were bounded against


def test_the_calibrator_holds_at_most_1000_tenant_scopes_after_10000_tenants():
    cal = Calibrator(CalibrationConfig(every=10**9))
    rng = np.random.default_rng(0)
    for start in range(0, TENANTS, 500):  # 500 tenants per batch, 2 drafts each
        n = 1000
        draft_len = np.full(n, 8)
        curves = np.sort(rng.uniform(0, 1, (n, SURVIVAL_K)), axis=1)[:, ::-1].astype(np.float32)
        tenants = np.array([name(start + k // 2) for k in range(n)], dtype=object)
        cal.observe(curves, draft_len, rng.integers(0, 9, n), np.full(n, WORKLOADS.index("chat")), tenants, WORKLOADS)
    assert cal.tenant_scopes() == 1000 and cal.evicted == 9000
    kept = sorted(k[1] for k in cal._scopes if k[1] is not None)
    assert kept == [name(i) for i in range(9000, 10_000)]  # the last seen stay


def test_the_learners_tenant_scopes_reach_the_health_page_and_the_metrics():
    progress = {"cursor": 5, "leading": True, "tenant_scopes": 1000, "tenant_scope_cap": 1000,
                "tenant_scopes_evicted": 9000}
    assert q.tenant_scopes(progress) == {"scopes": 1000, "scope_cap": 1000, "scopes_evicted": 9000}
    assert q.tenant_scopes({"cursor": 5}) is None  # an older replica's heartbeat
    registry = CollectorRegistry()
    metrics = HvdMetrics(registry, max_tenants=2)
    metrics.calibration_scopes(1000, 9000)
    metrics.calibration_scopes(1000, 9500)
    assert registry.get_sample_value("hvd_calibration_tenant_scopes") == 1000
    assert registry.get_sample_value("hvd_calibration_tenant_scopes_evicted_total") == 9500
    for t in ("a", "b", "c", "d"):
        metrics.tenant_label(t)
    assert metrics.tenant_labels() == 2 and registry.get_sample_value("hvd_metric_tenants") == 2


def test_the_health_page_shows_the_learners_tenant_scopes(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from storage.engine import make_engine
    from storage.migrate import upgrade
    from storage.models import ReplicaHealth, utcnow
    from storage.versions import create_version

    url = f"sqlite:///{tmp_path}/h.db"
    engine = make_engine(url)
    upgrade(engine)
    progress = {"cursor": 0, "cursor_at": None, "leading": True, "tenant_scopes": 1000, "tenant_scope_cap": 1000,
                "tenant_scopes_evicted": 9000}
    with session_scope(engine) as s:
        create_version(s, blob=b"x", kind="mlp", feature_schema_hash="h", metrics={}, training_summary={},
                       reason="r", created_by="t")
        s.add(ReplicaHealth(replica="r1", updated_at=utcnow(), queue_depth=0, events_written=0, events_dropped=0,
                            events_dead_lettered=0, flush_ms=1.0, services=json.dumps([
                                {"name": "hvd-learner", "state": "ok", "failures": 0, "failing": 0,
                                 "last_error": None, "last_success": None, "progress": progress}])))
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    at = AppTest.from_file("../dashboard/views/health.py", default_timeout=60).run()
    assert not at.exception
    table = at.dataframe[-1].value.set_index("What")
    row = table.loc["Calibration tenant scopes (leading learner)"]
    assert (row["Held"], row["Bound"], row["Forgotten"]) == ("1,000", "at most 1,000", "9,000 evicted (longest "
                                                                                       "unseen first)")
    assert table.loc["Automatic tau history", "Bound"] == "30 days, at most 200,000 rows"
