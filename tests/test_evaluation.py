"""The evaluation report on a tiny hand-built replay: its JSON shape, its checks, and its table."""
from __future__ import annotations

import json

import numpy as np
import pytest

from predictor.data.traces import LoadReport
from predictor.decision.profiles import DrafterProfile, ProfileError, cost_profiles
from predictor.drafting.features import NUM_FEATURES
from predictor.evaluation.report import (BINARY_MARGIN, RELIABILITY_KEY, checks, evaluate, format_table, parse_settings)
from predictor.evaluation.simulator import POLICIES
from predictor.replay.dataset import Dataset
from predictor.replay.trace_replay import ReplayResult
from storage.workloads import WORKLOADS

SETTING_KEYS = {"cpu-smollm2/b1", "cpu-smollm2/b8", "gpu-8b/b1", "gpu-8b/b64"}
FIGURE_KEYS = {"cycles_per_1k", "tokens_per_cycle", "wasted_per_1k", "speedup", "cache_share", "ms_per_1k",
               "decode_ms_per_1k"}
K = 24


class CurveGate:
    """A test double of the gate's interface: feature column 0 holds the row's index into `curves`."""

    def __init__(self, curves: np.ndarray, kind: str = "survival") -> None:
        self.curves = curves.astype(np.float32)
        self.kind = kind

    def survival(self, x: np.ndarray) -> np.ndarray:
        if self.kind != "survival":
            raise TypeError("a point gate has no survival curve")
        return self.curves[x[:, 0].astype(np.int64)]

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.curves[x[:, 0].astype(np.int64)].sum(axis=1)


def _dataset(seed: int = 0) -> tuple[Dataset, np.ndarray]:
    """Eight traces over three workloads (the last one in the training split), drafts at random; the
    curves are the truth blurred (so the reliability gaps are small but not zero)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([12, 20, 1, 15, 9, 18, 7, 30])
    workload = np.array([WORKLOADS.index(w) for w in ("agentic", "sql", "sql", "chat", "agentic", "chat", "sql", "chat")])
    trace = np.repeat(np.arange(8), lengths - 1)
    n = len(trace)
    position = np.concatenate([np.arange(1, k) for k in lengths])
    draft_len = rng.integers(0, 10, n)
    label = np.minimum(rng.geometric(0.35, n) - 1, draft_len)
    j = np.arange(1, K + 1)[None, :]
    truth = (j <= label[:, None]).astype(np.float64)
    curves = np.clip(0.8 * truth + 0.1, 0, 1) * (j <= draft_len[:, None])
    curves = np.minimum.accumulate(curves, axis=1)
    features = np.zeros((n, NUM_FEATURES), np.float32)
    features[:, 0] = np.arange(n)
    # path probabilities as arctic-inference gives them (cumulative): 0.9 per token up to the label, 0.4 past it
    token_probs = np.concatenate([np.cumprod(np.where(np.arange(k) < y, 0.9, 0.4)) for k, y in zip(draft_len, label)]
                                 + [np.zeros(0)])
    replay = ReplayResult(trace=trace.astype(np.int32), position=position.astype(np.int32),
                          draft_len=draft_len.astype(np.int16), label=label.astype(np.int16),
                          score=label.astype(np.float32), features=features, output_len=lengths.astype(np.int32),
                          workload=workload.astype(np.int8), token_probs=token_probs.astype(np.float32),
                          # vLLM's suffix shape drafts half as far: a prefix of each draft here
                          vllm_len=((draft_len + 1) // 2).astype(np.int16),
                          vllm_label=np.minimum(label, (draft_len + 1) // 2).astype(np.int16),
                          vllm_score=np.minimum(label, (draft_len + 1) // 2).astype(np.float32))
    test = np.ones(8, dtype=bool)
    test[7] = False
    return Dataset(records=[None] * 8, load_report=LoadReport(), replay=replay, test_traces=test, key="tiny"), curves


DRAFTERS = [DrafterProfile("weak", draft_len=3, acceptance=0.37), DrafterProfile("strong", draft_len=5, acceptance=0.7)]


@pytest.fixture(scope="module")
def report():
    data, curves = _dataset()
    return evaluate(data, CurveGate(curves), DRAFTERS, cost_profiles()["gpu-8b"], seed=1, version_id=3)


def test_every_figures_object_has_the_four_settings(report):
    json.dumps(report)  # plain JSON
    assert set(report["settings"]) == SETTING_KEYS
    assert report["settings"]["gpu-8b/b64"] == {"cost_profile": "gpu-8b", "batch": 64}
    assert set(report["cost_profiles"]) == {"cpu-smollm2", "gpu-8b"}
    assert report["cost_profiles"]["gpu-8b"]["compute_ms_per_token"] > 0 and report["cost_profiles"]["gpu-8b"]["sources"]
    assert report["data"]["traces"] == 7  # the training-split trace is left out
    for name, d in report["drafters"].items():
        assert set(d["policies"]) == set(POLICIES)
        for policy, fig in d["policies"].items():
            assert set(fig["by_workload"]) == {"agentic", "sql", "chat"}
            for scope in [fig["overall"], *fig["by_workload"].values()]:
                assert set(scope) == FIGURE_KEYS, (name, policy)
                assert set(scope["ms_per_1k"]) == SETTING_KEYS, (name, policy)
                assert all(v > 0 for v in scope["ms_per_1k"].values())


def test_known_values(report):
    cpu, gpu = cost_profiles()["cpu-smollm2"], cost_profiles()["gpu-8b"]
    for d in report["drafters"].values():
        none = d["policies"]["none"]
        # no speculation at batch 1: one plain step per token
        assert none["overall"]["ms_per_1k"]["cpu-smollm2/b1"] == pytest.approx(1000 * cpu.step_ms(1, 1), abs=1e-3)
        assert none["overall"]["ms_per_1k"]["gpu-8b/b1"] == pytest.approx(1000 * gpu.step_ms(1, 1), abs=1e-3)
        assert none["overall"]["decode_ms_per_1k"]["cpu-smollm2/b1"] == pytest.approx(1000 * cpu.step_ms(1, 1), abs=1e-3)
        assert none["overall"]["cycles_per_1k"] == 1000.0 and none["overall"]["speedup"] == 1.0
        # batching helps plain decoding (the steps are shared)
        assert none["overall"]["ms_per_1k"]["cpu-smollm2/b8"] < none["overall"]["ms_per_1k"]["cpu-smollm2/b1"]
        # cycles_per_1k of the binary rule at batch 1 is what it always was: full drafts, so no fewer
        # rejected tokens than the allocator fed the truth, which rejects none but at a trace's end
        p = d["policies"]
        assert p["oracle-length"]["overall"]["wasted_per_1k"] <= p["hvd-binary"]["overall"]["wasted_per_1k"]


def test_suffix_and_arctic_verify_vllms_drafts_the_rest_hvds():
    """vLLM's suffix method and ArcticInference's rule see the drafts vLLM's shape makes (here half as
    long), the others HVD's: the baselines' figures change with vLLM's columns alone."""
    data, curves = _dataset()
    before = evaluate(data, CurveGate(curves), DRAFTERS[:1], cost_profiles()["gpu-8b"], seed=1)
    rp = data.replay
    rp.vllm_len, rp.vllm_label, rp.vllm_score = rp.draft_len.copy(), rp.label.copy(), rp.score.copy()
    after = evaluate(data, CurveGate(curves), DRAFTERS[:1], cost_profiles()["gpu-8b"], seed=1)
    b, a = before["drafters"]["weak"]["policies"], after["drafters"]["weak"]["policies"]
    for policy in ("suffix", "arctic"):
        assert b[policy]["overall"]["wasted_per_1k"] < a[policy]["overall"]["wasted_per_1k"], policy
    for policy in ("none", "model", "hvd", "hvd-binary", "oracle", "vllm-adaptive"):
        assert b[policy]["overall"] == a[policy]["overall"], policy


def test_reliability_table_and_its_check(report):
    table = report["predictor"]["reliability"]
    assert report["predictor"]["kind"] == "survival"
    assert [row["position"] for row in table] == list(range(1, len(table) + 1)) and len(table) >= 5
    data, curves = _dataset()
    rows = data.test_traces[data.replay.trace] & (data.replay.draft_len > 0)
    s, dl, label = curves[rows], data.replay.draft_len[rows], data.replay.label[rows]
    for row in table:
        reach = dl >= row["position"]
        assert row["count"] == int(reach.sum())
        assert row["mean_predicted"] == pytest.approx(s[reach, row["position"] - 1].mean(), abs=1e-4)
        assert row["observed"] == pytest.approx(np.mean(label[reach] >= row["position"]), abs=1e-4)
    c = report["checks"][RELIABILITY_KEY]
    assert c["failing_positions"] == [row["position"] for row in table if abs(row["gap"]) > 0.03]
    assert c["within"] == (not c["failing_positions"])
    assert c["max_abs_gap"] == max(abs(row["gap"]) for row in table)


def test_a_point_gate_falls_back_to_the_binary_rule():
    data, curves = _dataset()
    r = evaluate(data, CurveGate(curves, kind="point"), DRAFTERS[:1], cost_profiles()["gpu-8b"], seed=1)
    p = r["drafters"]["weak"]["policies"]
    assert p["hvd"] == p["hvd-binary"]
    assert r["predictor"]["reliability"] == [] and r["predictor"]["kind"] == "point"
    assert "point-estimate gate" in r["note"] and r["checks"][RELIABILITY_KEY]["within"] is None
    assert "survival reliability: none" in format_table(r)


def test_the_table_prints_every_setting_and_the_checks(report):
    text = format_table(report)
    for setting in SETTING_KEYS:
        assert f"ms per 1000 tokens, {setting}" in text
    for policy in POLICIES:
        assert f"\n{policy:13s}" in text
    assert "never more than 0.5% above hvd-binary" in text and "survival reliability (per draft position" in text


def _synthetic(ms: dict[str, dict[str, float]]) -> dict:
    """A report with only what checks() reads: per policy, ms per setting for overall and one workload."""
    policies = {}
    for policy in POLICIES:
        values = ms.get(policy, {"s/b1": 100.0, "cpu-smollm2/b8": 100.0})
        fig = {"cycles_per_1k": 500.0, "ms_per_1k": values}
        policies[policy] = {"overall": dict(fig), "by_workload": {"sql": dict(fig)}}
    return {"drafters": {"d": {"policies": policies}},
            "predictor": {"reliability": [{"position": 1, "gap": 0.01}, {"position": 2, "gap": -0.05}]}}


def test_checks_name_what_failed():
    good = {"hvd": {"s/b1": 90.0, "cpu-smollm2/b8": 80.0}, "hvd-binary": {"s/b1": 90.0, "cpu-smollm2/b8": 95.0},
            "oracle": {"s/b1": 85.0, "cpu-smollm2/b8": 85.0}, "oracle-length": {"s/b1": 85.0, "cpu-smollm2/b8": 75.0}}
    c = checks(_synthetic(good))["d"]
    assert c["all_met"] and not c["failures"]
    assert c["ms_vs_oracle"] == {"cpu-smollm2/b8": round(80 / 85 - 1, 4)}
    assert c["ms_vs_hvd_binary"]["cpu-smollm2/b8"] == {"overall": round(80 / 95 - 1, 4), "sql": round(80 / 95 - 1, 4)}

    bad = {**good, "hvd": {"s/b1": 90.0 * (1 + 2 * BINARY_MARGIN), "cpu-smollm2/b8": 90.0}}
    c = checks(_synthetic(bad))["d"]
    assert not c["within_hvd_binary"] and not c["beats_oracle"] and not c["all_met"]
    assert c["ms_beats_baselines"] == {"s/b1": {"sql": True}, "cpu-smollm2/b8": {"sql": True}}
    assert not c["within_oracle_length"]  # 90 / 75 - 1 = 20% at cpu-smollm2/b8
    assert "s/b1 sql: hvd +1.00% against hvd-binary (limit +0.5%)" in c["failures"]
    assert "cpu-smollm2/b8: hvd +5.9% against the binary oracle gate (must be below)" in c["failures"]

    slow = {**good, "suffix": {"s/b1": 89.0, "cpu-smollm2/b8": 100.0}}
    c = checks(_synthetic(slow))["d"]
    assert c["ms_beats_baselines"]["s/b1"] == {"sql": False}
    assert "s/b1 sql: hvd 90.0 ms/1k not below suffix 89.0" in c["failures"]

    r = checks(_synthetic(good))[RELIABILITY_KEY]
    assert r == {"tolerance": 0.03, "max_abs_gap": 0.05, "failing_positions": [2], "within": False}


def test_parse_settings():
    profiles = cost_profiles()
    (cpu, batch), (gpu, big) = parse_settings(["cpu-smollm2/b8", "gpu-8b/b64"], profiles)
    assert (cpu.name, batch, gpu.name, big) == ("cpu-smollm2", 8, "gpu-8b", 64)
    for bad in ("cpu-smollm2", "cpu-smollm2/b0", "cpu-smollm2/8", "cpu-smollm2/bx"):
        with pytest.raises(ValueError, match="is not PROFILE/bN"):
            parse_settings([bad], profiles)
    with pytest.raises(ProfileError, match="unknown cost profile 'tpu'"):
        parse_settings(["tpu/b8"], profiles)


def test_repeated_or_empty_settings_are_refused():
    data, curves = _dataset()
    gpu = cost_profiles()["gpu-8b"]
    with pytest.raises(ValueError, match="settings repeat"):
        evaluate(data, CurveGate(curves), DRAFTERS[:1], gpu, settings=[(gpu, 1), (gpu, 1)])
    with pytest.raises(ValueError, match="at least one"):
        evaluate(data, CurveGate(curves), DRAFTERS[:1], gpu, settings=[])
