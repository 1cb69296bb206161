"""What each engine step costs: the timing record and its validation, the per-minute aggregator
(minute boundaries, quantiles worked out by hand, the bounded reservoir, sums kept exactly), the
additive upsert into `step_cost_minutes` (on SQLite and PostgreSQL), the writer (never waiting for
the database, keeping minutes while it refuses, backing off, draining at stop) and its place in the
ServiceStack."""
from __future__ import annotations

import math
import threading
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, create_engine, func, select

import controller.services.step_cost_writer as writer_mod
from controller.core.step_costs import (MAX_SAMPLES, PARTS, SUMMARY_PARTS, MinuteAggregator, MinuteSummary,
                                        StepTiming, StepTimingError, merge_summaries, minute_of, quantile)
from controller.services.step_cost_writer import StepCostWriter
from storage.engine import session_scope
from storage.migrate import downgrade, upgrade
from storage.models import StepCostMinute
from storage.step_costs import STEP_PARTS, prune_step_cost_minutes, recent_minutes, record_minutes

T0 = 1_700_000_040  # a minute's start (a multiple of 60)


def timing(at: float, target: float = 0.05, hvd: float = 0.0005, drafter: float = 0.0, rest: float = 0.002,
           batch: int = 4, query_tokens: int = 8, model_k: int = 0) -> StepTiming:
    return StepTiming.of(at, batch, query_tokens, model_k, target=target, hvd=hvd, drafter=drafter, rest=rest)


def ten_steps(minute: int = T0) -> list[StepTiming]:
    """Step i (1..10): target 10i ms, hvd i ms, drafter 5 ms in even steps, rest 2 ms; batch i, 2i tokens."""
    return [timing(minute + i, target=0.01 * i, hvd=0.001 * i, drafter=0.005 if i % 2 == 0 else 0.0,
                   rest=0.002, batch=i, query_tokens=2 * i, model_k=3 if i % 2 == 0 else 0) for i in range(1, 11)]


def row_of(s: MinuteSummary) -> dict:
    return {"steps": s.steps, "sum": s.sum_s, "p50": s.p50_s, "p90": s.p90_s, "batch": s.batch_mean,
            "tokens": s.query_tokens_mean, "drafter_steps": s.drafter_steps}


# --- the timing record --------------------------------------------------------------------------


def test_a_timing_keeps_its_parts_in_order_and_totals_them():
    t = StepTiming.of(T0 + 1.5, np.int64(8), 20, np.int32(3), target=0.04, hvd=np.float32(0.5), drafter=0.01, rest=0)
    assert PARTS == ("target", "hvd", "drafter", "rest") and SUMMARY_PARTS == STEP_PARTS
    assert t.parts == (0.04, 0.5, 0.01, 0.0) and t.total == pytest.approx(0.55)
    assert (type(t.batch), type(t.model_k), type(t.parts[1])) == (int, int, float)  # numpy values normalised
    wall = StepTiming.from_wall(T0, 8, 20, 3, wall=0.060, target=0.040, hvd=0.001, drafter=0.010)
    assert wall.parts[3] == pytest.approx(0.009) and wall.total == pytest.approx(0.060)
    jitter = StepTiming.from_wall(T0, 8, 20, 3, wall=0.050, target=0.040, hvd=0.001, drafter=0.010)
    assert jitter.parts[3] == 0.0  # the parts outran the wall clock by 1 ms: rest clamped, not negative
    with pytest.raises(AttributeError):
        t.batch = 3  # frozen


@pytest.mark.parametrize("kwargs, field", [
    ({"at": float("nan")}, "at"),
    ({"at": 0}, "at"),
    ({"at": "now"}, "at"),
    ({"batch": -1}, "batch"),
    ({"batch": 2.5}, "batch"),
    ({"batch": True}, "batch"),
    ({"query_tokens": None}, "query_tokens"),
    ({"model_k": -3}, "model_k"),
    ({"parts": (0.1, 0.2, 0.3)}, "parts"),
    ({"parts": "abcd"}, "parts"),
    ({"parts": (0.1, -0.001, 0.0, 0.0)}, "parts.hvd"),
    ({"parts": (0.1, 0.0, float("inf"), 0.0)}, "parts.drafter"),
    ({"parts": (0.1, 0.0, 0.0, "x")}, "parts.rest"),
])
def test_a_bad_timing_is_refused_naming_the_field(kwargs, field):
    args = {"at": T0, "batch": 4, "query_tokens": 8, "model_k": 0, "parts": (0.05, 0.0005, 0.0, 0.002)} | kwargs
    with pytest.raises(StepTimingError) as err:
        StepTiming(**args)
    assert err.value.field == field and f"step timing {field}:" in str(err.value)
    assert isinstance(err.value, ValueError)


# --- the aggregator -----------------------------------------------------------------------------


def test_a_minute_closes_when_a_step_of_the_next_arrives():
    agg = MinuteAggregator()
    assert agg.add(timing(T0)) == [] and agg.add(timing(T0 + 59.999)) == []
    assert agg.open_minute == T0
    closed = agg.add(timing(T0 + 60))  # the first step of the next minute closes this one
    assert [(s.minute, s.steps) for s in closed] == [(T0, 2)] and agg.open_minute == T0 + 60
    assert [(s.minute, s.steps) for s in agg.drain()] == [(T0 + 60, 1)]
    assert agg.open_minute is None and agg.drain() == []
    assert minute_of(T0 - 0.001) == T0 - 60 and minute_of(T0) == T0


def test_a_minutes_sums_means_and_quantiles_worked_out_by_hand():
    agg = MinuteAggregator()
    for t in ten_steps():
        assert agg.add(t) == []
    (s,) = agg.drain()
    assert (s.minute, s.steps, s.drafter_steps) == (T0, 10, 5)
    assert (s.batch_mean, s.query_tokens_mean) == (5.5, 11.0)
    # hvd: 1..10 ms: sum 55 ms; p50 between the 5th and 6th (5.5 ms); p90 at rank 8.1 of 0..9 (9 + 0.1 ms)
    assert s.part("hvd") == pytest.approx((0.055, 0.0055, 0.0091))
    assert s.part("target") == pytest.approx((0.55, 0.055, 0.091))
    # drafter: five steps at 0, five at 5 ms: p50 halfway between a 0 and a 5 ms
    assert s.part("drafter") == pytest.approx((0.025, 0.0025, 0.005))
    assert s.part("rest") == pytest.approx((0.02, 0.002, 0.002))
    # totals 11i + 2 (+ 5 in even steps) ms: 13, 29, 35, 51, 57, 73, 79, 95, 101, 117
    assert s.part("total") == pytest.approx((0.65, 0.065, 0.1026))


def test_quantile_is_linear_between_ranks():
    assert quantile([1.0], 0.9) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([0.0, 10.0], 0.9) == 9.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_the_reservoir_bounds_memory_and_keeps_the_sums_exact():
    """10,000 steps of one minute through a 256-step sample: counts and sums over every step, the
    quantiles from a uniform sample of the steps (hvd: 0.01 ms .. 100 ms, uniform)."""
    agg = MinuteAggregator(max_samples=256, seed=1)
    steps = [timing(T0 + i * 0.005, hvd=0.00001 * (i + 1)) for i in range(10_000)]
    for t in steps:
        agg.add(t)
    assert len(agg._open.samples) == 256
    (s,) = agg.drain()
    assert s.steps == 10_000 and s.part("hvd")[0] == pytest.approx(math.fsum(t.parts[1] for t in steps))
    assert s.part("hvd")[1] == pytest.approx(0.05, abs=0.008)  # the true median: 50 ms
    assert s.part("hvd")[2] == pytest.approx(0.09, abs=0.008)
    again = MinuteAggregator(max_samples=256, seed=1)
    for t in steps:
        again.add(t)
    assert again.drain() == [s]  # seeded: the same sample, the same summary
    assert MAX_SAMPLES == 4096


@given(st.lists(st.tuples(st.floats(0, 600, allow_nan=False), st.lists(st.floats(0, 2.0), min_size=4, max_size=4),
                          st.integers(0, 64)), max_size=80),
       st.booleans())
def test_every_step_lands_in_exactly_one_closed_minute(steps, in_order):
    """Whatever the order: per part, the closed minutes' sums are the timings' sums; each minute's
    steps are the timings that fall in it (in order, each minute once; out of order, a minute may
    close more than once, and its pieces add up); sums, counts and drafter steps exact."""
    timings = [StepTiming(T0 + at, batch, batch, 0, tuple(parts)) for at, parts, batch in steps]
    if in_order:
        timings.sort(key=lambda t: t.at)
    agg = MinuteAggregator(max_samples=8)
    closed = [s for t in timings for s in agg.add(t)] + agg.drain()
    assert sum(s.steps for s in closed) == len(timings)
    for i, part in enumerate(SUMMARY_PARTS):
        expected = math.fsum((t.parts + (t.total,))[i] for t in timings)
        assert math.fsum(s.sum_s[i] for s in closed) == pytest.approx(expected, rel=1e-9, abs=1e-12), part
    per_minute: dict[int, int] = {}
    for t in timings:
        per_minute[minute_of(t.at)] = per_minute.get(minute_of(t.at), 0) + 1
    got: dict[int, int] = {}
    for s in closed:
        assert s.minute % 60 == 0 and s.steps >= 1
        assert 0 <= s.p50_s[-1] <= s.p90_s[-1] <= max(t.total for t in timings if minute_of(t.at) == s.minute)
        got[s.minute] = got.get(s.minute, 0) + s.steps
    assert got == per_minute
    assert sum(s.drafter_steps for s in closed) == sum(t.parts[2] > 0 for t in timings)
    if in_order:
        assert [s.minute for s in closed] == sorted(per_minute)  # each minute closed once, in order


def test_two_pieces_of_a_minute_merge_as_storage_adds_them():
    a = MinuteAggregator()
    for t in ten_steps()[:3]:
        a.add(t)
    (small,) = a.drain()
    for t in ten_steps()[3:]:
        a.add(t)
    (big,) = a.drain()
    m = merge_summaries(small, big)
    assert (m.steps, m.drafter_steps) == (10, 5)
    assert m.sum_s == pytest.approx(tuple(x + y for x, y in zip(small.sum_s, big.sum_s)))
    assert (m.batch_mean, m.query_tokens_mean) == (pytest.approx(5.5), pytest.approx(11.0))
    assert (m.p50_s, m.p90_s) == (big.p50_s, big.p90_s)  # the larger piece's quantiles
    assert merge_summaries(big, small).p50_s == big.p50_s
    with pytest.raises(ValueError, match="cannot merge"):
        merge_summaries(small, MinuteSummary(T0 + 60, 1, small.sum_s, small.p50_s, small.p90_s, 1.0, 1.0, 0))


# --- storage ------------------------------------------------------------------------------------


def summary(minute: int, steps: int, ms: float, p50: float, p90: float, batch: float = 4.0,
            drafter_steps: int = 0) -> MinuteSummary:
    """Every part with the same sum/p50/p90 (given in ms), the tokens twice the batch."""
    n = len(SUMMARY_PARTS)
    return MinuteSummary(minute, steps, (ms / 1000,) * n, (p50 / 1000,) * n, (p90 / 1000,) * n, batch, 2 * batch,
                         drafter_steps)


def stored(engine: Engine) -> dict[tuple[str, datetime], dict]:
    with session_scope(engine) as s:
        return {(r.replica, r.minute): {"steps": r.steps, "batch": r.batch_mean, "tokens": r.query_tokens_mean,
                                        "drafter_steps": r.drafter_steps,
                                        **{f"{p}.{k}": getattr(r, f"{p}_ms_{k}") for p in STEP_PARTS
                                           for k in ("sum", "p50", "p90")}}
                for r in s.scalars(select(StepCostMinute))}


def at(minute: int) -> datetime:
    return datetime.fromtimestamp(minute, timezone.utc)


def test_recording_a_minute_again_adds_to_its_row(db: Engine):
    with session_scope(db) as s:
        assert record_minutes(s, "r1", [summary(T0, 10, ms=500.0, p50=40.0, p90=90.0, batch=2.0, drafter_steps=4),
                                        summary(T0 + 60, 1, ms=7.0, p50=7.0, p90=7.0)]) == 2
        assert record_minutes(s, "r2", [summary(T0, 5, ms=100.0, p50=20.0, p90=30.0)]) == 1
    with session_scope(db) as s:
        # r1's first minute again, in two pieces of one call (combined first: 30 steps of batch 8 mean)
        assert record_minutes(s, "r1", [summary(T0, 20, ms=1000.0, p50=45.0, p90=95.0, batch=8.0, drafter_steps=1),
                                        summary(T0, 10, ms=300.0, p50=60.0, p90=99.0, batch=8.0)]) == 1
    rows = stored(db)
    first = rows[("r1", at(T0))]
    assert (first["steps"], first["drafter_steps"]) == (40, 5)
    assert first["batch"] == pytest.approx((10 * 2.0 + 30 * 8.0) / 40) and first["tokens"] == pytest.approx(13.0)
    for p in STEP_PARTS:
        assert first[f"{p}.sum"] == pytest.approx(1800.0)
        assert (first[f"{p}.p50"], first[f"{p}.p90"]) == (45.0, 95.0)  # the 30-step piece's (its larger part's)
    assert rows[("r1", at(T0 + 60))]["steps"] == 1 and rows[("r2", at(T0))]["steps"] == 5
    with session_scope(db) as s:  # a smaller piece adds its steps and sums, and keeps the row's quantiles
        record_minutes(s, "r2", [summary(T0, 2, ms=10.0, p50=1.0, p90=2.0, batch=11.0)])
    r2 = stored(db)[("r2", at(T0))]
    assert (r2["steps"], r2["batch"], r2["total.sum"], r2["total.p50"], r2["total.p90"]) == \
        (7, pytest.approx(6.0), pytest.approx(110.0), 20.0, 30.0)
    with session_scope(db) as s:
        assert [(m.replica, m.minute) for m in recent_minutes(s, at(T0))] == \
            [("r1", at(T0)), ("r1", at(T0 + 60)), ("r2", at(T0))]
        assert [m.minute for m in recent_minutes(s, at(T0 + 1), replica="r1")] == [at(T0 + 60)]
        assert prune_step_cost_minutes(s, 1) == 2 and s.scalar(select(func.count(StepCostMinute.id))) == 1


def test_recording_refuses_what_the_table_cannot_hold(db: Engine):
    with session_scope(db) as s:
        with pytest.raises(ValueError, match="multiple of 60"):
            record_minutes(s, "r1", [summary(T0 + 1, 1, 1.0, 1.0, 1.0)])
        with pytest.raises(ValueError, match="replica contains NUL"):
            record_minutes(s, "r\x00", [summary(T0, 1, 1.0, 1.0, 1.0)])
        with pytest.raises(ValueError, match="must be finite"):
            record_minutes(s, "r1", [summary(T0, 1, float("nan"), 1.0, 1.0)])
        assert record_minutes(s, "r1", []) == 0


# --- the writer ---------------------------------------------------------------------------------


def test_the_writer_adds_its_minutes_to_stored_ones_and_drains_at_stop(db: Engine):
    with session_scope(db) as s:  # another piece of the first minute, stored earlier (a restart, a retry)
        record_minutes(s, "r1", [summary(T0, 2, ms=100.0, p50=50.0, p90=60.0, batch=1.0)])
    writer = StepCostWriter(db, "r1", flush_interval=60.0)
    for t in ten_steps():
        writer.add(t)
    writer.add(timing(T0 + 60, hvd=0.002))  # closes the first minute; the second stays open
    assert writer.pending_minutes() == 1 and writer.flush() and writer.pending_minutes() == 0
    first = stored(db)[("r1", at(T0))]
    assert (first["steps"], first["drafter_steps"]) == (12, 5)
    assert first["batch"] == pytest.approx((2 * 1.0 + 10 * 5.5) / 12)
    assert first["hvd.sum"] == pytest.approx(100.0 + 55.0) and first["total.sum"] == pytest.approx(100.0 + 650.0)
    assert (first["hvd.p50"], first["hvd.p90"]) == (pytest.approx(5.5), pytest.approx(9.1))  # the 10 steps'
    assert ("r1", at(T0 + 60)) not in stored(db)
    assert writer.stop() is True  # the open minute is closed and written
    second = stored(db)[("r1", at(T0 + 60))]
    assert (second["steps"], second["hvd.sum"], second["hvd.p50"]) == (1, pytest.approx(2.0), pytest.approx(2.0))
    assert (writer.steps, writer.written_minutes, writer.dropped_minutes, writer.failures) == (11, 2, 0, 0)


def test_the_writer_keeps_minutes_while_the_table_is_gone_and_writes_them_after(db: Engine):
    downgrade(db, "0011")  # the table is gone: every write fails
    writer = StepCostWriter(db, "r1", flush_interval=0.5, max_backoff=2.0, max_pending_minutes=2, keep_minutes=None)
    for minute in range(4):
        writer.add(timing(T0 + 60 * minute + 1, hvd=0.001 * (minute + 1)))
    assert writer.pending_minutes() == 3 - 1 and writer.dropped_minutes == 1  # minute 0 dropped: the bound is 2
    assert [writer.round() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]  # retried with back-off
    assert writer.failures == 4 and writer.failing == 4 and "step_cost_minutes" in writer.last_error
    assert writer.pending_minutes() == 2 and writer.dropped_minutes == 2  # the open minute 3 joined: minute 1 went
    upgrade(db)  # the table is back
    assert writer.round() == 0.5 and writer.failing == 0 and writer.pending_minutes() == 0
    assert sorted(m for _, m in stored(db)) == [at(T0 + 120), at(T0 + 180)]
    assert stored(db)[("r1", at(T0 + 180))]["hvd.sum"] == pytest.approx(4.0)
    writer.add(timing(T0 + 60 * 4 + 1))
    assert writer.stop() is True
    assert sorted(m for _, m in stored(db)) == [at(T0 + 120), at(T0 + 180), at(T0 + 240)]


def test_the_writer_keeps_minutes_while_the_database_is_unreachable(db: Engine, db_url: str, tmp_path):
    from conftest import PG_URL
    from sqlalchemy.engine import make_url

    if db_url.startswith("sqlite"):
        down = create_engine(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}")
    else:
        down = create_engine(make_url(PG_URL).set(port=1), connect_args={"connect_timeout": 2})
    writer = StepCostWriter(down, "r1", flush_interval=60.0)
    writer.add(timing(T0 + 1))
    writer.add(timing(T0 + 61))
    assert writer.flush() is False and writer.pending_minutes() == 1 and writer.last_error
    assert writer.stop(attempts=1) is False  # drained into pending, still nowhere to write
    assert writer.pending_minutes() == 2
    writer.engine = db
    assert writer.flush() is True and sorted(m for _, m in stored(db)) == [at(T0), at(T0 + 60)]
    down.dispose()


def test_every_round_writes_the_open_minute_so_far(db: Engine):
    """vLLM kills its worker at shutdown without exit handlers: a round must not keep a minute's
    steps back until the minute ends. The minute's later steps add to its row."""
    writer = StepCostWriter(db, "r1", flush_interval=1.0)
    writer.add(timing(T0 + 10))
    assert writer.round() == 1.0 and stored(db)[("r1", at(T0))]["steps"] == 1
    writer.add(timing(T0 + 30))
    assert writer.round() == 1.0 and stored(db)[("r1", at(T0))]["steps"] == 2
    writer.add(timing(T0 + 40))
    assert writer.stop() is True and stored(db)[("r1", at(T0))]["steps"] == 3


def test_adding_never_waits_for_the_database(db: Engine, monkeypatch):
    real = writer_mod.record_minutes
    entered, release = threading.Event(), threading.Event()

    def slow(session, replica, summaries):
        entered.set()
        assert release.wait(10)
        return real(session, replica, summaries)

    monkeypatch.setattr(writer_mod, "record_minutes", slow)
    writer = StepCostWriter(db, "r1", flush_interval=60.0)
    writer.add(timing(T0 + 1))
    writer.add(timing(T0 + 61))
    flushing = threading.Thread(target=writer.flush)
    flushing.start()
    assert entered.wait(10)
    started = time.monotonic()
    for i in range(1000):  # while the write hangs: the whole next minute, and the one after
        writer.add(timing(T0 + 61 + i * 0.05))
    writer.add(timing(T0 + 121))
    assert time.monotonic() - started < 2.0 and writer.pending_minutes() == 1
    release.set()
    flushing.join(10)
    assert writer.stop() is True
    assert {m: r["steps"] for (_, m), r in stored(db).items()} == {at(T0): 1, at(T0 + 60): 1001, at(T0 + 120): 1}


def test_the_writer_thread_writes_and_prunes(db: Engine):
    with session_scope(db) as s:
        record_minutes(s, "old", [summary(T0 - 60 * k, 1, 1.0, 1.0, 1.0) for k in range(1, 6)])
    writer = StepCostWriter(db, "r1", flush_interval=0.01, keep_minutes=3, prune_every=1).start()
    writer.add(timing(T0 + 1))
    writer.add(timing(T0 + 61))
    deadline = time.monotonic() + 10
    while ("r1", at(T0)) not in stored(db):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert writer.stop() is True and not writer.health().running
    rows = stored(db)
    assert len(rows) == 3 and ("r1", at(T0)) in rows and ("r1", at(T0 + 60)) in rows


# --- the service stack --------------------------------------------------------------------------


def test_the_stack_starts_the_step_cost_writer_before_the_event_writer_and_drains_it_at_shutdown(tmp_path, tokenizer):
    import torch

    from controller.core.decision import DecisionConfig
    from controller.services.stack import ServiceStack
    from predictor.drafting.features import NUM_FEATURES, schema_hash
    from predictor.drafting.token_classes import token_classes
    from predictor.gate.mlp import MLP, GatePredictor
    from predictor.gate.registry import store_champion
    from storage.engine import make_engine

    torch.manual_seed(0)
    engine = make_engine(f"sqlite:///{tmp_path / 'hvd.db'}")
    upgrade(engine)
    with session_scope(engine) as s:
        store_champion(s, GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash()), reason="t", actor="t")
    stack = ServiceStack.build(engine, DecisionConfig(), token_classes(tokenizer), replica="r9", learn=False)
    assert [s.name for s in stack.services()] == ["hvd-stats-writer", "hvd-step-costs", "hvd-event-writer",
                                                  "hvd-controls"]
    assert stack.step_costs.replica == "r9" and "hvd-step-costs" in [h.name for h in stack.health()]
    stack.writer.spill_dir = tmp_path  # where shutdown.jsonl goes
    stack.start()
    assert stack.step_costs.health().running
    now = time.time()
    stack.step_costs.add(StepTiming.of(now, 2, 6, 3, target=0.03, hvd=0.0008, drafter=0.004, rest=0.001))
    tally = stack.shutdown(drain_seconds=5.0, log=lambda line: None)
    assert tally.lost == 0 and not stack.step_costs.health().running
    (row,) = stored(engine).values()
    assert (row["steps"], row["drafter_steps"], row["hvd.sum"]) == (1, 1, pytest.approx(0.8))
    assert stored(engine) == {("r9", at(minute_of(now))): row}
    no_costs = ServiceStack.build(engine, DecisionConfig(), token_classes(tokenizer), replica="r9", learn=False,
                                  step_costs=False)
    assert no_costs.step_costs is None and "hvd-step-costs" not in [s.name for s in no_costs.services()]
    assert no_costs.flush() is True
    assert no_costs.live_cost is None  # the live cost fitter only where the engine fits its steps (the vLLM plugin)
    fitting = ServiceStack.build(engine, DecisionConfig(), token_classes(tokenizer), replica="r9", learn=False,
                                 step_costs=False, live_cost=True)
    assert [s.name for s in fitting.services()][-1] == "hvd-live-cost"
    fitting.writer.spill_dir = tmp_path
    fitting.start()
    assert {h.name: h.state for h in fitting.health()}["hvd-live-cost"] == "ok"
    fitting.shutdown(drain_seconds=5.0, log=lambda line: None)
    assert not fitting.live_cost.health().running
    engine.dispose()
