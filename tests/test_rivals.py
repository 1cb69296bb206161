"""The competitors' rules (predictor.decision.rivals): their published constants, what they decide,
what they learn from (only what they verified), and the same classes serving in the runtime."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core.decision import CACHE, MODEL, NONE, DecisionConfig
from controller.core.runtime import Runtime
from controller.engines.trace_engine import run_replay
from predictor.decision.profiles import CostProfile, drafter_profiles
from predictor.decision.rivals import Outcome, SglangHybrid, StepView, TrtllmRule, VllmAdaptive, make_rival
from predictor.decision.rivals.sglang_hybrid import BREAK_EVEN, T_HIGH, piecewise
from predictor.decision.rivals.step_view import conditional_matrix, conditional_probs
from predictor.decision.rivals.vllm_adaptive import (INIT_BIAS, INIT_SLOPE, MAX_STEP, REFIT_INTERVAL, WARMUP_REFITS,
                                                     AcceptanceLogistic, log_odds, sigmoid)
from predictor.drafting.token_classes import token_classes

from support.gates import random_survival_gate

CPU = CostProfile("cpu", base_ms=23.3, per_token_ms=1.36, draft_token_ms=2.0)


def view(cache_len, match_len=None, score=None, token_prob=None, allowed=None, k=3, batch=None) -> StepView:
    n = len(cache_len)
    cache_len = np.asarray(cache_len, dtype=np.int64)
    width = max(int(cache_len.max(initial=0)), 1)
    if token_prob is None:
        token_prob = np.where(np.arange(width)[None, :] < cache_len[:, None], 0.9, 0.0)
    return StepView(cache_len, np.asarray(match_len if match_len is not None else cache_len, dtype=np.int64),
                    np.asarray(score if score is not None else np.zeros(n), dtype=np.float64),
                    np.asarray(token_prob, dtype=np.float64),
                    np.asarray(allowed if allowed is not None else np.ones(n, bool), dtype=bool),
                    np.tile(0.5 ** np.arange(1, k + 1), (n, 1)) if k else np.zeros((n, 0)), batch or n)


# ------------------------------------------------------------------ token probabilities

@given(st.lists(st.lists(st.floats(0.05, 1.0), min_size=0, max_size=12), min_size=1, max_size=8))
def test_conditional_probabilities_undo_the_trees_running_product(qs):
    """arctic-inference's `probs` are running products of the tree's child/parent frequencies; the
    rules read the factors back, from lists (runtime) and from drafts laid end to end (replay)."""
    paths = [np.cumprod(q).tolist() for q in qs]
    width = 10
    got = conditional_probs(paths, width)
    for i, q in enumerate(qs):
        k = min(len(q), width)
        np.testing.assert_allclose(got[i, :k], q[:k], rtol=1e-6)
        assert not got[i, k:].any()
    flat = np.array([p for path in paths for p in path], dtype=np.float32)
    lens = np.array([len(p) for p in paths])
    np.testing.assert_allclose(conditional_matrix(flat, lens, width), got, rtol=1e-4, atol=1e-6)
    some = np.arange(len(paths))[::2]
    np.testing.assert_allclose(conditional_matrix(flat, lens, width, some), got[some], rtol=1e-4, atol=1e-6)


def test_a_replay_without_token_probabilities_is_named():
    with pytest.raises(ValueError, match="0 token probabilities for drafts of 5 tokens.*replay again"):
        conditional_matrix(np.zeros(0), np.array([2, 3]), 4)


def test_log_odds_clamp_at_forty_as_vllm_does():
    assert log_odds(np.array([1.0, 0.0, 0.5])).tolist() == [40.0, -40.0, 0.0]
    assert log_odds(np.array([0.9]))[0] == pytest.approx(np.log(9.0))


# ------------------------------------------------------------------ TensorRT-LLM

def test_trtllm_takes_the_suffix_draft_from_a_match_of_four():
    rule = TrtllmRule()
    plan = rule.plan(view([5, 5, 0, 6], match_len=[3, 4, 9, 12], allowed=[True, True, True, False]), CPU)
    assert plan.source.tolist() == [MODEL, CACHE, MODEL, NONE]
    assert plan.length.tolist() == [3, 5, 3, 0] and plan.model_k == 3
    no_model = rule.plan(view([5, 5], match_len=[3, 4], k=0), CPU)
    assert no_model.source.tolist() == [NONE, CACHE] and no_model.model_k == 0


# ------------------------------------------------------------------ SGLang

def test_sglang_tables_at_the_published_points():
    assert [piecewise(T_HIGH, b) for b in (1, 16, 32, 48)] == [2.0, 4.5, 7.5, 10.5]
    assert piecewise(T_HIGH, 4) == pytest.approx(2.5)
    assert [piecewise(BREAK_EVEN, b) for b in (1, 4, 16, 64)] == pytest.approx([2.0, 2.8, 6.0, 6.0])


def test_sglang_one_backend_per_batch_by_mean_score_then_the_acceptance_gate():
    rule = SglangHybrid(seed=1)
    rule._rng = np.random.default_rng(0)
    batch = view([6, 6, 0, 6], score=[4.0, 4.0, 0.0, 4.0])  # mean 3.0 >= T_high(4) = 2.5, EMAs cold
    plan = rule.plan(batch, CPU)
    assert plan.source.tolist() == [CACHE, CACHE, NONE, CACHE] and plan.model_k == 0
    low = rule.plan(view([6, 6], score=[1.0, 2.0]), CPU)  # mean 1.5 < T_high(2) = 2.17
    assert low.source.tolist() == [MODEL, MODEL] and low.length.tolist() == [3, 3]
    # warm: suffix accepts 1.0 token per step (2.0 with the bonus), the model 2 (3.0): the gate says model
    for _ in range(3):
        rule.learn(Outcome(np.array([CACHE, CACHE], np.int8), np.array([6, 6]), np.array([1, 1]), np.zeros((2, 6))))
        rule.learn(Outcome(np.array([MODEL], np.int8), np.array([3]), np.array([2]), np.zeros((1, 6))))
    assert rule.warm and rule.ema[CACHE].value == pytest.approx(2.0) and rule.ema[MODEL].value == pytest.approx(3.0)
    rule._rng = np.random.default_rng(5)  # no exploration draw below 0.01 in the next call
    assert rule.plan(batch, CPU).source.tolist() == [MODEL] * 4
    # a mean score of 5 or more bypasses the gate
    assert rule.plan(view([6, 6], score=[5.0, 5.0]), CPU).source.tolist() == [CACHE, CACHE]
    # batch 64 or more: no speculation
    assert set(rule.plan(view([6] * 64, score=[9.0] * 64), CPU).source.tolist()) == {NONE}


def test_sglang_explores_the_suffix_one_model_pick_in_a_hundred():
    rule = SglangHybrid(seed=3)
    picks = [rule.choose(0.0, 1, True, True) for _ in range(20_000)]
    assert 150 <= picks.count(CACHE) <= 250 and picks.count(NONE) == 0


def test_sglang_ema_floors_back_off_from_batch_16_once_warm():
    rule = SglangHybrid()
    for _ in range(3):
        rule.learn(Outcome(np.array([CACHE], np.int8), np.array([6]), np.array([0]), np.zeros((1, 6))))  # EMA 1.0
        rule.learn(Outcome(np.array([MODEL], np.int8), np.array([3]), np.array([0]), np.zeros((1, 6))))  # EMA 1.0
    assert rule.choose(8.0, 16, True, True) == NONE  # suffix picked (score >= 5), its EMA 1.0 < floor 1.5
    assert rule.choose(8.0, 8, True, True) == CACHE  # below batch 16 there is no floor


# ------------------------------------------------------------------ vLLM

def test_vllm_estimator_cold_start_and_its_censored_labels():
    e = AcceptanceLogistic(positions=6)
    q = np.full((1, 6), 0.9)
    np.testing.assert_allclose(e.confidence(q)[0], sigmoid(0.5 * np.log(9.0) - 0.2))
    # verified 5, accepted 2: slots 0 and 1 accepted, slot 2 the first rejected, 3-4 censored, 5 never verified
    e.learn(q, np.array([5]), np.array([2]))
    assert e._n.tolist() == [1, 1, 1, 0, 0, 0]
    p = sigmoid(0.5 * np.log(9.0) - 0.2)
    np.testing.assert_allclose(e._g1[:3], [1 - p, 1 - p, -p])


def test_vllm_estimator_refits_every_hundred_steps_towards_the_truth():
    """Drafts whose slots are accepted with probability sigmoid(1.2 f - 1) (f the token's log-odds):
    the damped Newton refits move the shared slope and the intercepts there."""
    rng = np.random.default_rng(0)
    e = AcceptanceLogistic(positions=4)
    for step in range(40 * REFIT_INTERVAL):
        q = rng.uniform(0.2, 0.98, (8, 4))
        accept = rng.random((8, 4)) < sigmoid(1.2 * log_odds(q) - 1.0)
        accepted = np.argmin(np.concatenate([accept, np.zeros((8, 1), bool)], axis=1), axis=1)
        e.learn(q, np.full(8, 4), accepted)
    assert e.refits == 40
    assert e.slope == pytest.approx(1.2, abs=0.15)
    np.testing.assert_allclose(e.intercepts, -1.0, atol=0.25)


def test_vllm_estimator_stays_finite_where_the_trees_frequency_is_one():
    """Suffix drafts past their first token: the tree's conditional frequency is 1 (the feature at
    its clamp) and a fifth of those slots are still rejected. Unbounded, vLLM's Newton step at that
    saturated cold start moves an intercept by thousands; bounded, the fit converges to the truth."""
    rng = np.random.default_rng(0)
    e = AcceptanceLogistic(positions=3)
    for step in range(80 * REFIT_INTERVAL):
        q = np.column_stack([rng.uniform(0.2, 0.98, 8), np.ones(8), np.ones(8)])
        first = rng.random(8) < sigmoid(1.2 * log_odds(q[:, 0]) - 1.0)
        later = rng.random((8, 2)) < 0.8
        accept = np.column_stack([first, later])
        accepted = np.argmin(np.concatenate([accept, np.zeros((8, 1), bool)], axis=1), axis=1)
        e.learn(q, np.full(8, 3), accepted)
        if e.refits == 1 and step < REFIT_INTERVAL:
            assert np.all(np.abs(e.intercepts - INIT_BIAS) <= MAX_STEP + 1e-12) and abs(e.slope - INIT_SLOPE) <= MAX_STEP
    assert np.isfinite(e.slope) and np.all(np.isfinite(e.intercepts))
    conf = e.confidence(np.array([[0.5, 1.0, 1.0], [0.95, 1.0, 1.0]]))
    np.testing.assert_allclose(conf[:, 1:], 0.8, atol=0.03)
    np.testing.assert_allclose(conf[:, 0], sigmoid(1.2 * log_odds(np.array([0.5, 0.95])) - 1.0), atol=0.06)


def test_vllm_adaptive_verifies_whole_drafts_until_its_third_refit_then_trims():
    rule = VllmAdaptive()
    tp = np.tile([0.99, 0.99, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], (2, 1))
    v = view([8, 8], token_prob=tp, batch=2)
    assert rule.plan(v, CPU).length.tolist() == [8, 8]  # warming up: whole drafts
    for _ in range(WARMUP_REFITS * REFIT_INTERVAL):
        rule.learn(Outcome(np.array([CACHE, CACHE], np.int8), np.array([8, 8]), np.array([2, 2]), tp))
    assert not rule.warming_up and rule.estimator.refits == WARMUP_REFITS
    plan = rule.plan(v, CPU)
    assert plan.source.tolist() == [CACHE, CACHE] and 1 <= plan.length.max() < 8
    assert make_rival("vllm-adaptive").estimator.refits == 0
    with pytest.raises(ValueError, match="unknown rival rule 'greedy'"):
        make_rival("greedy")


# ------------------------------------------------------------------ in the runtime

@pytest.mark.parametrize("rule", ["vllm-adaptive", "sglang-hybrid", "trtllm"])
def test_each_rule_serves_on_the_replay_engine_and_learns_from_what_it_verified(records, tokenizer, rule):
    """The runtime's rule is the rivals module's class: it plans every step, the tokens served are
    the traces' own, and the online rules have learned from the engine's verdicts."""
    drafter = drafter_profiles()["eagle3-1.75"]
    runtime = Runtime(random_survival_gate(), token_classes(tokenizer), DecisionConfig(rule=rule))
    assert runtime.rival.name == rule and runtime.rule == rule
    run = run_replay(runtime, records[:40], tokenizer, drafter, batch_size=4)
    total = sum(len(tokenizer.encode_output(r.output)) for r in records[:40])
    assert run.total().tokens == total
    d = runtime.stats.decisions
    assert d["cache"] > 0 and d["model"] > 0
    state = runtime.rival.state()
    if rule == "vllm-adaptive":
        assert state["refits"] == runtime.stats.steps // REFIT_INTERVAL > 0
        assert state["slope"] != INIT_SLOPE or any(b != INIT_BIAS for b in state["intercepts"])  # it learned
    if rule == "sglang-hybrid":
        assert state["warm"] and state["batches"]["suffix"] + state["batches"]["model"] > 0
