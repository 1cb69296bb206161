"""The verification allocator against exhaustive search, its constraints, and the drafter curve."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.decision.allocator import (AUTO, CACHE, FORCE_MODEL, FORCE_NONE, FULL_CACHE, MODEL, NO_CACHE, NONE, allocate)
from predictor.decision.drafter_survival import DrafterSurvival
from predictor.decision.profiles import CostProfile, DrafterProfile

CPU = CostProfile("cpu", base_ms=23.3, per_token_ms=1.36, draft_token_ms=1.5, batch8_base_ms=38.8,
                  batch8_per_token_ms=12.17, batch8_draft_token_ms=2.2)
GPU = CostProfile("gpu", base_ms=6.5, per_token_ms=0.03, draft_token_ms=0.4, per_request_ms=0.05,
                  compute_ms_per_token=0.025)


def _curves(rng: np.random.Generator, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, width + 1, n)
    s = np.cumprod(rng.uniform(0.2, 1.0, (n, width)), axis=1)
    return np.where(np.arange(width)[None, :] < lengths[:, None], s, 0.0), lengths


def _brute(s, lengths, se, cost, batch):
    """The best tokens per millisecond over every combination of per-request choices and k."""
    n = len(lengths)
    best = 0.0
    for k in range(se.shape[1] + 1):
        options = [[("c", l) for l in range(lengths[i] + 1)] + ([("m", k)] if k else []) for i in range(n)]
        for combo in itertools.product(*options):
            users = sum(1 for c, _ in combo if c == "m")
            tokens = n + sum(s[i, :l].sum() if c == "c" else se[i, :k].sum() for i, (c, l) in enumerate(combo))
            query = n + sum(l for _, l in combo)
            best = max(best, tokens / cost.step_ms(batch, query, k if users else 0))
    return best


@pytest.mark.parametrize("cost", [CPU, GPU], ids=["cpu", "gpu"])
def test_within_half_a_percent_of_exhaustive_search(cost):
    rng = np.random.default_rng(0)
    worst = 1.0
    for trial in range(60):
        n = int(rng.integers(1, 4))
        s, lengths = _curves(rng, n, 4)
        se = np.cumprod(rng.uniform(0.1, 0.9, (1, 3)), axis=1).repeat(n, 0)
        batch = int(rng.choice([1, 8, 64]))
        a = allocate(s, lengths, se, cost, batch=batch)
        optimum = _brute(s, lengths, se, cost, batch)
        assert a.rate <= optimum + 1e-9
        worst = min(worst, a.rate / optimum)
    assert worst >= 0.995


def test_plan_is_consistent_with_its_own_figures():
    rng = np.random.default_rng(1)
    s, lengths = _curves(rng, 16, 24)
    se = np.tile([0.6, 0.4, 0.25], (16, 1))
    a = allocate(s, lengths, se, CPU)
    assert np.all(a.length[a.source == CACHE] <= lengths[a.source == CACHE])
    assert np.all(a.length[a.source == MODEL] == a.model_k)
    assert np.all(a.length[a.source == NONE] == 0)
    query = 16 + int(a.length.sum())
    assert a.step_ms == pytest.approx(CPU.step_ms(16, query, a.model_k if (a.source == MODEL).any() else 0))
    assert a.rate == pytest.approx(a.expected.sum() / a.step_ms)
    cache = a.source == CACHE
    want = 1.0 + np.array([s[i, : a.length[i]].sum() for i in range(16)])
    assert np.allclose(a.expected[cache], want[cache])


def test_certain_drafts_are_verified_whole_and_hopeless_ones_not_at_all():
    s = np.array([[1.0] * 6 + [0.0] * 2, [0.01] * 8])
    a = allocate(s, np.array([6, 8]), np.zeros((2, 0)), CPU)
    assert a.source.tolist() == [CACHE, NONE]
    assert a.length.tolist() == [6, 0]


def test_drafts_are_cut_where_survival_stops_paying():
    # Survival falls off a cliff after 3 tokens: verifying the tail costs more than it brings.
    s = np.array([[0.95, 0.9, 0.85, 0.02, 0.01, 0.005]])
    a = allocate(s, np.array([6]), np.zeros((1, 0)), CPU)
    assert a.length.tolist() == [3]


def test_bigger_batches_on_a_compute_bound_machine_verify_fewer_tokens():
    rng = np.random.default_rng(2)
    s, lengths = _curves(rng, 64, 16)
    alone = [allocate(s[i : i + 1], lengths[i : i + 1], np.zeros((1, 0)), GPU) for i in range(64)]
    at_64 = allocate(s, lengths, np.zeros((64, 0)), GPU)
    # Alone, a query token costs 0.03 ms against a 6.5 ms base: draft token j is worth verifying while
    # its survival S(j) beats per_token_ms x the step's rate (tokens per ms). Request 0's 14-token
    # draft is cut after 12: rate = (1 + S(1) + .. + S(12)) / (6.5 + 0.03 x 13) = 3.63 / 6.89 = 0.53,
    # break-even S = 0.0158, S(12) = 0.0163 stays in, S(13) = 0.0123 would not pay.
    first = alone[0]
    l = int(first.length[0])
    rate = (1 + s[0, :l].sum()) / GPU.step_ms(1, 1 + l)
    assert first.source.tolist() == [CACHE] and (l, lengths[0]) == (12, 14)
    assert s[0, l - 1] > GPU.per_token_ms * rate > s[0, l]
    # At batch 64 a query token still costs 0.03 ms but the step's rate is 64 requests' worth (~8.6
    # tokens per ms): break-even S ~ 0.26, so no request verifies more than it would alone, and on
    # average far fewer (about 2 tokens against about 6).
    alone_lengths = np.array([a.length[0] for a in alone])
    assert np.all(at_64.length <= alone_lengths)
    assert at_64.length.mean() < 0.5 * alone_lengths.mean()


def test_model_drafter_is_called_once_for_the_step_with_one_k():
    s = np.zeros((4, 8))
    se = np.tile([0.9, 0.8, 0.7, 0.6, 0.5], (4, 1))
    a = allocate(s, np.zeros(4, dtype=int), se, CPU)
    assert set(a.source.tolist()) == {MODEL} and 1 <= a.model_k <= 5
    assert set(a.length.tolist()) == {a.model_k}


def test_constraints_are_obeyed():
    s = np.tile([0.9, 0.8, 0.7, 0.1], (5, 1))
    lengths = np.full(5, 4)
    se = np.tile([0.5, 0.2], (5, 1))
    mode = np.array([AUTO, FULL_CACHE, NO_CACHE, FORCE_MODEL, FORCE_NONE], dtype=np.int8)
    a = allocate(s, lengths, se, CPU, mode=mode)
    assert a.source[1] == CACHE and a.length[1] == 4
    assert a.source[2] in (MODEL, NONE)
    assert a.source[3] == MODEL and a.model_k >= 1
    assert a.source[4] == NONE and a.length[4] == 0


def test_tau_is_the_break_even_expected_length():
    s = np.array([[0.9, 0.8, 0.7, 0.6]])
    a = allocate(s, np.array([4]), np.zeros((1, 0)), CPU)
    _, per_query = CPU.step_line(1)
    assert a.tau[0] == pytest.approx(a.rate * per_query * 4)


@pytest.mark.parametrize("bad, message", [
    (dict(cache_survival=np.full((1, 2), 1.5)), "cache_survival must hold probabilities"),
    (dict(cache_survival=np.full((1, 2), np.nan)), "cache_survival must hold probabilities"),
    (dict(cache_len=np.array([-1])), "cache_len must be >= 0"),
    (dict(mode=np.array([9])), "mode must be one of"),
    (dict(model_survival=np.zeros((2, 3))), "one row per request"),
])
def test_bad_inputs_are_named(bad, message):
    args = dict(cache_survival=np.full((1, 2), 0.5), cache_len=np.array([2]), model_survival=np.zeros((1, 3)),
                cost=CPU)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        allocate(**args)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 24), st.integers(0, 5), st.integers(0, 2**31 - 1),
       st.sampled_from([1, 8, 32]))
def test_never_worse_than_no_speculation_or_the_whole_drafts(n, width, k_max, seed, batch):
    rng = np.random.default_rng(seed)
    s, lengths = _curves(rng, n, width)
    se = np.cumprod(rng.uniform(0.0, 1.0, (n, k_max)), axis=1)
    a = allocate(s, lengths, se, CPU, batch=batch)
    plain = n / CPU.step_ms(batch, n)
    whole = (n + s.sum()) / CPU.step_ms(batch, n + lengths.sum())
    assert a.rate >= max(plain, whole) - 1e-9
    assert np.all((a.length >= 0) & (a.length <= np.maximum(lengths, a.model_k)))


def test_drafter_curve_starts_at_the_prior_and_learns():
    profile = DrafterProfile("d", draft_len=3, acceptance=0.5)
    est = DrafterSurvival(profile, ("a", "b"), prior_drafts=10, decay=0.0)
    assert np.allclose(est.curve(0), [0.5, 0.25, 0.125])
    for _ in range(990):
        est.observe(0, 3, 3)  # every draft fully accepted
    assert est.curve(0)[2] > 0.97 and np.allclose(est.curve(1), [0.5, 0.25, 0.125])
    est2 = DrafterSurvival(profile, ("a",), prior_drafts=1e-9, decay=0.0)
    for accepted in (0, 1, 2, 3):  # reached: 4, 3, 2; accepted at j: 3, 2, 1
        est2.observe(0, 3, accepted)
    assert np.allclose(est2.curve(0), np.cumprod([3 / 4, 2 / 3, 1 / 2]))
    with pytest.raises(ValueError, match="accepted 4 outside"):
        est2.observe(0, 3, 4)


def test_batch_one_steps_decided_at_once_are_exact():
    from predictor.decision.allocator import allocate_each

    rng = np.random.default_rng(5)
    s, lengths = _curves(rng, 40, 5)
    se = np.cumprod(rng.uniform(0.1, 0.95, (40, 3)), axis=1)
    each = allocate_each(s, lengths, se, CPU)
    for i in range(40):
        optimum = _brute(s[i : i + 1], lengths[i : i + 1], se[i : i + 1], CPU, 1)
        assert each.expected[i] / each.step_ms[i] == pytest.approx(optimum)
