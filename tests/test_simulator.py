"""The offline policy simulator on hand-built inputs whose cycle counts are computed by hand."""
from __future__ import annotations

import numpy as np
import pytest

from predictor.goodput import tau_star
from predictor.profiles import CostProfile, DrafterProfile, ProfileError, cost_profiles, drafter_profiles
from predictor.simulator import CACHE, MODEL, NONE, POLICIES, SimInput, decisions, figures, model_accepted, simulate

# Flat cost: every forward costs 10 ms whatever its width, drafting is free -> tau* = mu_e exactly.
FLAT = CostProfile("flat", base_ms=10.0, per_token_ms=0.0, draft_token_ms=0.0)
DRAFTER = DrafterProfile("test", draft_len=2, acceptance=0.5)  # mu_e = 0.5 + 0.25 = 0.75

# Trace 0: 10 output tokens, rows t = 1..9. Trace 1: one token (no rows). Trace 2: 3 tokens.
DRAFT_LEN = [4, 0, 3, 5, 0, 2, 6, 1, 3] + [2, 0]
LABEL = [3, 0, 0, 5, 0, 2, 6, 1, 3] + [2, 0]
SCORE = [3.0, 0, 1.0, 5, 0, 1.5, 6, 1, 2.0] + [2.0, 0]
PREDICTED = [0.5, 0, 2, 4, 0, 3, 5, 0.8, 0.1] + [0.0, 0.0]
MODEL_ACC = np.array([2, 0, 1, 0, 2, 0, 0, 1, 0] + [2, 2])


def _input() -> SimInput:
    return SimInput(
        trace=np.array([0] * 9 + [2] * 2),
        position=np.array(list(range(1, 10)) + [1, 2]),
        draft_len=np.array(DRAFT_LEN),
        label=np.array(LABEL),
        score=np.array(SCORE, dtype=np.float32),
        predicted=np.array(PREDICTED, dtype=np.float32),
        traces=np.array([0, 1, 2]),
        output_len=np.array([10, 1, 3]),
        trace_workload=np.array([0, 0, 0]),
    )


def _run(policy: str):
    return simulate(policy, _input(), DRAFTER, FLAT, MODEL_ACC)


def test_tau_is_mu_under_flat_cost():
    assert DRAFTER.mean_accepted == pytest.approx(0.75)
    np.testing.assert_allclose(tau_star(np.array([1, 5, 24]), DRAFTER.mean_accepted, 2, FLAT), 0.75)


@pytest.mark.parametrize(
    ("policy", "cycles", "wasted", "cache_cycles"),
    [
        # one token per cycle
        ("none", [10, 1, 3], [0, 0, 0], [0, 0, 0]),
        # t=1 y=3 (k=4) -> 5; no draft -> 6; y=2 -> 9; y=3 capped at 1 left (2 wasted) -> done
        ("suffix", [5, 1, 2], [3, 0, 0], [3, 0, 1]),
        # model acc 2 -> 4; 0 -> 5; 2 -> 8; 1 -> 10
        ("model", [5, 1, 2], [3, 0, 0], [0, 0, 0]),
        # cache iff score >= 2: t=1 cache y=3 -> 5; model 2 -> 8; score 1 -> model 1 -> 10
        ("arctic", [4, 1, 2], [2, 0, 0], [1, 0, 1]),
        # cache iff predicted > 0.75: t=1 model 2 -> 4; cache y=5 -> 10
        ("hvd", [3, 1, 2], [0, 0, 0], [1, 0, 0]),
        # cache iff label > 0.75: t=1 cache 3 -> 5; model 2 -> 8; cache 1 -> 10
        ("oracle", [4, 1, 2], [1, 0, 0], [2, 0, 1]),
    ],
)
def test_cycles_by_hand(policy, cycles, wasted, cache_cycles):
    tallies = _run(policy)
    assert sorted(tallies) == [0, 1, 2]
    assert [tallies[i].cycles for i in (0, 1, 2)] == cycles
    assert [tallies[i].wasted for i in (0, 1, 2)] == wasted
    assert [tallies[i].cache_cycles for i in (0, 1, 2)] == cache_cycles
    assert [tallies[i].tokens for i in (0, 1, 2)] == [10, 1, 3]
    # every forward costs 10 ms under the flat profile
    assert [tallies[i].time_ms for i in (0, 1, 2)] == pytest.approx([10.0 * c for c in cycles])


def test_trace_2_under_hvd_uses_the_model_on_its_own_rows():
    # trace 2's rows start at index 9: predicted 0 -> model (acc 2, capped at the 2 tokens left)
    t = _run("hvd")[2]
    assert (t.cycles, t.wasted) == (2, 0)


def test_figures_from_a_tally():
    tally = _run("suffix")[0]
    f = figures(tally, baseline_ms_per_token=FLAT.target_ms(1))
    assert f.cycles_per_1k == pytest.approx(500.0)
    assert f.tokens_per_cycle == pytest.approx(2.0)
    assert f.wasted_per_1k == pytest.approx(300.0)
    assert f.speedup == pytest.approx(2.0)
    assert f.cache_share == pytest.approx(3 / 5)
    none = figures(_run("none")[0], FLAT.target_ms(1))
    assert none.cycles_per_1k == 1000.0 and none.speedup == pytest.approx(1.0)


def test_decisions_values():
    data = _input()
    assert decisions("none", data, DRAFTER, FLAT).tolist() == [NONE] * 11
    assert decisions("suffix", data, DRAFTER, FLAT).tolist() == [CACHE if k else NONE for k in DRAFT_LEN]
    assert decisions("model", data, DRAFTER, FLAT).tolist() == [MODEL] * 11
    assert decisions("oracle", data, DRAFTER, FLAT).tolist() == [CACHE if y >= 1 else MODEL for y in LABEL]
    with pytest.raises(ValueError, match="unknown policy 'bogus'"):
        decisions("bogus", data, DRAFTER, FLAT)
    assert set(POLICIES) == {"none", "suffix", "model", "arctic", "hvd", "oracle"}


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


@pytest.mark.parametrize("drafter", list(drafter_profiles().values()) + [DrafterProfile("x", 3, 0.9)],
                         ids=lambda d: d.name)
def test_model_accepted_matches_profile(drafter):
    a = model_accepted(200_000, drafter, seed=3)
    assert a.min() >= 0 and a.max() <= drafter.draft_len
    assert a.mean() == pytest.approx(drafter.mean_accepted, abs=0.02)
    for i in range(1, drafter.draft_len + 1):  # P(a >= i) = acceptance ** i
        assert (a >= i).mean() == pytest.approx(drafter.acceptance**i, abs=0.01)
    assert np.array_equal(a, model_accepted(200_000, drafter, seed=3))
    assert not np.array_equal(a, model_accepted(200_000, drafter, seed=4))


def test_model_accepted_with_zero_acceptance():
    assert model_accepted(10, DrafterProfile("z", 4, 0.0), seed=0).tolist() == [0] * 10


def test_per_workload_acceptance_is_used_per_row():
    from predictor.profiles import chain_acceptance, chain_mean
    from predictor.traces import WORKLOADS

    d = DrafterProfile("m", 3, 0.2, by_workload={"sql": 0.8}, measured=True)
    workload = np.array([WORKLOADS.index("sql")] * 100_000 + [WORKLOADS.index("chat")] * 100_000)
    a = model_accepted(len(workload), d, seed=1, workload=workload)
    assert a[:100_000].mean() == pytest.approx(chain_mean(0.8, 3), abs=0.02)
    assert a[100_000:].mean() == pytest.approx(chain_mean(0.2, 3), abs=0.02)
    assert d.mean_accepted_for("sql") == pytest.approx(0.8 + 0.64 + 0.512)
    assert chain_acceptance(chain_mean(0.37, 3), 3) == pytest.approx(0.37, abs=1e-9)
    with pytest.raises(ProfileError, match="by_workload.sql"):
        DrafterProfile("bad", 3, 0.2, by_workload={"sql": 1.5})
