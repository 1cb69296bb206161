"""The per-step runtime's speed-ups changed no decision, event or label (issue 27).

A recorded sequence of engine calls (tests/support/runtime_reference.py: the replay engine serving
bundled traces under seven scenarios) replayed into today's runtime gives the plans, labelled events,
statistics, metrics and counters the runtime gave before its per-step time was cut. The fast paths
that do it are held to their general twins here too, bit for bit, on random inputs: the feature rows
of a few drafts, the plan of a batch of one, the step-time table."""
from __future__ import annotations

import dataclasses
import json
import lzma

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.events import EventQueue, LabelledEvent
from controller.core.request_state import CacheDraftRecord
from predictor.decision.allocator import AUTO, FORCE_NONE, _step_cost, allocate, allocate_each, allocate_one
from predictor.decision.profiles import CostProfile
from predictor.drafting import features
from predictor.drafting.cache_drafter import CacheDraft
from predictor.drafting.token_classes import TokenClasses
from support import runtime_reference as ref

REFERENCE = json.loads(lzma.decompress(ref.REFERENCE.read_bytes()))


def test_the_reference_gates_are_the_ones_it_was_recorded_with():
    assert ref.gate_digests() == REFERENCE["gates"], \
        "the seeded test gates changed (torch?): the reference no longer applies; see tests/support/runtime_reference.py"


@pytest.mark.parametrize("name", sorted(REFERENCE["scenarios"]))
def test_replaying_the_recorded_calls_reproduces_plans_events_and_counters(name):
    scenario = REFERENCE["scenarios"][name]
    got = ref.replay(scenario["settings"], scenario["calls"])
    want = scenario["outputs"]
    kinds = {k for k, *_ in want}
    assert {"plan", "event", "stats", "metrics", "counters"} <= kinds
    diff = ref.same(got, want, name)
    assert diff is None, diff


# ---------------------------------------------------------------- the feature rows of a few drafts
_CLASSES = TokenClasses(np.array([0, 1, 2, 4, 8, 3, 12, 0, 15, 6], dtype=np.uint8), [0] * 10, [False] * 10)


@st.composite
def contexts(draw):
    k = draw(st.integers(0, 24))
    tokens = draw(st.lists(st.integers(0, 9), min_size=k, max_size=k))
    probs = draw(st.lists(st.floats(0.0, 1.0, width=32), min_size=k, max_size=k))
    draft = CacheDraft(tokens, probs, float(sum(probs)), draw(st.integers(0, 40)), draw(st.integers(0, 2)),
                       draw(st.floats(0, 30, allow_nan=False)), draw(st.integers(0, 24)), draw(st.integers(0, k)))
    counts = st.integers(0, 300_000)
    return features.DraftContext(
        draft, draw(st.integers(0, k)), draw(counts), draw(counts), draw(st.integers(-5, 20)), draw(st.booleans()),
        draw(st.integers(0, 4)), draw(st.floats(0, 1)), draw(st.integers(0, 50)), draw(st.booleans()),
        float(draw(st.integers(0, 24))), draw(st.floats(0, 24)), draw(counts), draw(st.floats(0, 1)),
        draw(st.floats(0, 1)), draw(st.integers(0, 60)), draw(st.booleans()))


def _columns(rows) -> np.ndarray:
    inputs = features._Inputs(rows, _CLASSES)
    x = np.empty((len(rows), features.NUM_FEATURES), dtype=np.float32)
    for j, (_, formula) in enumerate(features.FEATURES):
        x[:, j] = formula(inputs)
    return x


@settings(max_examples=300, deadline=None)
@given(st.lists(contexts(), max_size=features.FEW_ROWS))
def test_a_few_rows_are_built_to_the_same_bits_as_the_columns(rows):
    fast = features.feature_matrix(rows, _CLASSES)
    assert fast.dtype == np.float32 and fast.shape == (len(rows), features.NUM_FEATURES)
    assert fast.tobytes() == _columns(rows).tobytes()


def test_log1p_of_counts_is_numpys_own():
    counts = [0, 1, 2, 4095, 4096, 70_000, (1 << 17) - 1, 1 << 17, 5_000_000]
    assert [features._log1p(v) for v in counts] == np.log1p(np.array(counts, dtype=np.float64)).tolist()
    assert features._log1p(np.int64(12)) == features._log1p(12) == features._log1p(12.0)


# ---------------------------------------------------------------- the plan of a batch of one
COSTS = [CostProfile("flat", base_ms=20.0, per_token_ms=1.3, draft_token_ms=2.0),
         CostProfile("compute-bound", base_ms=6.5, per_token_ms=0.01, draft_token_ms=0.4, per_request_ms=0.08,
                     compute_ms_per_token=0.035, draft_call_ms=0.3)]


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 1), st.integers(1, 24), st.integers(0, 30), st.integers(0, 4), st.integers(0, 4),
       st.integers(0, 2**32 - 1))
def test_a_batch_of_one_is_planned_as_allocate_each_plans_it(c, width, length, k_max, mode, seed):
    rng = np.random.default_rng(seed)
    s = np.cumprod(rng.uniform(size=(1, width)), axis=1).astype(np.float32) * (np.arange(width) < length)
    se = np.cumprod(rng.uniform(size=(1, k_max)), axis=1)
    modes = np.array([mode], dtype=np.int8)
    want = allocate_each(s, np.array([length]), se, COSTS[c], modes).step(0)
    got = allocate(s, np.array([length]), se, COSTS[c], modes, batch=1)
    for field in ("source", "length", "expected", "tau"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), field
    assert (got.model_k, got.step_ms, got.rate) == (want.model_k, want.step_ms, want.rate)
    one = allocate_one(s[0].tolist(), length, se[0].tolist(), COSTS[c], mode)
    assert (one.source, one.length, one.model_k, one.tau) == (int(want.source[0]), int(want.length[0]),
                                                              want.model_k, float(want.tau[0]))


def test_a_batch_of_one_refuses_what_allocate_refuses():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        allocate(np.array([[1.5]]), np.array([1]), np.zeros((1, 0)), COSTS[0])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        allocate_one([float("nan")], 1, [], COSTS[0])
    with pytest.raises(ValueError, match="mode"):
        allocate(np.zeros((1, 2)), np.array([1]), np.zeros((1, 0)), COSTS[0], np.array([9]))
    with pytest.raises(ValueError, match=">= 0"):
        allocate_one([0.5], -1, [], COSTS[0], AUTO)
    assert allocate_one([0.9, 0.8], 2, [0.5], COSTS[0], FORCE_NONE).source == 0


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: c.name)
def test_the_step_time_table_is_what_ms_gives(cost):
    step = _step_cost(cost, 64, 3)
    line = step.line_upto(300)
    for k in range(4):
        assert (line[:300] + step.draft[k]).tobytes() == np.asarray(step.ms(np.arange(300), k)).tobytes()
    assert _step_cost(cost, 64, 3) is step


# ---------------------------------------------------------------- the records and the queue
def test_quickly_made_records_are_the_dataclasses_they_were():
    event = LabelledEvent(1.0, "t", "chat", "r", 3, "cache", "cache", 5, 2, 1.5, 0.7, 4, b"\x00" * 4)
    assert event.verified_len is None and event == LabelledEvent(
        at=1.0, tenant="t", workload="chat", request_id="r", position=3, drafter="cache", decision="cache",
        draft_len=5, accepted=2, predicted=1.5, tau=0.7, predictor_version_id=4, features=b"\x00" * 4)
    assert hash(event) == hash(dataclasses.replace(event))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.tau = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        LabelledEvent(1.0)  # type: ignore[call-arg]
    record = CacheDraftRecord(3, 5, "shadow", 1.25, float("nan"), None, b"")
    assert dataclasses.replace(record, verified_len=2).verified_len == 2 and record.verified_len is None


def test_the_queue_keeps_order_bounds_and_counts():
    q = EventQueue(3)
    events = [LabelledEvent(float(i), "t", "chat", "r", i, "model", "model", 3, 1, None, None, None, None)
              for i in range(5)]
    assert [q.put(e) for e in events] == [True, True, True, False, False]
    assert (q.depth(), q.queued, q.dropped) == (3, 3, 2)
    assert q.get_batch(2) == events[:2] and q.get_batch(10) == events[2:3] and q.get_batch(1) == []
    q.close()
    assert not q.put(events[0]) and q.dropped == 3
