"""The one thing the engine knows that text-only traces do not: the output is its own. The flag is
set per request (live traffic, lines the engine recorded), reaches every draft's `on_policy`
column in replay and serving alike, survives the recorder and the trace loader, and is ignored by a
gate that never saw it set until it learns it."""
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
from controller.engines.trace_engine import run_replay
from controller.services.trace_recorder import ServedRequest, TraceRecorder
from predictor.data.traces import TraceFormatError, load_traces, parse_record
from predictor.decision.profiles import drafter_profiles
from predictor.drafting.cache_drafter import CacheDraft
from predictor.drafting.features import FEATURE_NAMES, schema_hash
from predictor.drafting.hindsight import Hindsight
from predictor.drafting.token_classes import token_classes
from predictor.gate.batch import Batch
from predictor.gate.config import TrainConfig
from predictor.gate.mlp import DRAFT_LEN_COLUMN as DRAFT_LEN
from predictor.gate.mlp import GatePredictor
from predictor.gate.training import train_gate
from predictor.online.learner import LearnerConfig, OnlineLearner
from predictor.replay.trace_replay import replay
from support.gates import match_len_gate

ON_POLICY = FEATURE_NAMES.index("on_policy")
SQL = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT name FROM users"


def test_hindsight_marks_every_draft_of_the_request(tokenizer):
    classes = token_classes(tokenizer)
    for flag in (True, False):
        h = Hindsight(np.array([1, 2, 3], dtype=np.int32), 0, classes, on_policy=flag)
        assert h.draft_context(CacheDraft([9], [1.0])).on_policy is flag  # before any output
        h.append(np.array([10, 11], dtype=np.int32))
        h.append_token(12)
        assert h.draft_context(CacheDraft([13], [1.0])).on_policy is flag
    assert Hindsight(np.array([1], dtype=np.int32), 0, classes).draft_context(CacheDraft([], [])).on_policy is False


def test_the_runtime_takes_the_flag_when_it_first_sees_the_request(tokenizer):
    rt = Runtime(match_len_gate(), token_classes(tokenizer), DecisionConfig(fallback="none", fixed_tau=-1.0))
    rt.step([RequestInput("own", np.array([5]), np.array([1, 2, 3]), on_policy=True),
             RequestInput("text", np.array([5]), np.array([1, 2, 3]))])
    assert rt.requests["own"].hindsight.on_policy and not rt.requests["text"].hindsight.on_policy
    with pytest.raises(RequestInputError, match="on_policy must be a bool, got 1"):
        rt.step([RequestInput("other", np.array([5]), np.array([1]), on_policy=1)])
    assert "other" not in rt.requests  # refused before the step changed anything
    ok = RequestInput("r", np.array([5, 6]), np.array([1, 2, 3]), on_policy=True)
    assert RequestInput.from_json(json.loads(json.dumps(ok.to_json()))).on_policy is True


def _line(ids: list[int], **engine) -> dict:
    return {"workload": "sql", "context": "q", "output": "a", "engine": {"output_ids": ids, **engine}}


@pytest.mark.parametrize("engine, field", [
    ({"output_ids": []}, "engine.output_ids"),
    ({"output_ids": [1, -2]}, "engine.output_ids[1]"),
    ({"output_ids": [1, True]}, "engine.output_ids[1]"),
    ({"output_ids": "1 2"}, "engine.output_ids"),
])
def test_a_bad_engine_field_is_refused_by_name(engine, field):
    line = _line([1, 2])
    line["engine"].update(engine)
    with pytest.raises(TraceFormatError, match=re.escape(f"f.jsonl:3: field '{field}'")):
        parse_record(line, "f.jsonl:3")
    with pytest.raises(TraceFormatError, match="field 'engine'.*'extra'"):
        parse_record(_line([1, 2], extra=[]), "f.jsonl:3")
    with pytest.raises(TraceFormatError, match="field 'engine'.*'output_ids'"):
        parse_record({**_line([1]), "engine": {}}, "f.jsonl:3")


def test_lines_recorded_with_the_removed_signals_still_load():
    """Schema 4's recorder also kept the target's confidence per token; those lines read as before."""
    rec = parse_record(_line([4, 5], top1_prob=[0.5, None], logit_gap=[1.0, 2.0], entropy=[0.1, 0.2]), "f:1")
    assert rec.engine.output_ids == (4, 5)


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20))
def test_valid_engine_fields_round_trip(ids):
    assert parse_record(json.loads(json.dumps(_line(ids))), "f:1").engine.output_ids == tuple(ids)


def test_recorded_lines_replay_on_policy_over_the_engines_own_ids(tmp_path, tokenizer):
    """The recorder keeps the engine's token ids; replay drafts over those very ids (not the text
    tokenized again) and marks every draft on-policy; a text-only line of the same text is not."""
    prompt = tokenizer._encode(f"<|im_start|>user\n{SQL}<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode_output(SQL)
    served = np.concatenate([output, output[:5]])  # ids the text alone would not give back
    rec = TraceRecorder(tmp_path / "served.jsonl", tokenizer, replica="r1", model="m")
    rec.add(ServedRequest("a", "acme", "sql", prompt, served))
    assert rec.flush()
    (line,) = (json.loads(s) for s in (tmp_path / "served.jsonl").read_text().splitlines())
    assert line["engine"] == {"output_ids": served.tolist()}
    records, report = load_traces([tmp_path / "served.jsonl"])
    plain = parse_record({k: v for k, v in line.items() if k != "engine"} | {"trace_id": "plain"}, "x:1")
    result = replay([records[0], plain], tokenizer)
    assert result.output_len.tolist() == [len(served), len(tokenizer.encode_output(plain.output))]
    assert result.features[result.trace == 0][:, ON_POLICY].all()
    assert not result.features[result.trace == 1][:, ON_POLICY].any()


def test_the_replay_engine_serves_recorded_lines_on_policy(tmp_path, tokenizer):
    prompt = tokenizer._encode(f"<|im_start|>user\n{SQL}<|im_end|>\n<|im_start|>assistant\n")
    rec = TraceRecorder(tmp_path / "served.jsonl", tokenizer, replica="r1", model="m")
    rec.add(ServedRequest("a", "acme", "sql", prompt, tokenizer.encode_output(SQL)))
    assert rec.flush()
    (recorded,), _ = load_traces([tmp_path / "served.jsonl"])
    plain = parse_record({"trace_id": "plain", "session_id": "plain", "workload": "sql", "context": SQL,
                          "output": SQL}, "x:1")
    rt = Runtime(match_len_gate(), token_classes(tokenizer), DecisionConfig(fallback="none", fixed_tau=-1.0))
    seen: dict[str, bool] = {}

    def look(_run) -> None:
        seen.update({r: st.hindsight.on_policy for r, st in rt.requests.items()})

    run_replay(rt, [recorded, plain], tokenizer, drafter_profiles()["eagle3-1.75"], batch_size=2, on_step=look)
    assert seen == {recorded.trace_id: True, "plain": False}


def test_a_column_constant_in_training_gets_no_weight():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, len(FEATURE_NAMES))).astype(np.float32)
    x[:, FEATURE_NAMES.index("draft_len")] = 8
    x[:, ON_POLICY] = 0.0  # text-only traces: never on-policy
    labels = rng.integers(0, 9, 400).astype(np.float32)
    model = train_gate(x, labels, np.zeros(400, dtype=np.int64), TrainConfig(epochs=1, hidden=(8,)))
    w = model.net[0].weight.detach().numpy()
    assert not w[:, ON_POLICY].any() and w[:, 0].any()
    served = x[:5].copy()
    served[:, ON_POLICY] = 1.0  # live traffic: the same predictions until the learner learns the column
    with torch.no_grad():
        np.testing.assert_array_equal(model(torch.from_numpy(served)).numpy(), model(torch.from_numpy(x[:5])).numpy())


def test_the_online_learner_learns_the_flag_a_text_only_warm_start_never_saw():
    """The issue's online part: a champion trained only on text-only rows (the column always 0) gives
    the flag no weight; live labels where the engine's own drafts are accepted whole and other text's
    mostly rejected (the replay engine serves both) teach the learner's challenger the column: its
    curve then tells on-policy drafts from the same drafts read as other models' text."""
    rng = np.random.default_rng(11)
    n = 600

    def rows(on_policy: float) -> np.ndarray:
        x = rng.normal(size=(n, len(FEATURE_NAMES))).astype(np.float32)
        x[:, DRAFT_LEN] = 8
        x[:, ON_POLICY] = on_policy
        return x

    def mostly_rejected() -> np.ndarray:
        return np.where(rng.random(n) < 0.8, 0, 8).astype(np.float32)

    x = rows(0.0)
    torch.manual_seed(0)
    model = train_gate(x, mostly_rejected(), np.zeros(n, dtype=np.int64), TrainConfig(epochs=3, hidden=(16,)))
    champion = GatePredictor.from_torch(model, schema_hash())
    learner = OnlineLearner(champion, lambda label, dl, cache, w: (np.where(cache, label + 1.0, 1.0), np.ones(len(label))),
                            LearnerConfig(seed=5, batch_size=64, learning_rate=1e-2))
    for _ in range(16):
        live = np.concatenate([rows(1.0), rows(0.0)])
        labels = np.concatenate([np.full(n, 8.0, dtype=np.float32), mostly_rejected()])
        learner.learn_many(Batch(live, labels, np.full(2 * n, 8), np.zeros(2 * n, dtype=np.int64), np.full(2 * n, 0.7)))
    challenger = learner.challenger()
    assert not champion.weights[0][ON_POLICY].any() and np.abs(challenger.weights[0][ON_POLICY]).max() > 1e-3

    served = rows(1.0)
    read_as_text = served.copy()
    read_as_text[:, ON_POLICY] = 0.0
    before = champion.survival(served)[:, 0].mean(), champion.survival(read_as_text)[:, 0].mean()
    after = challenger.survival(served)[:, 0].mean(), challenger.survival(read_as_text)[:, 0].mean()
    assert before[0] == pytest.approx(before[1])  # the champion cannot tell them apart
    assert after[0] > 0.9 and after[1] < 0.35  # observed: 1.0 on-policy, 0.2 other text
