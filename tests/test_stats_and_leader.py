"""Statistics buckets (aggregation, additive upsert, writer), raw-sample retention, leader election,
and crash safety (kill -9) — on SQLite and a real PostgreSQL.

PostgreSQL is skipped only when HVD_SKIP_POSTGRES=1 (same policy as tests/test_storage.py).
Child processes use the 'spawn' start method and their own engines.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import PG_URL
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

import controller.services.stats_writer as stats_writer_mod
import storage.leader as leader_mod
from controller.services.event_writer import EventWriter
from controller.core.events import EventQueue, LabelledEvent
from controller.services.stats_writer import StatsWriter
from storage.engine import make_engine, session_scope
from storage.events import insert_events, list_events
from support import rows as readback
from storage.leader import LeadershipLost, LeaseLeaderLock, make_leader_lock
from storage.models import DecisionEvent, StatBucket
from storage.stats import (ALL, HIST_BINS, BucketDelta, add_dropped, add_steps, aggregate, bucket_start,
                           merge_deltas, prune_events, upsert_buckets)
from storage.versions import create_version, get_alias_version, set_alias, verify_blob

T0 = 1_700_000_040.0  # a bucket boundary (multiple of 60)
SPAWN = mp.get_context("spawn")


# --- fixtures -------------------------------------------------------------------------------------


def ev(at: float = T0, tenant: str = "t", workload: str = "code", drafter: str = "cache", decision: str = "cache",
       draft_len: int = 8, accepted: int = 0, predicted: float | None = None, version: int | None = None,
       request_id: str = "r", position: int = 0, verified_len: int | None = None,
       promised: float | None = None) -> LabelledEvent:
    return LabelledEvent(at, tenant, workload, request_id, position, drafter, decision, draft_len, accepted,
                         predicted, 1.0, version, None, verified_len, promised)


BUCKET_FIELDS = ("cache_drafts", "cache_verified", "model_drafts", "draft_tokens", "accepted_tokens", "tp", "fp", "fn",
                 "tn", "tokens", "cycles", "dropped_events", "cache_promised_milli", "cache_promise_kept",
                 "model_promised_milli", "model_promise_kept", "accepted_hist")
NO_PROMISES = dict(cache_promised_milli=0, cache_promise_kept=0, model_promised_milli=0, model_promise_kept=0)


def _bucket_dict(b: StatBucket) -> dict:
    return {name: getattr(b, name) for name in BUCKET_FIELDS}


def _delta_dict(d: BucketDelta) -> dict:
    return {name: getattr(d, name) for name in BUCKET_FIELDS}


def _db_as_deltas(engine: Engine) -> dict:
    with session_scope(engine) as s:
        return {(b.bucket_start, b.tenant, b.workload, b.predictor_version_id): _bucket_dict(b)
                for b in readback.buckets(s)}


# --- aggregation (pure) ---------------------------------------------------------------------------


def test_aggregate_exact_counters_histogram_and_confusion() -> None:
    events = [
        ev(accepted=7, predicted=9.0, draft_len=10),                      # tp, verified
        ev(accepted=2, predicted=6.0, decision="none", draft_len=10),     # fp, not verified
        ev(accepted=6, predicted=5.9, decision="model", draft_len=12),    # fn (6 counts as long), not verified
        ev(accepted=0, predicted=1.0, draft_len=4),                       # tn, verified
        ev(accepted=40, predicted=None, draft_len=24),                    # no prediction: hist bin 24, no matrix
        ev(drafter="model", decision="model", draft_len=5, accepted=3),   # model draft
        ev(drafter="model", decision="model", draft_len=5, accepted=5, at=T0 + 59.9),
        ev(at=T0 + 60.0, accepted=1, predicted=0.0),                      # next bucket
        ev(tenant="u", accepted=3, predicted=7.0, version=4),             # other tenant + version
    ]
    got = aggregate(events)
    k0 = (bucket_start(T0), "t", "code", 0)
    assert k0[0].timestamp() == T0 and k0[0].tzinfo is not None
    assert set(got) == {k0, (bucket_start(T0 + 60), "t", "code", 0), (bucket_start(T0), "u", "code", 4)}
    d = got[k0]
    hist = [0] * HIST_BINS
    hist[7] = hist[2] = hist[6] = hist[0] = hist[24] = 1
    assert _delta_dict(d) == dict(cache_drafts=5, cache_verified=3, model_drafts=2,
                                  draft_tokens=10 + 4 + 24 + 5 + 5, accepted_tokens=7 + 0 + 40 + 3 + 5,
                                  tp=1, fp=1, fn=1, tn=1, tokens=0, cycles=0, dropped_events=0, **NO_PROMISES,
                                  accepted_hist=hist)
    d1 = got[(bucket_start(T0 + 60), "t", "code", 0)]
    assert (d1.cache_drafts, d1.cache_verified, d1.tn, d1.accepted_hist[1]) == (1, 1, 1, 1)
    d2 = got[(bucket_start(T0), "u", "code", 4)]
    assert (d2.cache_drafts, d2.fp, d2.accepted_tokens) == (1, 1, 3)
    # bucket size is a parameter
    assert len(aggregate(events, bucket_seconds=3600)) == 2


def test_a_cut_cache_draft_counts_only_its_verified_prefix() -> None:
    # The allocator verified 3 of 10 tokens; the label (7, the whole draft's) stays for learning.
    d = aggregate([ev(accepted=7, draft_len=10, verified_len=3), ev(accepted=1, draft_len=10, verified_len=3),
                   ev(accepted=5, draft_len=6, verified_len=None)])[(bucket_start(T0), "t", "code", 0)]
    assert (d.cache_verified, d.draft_tokens, d.accepted_tokens) == (3, 3 + 3 + 6, 3 + 1 + 5)
    assert d.accepted_hist[7] == d.accepted_hist[1] == d.accepted_hist[5] == 1


def test_promises_count_per_drafter_against_what_was_accepted_of_what_was_verified() -> None:
    # A cut cache draft promised 2.5 of its 3 verified tokens and its label is 7 (3 kept); a whole one
    # 1.25 of 4 (1 kept); a model draft 1.9 of 3 (2 kept). A shadow draft and a cache draft without a
    # promise (no allocator planned its step) count nothing here, though their tokens count as before.
    d = aggregate([ev(accepted=7, draft_len=10, verified_len=3, promised=2.5),
                   ev(accepted=1, draft_len=4, promised=1.25),
                   ev(drafter="model", decision="model", draft_len=3, accepted=2, promised=1.9),
                   ev(accepted=5, decision="shadow", draft_len=8),
                   ev(accepted=2, draft_len=4)])[(bucket_start(T0), "t", "code", 0)]
    assert (d.cache_promised_milli, d.cache_promise_kept) == (3750, 4)
    assert (d.model_promised_milli, d.model_promise_kept) == (1900, 2)
    assert (d.draft_tokens, d.accepted_tokens) == (3 + 4 + 3 + 4, 3 + 1 + 2 + 2)


def test_add_steps_and_dropped() -> None:
    deltas = aggregate([ev(accepted=1)])
    add_steps(deltas, T0 + 1, "t", "code", None, tokens=17, cycles=5)
    add_steps(deltas, T0 + 2, "t", "code", 0, tokens=3, cycles=1)
    add_steps(deltas, T0 + 2, "t", "chat", 2, tokens=1, cycles=1)
    add_dropped(deltas, T0 + 3, 7)
    add_dropped(deltas, T0 + 4, 2)
    add_dropped(deltas, T0 + 4, 0)
    k = (bucket_start(T0), "t", "code", 0)
    assert (deltas[k].tokens, deltas[k].cycles, deltas[k].cache_drafts) == (20, 6, 1)
    assert deltas[(bucket_start(T0), "t", "chat", 2)].tokens == 1
    assert deltas[(bucket_start(T0), ALL, ALL, 0)].dropped_events == 9
    assert len(deltas) == 3


EVENTS = st.lists(st.builds(
    ev,
    at=st.floats(min_value=T0 - 200, max_value=T0 + 200, allow_nan=False),
    tenant=st.sampled_from(["a", "b"]),
    workload=st.sampled_from(["code", "chat"]),
    drafter=st.sampled_from(["cache", "model"]),
    decision=st.sampled_from(["cache", "model", "none"]),
    draft_len=st.integers(0, 32),
    accepted=st.integers(0, 40),
    predicted=st.none() | st.floats(min_value=0, max_value=30, allow_nan=False),
    version=st.sampled_from([None, 0, 1, 2]),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(events=EVENTS, data=st.data())
def test_aggregate_is_additive_over_any_split(events: list[LabelledEvent], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(events)))
    whole = aggregate(events)
    parts = merge_deltas(aggregate(events[:cut]), aggregate(events[cut:]))
    assert parts == whole
    assert sum(d.cache_drafts + d.model_drafts for d in whole.values()) == len(events)
    for d in whole.values():
        assert sum(d.accepted_hist) == d.cache_drafts
        assert d.tp + d.fp + d.fn + d.tn <= d.cache_drafts


# --- upsert -------------------------------------------------------------------------------------


def test_upsert_adds_to_existing_rows_and_reads_filter(db: Engine) -> None:
    events = [ev(accepted=a, predicted=float(a), draft_len=10) for a in range(12)] + [
        ev(tenant="u", workload="chat", drafter="model", decision="model", draft_len=4, accepted=2, version=3)]
    first = aggregate(events)
    add_dropped(first, T0, 5)
    with session_scope(db) as s:
        assert upsert_buckets(s, first) == 3
    second = aggregate(events[:4])
    add_steps(second, T0, "t", "code", None, tokens=9, cycles=2)
    with session_scope(db) as s:
        upsert_buckets(s, second)
        upsert_buckets(s, {})  # nothing to do
    expected = merge_deltas(merge_deltas({}, first), second)
    assert _db_as_deltas(db) == {k: _delta_dict(d) for k, d in expected.items()}
    with session_scope(db) as s:
        assert [b.tenant for b in readback.buckets(s, tenant="u")] == ["u"]
        assert [b.workload for b in readback.buckets(s, workload="chat")] == ["chat"]
        assert readback.buckets(s, since=bucket_start(T0 + 60)) == []
        assert len(readback.buckets(s, since=bucket_start(T0))) == 3
        row = readback.buckets(s, tenant="t")[0]
        assert row.bucket_start == bucket_start(T0)
        assert row.accepted_hist[:12] == [2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]


def _upsert_worker(url: str, rounds: int, seed: int) -> None:
    engine = make_engine(url)
    rng = random.Random(seed)
    keys = [("a", "code"), ("b", "code"), ("a", "chat")]
    for _ in range(rounds):
        # the same keys in a random order each time: upsert_buckets must still be race- and deadlock-free
        rng.shuffle(keys)
        events = [ev(tenant=t, workload=w, accepted=3, predicted=7.0, draft_len=5) for t, w in keys]
        deltas = aggregate(events)
        add_steps(deltas, T0, "a", "code", None, tokens=2, cycles=1)
        with session_scope(engine) as s:
            upsert_buckets(s, deltas)
    engine.dispose()


def test_upsert_from_two_processes_sums_exactly(db: Engine, db_url: str) -> None:
    rounds = 200
    procs = [SPAWN.Process(target=_upsert_worker, args=(db_url, rounds, seed)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = _db_as_deltas(db)
    assert len(got) == 3
    n = 2 * rounds
    for (_, tenant, workload, version), row in got.items():
        assert version == 0
        assert (row["cache_drafts"], row["cache_verified"], row["draft_tokens"], row["accepted_tokens"]) == (n, n, 5 * n, 3 * n)
        assert (row["tp"], row["fp"], row["fn"], row["tn"]) == (0, n, 0, 0)
        assert row["accepted_hist"][3] == n and sum(row["accepted_hist"]) == n
        assert row["tokens"] == (2 * n if (tenant, workload) == ("a", "code") else 0)


def test_prune_events_keeps_newest(db: Engine) -> None:
    with session_scope(db) as s:
        insert_events(s, [ev(request_id=f"r{i}", position=i).to_row() for i in range(10)])
    with session_scope(db) as s:
        assert prune_events(s, 4) == 6
    with session_scope(db) as s:
        assert [e.position for e in list_events(s)] == [6, 7, 8, 9]
        assert prune_events(s, 4) == 0 and prune_events(s, 100) == 0
    with session_scope(db) as s:
        assert prune_events(s, 0) == 4
        assert readback.count(s) == 0 and prune_events(s, 0) == 0
    with pytest.raises(ValueError):
        with session_scope(db) as s:
            prune_events(s, -1)


# --- StatsWriter ----------------------------------------------------------------------------------


def _unreachable(db_url: str, tmp_path: Path) -> Engine:
    if db_url.startswith("sqlite"):
        return create_engine(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}")
    return create_engine(make_url(PG_URL).set(port=1), connect_args={"connect_timeout": 2})


def test_stats_writer_keeps_bounded_pending_while_down_then_flushes(db: Engine, db_url: str, tmp_path: Path) -> None:
    bad = _unreachable(db_url, tmp_path)
    writer = StatsWriter(bad, flush_interval=0.01, max_pending_keys=5)
    first = [ev(tenant=f"t{i}", accepted=i, predicted=8.0) for i in range(5)]
    writer.add(first)
    assert writer.flush() is False and writer.failures == 1 and writer.last_error
    assert writer.pending_keys() == 5 and writer.dropped_keys == 0
    later = [ev(tenant=f"t{i}", accepted=1, drafter="model", decision="model", draft_len=3) for i in range(5, 8)]
    writer.add(later)  # 8 keys > 5: the 3 oldest (t0, t1, t2) go
    assert writer.dropped_keys == 3 and writer.pending_keys() == 5
    more = [ev(tenant="t7", accepted=9, predicted=1.0), ev(tenant="t3", accepted=2, predicted=None)]
    writer.add(more)  # existing keys: nothing more dropped
    writer.add_steps(T0, "t4", "code", None, tokens=11, cycles=3)
    assert writer.flush() is False and writer.failures == 2
    assert writer.dropped_keys == 3 and writer.pending_keys() == 5
    assert _db_as_deltas(db) == {}

    writer.engine = db  # the database is back
    assert writer.flush() is True
    assert writer.pending_keys() == 0 and writer.dropped_keys == 3
    expected = aggregate(first[3:] + later + more)
    add_steps(expected, T0, "t4", "code", None, tokens=11, cycles=3)
    assert _db_as_deltas(db) == {k: _delta_dict(d) for k, d in expected.items()}
    assert writer.stop() is True
    bad.dispose()


def test_stats_writer_thread_retries_with_backoff_and_loses_nothing(db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = stats_writer_mod.upsert_buckets
    calls = {"n": 0}

    def flaky(session, deltas):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OperationalError("INSERT ...", {}, Exception("server closed the connection"))
        return real(session, deltas)

    monkeypatch.setattr(stats_writer_mod, "upsert_buckets", flaky)
    writer = StatsWriter(db, flush_interval=0.02, max_backoff=0.1).start()
    rng = random.Random(7)
    all_events: list[LabelledEvent] = []
    lock = threading.Lock()

    def produce(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(30):
            batch = [ev(at=T0 + r.uniform(0, 150), tenant=r.choice("ab"), accepted=r.randint(0, 30),
                        predicted=r.choice([None, 3.0, 8.0]), drafter=r.choice(["cache", "model"]))
                     for _ in range(r.randint(1, 20))]
            writer.add(batch)
            with lock:
                all_events.extend(batch)
            time.sleep(0.003)

    threads = [threading.Thread(target=produce, args=(rng.random(),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.stop() is True
    assert writer.failures == 3 and writer.dropped_keys == 0 and writer.pending_keys() == 0
    assert _db_as_deltas(db) == {k: _delta_dict(d) for k, d in aggregate(all_events).items()}


def test_event_writer_feeds_raw_events_stats_drops_and_retention(db: Engine) -> None:
    q = EventQueue(maxsize=6)
    accepted: list[LabelledEvent] = []
    for i in range(9):  # 6 fit, 3 dropped
        e = ev(accepted=i, predicted=float(i), request_id=f"r{i}", position=i,
               drafter="model" if i % 4 == 3 else "cache", tenant="a" if i % 2 else "b")
        if q.put(e):
            accepted.append(e)
    assert q.dropped == 3
    # The writer takes from the queue only through get_batch: holding `gate` pauses it (after any
    # get_batch under way has returned), so what fits in the queue below does not race with it.
    gate = threading.Lock()
    get_batch = q.get_batch

    def gated_get_batch(max_items: int) -> list[LabelledEvent]:
        with gate:
            return get_batch(max_items)

    q.get_batch = gated_get_batch  # type: ignore[method-assign]
    stats = StatsWriter(db, flush_interval=0.05)
    writer = EventWriter(db, q, batch_size=4, flush_interval=0.05, stats=stats, keep_events=4, prune_every=1).start()
    deadline = time.monotonic() + 30
    while writer.written < 6:  # the first six written: waited for, not slept past
        assert time.monotonic() < deadline, f"the writer wrote {writer.written} of 6"
        time.sleep(0.01)
    with gate:  # the writer paused: the queue (empty, room for 6) fills exactly
        assert q.depth() == 0
        for i in range(9, 12):
            e = ev(at=T0 + 61, accepted=i, predicted=2.0, request_id=f"r{i}", position=i, tenant="a")
            assert q.put(e)
            accepted.append(e)
        burst = [ev(at=T0 + 61, accepted=1, request_id="burst", position=100 + j, tenant="c") for j in range(8)]
        assert [q.put(e) for e in burst] == [True] * 3 + [False] * 5  # 3 fit, 5 dropped
        accepted += burst[:3]
    assert writer.stop() and stats.stop()  # the writer stops only itself; the stats writer writes what it got
    assert len(accepted) == 12 and q.dropped == 8
    assert writer.written == 12 and writer.dropped == 0 and writer.failures == 0
    assert writer.pruned == 12 - 4
    with session_scope(db) as s:
        assert [e.position for e in list_events(s)] == [a.position for a in accepted[-4:]]
    expected = aggregate(accepted)
    drops = {k: d for k, d in _db_as_deltas(db).items() if k[1] == ALL}
    assert sum(d["dropped_events"] for d in drops.values()) == 8
    got = {k: d for k, d in _db_as_deltas(db).items() if k[1] != ALL}
    assert got == {k: _delta_dict(d) for k, d in expected.items()}
    assert stats.pending_keys() == 0


# --- leader election ---------------------------------------------------------------------------


class FakeClock:
    """Time that moves only when told: the lease lock's monotonic clock (passed in) and the wall
    clock its rows expire by (storage.leader.utcnow, patched), advanced together."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.t = 1000.0
        self._wall0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
        monkeypatch.setattr(leader_mod, "utcnow", self.utcnow)

    def monotonic(self) -> float:
        return self.t

    def utcnow(self) -> datetime:
        return self._wall0 + timedelta(seconds=self.t - 1000.0)

    def advance(self, seconds: float) -> None:
        self.t += seconds


TTL = 10.0  # seconds of the fake clock: nothing here waits for it


def test_leader_lock_in_process(db: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One holder per name; a lapsed lease passes to a follower with a new term. PostgreSQL times
    the lease by its own clock, so the lapse there is waited for (1 s); SQLite's by a fake clock."""
    pg = db_url.startswith("postgresql")
    assert isinstance(make_leader_lock(db, "learner", ttl=TTL), LeaseLeaderLock)
    clock = FakeClock(monkeypatch)
    ttl = 1.0 if pg else TTL
    local = time.monotonic if pg else clock.monotonic

    def lock(name: str, holder: str) -> LeaseLeaderLock:
        # renewals driven by hand below (the renewing thread is test_lease_renews_itself_until_released's)
        return LeaseLeaderLock(db, name, holder=holder, ttl=ttl, auto_renew=False, clock=local)

    a, b, other = lock("learner", "A"), lock("learner", "B"), lock("other-role", "B")
    assert a.try_acquire() and a.is_leader and a.epoch == 1
    assert a.try_acquire() and a.renew() and a.epoch == 1  # re-entrant for the holder, same term
    assert not b.try_acquire() and not b.is_leader and not b.renew() and b.epoch == 0
    assert other.try_acquire() and other.epoch == 1  # a different name is a different lock
    a.release()
    assert not a.is_leader
    assert b.try_acquire() and b.is_leader and b.epoch == 2  # a new term
    assert not a.try_acquire()
    if pg:  # the database's clock: b stops renewing, and after ttl a takes over
        time.sleep(ttl + 0.2)
        assert not b.is_leader
        assert a.try_acquire() and a.epoch == 3
        assert not b.renew() and not b.is_leader
    else:
        # a leader keeps the lease while it renews; once it stops, it keeps it until ttl after the
        # last renewal (not a moment less), then loses it to a follower, and finds out
        clock.advance(0.9 * TTL)
        assert b.is_leader and not a.try_acquire()
        assert b.renew() and b.epoch == 2  # ours for another ttl from now
        clock.advance(0.9 * TTL)  # 1.8 ttl since it was taken: alive only thanks to the renewal
        assert b.is_leader and not a.try_acquire()
        clock.advance(0.1 * TTL - 0.001)  # just short of ttl since the renewal
        assert b.is_leader and not a.try_acquire()
        clock.advance(0.002)  # just past it
        assert not b.is_leader
        assert a.try_acquire() and a.is_leader and a.epoch == 3
        assert not b.renew() and not b.is_leader
    for held in (a, b, other):
        held.release()


def test_fenced_writes_commit_only_inside_the_term(db: Engine, db_url: str) -> None:
    """A leader's fenced transaction commits while its term lasts; once the lease changed hands (a
    partitioned leader that comes back), the same transaction fails and writes nothing."""
    a = LeaseLeaderLock(db, "learner", holder="A", ttl=1.0, auto_renew=False)
    b = LeaseLeaderLock(db, "learner", holder="B", ttl=30.0, auto_renew=False)

    def write(lock: LeaseLeaderLock, name: str) -> None:
        with lock.transaction() as s:
            create_version(s, blob=b"x" * 8, kind="point", feature_schema_hash="h", metrics={}, training_summary={},
                           reason=name, created_by=lock.holder)

    assert a.try_acquire()
    write(a, "in term 1")
    time.sleep(1.2)  # a's lease lapses (by the database's clock on PostgreSQL)
    assert b.try_acquire() and b.epoch == 2
    a._valid_until = float("inf")  # a does not know yet: its clock or its network misled it
    with pytest.raises(LeadershipLost, match="term 1 is over"):
        write(a, "late, from term 1")
    assert not a.is_leader  # and now it knows
    write(b, "in term 2")
    with session_scope(db) as s:
        from storage.versions import list_versions

        assert [v.reason for v in list_versions(s)] == ["in term 1", "in term 2"]
    b.release()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_lease_renews_itself_until_released(db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewing thread (every ttl / 3 of real time) extends the lease from the clock's now."""
    clock = FakeClock(monkeypatch)
    lock = LeaseLeaderLock(db, "learner", holder="A", ttl=0.3, clock=clock.monotonic)
    assert lock.try_acquire() and lock._valid_until == pytest.approx(1000.3)
    clock.advance(100.0)  # long expired, unless the thread renews it
    deadline = time.monotonic() + 10
    while lock._valid_until != pytest.approx(1100.3):  # a renewal waited for, not slept past
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.01)
    assert lock.is_leader
    lock.release()
    assert lock._thread is None and not lock.is_leader
    assert LeaseLeaderLock(db, "learner", holder="B", auto_renew=False, clock=clock.monotonic).try_acquire()


def _leader_worker(url: str, name: str, ttl: float, poll: float, out) -> None:
    engine = make_engine(url)
    lock = make_leader_lock(engine, name, holder=f"pid-{os.getpid()}", ttl=ttl)
    was = None
    while True:
        leader = lock.renew() if lock.is_leader else lock.try_acquire()
        if leader != was:
            out.put((os.getpid(), leader, time.time()))
            was = leader
        time.sleep(poll)


def test_leader_failover_after_kill_9(db: Engine, db_url: str) -> None:
    pg = db_url.startswith("postgresql")
    ttl, poll = 1.5, 0.05
    out = SPAWN.Queue()
    procs = {}
    for _ in range(2):
        p = SPAWN.Process(target=_leader_worker, args=(db_url, "learner", ttl, poll, out), daemon=True)
        p.start()
        procs[p.pid] = p
    try:
        state: dict[int, bool] = {}
        deadline = time.time() + 30
        while not (len(state) == 2 and any(state.values())):
            pid, leader, _ = out.get(timeout=max(0.1, deadline - time.time()))
            state[pid] = leader
        time.sleep(1.0)  # contention continues: still exactly one leader, nobody flips
        while not out.empty():
            pid, leader, _ = out.get()
            state[pid] = leader
        assert sorted(state.values()) == [False, True]
        leader_pid = next(pid for pid, v in state.items() if v)
        follower_pid = next(pid for pid, v in state.items() if not v)
        killed_at = time.time()
        os.kill(leader_pid, signal.SIGKILL)
        procs[leader_pid].join(10)
        while True:
            pid, leader, at = out.get(timeout=ttl + 10)
            if pid == follower_pid and leader:
                break
        took = at - killed_at
        # the lease runs out ttl after the last renewal (<= ~poll before the kill), not earlier
        assert ttl * 0.5 < took < ttl + 1.0, took
    finally:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)


# --- kill -9 during writes ------------------------------------------------------------------------

BATCH = 40


def _batch_writer(url: str, first_batch: int, progress) -> None:
    engine = make_engine(url)
    n = first_batch
    while True:
        events = [ev(at=T0 + 5, request_id=f"batch-{n}", position=i, accepted=i % 9, predicted=float(i % 11))
                  for i in range(BATCH)]
        rows = [dict(e.to_row(), features=os.urandom(512)) for e in events]
        deltas = aggregate(events)
        add_steps(deltas, T0 + 5, "t", "code", None, tokens=1, cycles=0)  # tokens == whole batches
        with session_scope(engine) as s:
            insert_events(s, rows)
            upsert_buckets(s, deltas)
        progress.value = n
        n += 1


def test_kill_9_during_writes_leaves_a_consistent_database(db: Engine, db_url: str) -> None:
    blob = os.urandom(50_000)
    with session_scope(db) as s:
        v = create_version(s, blob=blob, kind="mlp", feature_schema_hash="h" * 64, metrics={"loss": 0.1},
                           training_summary={}, reason="champion before the crash", created_by="pytest")
        set_alias(s, "champion", v.id, reason="test", actor="pytest")
        champion_id = v.id
    rng = random.Random(20261129)
    for round_ in range(3):
        first = round_ * 1_000_000
        progress = SPAWN.Value("q", -1)
        p = SPAWN.Process(target=_batch_writer, args=(db_url, first, progress), daemon=True)
        p.start()
        deadline = time.time() + 30
        while progress.value < first + 2:  # writing for real
            assert p.is_alive() and time.time() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.5))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL

    if db_url.startswith("sqlite"):
        with db.connect() as c:
            assert c.execute(text("PRAGMA integrity_check")).scalar() == "ok"
    with session_scope(db) as s:
        sizes = Counter(dict(s.execute(select(DecisionEvent.request_id, func.count())
                                       .group_by(DecisionEvent.request_id)).all()))
        buckets = readback.buckets(s)
        champion = get_alias_version(s, "champion")
        assert champion is not None and champion.id == champion_id
        assert verify_blob(champion) == blob
    assert sizes and set(sizes.values()) == {BATCH}  # every batch all-or-nothing
    for round_ in range(3):  # batches of each round are a gap-free prefix: none lost, none half-kept
        ns = sorted(int(r.split("-")[1]) - round_ * 1_000_000 for r in sizes if
                    round_ * 1_000_000 <= int(r.split("-")[1]) < (round_ + 1) * 1_000_000)
        assert ns == list(range(len(ns))) and len(ns) >= 3
    whole = len(sizes)
    assert len(buckets) == 1
    b = buckets[0]
    assert b.tokens == whole and b.cache_drafts == whole * BATCH and sum(b.accepted_hist) == whole * BATCH
    assert b.tp + b.fp + b.fn + b.tn == whole * BATCH


def test_stats_writers_prune_buckets_past_the_retention(db: Engine) -> None:
    from datetime import datetime, timedelta, timezone

    from storage.stats import prune_buckets

    now = datetime(2026, 3, 1, tzinfo=timezone.utc)
    old, recent = now - timedelta(days=31), now - timedelta(days=29)
    with session_scope(db) as s:
        s.add_all(StatBucket(bucket_start=at, tenant=t, workload="code", predictor_version_id=0,
                             accepted_hist=[0] * HIST_BINS, tokens=1, cycles=1)
                  for at, t in ((old, "old"), (recent, "recent")))
    writer = StatsWriter(db, keep_days=30, prune_every=2, clock=lambda: now)
    writer.add([ev(at=now.timestamp(), tenant="new")])
    assert writer.flush()  # the first write prunes
    with session_scope(db) as s:
        assert sorted(b.tenant for b in s.query(StatBucket)) == ["new", "recent"]
    assert writer.pruned == 1
    writer.clock = lambda: now + timedelta(days=2)  # "recent" is now 31 days old
    writer.add([ev(at=now.timestamp(), tenant="new")])
    assert writer.flush()  # one write since the last prune: not yet
    writer.add([ev(at=now.timestamp(), tenant="new")])
    assert writer.flush() and writer.pruned == 2
    with session_scope(db) as s:
        assert [b.tenant for b in s.query(StatBucket)] == ["new"]
        with pytest.raises(ValueError, match="naive"):
            prune_buckets(s, datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="keep_days must be > 0"):
        StatsWriter(db, keep_days=0)
