"""The engine's signals: read from a step's logits row by row, kept per output position, recorded in
trace lines, validated when read back, replayed into the same feature columns, and ignored by a
gate that never saw them until it learns them."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.decision import DecisionConfig
from controller.core.runtime import RequestInput, RequestInputError, Runtime
from controller.engines.trace_engine import _Live
from controller.engines.vllm_signals import row_signals, step_signals
from controller.services.trace_recorder import ServedRequest, TraceRecorder
from predictor.data.traces import TraceFormatError, load_traces, parse_record
from predictor.drafting.engine_signals import NUM_SIGNALS, SIGNAL_NAMES
from predictor.drafting.features import FEATURE_NAMES
from predictor.drafting.hindsight import Hindsight
from predictor.drafting.token_classes import token_classes
from predictor.gate.config import TrainConfig
from predictor.gate.training import train_gate
from predictor.replay.trace_replay import replay
from support.gates import match_len_gate

COLUMNS = [FEATURE_NAMES.index(f"target_{n}") for n in ("top1_prob", "logit_gap", "entropy")]
HAS = FEATURE_NAMES.index("has_target_signals")


def _exact(row: np.ndarray, token: int) -> list[float]:
    x = row.astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    others = np.delete(x, token)
    nz = p > 0
    return [p[token], x[token] - others.max(), float(-(p[nz] * np.log(p[nz])).sum())]


def test_row_signals_are_the_emitted_tokens_probability_gap_and_entropy():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(3, 50)).astype(np.float32)
    logits[1, 7] = 20.0  # a confident row
    logits[2, :10] = -np.inf  # masked tokens (a grammar): they carry no probability
    tokens = [int(logits[0].argmax()), 7, 12]  # row 2 emitted a token that is not its top one
    got = row_signals(torch.from_numpy(logits.copy()), torch.tensor(tokens))
    want = np.array([_exact(logits[i], t) for i, t in enumerate(tokens)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got[1, 0] > 0.99 and got[1, 1] > 10 and got[1, 2] < 0.01
    assert (got[2, 1] < 0) == (tokens[2] != int(np.argmax(logits[2])))


def test_step_signals_read_the_row_each_token_was_emitted_from():
    """Three requests with drafts of 2, 0 and 3 tokens: logits rows 0-2, 3 and 4-7. The first
    accepted one draft token (emitted 2), the second emitted 1, the third accepted all (emitted 4)."""
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(0, 2, size=(8, 30)).astype(np.float32))
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4]])
    rows = {0: [0, 1], 1: [3], 2: [4, 5, 6, 7]}
    every = step_signals(logits, sampled, [2, 0, 3], every_token=True)
    for i, r in rows.items():
        tokens = [t for t in sampled[i].tolist() if t >= 0]
        np.testing.assert_allclose(every[i], row_signals(logits[r].clone(), torch.tensor(tokens)), rtol=1e-6)
    last = step_signals(logits, sampled, [2, 0, 3], every_token=False)
    for i in rows:
        assert last[i].shape == every[i].shape
        assert np.isnan(last[i][:-1]).all()
        np.testing.assert_array_equal(last[i][-1], every[i][-1])
    plain = step_signals(logits[:3], torch.tensor([[4], [-1], [9]]), None, every_token=True)  # no drafts; row 1 prefilling
    assert [len(s) for s in plain] == [1, 0, 1]
    np.testing.assert_allclose(plain[2], row_signals(logits[2:3].clone(), torch.tensor([9])), rtol=1e-6)


def test_hindsight_hands_the_last_positions_signals_to_the_draft(tokenizer):
    from predictor.drafting.cache_drafter import CacheDraft

    h = Hindsight(np.array([1, 2, 3], dtype=np.int32), 0, token_classes(tokenizer))
    h.append(np.array([10, 11], dtype=np.int32), np.array([[0.5, 1.0, 2.0], [0.9, 4.0, 0.3]], dtype=np.float32))
    c = h.draft_context(CacheDraft([12], [1.0]))
    assert (c.top1_prob, c.logit_gap, c.entropy, c.has_signals) == pytest.approx((0.9, 4.0, 0.3, True))
    h.append_token(12)  # an engine without signals
    c = h.draft_context(CacheDraft([13], [1.0]))
    assert (c.top1_prob, c.logit_gap, c.entropy, c.has_signals) == (0.0, 0.0, 0.0, False)
    h.append(np.array([13], dtype=np.int32), np.full((1, NUM_SIGNALS), np.nan, dtype=np.float32))
    assert not h.draft_context(CacheDraft([14], [1.0])).has_signals
    got = h.signal_array()
    assert got.shape == (4, NUM_SIGNALS) and np.isnan(got[2:]).all()
    np.testing.assert_array_equal(got[1], np.array([0.9, 4.0, 0.3], dtype=np.float32))
    with pytest.raises(ValueError, match="expected 1 rows of 3"):
        h.append(np.array([1], dtype=np.int32), np.zeros((2, NUM_SIGNALS), dtype=np.float32))


def test_a_request_input_with_misshapen_signals_is_refused_and_json_keeps_missing_ones(tokenizer):
    rt = Runtime(match_len_gate(), token_classes(tokenizer), DecisionConfig(fallback="none", fixed_tau=-1.0))
    bad = RequestInput("r", np.array([5, 6]), np.array([1, 2, 3]), signals=np.zeros((1, NUM_SIGNALS)))
    with pytest.raises(RequestInputError, match="signals must be 2 rows"):
        rt.step([bad])
    ok = RequestInput("r", np.array([5, 6]), np.array([1, 2, 3]),
                      signals=np.array([[np.nan] * NUM_SIGNALS, [0.5, 2.0, 1.0]], dtype=np.float32))
    back = RequestInput.from_json(json.loads(json.dumps(ok.to_json())))
    np.testing.assert_array_equal(back.signals, ok.signals)
    rt.step([ok])
    assert rt.requests["r"].hindsight.signals == [None, (0.5, 2.0, 1.0)]


def _line(ids: list[int], **engine) -> dict:
    values = {n: [0.5] * len(ids) for n in SIGNAL_NAMES} | engine
    return {"workload": "sql", "context": "q", "output": "a", "engine": {"output_ids": ids, **values}}


@pytest.mark.parametrize("engine, field", [
    ({"output_ids": []}, "engine.output_ids"),
    ({"output_ids": [1, -2]}, "engine.output_ids[1]"),
    ({"output_ids": [1, True]}, "engine.output_ids[1]"),
    ({"top1_prob": [0.5]}, "engine.top1_prob"),
    ({"top1_prob": [0.5, 1.5]}, "engine.top1_prob[1]"),
    ({"entropy": [0.5, -1.0]}, "engine.entropy[1]"),
    ({"logit_gap": ["x", 0.5]}, "engine.logit_gap[0]"),
])
def test_a_bad_engine_field_is_refused_by_name(engine, field):
    line = _line([1, 2])
    line["engine"].update(engine)
    with pytest.raises(TraceFormatError, match=re.escape(f"f.jsonl:3: field '{field}'")):
        parse_record(line, "f.jsonl:3")
    line = _line([1, 2])
    line["engine"]["extra"] = []
    with pytest.raises(TraceFormatError, match="field 'engine'.*'extra'"):
        parse_record(line, "f.jsonl:3")


finite = st.one_of(st.none(), st.floats(0, 1))


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), finite, st.one_of(st.none(), st.floats(-30, 30)),
                          st.one_of(st.none(), st.floats(0, 12))), min_size=1, max_size=20))
def test_valid_engine_fields_round_trip(rows):
    ids = [r[0] for r in rows]
    line = _line(ids, **{n: [r[j + 1] for r in rows] for j, n in enumerate(SIGNAL_NAMES)})
    rec = parse_record(json.loads(json.dumps(line)), "f:1")
    assert rec.engine.output_ids == tuple(ids)
    got = rec.engine.signal_array()
    for j in range(NUM_SIGNALS):
        for i, r in enumerate(rows):
            assert (np.isnan(got[i, j]) if r[j + 1] is None else got[i, j] == np.float32(r[j + 1]))


def test_recorded_signals_replay_into_the_feature_columns(tmp_path, tokenizer):
    """The recorder keeps the engine's token ids and signals; replay drafts over those very ids and
    each draft at t sees the signals of position t - 1 (the token just emitted)."""
    text = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT name FROM users"
    prompt = tokenizer._encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode_output(text)
    rng = np.random.default_rng(2)
    signals = np.column_stack([rng.uniform(0, 1, len(output)), rng.uniform(0, 20, len(output)),
                               rng.uniform(0, 5, len(output))]).astype(np.float32)
    signals[3] = np.nan
    rec = TraceRecorder(tmp_path / "served.jsonl", tokenizer, replica="r1", model="m")
    rec.add(ServedRequest("a", "acme", "sql", prompt, output, signals))
    rec.add(ServedRequest("b", "acme", "sql", prompt, output))  # an engine without signals: text only
    assert rec.flush()
    records, report = load_traces([tmp_path / "served.jsonl"])
    assert report.skipped == 0 and records[1].engine is None
    assert records[0].engine.output_ids == tuple(output.tolist())
    np.testing.assert_allclose(records[0].engine.signal_array(), signals, atol=5e-4)  # kept to 3 decimals
    result = replay(records, tokenizer)
    rows = result.trace == 0
    x, t = result.features[rows], result.position[rows]
    stored = records[0].engine.signal_array()[t - 1]
    known = ~np.isnan(stored).any(axis=1)
    assert known.sum() == len(t) - 1  # position 4's draft sees position 3's missing signals
    np.testing.assert_array_equal(x[known][:, COLUMNS[0]], stored[known, 0])
    np.testing.assert_array_equal(x[known][:, COLUMNS[1]], np.minimum(stored[known, 1], 20.0))
    np.testing.assert_array_equal(x[:, HAS], known.astype(np.float32))
    assert not result.features[result.trace == 1][:, COLUMNS + [HAS]].any()


def test_the_replay_engine_hands_over_the_steps_last_signals_only():
    live = _Live(None, np.zeros(1, np.int32), np.arange(5, dtype=np.int32),
                 signals=np.arange(15, dtype=np.float32).reshape(5, 3))
    got = live.step_signals(1, 4)
    assert got.shape == (3, 3) and np.isnan(got[:2]).all()
    np.testing.assert_array_equal(got[2], [9, 10, 11])
    assert _Live(None, np.zeros(1, np.int32), np.arange(5, dtype=np.int32)).step_signals(0, 1) is None


def test_a_column_constant_in_training_gets_no_weight():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, len(FEATURE_NAMES))).astype(np.float32)
    x[:, FEATURE_NAMES.index("draft_len")] = 8
    x[:, COLUMNS + [HAS]] = 0.0  # text-only traces: the signals never present
    labels = rng.integers(0, 9, 400).astype(np.float32)
    model = train_gate(x, labels, np.zeros(400, dtype=np.int64), TrainConfig(epochs=1, hidden=(8,)))
    w = model.net[0].weight.detach().numpy()
    assert not w[:, COLUMNS + [HAS]].any() and w[:, 0].any()
    served = x[:5].copy()
    served[:, COLUMNS + [HAS]] = [0.9, 12.0, 0.1, 1.0]  # an engine that has them: the same predictions
    with torch.no_grad():
        np.testing.assert_array_equal(model(torch.from_numpy(served)).numpy(), model(torch.from_numpy(x[:5])).numpy())
