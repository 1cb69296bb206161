"""`make bench` (part): 10,000 tenants. The dashboard on 30 days of their statistics, and one serving
replica's memory with 10,000 tenants sent through it.

1. Fills a SQLite database (and PostgreSQL when $HVD_TEST_POSTGRES_URL answers; a throwaway schema)
   with 10,000 tenants x 30 days of 1-minute stat_buckets at the density below, 30 days of tau
   history, active overrides, decision events and a champion, then times each dashboard page's
   queries (as the page runs them: the default selection, every tenant over the last day of traffic;
   then one tenant, then all 30 days) and renders each page
   in Chromium (`streamlit run dashboard/app.py`, helpers of tests/test_dashboard_browser.py),
   timed from navigation until the page's content shows and the script run has finished.
   Goal: < 5 s per page.
2. Serves the bundled traces on the replay engine (`hvd serve --engine replay`'s serve_replay,
   synchronous, learning on, a seeded random survival champion so the fast calibration keeps
   tenant scopes) in a fresh process, each request from the next of 10,000 tenant names, and again
   with 3 tenants on the same requests: RSS growth, and the size of every per-tenant structure.

Density (realistic, not every tenant every minute): tenant r = 1..10,000 sends traffic in one
minute out of k_r = max(1, round(r / c)), from a random offset, one workload per tenant, with c
chosen so that on average `--active` tenants (default 60) are active in a minute (a Zipf-like
long tail: the busiest tenants every minute, the 10,000th about once a day). One row per active
(tenant, minute); the version changes every 10 days.

Medians and min-max over `--reps` repetitions (default 3).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from storage import dashboard_queries as q  # noqa: E402
from storage.engine import make_engine, session_scope  # noqa: E402
from storage.migrate import downgrade, upgrade  # noqa: E402
from storage.stats import HIST_BINS  # noqa: E402
from storage.workloads import WORKLOADS  # noqa: E402

PG_URL = os.environ.get("HVD_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
GOAL_S = 5.0
MINUTES_PER_DAY = 1440
VERSION_DAYS = 10
NOW = datetime(2026, 12, 4, tzinfo=timezone.utc)  # the fill ends here (its newest minute starts before)


# ------------------------------------------------------------------------------------------ the fill
def periods(tenants: int, active: float) -> np.ndarray:
    """k_r, the minutes between two active minutes of tenant r (1-based rank), for `active` tenants
    active per minute on average (bisection on c)."""
    r = np.arange(1, tenants + 1, dtype=np.float64)
    lo, hi = 1e-6, float(tenants)
    for _ in range(60):
        c = (lo + hi) / 2
        k = np.maximum(1, np.round(r / c))
        lo, hi = (c, hi) if (1 / k).sum() < active else (lo, c)
    return np.maximum(1, np.round(r / c)).astype(np.int64)


def tenant_name(i: int) -> str:
    return f"tenant-{i:05d}"


def bucket_rows(tenants: int, days: int, active: float, seed: int = 0) -> Iterator[tuple]:
    """The stat_buckets rows of the fill (as SQLite stores them: naive UTC text), in time order."""
    rng = np.random.default_rng(seed)
    minutes = days * MINUTES_PER_DAY
    start = NOW - timedelta(minutes=minutes)
    hists = [json.dumps([int(x) for x in rng.multinomial(20, np.r_[[0.4, 0.15, 0.1], np.full(HIST_BINS - 3, 0.35 / (HIST_BINS - 3))])])
             for _ in range(64)]
    ks = periods(tenants, active)
    per = [np.arange(int(rng.integers(0, k)), minutes, k) for k in ks]
    ms = np.concatenate(per)
    ts = np.concatenate([np.full(len(m), i) for i, m in enumerate(per)])
    order = np.argsort(ms, kind="stable")  # minute by minute, as the statistics writers insert them
    tokens = rng.integers(50, 2000, len(ms))
    for m, i, tok in zip(ms[order].tolist(), ts[order].tolist(), tokens.tolist()):
        at = start + timedelta(minutes=m)
        cycles = tok // 2
        yield (at.strftime("%Y-%m-%d %H:%M:%S.000000"), tenant_name(i), WORKLOADS[i % len(WORKLOADS)],
               1 + m // (VERSION_DAYS * MINUTES_PER_DAY),
               20, cycles // 3, cycles // 4, tok // 3, tok // 4, hists[m % 64], 3, 2, 1, 14, tok, cycles, 0)


BUCKET_COLUMNS = ("bucket_start", "tenant", "workload", "predictor_version_id", "cache_drafts", "cache_verified",
                  "model_drafts", "draft_tokens", "accepted_tokens", "accepted_hist", "tp", "fp", "fn", "tn",
                  "tokens", "cycles", "dropped_events")


def seed_rest(engine, tenants: int, days: int, tau_rows: int = 100_000, events: int = 50_000) -> None:
    """What the pages read besides the buckets: a champion (a seeded random survival gate) and a
    second version, tau history over the days, 100 active overrides, recent decision events, dropped
    events, a replica heartbeat whose learner reports its tenant scopes."""
    from predictor.gate.registry import store_champion
    from storage.models import DecisionEvent, ReplicaHealth, TauHistory, TauOverride
    from support.gates import random_survival_gate

    rng = np.random.default_rng(1)
    with session_scope(engine) as s:
        store_champion(s, random_survival_gate(), reason="bench", actor="bench")
        start = NOW - timedelta(days=days)
        step = timedelta(days=days) / tau_rows
        s.bulk_insert_mappings(TauHistory, [
            {"at": start + i * step, "workload": WORKLOADS[i % len(WORKLOADS)], "tau": 2 + float(np.sin(i / 500)),
             "rule_tau": 2.0, "correction": 0.1, "model_mean_accepted": 1.5, "reason": "live estimates",
             "replica": "bench"} for i in range(tau_rows)])
        s.bulk_insert_mappings(TauOverride, [
            {"tenant": tenant_name(int(t)), "workload": None, "mode": "fixed", "tau": 3.0, "author": "bench",
             "reason": "bench", "created_at": NOW - timedelta(days=1)}
            for t in rng.choice(tenants, 100, replace=False)])
        s.bulk_insert_mappings(DecisionEvent, [
            {"at": NOW - timedelta(seconds=events - i), "tenant": tenant_name(int(rng.integers(tenants))),
             "workload": WORKLOADS[i % len(WORKLOADS)], "request_id": f"r{i // 50}", "position": i % 50 * 4,
             "drafter": "cache" if i % 3 else "model", "decision": "cache" if i % 2 else "model",
             "draft_len": 8, "accepted": int(rng.integers(0, 9)), "predicted": float(rng.uniform(0, 8)),
             "tau": 2.0, "predictor_version_id": 1} for i in range(events)])
        progress = {"cursor": events, "cursor_at": NOW.timestamp(), "leading": True, "tenant_scopes": 1000,
                    "tenant_scope_cap": 1000, "tenant_scopes_evicted": 9000}
        s.add(ReplicaHealth(replica="bench", updated_at=NOW, queue_depth=0, events_written=events, events_dropped=0,
                            events_dead_lettered=0, flush_ms=1.0, services=json.dumps([
                                {"name": "hvd-learner", "state": "ok", "failures": 0, "failing": 0,
                                 "last_error": None, "last_success": NOW.timestamp(), "progress": progress}])))


def hours_from_minutes(url: str) -> None:
    """stat_hours as the statistics writers would have kept it: the fill wrote the minutes straight
    into stat_buckets, so migration 0017 is run again over them (down to 0016, up to head), timed."""
    t0 = time.perf_counter()
    engine = make_engine(url)
    downgrade(engine, "0016")
    upgrade(engine)
    engine.dispose()
    print(f"  migration 0017 over the filled minutes (stat_hours filled): {time.perf_counter() - t0:.1f} s")


def fill_sqlite(path: Path, tenants: int, days: int, active: float) -> tuple[str, int, float]:
    """(URL, bucket rows, seconds to fill)."""
    t0 = time.perf_counter()
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    upgrade(engine)
    seed_rest(engine, tenants, days)
    engine.dispose()
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    marks = ",".join("?" * len(BUCKET_COLUMNS))
    rows = 0
    batch: list[tuple] = []
    for row in bucket_rows(tenants, days, active):
        batch.append(row)
        if len(batch) == 100_000:
            con.executemany(f"INSERT INTO stat_buckets ({','.join(BUCKET_COLUMNS)}) VALUES ({marks})", batch)
            rows += len(batch)
            batch = []
    con.executemany(f"INSERT INTO stat_buckets ({','.join(BUCKET_COLUMNS)}) VALUES ({marks})", batch)
    rows += len(batch)
    con.execute("INSERT INTO stat_buckets (" + ",".join(BUCKET_COLUMNS) + ") VALUES "
                f"('{(NOW - timedelta(minutes=5)):%Y-%m-%d %H:%M:%S}.000000','*','*',0,0,0,0,0,0,"
                f"'{json.dumps([0] * HIST_BINS)}',0,0,0,0,0,0,7)")
    con.commit()
    con.close()
    hours_from_minutes(url)
    con = sqlite3.connect(path)
    con.execute("ANALYZE")
    con.close()
    return url, rows, time.perf_counter() - t0


def fill_postgres(admin_url: str, tenants: int, days: int, active: float) -> tuple[str, str, int, float]:
    """(URL into a fresh schema, the schema, bucket rows, seconds): the buckets by generate_series,
    one series per tenant with its period k_r (same density as the SQLite fill)."""
    from sqlalchemy import create_engine, make_url, text

    t0 = time.perf_counter()
    schema = f"hvd_bench_{uuid.uuid4().hex[:10]}"
    with create_engine(admin_url).begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(admin_url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    seed_rest(engine, tenants, days)
    ks = periods(tenants, active)
    minutes = days * MINUTES_PER_DAY
    with engine.begin() as conn:
        conn.execute(text("CREATE TEMP TABLE bench_k (i int, k int, off int)"))
        rng = np.random.default_rng(0)
        conn.execute(text("INSERT INTO bench_k VALUES " + ",".join(
            f"({i},{int(k)},{int(rng.integers(0, k))})" for i, k in enumerate(ks))))
        hist = json.dumps([8, 3, 2] + [1] * 7 + [0] * (HIST_BINS - 10))
        conn.execute(text(f"""
            INSERT INTO stat_buckets ({','.join(BUCKET_COLUMNS)})
            SELECT :start + make_interval(mins => m), 'tenant-' || lpad(i::text, 5, '0'),
                   (ARRAY{list(WORKLOADS)!r})[i % {len(WORKLOADS)} + 1], 1 + m / {VERSION_DAYS * MINUTES_PER_DAY},
                   20, tok / 6, tok / 8, tok / 3, tok / 4, CAST(:hist AS json), 3, 2, 1, 14, tok, tok / 2, 0
            FROM bench_k, generate_series(off, {minutes - 1}, k) AS m,
                 LATERAL (SELECT 50 + ((i::bigint * 7919 + m::bigint * 104729) % 1950)::int AS tok) t
            ORDER BY m, i"""),
            {"start": NOW - timedelta(minutes=minutes), "hist": hist})
        conn.execute(text("INSERT INTO stat_buckets (" + ",".join(BUCKET_COLUMNS) + ") VALUES "
                          "(:at, '*', '*', 0, 0, 0, 0, 0, 0, CAST(:h AS json), 0, 0, 0, 0, 0, 0, 7)"),
                     {"at": NOW - timedelta(minutes=5), "h": json.dumps([0] * HIST_BINS)})
        rows = conn.execute(text("SELECT count(*) FROM stat_buckets")).scalar_one() - 1
    hours_from_minutes(url)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE"))
    engine.dispose()
    return url, schema, int(rows), time.perf_counter() - t0


# ------------------------------------------------------------------------------- the page queries
def page_queries(s, scope: q.Scope = q.ALL_TIME) -> dict[str, Callable[[], object]]:
    """Each page's reads, as the page makes them (with the sidebar's, which every page runs)."""
    from storage.workloads import WORKLOADS as W

    def sidebar() -> None:
        q.is_empty(s)
        q.tenants(s)
        q.workloads(s)

    def overview() -> None:
        sidebar()
        res = q.bucket_resolution(s, scope)
        q.overview_totals(s, scope), q.overview_by_bucket(s, scope, res), q.served_counts(s, scope)
        q.cache_drafts(s, scope)

    def quality() -> None:
        sidebar()
        res = q.bucket_resolution(s, scope)
        q.quality_totals(s, scope), q.quality_by_workload(s, scope), q.quality_by_bucket(s, scope, res)
        q.quality_by_version(s, scope), q.accepted_histograms(s, scope), q.calibration(s, scope)
        q.pr_curves(s, scope)

    def thresholds() -> None:
        sidebar()
        q.tau_history(s, since=scope.since, workload=scope.workload), q.latest_tau(s)
        q.effective_taus(s, W, names=q.tenants(s)), q.overrides_audit(s)

    def versions() -> None:
        sidebar()
        q.versions(s), q.alias_events(s), q.learner_checks(s), q.learning_room(s), q.calibrations(s)

    def health() -> None:
        sidebar()
        h = q.health(s)
        q.drift_events(s), q.step_costs(s, now=h["now"])

    return {"overview": overview, "quality": quality, "thresholds": thresholds, "versions": versions,
            "health": health}


@dataclass
class Spread:
    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.2f} s ({self.low:.2f}-{self.high:.2f})"


def spread(xs: list[float]) -> Spread:
    return Spread(statistics.median(xs), min(xs), max(xs))


def time_queries(url: str, reps: int, scope: q.Scope = q.ALL_TIME) -> dict[str, Spread]:
    engine = make_engine(url)
    out: dict[str, list[float]] = {}
    for _ in range(reps):
        with session_scope(engine) as s:
            for page, run in page_queries(s, scope).items():
                t0 = time.perf_counter()
                run()
                out.setdefault(page, []).append(time.perf_counter() - t0)
            s.rollback()
    engine.dispose()
    return {p: spread(v) for p, v in out.items()}


# ------------------------------------------------------------------------------------ the browser
@contextlib.contextmanager
def streamlit_app(url: str) -> Iterator[str]:
    """`streamlit run dashboard/app.py` on `url`, as tests/test_dashboard_browser.py starts it."""
    from test_dashboard_browser import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    env["HVD_DATABASE_URL"] = url
    env["HVD_DASHBOARD_REFRESH_S"] = "0"  # no rerun in the middle of a timing
    log = tempfile.NamedTemporaryFile(prefix="hvd-streamlit-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"), "--server.headless", "true",
         "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"streamlit did not come up: {Path(log.name).read_text()}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# url path -> the text that says the page's content is there (its last section)
PAGE_DONE = {"": "Decode cycles per 1000 tokens by decision path", "quality": "Accepted length of cache drafts",
             "thresholds": "Override audit", "versions": "Room to learn", "health": "Per-tenant state"}


def render_page(browser, base: str, path: str, timeout_ms: int = 120_000) -> float:
    """Seconds from navigation until the page's content shows and its script run has finished."""
    from test_dashboard_browser import rendered

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        t0 = time.perf_counter()
        page.goto(f"{base}/{path}", wait_until="domcontentloaded")
        page.get_by_text(PAGE_DONE[path]).first.wait_for(timeout=timeout_ms)
        rendered(page, timeout_ms)
        return time.perf_counter() - t0
    finally:
        page.close()


def time_pages(url: str, reps: int) -> dict[str, Spread]:
    from playwright.sync_api import sync_playwright
    from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

    out: dict[str, list[float]] = {}
    with streamlit_app(url) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            render_page(browser, base, "")  # the server's first run imports the pages' modules: not timed
            for _ in range(reps):
                for path in PAGE_DONE:
                    out.setdefault(path or "overview", []).append(render_page(browser, base, path))
        finally:
            browser.close()
    return {p: spread(v) for p, v in out.items()}


# ------------------------------------------------------------------------------------- the memory
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_child(tenants: int, requests: int, chars: int) -> dict:
    """One replica (this process): serve `requests` bundled requests, their outputs cut to `chars`
    characters, request i from tenant i mod `tenants`; RSS before and after, every per-tenant size."""
    import dataclasses
    import gc

    from controller.cli import serve_traces
    from controller.cli.serve_traces import ReplayServeOptions, round_robin_sources, serve_replay
    from predictor.data.traces import bundled_traces_path, load_traces
    from predictor.gate.registry import store_champion
    from support.gates import random_survival_gate

    records = round_robin_sources(load_traces([bundled_traces_path()])[0])
    records = [dataclasses.replace(r, output=r.output[:chars], tenant=tenant_name(i % tenants))
               for i, r in enumerate((records * (1 + requests // len(records)))[:requests])]
    serve_traces.tenant_of = lambda n: (lambda r: r.tenant)  # each request's own tenant, not a hash of 3
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{tmp}/mem.db")
        upgrade(engine)
        with session_scope(engine) as s:
            store_champion(s, random_survival_gate(), reason="bench", actor="bench")
        from controller.core.metrics import HvdMetrics
        from prometheus_client import CollectorRegistry

        metrics = HvdMetrics(CollectorRegistry())
        state: dict = {}
        base = {}

        def on_step(run, runtime) -> None:
            if not base:
                gc.collect()
                base["rss"] = rss_bytes()

        from controller.services import stack as stack_module

        build = stack_module.ServiceStack.build

        def keep(*a, **k):
            st = build(*a, **k)
            state["stack"] = st
            return st

        stack_module.ServiceStack.build = keep
        serve_traces.ServiceStack.build = keep
        t0 = time.perf_counter()
        serve_replay(engine, records, ReplayServeOptions(synchronous=True, batch_size=8), log=lambda _: None,
                     on_step=on_step, metrics=metrics)
        seconds = time.perf_counter() - t0
        gc.collect()
        sizes = state["stack"].tenant_state()
        with session_scope(engine) as s:
            from sqlalchemy import func, select

            from storage.models import StatBucket, SurvivalCalibration

            sizes["stat_bucket_tenants"] = s.scalar(select(func.count(func.distinct(StatBucket.tenant))))
            sizes["stored_tenant_corrections"] = s.scalar(select(func.count()).select_from(SurvivalCalibration)
                                                          .where(SurvivalCalibration.tenant != ""))
        return {"tenants": tenants, "requests": len(records), "seconds": seconds, "rss_start": base["rss"],
                "rss_end": rss_bytes(), **sizes}


def memory(tenants: int, requests: int, chars: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--memory-child", str(tenants), "--requests", str(requests),
                          "--chars", str(chars)], capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- main
def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def report_db(name: str, url: str, rows: int, fill_s: float, reps: int, browser: bool) -> None:
    print(f"  {name}: {rows:,} stat_buckets rows filled in {fill_s:.0f} s")
    day = NOW - timedelta(days=1)  # the default range: the last day of traffic (the fill ends at NOW)
    for label, scope in (("last day of traffic (the default)", q.Scope(since=day)),
                         ("one tenant, last day", q.Scope(tenant=tenant_name(42), since=day)),
                         ("all time (30 days)", q.ALL_TIME)):
        times = time_queries(url, reps, scope)
        print(f"    queries per page, {label}: " + ", ".join(f"{p} {t}" for p, t in times.items()))
    if browser and not Path("/usr/bin/chromium").exists():
        print("    rendered in Chromium: skipped, /usr/bin/chromium is absent (`make chromium` installs it)")
    elif browser:
        pages = time_pages(url, reps)
        worst = max(t.median for t in pages.values())
        print("    rendered in Chromium (navigation to content shown): "
              + ", ".join(f"{p} {t}" for p, t in pages.items())
              + f"; goal < {GOAL_S:.0f} s per page: {'met' if worst < GOAL_S else 'NOT met'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=10_000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--active", type=float, default=60.0, help="tenants active in a minute, on average (60)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10_000, help="requests served in the memory run (10,000)")
    ap.add_argument("--chars", type=int, default=40, help="characters of each request's output served (40)")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--no-postgres", action="store_true")
    ap.add_argument("--no-sqlite", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-dashboard", action="store_true", help="the memory run only")
    ap.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child is not None:
        print(json.dumps(memory_child(args.memory_child, args.requests, args.chars)))
        return 0

    print(f"{args.tenants:,} tenants x {args.days} days of 1-minute statistics, {args.active:g} tenants active per "
          f"minute on average ({args.reps} repetitions: median (min-max))")
    if not args.no_dashboard and not args.no_sqlite:
        with tempfile.TemporaryDirectory() as tmp:
            url, rows, fill_s = fill_sqlite(Path(tmp) / "tenants.db", args.tenants, args.days, args.active)
            report_db("SQLite", url, rows, fill_s, args.reps, not args.no_browser)
    if not args.no_postgres and not args.no_dashboard:
        from sqlalchemy import create_engine, text

        try:
            with create_engine(PG_URL).connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001 - any failure to connect: skip, and say so
            print(f"  PostgreSQL: not reachable at {PG_URL} ({type(exc).__name__}); skipped")
        else:
            pg_url, schema, rows, fill_s = fill_postgres(PG_URL, args.tenants, args.days, args.active)
            try:
                report_db("PostgreSQL", pg_url, rows, fill_s, args.reps, not args.no_browser)
            finally:
                with create_engine(PG_URL).begin() as conn:
                    conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    if not args.no_memory:
        print(f"One replica (replay engine, synchronous, learning on), {args.requests:,} requests of the bundle "
              f"(outputs cut to {args.chars} characters), one tenant per request in turn:")
        for tenants in (3, args.tenants):
            m = memory(tenants, args.requests, args.chars)
            print(f"  {tenants:>6,} tenants: RSS {mib(m['rss_start'])} after the first step -> {mib(m['rss_end'])} "
                  f"(+{mib(m['rss_end'] - m['rss_start'])}) in {m['seconds']:.0f} s; calibration tenant scopes "
                  f"{m['calibration_tenant_scopes']:,} (evicted {m['calibration_scopes_evicted']:,}), stats writer "
                  f"pending buckets {m['stats_pending_buckets']:,}, metric tenant labels {m['metric_tenant_labels']:,}, "
                  f"runtime step tally {m['runtime_step_tally']:,}, corrections served {m['served_corrections']:,} "
                  f"(stored per tenant {m['stored_tenant_corrections']:,}), tenants in stat_buckets "
                  f"{m['stat_bucket_tenants']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
