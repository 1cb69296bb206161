"""The offline policy simulator on hand-built inputs whose cycles, steps and milliseconds are computed by hand."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.decision.binary_rule import tau_star
from predictor.decision.profiles import CostProfile, DrafterProfile, ProfileError, cost_profiles, drafter_profiles
from predictor.evaluation.simulator import (ALLOCATED, CACHE, MODEL, NONE, POLICIES, SETTINGS, SimInput, Simulator, binary_rule,
                                 decisions, figures, model_accepted, setting_name, simulate)

# Flat cost: every forward costs 10 ms whatever its width, drafting is free -> tau* = mu_e exactly.
FLAT = CostProfile("flat", base_ms=10.0, per_token_ms=0.0, draft_token_ms=0.0)
DRAFTER = DrafterProfile("test", draft_len=2, acceptance=0.5)  # mu_e = 0.5 + 0.25 = 0.75
# The measured CPU fits (batch 1 and 8) and an H100-like profile with a compute-bound floor.
CPU = CostProfile("cpu", base_ms=23.3, per_token_ms=1.36, draft_token_ms=1.5, batch8_base_ms=38.8,
                  batch8_per_token_ms=12.17)
GPU = CostProfile("gpu", base_ms=6.5, per_token_ms=0.03, draft_token_ms=0.4)


def rival_inputs(data: SimInput, width: int = 24) -> SimInput:
    """What the competitors' rules read, made up from each row's own figures: a match as long as
    the draft, token probabilities 0.9 up to the accepted length and 0.3 past it."""
    j = np.arange(width)[None, :]
    dl, label = np.asarray(data.draft_len)[:, None], np.asarray(data.label)[:, None]
    prob = np.where(j < dl, np.where(j < label, 0.9, 0.3), 0.0).astype(np.float32)
    return replace(data, match_len=np.asarray(data.draft_len, dtype=np.int64), token_prob=prob)

# Trace 0: 10 output tokens, rows t = 1..9. Trace 1: one token (no rows). Trace 2: 3 tokens.
DRAFT_LEN = [4, 0, 3, 5, 0, 2, 6, 1, 3] + [2, 0]
LABEL = [3, 0, 0, 5, 0, 2, 6, 1, 3] + [2, 0]
SCORE = [3.0, 0, 1.0, 5, 0, 1.5, 6, 1, 2.0] + [2.0, 0]
PREDICTED = [0.5, 0, 2, 4, 0, 3, 5, 0.8, 0.1] + [0.0, 0.0]
MODEL_ACC = np.array([2, 0, 1, 0, 2, 0, 0, 1, 0] + [2, 2])


def _input(survival: np.ndarray | None = None) -> SimInput:
    return rival_inputs(SimInput(
        trace=np.array([0] * 9 + [2] * 2),
        position=np.array(list(range(1, 10)) + [1, 2]),
        draft_len=np.array(DRAFT_LEN),
        label=np.array(LABEL),
        score=np.array(SCORE, dtype=np.float32),
        predicted=np.array(PREDICTED, dtype=np.float32),
        traces=np.array([0, 1, 2]),
        output_len=np.array([10, 1, 3]),
        trace_workload=np.array([0, 0, 0]),
        survival=survival,
    ))


def _run(policy: str):
    return simulate(policy, _input(), DRAFTER, FLAT, MODEL_ACC)


def test_tau_is_mu_under_flat_cost():
    assert DRAFTER.mean_accepted == pytest.approx(0.75)
    np.testing.assert_allclose(tau_star(np.array([1, 5, 24]), DRAFTER.mean_accepted, 2, FLAT), 0.75)


HAND = [
    # one token per cycle
    ("none", [10, 1, 3], [0, 0, 0], [0, 0, 0]),
    # t=1 y=3 (k=4) -> 5; no draft -> 6; y=2 -> 9; y=3 capped at 1 left (2 wasted) -> done
    ("suffix", [5, 1, 2], [3, 0, 0], [3, 0, 1]),
    # model acc 2 -> 4; 0 -> 5; 2 -> 8; 1 -> 10
    ("model", [5, 1, 2], [3, 0, 0], [0, 0, 0]),
    # cache iff score >= 2: t=1 cache y=3 -> 5; model 2 -> 8; score 1 -> model 1 -> 10
    ("arctic", [4, 1, 2], [2, 0, 0], [1, 0, 1]),
    # cache iff predicted > 0.75: t=1 model 2 -> 4; cache y=5 -> 10
    ("hvd-binary", [3, 1, 2], [0, 0, 0], [1, 0, 0]),
    # a point-estimate gate (no survival curves): hvd is the binary rule
    ("hvd", [3, 1, 2], [0, 0, 0], [1, 0, 0]),
    # cache iff label > 0.75: t=1 cache 3 -> 5; model 2 -> 8; cache 1 -> 10
    ("oracle", [4, 1, 2], [1, 0, 0], [2, 0, 1]),
]


@pytest.mark.parametrize(("policy", "cycles", "wasted", "cache_cycles"), HAND)
def test_cycles_by_hand(policy, cycles, wasted, cache_cycles):
    tallies = _run(policy)
    assert sorted(tallies) == [0, 1, 2]
    assert [tallies[i].cycles for i in (0, 1, 2)] == cycles
    assert [tallies[i].wasted for i in (0, 1, 2)] == wasted
    assert [tallies[i].cache_cycles for i in (0, 1, 2)] == cache_cycles
    assert [tallies[i].tokens for i in (0, 1, 2)] == [10, 1, 3]
    # every forward costs 10 ms under the flat profile
    assert [tallies[i].time_ms for i in (0, 1, 2)] == pytest.approx([10.0 * c for c in cycles])


def test_trace_2_under_hvd_binary_uses_the_model_on_its_own_rows():
    # trace 2's rows start at index 9: predicted 0 -> model (acc 2, capped at the 2 tokens left)
    t = _run("hvd-binary")[2]
    assert (t.cycles, t.wasted) == (2, 0)


def test_figures_from_a_tally():
    tally = _run("suffix")[0]
    f = figures(tally, baseline_ms_per_token=FLAT.target_ms(1))
    assert f.cycles_per_1k == pytest.approx(500.0)
    assert f.tokens_per_cycle == pytest.approx(2.0)
    assert f.wasted_per_1k == pytest.approx(300.0)
    assert f.speedup == pytest.approx(2.0)
    assert f.cache_share == pytest.approx(3 / 5)
    assert tally.ms_per_1k == pytest.approx(5000.0)
    # without its prefill cycle (10 ms, 1 token): 4 cycles, 9 tokens
    assert (tally.first_tokens, tally.first_ms) == (1, pytest.approx(10.0))
    assert tally.decode_ms_per_1k == pytest.approx(1000 * 40 / 9)
    none = figures(_run("none")[0], FLAT.target_ms(1))
    assert none.cycles_per_1k == 1000.0 and none.speedup == pytest.approx(1.0)


def test_decisions_values():
    data = _input()
    assert decisions("none", data, DRAFTER, FLAT).tolist() == [NONE] * 11
    assert decisions("suffix", data, DRAFTER, FLAT).tolist() == [CACHE if k else NONE for k in DRAFT_LEN]
    assert decisions("model", data, DRAFTER, FLAT).tolist() == [MODEL] * 11
    assert decisions("oracle", data, DRAFTER, FLAT).tolist() == [CACHE if y >= 1 else MODEL for y in LABEL]
    with pytest.raises(ValueError, match="unknown fixed-plan policy 'bogus'"):
        decisions("bogus", data, DRAFTER, FLAT)
    with pytest.raises(ValueError, match="unknown policy 'bogus'"):
        simulate("bogus", data, DRAFTER, FLAT, MODEL_ACC)
    assert set(POLICIES) == {"none", "suffix", "model", "arctic", "vllm-adaptive", "sglang-hybrid", "trtllm", "hvd", "hvd-binary",
                             "oracle", "oracle-length"}
    assert set(ALLOCATED) == {"hvd", "oracle-length"}
    assert [f"{c}/b{b}" for c, b in SETTINGS] == ["cpu-smollm2/b1", "cpu-smollm2/b8", "gpu-8b/b1", "gpu-8b/b64"]
    assert setting_name(CPU, 8) == "cpu/b8"


def test_arctic_rule_is_score_at_least_model_draft_len():
    drafter = DrafterProfile("d", draft_len=5, acceptance=0.5)
    data = SimInput(
        trace=np.zeros(5, dtype=np.int64), position=np.arange(1, 6), draft_len=np.array([3, 8, 8, 0, 24]),
        label=np.zeros(5, dtype=np.int64), score=np.array([5.0, 4.999, 5.0, 9.0, 24.0], dtype=np.float32),
        predicted=np.zeros(5, dtype=np.float32), traces=np.array([0]), output_len=np.array([6]),
        trace_workload=np.array([0]),
    )
    # score == draft_len verifies the cache; just below, or no cache draft at all, uses the model
    assert decisions("arctic", data, drafter, FLAT).tolist() == [CACHE, MODEL, CACHE, MODEL, CACHE]


def test_hvd_threshold_grows_with_draft_length_on_cpu_cost():
    cpu = cost_profiles()["cpu-smollm2"]
    tau = tau_star(np.array([1, 8, 24]), DRAFTER.mean_accepted, DRAFTER.draft_len, cpu)
    assert tau[0] < tau[1] < tau[2]


def test_binary_rule_prices_the_request_share_at_the_batch_size():
    """At batch 8 on the CPU fits a weak model draft loses to a plain step (the runtime's fallback
    rule then picks none) and tau is measured against the plain step."""
    weak = DrafterProfile("weak", draft_len=3, acceptance=0.3764)
    data = _input()
    tau1, fallback1 = binary_rule(data, weak, CPU, 1)
    tau8, fallback8 = binary_rule(data, weak, CPU, 8)
    share = CPU.per_request(8)
    k = np.array(DRAFT_LEN, dtype=np.float64)
    assert fallback1.tolist() == [MODEL] * 11  # (0.571 + 1) / 33.24 ms beats 1 / 24.66 ms
    assert fallback8.tolist() == [NONE] * 11  # (0.571 + 1) / 11.49 ms loses to 1 / 6.37 ms
    np.testing.assert_allclose(tau1, tau_star(k, weak.mean_accepted, 3, CPU))
    np.testing.assert_allclose(tau8, share.target_ms(1 + k) / share.target_ms(1) - 1.0)
    assert decisions("oracle", data, weak, CPU, batch=8).tolist() == [CACHE if y > t else NONE for y, t in zip(LABEL, tau8)]


# ------------------------------------------------------------------ the binary rule priced, by hand

# Round figures: a forward over n query tokens costs 20 + 2n ms, a drafted token 1 ms.
ROUND = CostProfile("round", base_ms=20.0, per_token_ms=2.0, draft_token_ms=1.0)


def test_hvd_binary_and_oracle_priced_by_hand():
    """One trace of 8 tokens under a non-flat cost, every figure worked out below.

    Model drafter: 2 tokens at 0.5 each, mu_e = 0.5 + 0.25 = 0.75; its step costs
    20 + 2 x (1 + 2) + 2 x 1 = 28 ms. It beats a plain step (1.75 / 28 = 0.0625 > 1 / 22 tokens per
    ms), so it is the fallback, and tau(k) = (mu_e + 1) x (20 + 2 x (1 + k)) / 28 - 1 = 0.375 + 0.125 k:
    tau(2) = 0.625, tau(4) = 0.875, tau(6) = 1.125.
    Prefill: token 1, 22 ms. Only positions 1, 5 and 6 are ever reached (below).
    """
    #          pos: 1    2  3  4  5    6    7
    draft_len = [4, 0, 0, 0, 2, 6, 0]
    label = [3, 0, 0, 0, 0, 1, 0]
    predicted = [2.0, 0, 0, 0, 1.0, 0.9, 0]
    model_acc = np.array([1, 0, 0, 0, 2, 1, 0])
    data = _one_trace(draft_len, label, length=8)
    data.predicted = np.array(predicted, dtype=np.float32)
    drafter = DrafterProfile("half", draft_len=2, acceptance=0.5)
    tau, fallback = binary_rule(data, drafter, ROUND)
    np.testing.assert_allclose(tau, [0.375 + 0.125 * k for k in draft_len])
    assert fallback.tolist() == [MODEL] * 7
    # hvd-binary: pos 1 predicted 2 > 0.875: cache, 3 of 4 accepted, 4 tokens (5 in all), 1 wasted,
    #   20 + 2 x 5 = 30 ms; pos 5 predicted 1 > 0.625: cache, 0 of 2 accepted, 1 token, 2 wasted,
    #   20 + 2 x 3 = 26 ms; pos 6 predicted 0.9 < 1.125: model, 1 of 2 accepted, the last 2 tokens,
    #   1 wasted, 28 ms. 4 cycles, 4 wasted, 2 cache cycles, 22 + 30 + 26 + 28 = 106 ms.
    # oracle: pos 1 label 3 > 0.875: cache as above (30 ms); pos 5 label 0 < 0.625: model, 2 of 2
    #   accepted, the last 3 tokens, none wasted, 28 ms. 3 cycles, 1 wasted, 1 cache cycle,
    #   22 + 30 + 28 = 80 ms.
    for policy, want in (("hvd-binary", (8, 4, 4, 2, 1, 106.0)), ("oracle", (8, 3, 1, 1, 1, 80.0))):
        t = simulate(policy, data, drafter, ROUND, model_acc)[0]
        assert (t.tokens, t.cycles, t.wasted, t.cache_cycles, t.model_cycles, t.time_ms) == pytest.approx(want), policy


# ------------------------------------------------------------------ the old simulator's hvd, kept as hvd-binary

def _fixture_input() -> SimInput:
    """Random drafts over 4 traces (one of a single token), in 4 workloads."""
    rng = np.random.default_rng(7)
    lens = [40, 1, 25, 33]
    trace, pos, dl, lab, sc, pr = [], [], [], [], [], []
    for i, length in enumerate(lens):
        for t in range(1, length):
            k = int(rng.integers(0, 13))
            y = int(rng.integers(0, k + 1)) if k else 0
            trace.append(i), pos.append(t), dl.append(k), lab.append(y)
            sc.append(float(y) + rng.normal())
            pr.append(max(0.0, y + rng.normal() * 1.5) if k else 0.0)
    return SimInput(np.array(trace), np.array(pos), np.array(dl), np.array(lab), np.array(sc, np.float32),
                    np.array(pr, np.float32), np.arange(4), np.array(lens), np.array([0, 1, 2, 3]))


FIXTURE_DRAFTER = DrafterProfile("d", draft_len=3, acceptance=0.4, by_workload={"sql": 0.6})
# A REGRESSION GUARD, not a check of correctness: per trace [cycles, wasted, cache cycles, ms], as the
# simulator computed them before the allocator (commit bac6f3a, predictor/simulator.py:
# simulate("hvd"/"oracle", ..., model_accepted(.., seed=5))). They catch a change, not an error; the
# same rule priced by hand is test_hvd_binary_and_oracle_priced_by_hand.
OLD = {
    ("cpu", "hvd"): [[8, 22, 7, 272.08], [1, 0, 0, 24.66], [6, 13, 5, 192.84], [8, 12, 5, 256.6]],
    ("cpu", "oracle"): [[8, 21, 6, 275.22], [1, 0, 0, 24.66], [6, 13, 5, 192.84], [8, 18, 6, 260.26]],
    ("gpu", "hvd"): [[8, 22, 7, 53.89], [1, 0, 0, 6.53], [6, 13, 5, 40.17], [8, 26, 7, 53.77]],
    ("gpu", "oracle"): [[8, 21, 6, 55.06], [1, 0, 0, 6.53], [6, 13, 5, 40.17], [8, 26, 7, 53.77]],
}


@pytest.mark.parametrize(("cost", "policy"), list(OLD))
def test_regression_guard_hvd_binary_and_oracle_match_the_old_simulator(cost, policy):
    """Regression guard: the figures of the simulator before the allocator (golden numbers, see OLD)."""
    data = _fixture_input()
    acc = model_accepted(len(data.trace), FIXTURE_DRAFTER, 5, data.trace_workload[data.trace])
    profile = {"cpu": CPU, "gpu": GPU}[cost]
    tallies = simulate("hvd-binary" if policy == "hvd" else policy, data, FIXTURE_DRAFTER, profile, acc)
    got = [[tallies[i].cycles, tallies[i].wasted, tallies[i].cache_cycles, round(tallies[i].time_ms, 6)] for i in range(4)]
    assert got == OLD[(cost, policy)]
    assert [tallies[i].tokens for i in range(4)] == [40, 1, 25, 33]


# ------------------------------------------------------------------ the allocator's policies

def _one_trace(draft_len, label, survival=None, length=None) -> SimInput:
    n = len(draft_len)
    return rival_inputs(SimInput(trace=np.zeros(n, np.int64), position=np.arange(1, n + 1), draft_len=np.array(draft_len),
                    label=np.array(label), score=np.zeros(n, np.float32),
                    predicted=np.zeros(n, np.float32) if survival is None else survival.sum(1).astype(np.float32),
                    traces=np.array([0]), output_len=np.array([length or n + 1]), trace_workload=np.array([0]),
                    survival=survival))


NO_MODEL = DrafterProfile("useless", draft_len=2, acceptance=0.0)  # its curve is all zero: never worth a call


def test_oracle_length_verifies_fully_accepted_drafts_whole():
    # 13 tokens; every row's 4-token draft is right: t=1 -> 6 -> 11 -> (4 accepted, 2 left: 2 used) done
    data = _one_trace([4] * 12, [4] * 12)
    sim = Simulator(data, NO_MODEL, np.zeros(12, np.int64))
    plan = sim.plan("oracle-length", CPU)
    assert plan.source.tolist() == [CACHE] * 12 and plan.length.tolist() == [4] * 12
    t = sim.per_trace("oracle-length", CPU)[0]
    assert (t.tokens, t.cycles, t.wasted, t.cache_cycles) == (13, 4, 2, 3)
    assert t.time_ms == pytest.approx(CPU.target_ms(1) + 3 * CPU.target_ms(5))


def test_hvd_cuts_a_draft_where_its_survival_falls_off_a_cliff():
    # S = 1, 1, 1, then 0.05: at 23.3 ms + 1.36 ms per query token, l = 3 gives 4 / 28.74 = 0.139 tokens
    # per ms, l = 4 gives 4.05 / 30.1 = 0.135, the whole 8-token draft 4.25 / 35.54 = 0.120.
    curve = np.array([1.0, 1.0, 1.0] + [0.05] * 5 + [0.0] * 16, dtype=np.float32)
    data = _one_trace([8] * 8, [3] * 8, survival=np.tile(curve, (8, 1)))
    sim = Simulator(data, NO_MODEL, np.zeros(8, np.int64))
    assert sim.plan("hvd", CPU).length.tolist() == [3] * 8
    assert sim.plan("hvd-binary", CPU).length.tolist() == [8] * 8  # predicted 3.25 beats tau
    # 9 tokens: prefill, then t = 1 -> 5 -> 9 with 3 accepted each time
    hvd, binary = sim.per_trace("hvd", CPU)[0], sim.per_trace("hvd-binary", CPU)[0]
    assert (hvd.cycles, hvd.wasted, binary.cycles, binary.wasted) == (3, 0, 3, 10)
    assert hvd.time_ms == pytest.approx(CPU.target_ms(1) + 2 * CPU.target_ms(4))
    assert binary.time_ms == pytest.approx(CPU.target_ms(1) + 2 * CPU.target_ms(9))


# Three traces for lanes at batch 2. A (5 tokens): t=1 draft 2 right -> t=4 draft 1 wrong -> done.
# B (3 tokens): t=1 no draft -> t=2 draft 3, 1 right (1 token left). C (2 tokens): t=1 draft 1 right.
LANES = rival_inputs(SimInput(
    trace=np.array([0, 0, 0, 0, 1, 1, 2]), position=np.array([1, 2, 3, 4, 1, 2, 1]),
    draft_len=np.array([2, 0, 0, 1, 0, 3, 1]), label=np.array([2, 0, 0, 0, 0, 1, 1]),
    score=np.zeros(7, np.float32), predicted=np.zeros(7, np.float32), traces=np.array([0, 1, 2]),
    output_len=np.array([5, 3, 2]), trace_workload=np.array([0, 0, 0]),
))
# 10 ms + 2 ms per further running request + 1 ms per query token of the step.
LINEAR = CostProfile("linear", base_ms=10.0, per_token_ms=1.0, draft_token_ms=0.0, per_request_ms=2.0)


def test_lanes_at_batch_2_by_hand():
    sim = Simulator(LANES, NO_MODEL, np.zeros(7, np.int64))
    # suffix: A's cycles have 1, 3, 2 query tokens, B's 1, 1, 4, C's 1, 2. A and B take the lanes
    # (steps 0-2), C follows in step 3. Steps: (2 lanes, 2 tokens) 14 ms, (2, 4) 16, (2, 6) 18, (1, 1) 11, (1, 2) 12.
    suffix = sim.lanes("suffix", LINEAR, 2, [0, 1, 2])
    assert (suffix.tokens, suffix.cycles, suffix.wasted, suffix.cache_cycles) == (10, 5, 3, 4)
    assert suffix.time_ms == pytest.approx(14 + 16 + 18 + 11 + 12)
    assert suffix.ms_per_1k == pytest.approx(7100.0)
    # steps 0 (A's and B's prefill cycles) and 3 (C's) are left out of the decode-only figure
    assert (suffix.first_tokens, suffix.first_ms) == (3, pytest.approx(14 + 11))
    assert suffix.decode_ms_per_1k == pytest.approx(1000 * (16 + 18 + 12) / 7)
    # oracle-length verifies exactly the right tokens (each is worth its 1 ms at any rate below 1 token
    # per ms): A 1, 3, 1; B 1, 1, 2; C 1, 2 -> 14 + 16 + 15 + 11 + 12 ms, nothing wasted
    length = sim.lanes("oracle-length", LINEAR, 2, [0, 1, 2])
    assert (length.tokens, length.cycles, length.wasted, length.cache_cycles) == (10, 5, 0, 3)
    assert length.time_ms == pytest.approx(68.0)
    assert length.decode_ms_per_1k == pytest.approx(1000 * (68 - 25) / 7)
    # the same traces on one lane: every cycle alone
    one = sim.lanes("suffix", LINEAR, 1, [0, 1, 2])
    assert (one.cycles, one.time_ms) == (8, pytest.approx(11 + 13 + 12 + 11 + 11 + 14 + 11 + 12))


def test_hvd_with_a_perfect_survival_curve_is_oracle_length():
    truth = (np.arange(1, 25)[None, :] <= LANES.label[:, None]).astype(np.float32)
    data = SimInput(**{**LANES.__dict__, "survival": truth})
    sim = Simulator(data, NO_MODEL, np.zeros(7, np.int64))
    for batch in (1, 2, 3):
        a, b = sim.lanes("hvd", LINEAR, batch, [0, 1, 2]), sim.lanes("oracle-length", LINEAR, batch, [0, 1, 2])
        assert (a.tokens, a.cycles, a.wasted, a.time_ms) == (b.tokens, b.cycles, b.wasted, pytest.approx(b.time_ms))


def test_lanes_of_one_trace_match_the_batch_1_walk():
    """The lockstep loop (allocate per step) and the batch-1 walk (allocate_each) agree when one trace
    runs alone, whatever the number of lanes."""
    data = _fixture_input()
    acc = model_accepted(len(data.trace), FIXTURE_DRAFTER, 5, data.trace_workload[data.trace])
    sim = Simulator(data, FIXTURE_DRAFTER, acc)
    for policy in ("oracle-length", "suffix", "model"):  # (the binary rules price at the batch size)
        per = sim.per_trace(policy, CPU)
        for trace in range(4):
            lane = sim.lanes(policy, CPU, 4, [trace])
            ref = per[trace]
            assert (lane.tokens, lane.cycles, lane.wasted, lane.cache_cycles) == (ref.tokens, ref.cycles, ref.wasted, ref.cache_cycles)
            assert lane.time_ms == pytest.approx(ref.time_ms)


def _random_input(seed: int, survival: str) -> tuple[SimInput, np.ndarray]:
    """A few traces of random drafts; survival curves either the truth or a noisy geometric guess."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 30, 5)
    trace = np.repeat(np.arange(5), lens - 1)
    n = len(trace)
    dl = rng.integers(0, 9, n)
    label = np.minimum(rng.geometric(0.3, n) - 1, dl)
    positions = np.arange(1, 25)[None, :]
    if survival == "truth":
        s = (positions <= label[:, None]).astype(np.float32)
    else:
        s = (rng.uniform(0.3, 0.95, n)[:, None] ** positions * (positions <= dl[:, None])).astype(np.float32)
    position = np.concatenate([np.arange(1, k) for k in lens])
    data = rival_inputs(SimInput(trace, position, dl, label, label.astype(np.float32), s.sum(1), np.arange(5), lens,
                                 rng.integers(0, 5, 5), survival=s))
    return data, rng.integers(0, 4, n)


@pytest.mark.parametrize(("cost", "batches"), [(LINEAR, (1, 2, 3)), (CPU, (1, 2, 3)), (GPU, (1,))], ids=["linear", "cpu", "gpu"])
def test_oracle_length_is_the_fastest_on_the_hand_built_inputs(cost, batches):
    """On these inputs no policy beats the allocator fed the truth. (It is the best plan per engine
    step, not over a whole run: on random inputs a luckier path can beat it, and on GPU at batch 2 the
    LANES run lasts as long as B then C in one lane whatever A does, so verifying costs without paying.)"""
    cliff = _one_trace([8] * 8, [3] * 8, survival=np.tile(np.array([1.0] * 3 + [0.05] * 5 + [0.0] * 16, np.float32), (8, 1)))
    whole = _one_trace([4] * 12, [4] * 12)
    for data in (LANES, cliff, whole):
        sim = Simulator(data, NO_MODEL, np.zeros(len(data.trace), np.int64))
        for batch in batches:
            ms = {p: sim.lanes(p, cost, batch, data.traces).ms_per_1k for p in POLICIES}
            assert ms["oracle-length"] <= min(ms.values()) + 1e-9, (batch, ms)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 3, 8]), st.sampled_from(["truth", "guess"]))
def test_every_policy_emits_every_token_once(seed, batch, survival):
    """Invariant: whatever the policy and the batch size, the tokens are the traces' lengths, every
    trace takes at least one cycle per token it did not get from a draft, and steps cost > 0."""
    data, acc = _random_input(seed, survival)
    sim = Simulator(data, DrafterProfile("d", draft_len=3, acceptance=0.5), acc)
    total = int(data.output_len.sum())
    for policy in POLICIES:
        t = sim.lanes(policy, CPU, batch, data.traces)
        assert t.tokens == total, policy
        assert t.time_ms > 0 and t.cycles >= -(-len(data.traces) // batch)
        assert t.wasted >= 0 and t.cache_cycles + t.model_cycles <= total


def test_traces_of_one_token_are_one_plain_cycle_each():
    empty = np.zeros(0, np.int64)
    data = SimInput(empty, empty, empty, empty, np.zeros(0, np.float32), np.zeros(0, np.float32), np.array([0, 1, 2]),
                    np.array([1, 1, 1]), np.array([0, 1, 2]), survival=np.zeros((0, 24), np.float32),
                    match_len=empty, token_prob=np.zeros((0, 24), np.float32))
    sim = Simulator(data, DRAFTER, empty)
    for policy in POLICIES:
        t = sim.lanes(policy, LINEAR, 2, [0, 1, 2])  # steps: (2 lanes, 2 tokens) 14 ms, then (1, 1) 11 ms
        assert (t.tokens, t.cycles, t.wasted, t.time_ms) == (3, 2, 0, pytest.approx(25.0)), policy


def test_bad_inputs_are_named():
    sim = Simulator(_input(), DRAFTER, MODEL_ACC)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        sim.lanes("suffix", FLAT, 0, [0])
    with pytest.raises(ValueError, match="every trace must be one of the SimInput's traces"):
        sim.lanes("suffix", FLAT, 2, [7])
    with pytest.raises(ValueError, match="model_acc has 3 rows, the input 11"):
        Simulator(_input(), DRAFTER, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="survival must be"):
        _input(np.zeros((3, 24), np.float32))
    with pytest.raises(ValueError, match="oracle-length decides per engine step at batch 8"):
        sim.plan("oracle-length", FLAT, 8)


@pytest.mark.parametrize("drafter", list(drafter_profiles().values()) + [DrafterProfile("x", 3, 0.9)],
                         ids=lambda d: d.name)
def test_model_accepted_matches_profile(drafter):
    a = model_accepted(200_000, drafter, seed=3)
    assert a.min() >= 0 and a.max() <= drafter.draft_len
    assert a.mean() == pytest.approx(drafter.mean_accepted, abs=0.02)
    for i in range(1, drafter.draft_len + 1):  # P(a >= i) = S(i): acceptance ** i for a chain
        assert (a >= i).mean() == pytest.approx(drafter.survival_for("")[i - 1], abs=0.01)
    assert np.array_equal(a, model_accepted(200_000, drafter, seed=3))
    assert not np.array_equal(a, model_accepted(200_000, drafter, seed=4))


def test_model_accepted_with_zero_acceptance():
    assert model_accepted(10, DrafterProfile("z", 4, 0.0), seed=0).tolist() == [0] * 10


def test_per_workload_acceptance_is_used_per_row():
    from predictor.decision.profiles import chain_acceptance, chain_mean
    from storage.workloads import WORKLOADS

    d = DrafterProfile("m", 3, 0.2, by_workload={"sql": 0.8}, measured=True)
    workload = np.array([WORKLOADS.index("sql")] * 100_000 + [WORKLOADS.index("chat")] * 100_000)
    a = model_accepted(len(workload), d, seed=1, workload=workload)
    assert a[:100_000].mean() == pytest.approx(chain_mean(0.8, 3), abs=0.02)
    assert a[100_000:].mean() == pytest.approx(chain_mean(0.2, 3), abs=0.02)
    assert d.mean_accepted_for("sql") == pytest.approx(0.8 + 0.64 + 0.512)
    assert chain_acceptance(chain_mean(0.37, 3), 3) == pytest.approx(0.37, abs=1e-9)
    with pytest.raises(ProfileError, match="by_workload.sql"):
        DrafterProfile("bad", 3, 0.2, by_workload={"sql": 1.5})


def test_a_measured_survival_curve_is_what_the_allocator_and_the_simulator_use(tmp_path):
    from predictor.decision.profiles import accepted_from_survival, chain_mean
    from storage.workloads import WORKLOADS

    from controller.engines.trace_engine import model_draft_accepted
    from eagle3_training.acceptance import Acceptance, profile_snippet

    rows = [Acceptance("sql", 6, 900, 100, 300, 150, [70, 50, 30], 1.0),
            Acceptance("chat", 6, 900, 200, 600, 90, [60, 20, 10], 1.0)]
    (tmp_path / "p.toml").write_text(profile_snippet("m", rows, 3, "cmd") + "\n")
    d = drafter_profiles(tmp_path / "p.toml")["m"]
    assert d.measured and d.survival_for("sql").tolist() == [0.7, 0.5, 0.3]
    assert d.survival_for("chat").tolist() == [0.3, 0.1, 0.05]
    assert d.survival_for("agentic").tolist() == pytest.approx([130 / 300, 70 / 300, 40 / 300], abs=1e-4)  # overall
    assert d.mean_accepted_for("sql") == pytest.approx(1.5)
    assert chain_mean(d.acceptance_for("sql"), 3) == pytest.approx(1.5, abs=1e-6)  # same mean as a chain
    workload = np.array([WORKLOADS.index("sql")] * 100_000 + [WORKLOADS.index("chat")] * 100_000)
    a = model_accepted(len(workload), d, seed=2, workload=workload)
    for i, (s_sql, s_chat) in enumerate(zip([0.7, 0.5, 0.3], [0.3, 0.1, 0.05]), 1):
        assert (a[:100_000] >= i).mean() == pytest.approx(s_sql, abs=0.01)
        assert (a[100_000:] >= i).mean() == pytest.approx(s_chat, abs=0.01)
    draws = [model_draft_accepted(d, 0, "t", pos, "sql") for pos in range(20_000)]
    assert np.mean(draws) == pytest.approx(1.5, abs=0.05)
    assert accepted_from_survival(np.array([0.7, 0.5, 0.3]), 0.6) == 1
    with pytest.raises(ProfileError, match="survival_by_workload.sql must be non-increasing"):
        DrafterProfile("bad", 3, 0.2, survival_by_workload={"sql": (0.2, 0.5, 0.1)})
    with pytest.raises(ProfileError, match="must give 3 positions"):
        DrafterProfile("bad", 3, 0.2, survival=(0.5, 0.2))


def test_gpu_profile_has_a_compute_bound_floor_from_published_figures():
    gpu = cost_profiles()["gpu-8b"]
    assert gpu.sources and any("nvidia.com" in s for s in gpu.sources)
    assert gpu.compute_ms_per_token > 0 and gpu.per_request_ms > 0
    # plain decoding at batch 64 is memory-bound; 13 query tokens per request are compute-bound
    assert gpu.step_ms(64, 64) == pytest.approx(gpu.base_ms + 63 * gpu.per_request_ms + 64 * gpu.per_token_ms)
    assert gpu.step_ms(64, 64 * 13) == pytest.approx(64 * 13 * gpu.compute_ms_per_token)
    cpu = cost_profiles()["cpu-smollm2"]
    assert cpu.draft_ms(8, 3) == pytest.approx(6.6)  # 2.2 ms per drafted position at batch 8, measured


def test_deciding_with_one_profile_and_pricing_with_another():
    # hvd-binary's tau comes from the cost profile: deciding with DEAR (10 ms a query token), priced
    # FLAT (10 ms a forward), walks exactly DEAR's cycles and prices each at 10 ms
    dear = CostProfile("dear", base_ms=1.0, per_token_ms=10.0, draft_token_ms=0.0)
    sim = Simulator(_input(), DRAFTER, MODEL_ACC)
    decided = sim.per_trace("hvd-binary", FLAT, decide=dear)
    by_dear, by_flat = sim.per_trace("hvd-binary", dear), sim.per_trace("hvd-binary", FLAT)
    assert [decided[t].cycles for t in (0, 1, 2)] == [by_dear[t].cycles for t in (0, 1, 2)]
    assert [decided[t].cycles for t in (0, 1, 2)] != [by_flat[t].cycles for t in (0, 1, 2)]
    assert [decided[t].time_ms for t in (0, 1, 2)] == pytest.approx([10.0 * by_dear[t].cycles for t in (0, 1, 2)])
    # the allocator at batch 2: LINEAR's plan, every engine step priced FLAT
    lanes = Simulator(LANES, NO_MODEL, np.zeros(7, np.int64))
    mixed = lanes.lanes("oracle-length", FLAT, 2, [0, 1, 2], decide=LINEAR)
    linear = lanes.lanes("oracle-length", LINEAR, 2, [0, 1, 2])
    assert (mixed.tokens, mixed.cycles, mixed.wasted) == (linear.tokens, linear.cycles, linear.wasted)
    assert mixed.time_ms == pytest.approx(10.0 * linear.cycles)
