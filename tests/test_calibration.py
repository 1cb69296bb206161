"""The fast survival calibration: its invariants, that a fit recovers a known miscalibration, its
storage, and that the runtime serves with it (and with per-workload champions)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.gate.calibration import Calibration, CalibrationError, apply, conditional
from predictor.gate.mlp import SURVIVAL_K
from predictor.online.calibrator import CalibrationConfig, Calibrator, fit_position
from storage.workloads import WORKLOADS

K = SURVIVAL_K


def _curves(n: int, seed: int, draft_len: np.ndarray) -> np.ndarray:
    """Survival curves as a gate makes them: products of conditional probabilities, 0 past the draft."""
    rng = np.random.default_rng(seed)
    h = 1.0 / (1.0 + np.exp(-rng.normal(0.5, 1.5, size=(n, K))))
    inside = np.arange(K)[None, :] < draft_len[:, None]
    return np.where(inside, np.cumprod(np.where(inside, h, 1.0), axis=1), 0.0).astype(np.float32)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), slope=st.floats(0.05, 20.0), bias=st.floats(-20.0, 20.0), n=st.integers(1, 30))
def test_a_corrected_curve_is_monotone_in_unit_range_and_zero_past_the_draft(seed, slope, bias, n):
    rng = np.random.default_rng(seed)
    draft_len = rng.integers(0, K + 1, size=n)
    out = apply(_curves(n, seed, draft_len), draft_len, np.full(K, slope), np.full(K, bias))
    assert out.dtype == np.float32 and out.shape == (n, K)
    assert np.all((out >= 0.0) & (out <= 1.0))
    assert np.all(np.diff(out, axis=1) <= 1e-7)
    assert np.all(out[np.arange(K)[None, :] >= draft_len[:, None]] == 0.0)


def test_the_identity_changes_nothing_and_conditional_inverts_the_product():
    draft_len = np.array([0, 1, 5, K])
    curves = _curves(4, 3, draft_len)
    ident = Calibration.identity()
    np.testing.assert_allclose(apply(curves, draft_len, ident.slope, ident.bias), curves, atol=2e-6)
    h = conditional(curves)
    np.testing.assert_allclose(np.cumprod(h, axis=1)[:, :5][2], curves[2, :5], rtol=1e-5)


def test_a_fit_recovers_a_known_correction():
    """Labels drawn from sigmoid(2 logit h + 0.7): the fitted slope and bias are near (2, 0.7) where
    data is plentiful, and the corrected curves' expected lengths match the truth."""
    rng = np.random.default_rng(0)
    n = 6000
    draft_len = rng.integers(1, K + 1, size=n)
    curves = _curves(n, 1, draft_len)
    z = np.log(np.clip(conditional(curves), 1e-6, 1 - 1e-6)) - np.log1p(-np.clip(conditional(curves), 1e-6, 1 - 1e-6))
    true_h = 1.0 / (1.0 + np.exp(-(2.0 * z + 0.7)))
    accept = rng.random((n, K)) < true_h
    label = np.minimum(np.argmin(np.concatenate([accept, np.zeros((n, 1), bool)], axis=1), axis=1), draft_len)
    cal = Calibrator(CalibrationConfig(every=1000, window=20000, prior=5.0))
    w = np.full(n, WORKLOADS.index("sql"))
    fitted = cal.observe(curves, draft_len, label, w, np.array(["t"] * n, dtype=object), WORKLOADS)
    c = fitted[("sql", None)]
    assert abs(c.slope[0] - 2.0) < 0.2 and abs(c.bias[0] - 0.7) < 0.2
    truth = apply(curves, draft_len, np.full(K, 2.0), np.full(K, 0.7)).sum(axis=1)
    before = np.abs(curves.sum(axis=1) - truth).mean()
    after = np.abs(apply(curves, draft_len, c.slope, c.bias).sum(axis=1) - truth).mean()
    assert after < 0.15 * before
    assert ("sql", "t") in fitted  # the tenant had enough traffic (n >= tenant_min_events) for its own


def test_a_tenant_gets_its_own_correction_only_with_traffic_and_drift_resets():
    cal = Calibrator(CalibrationConfig(every=100, tenant_min_events=500))
    draft_len = np.full(300, 8)
    curves = _curves(300, 2, draft_len)
    w = np.full(300, 0)
    tenants = np.array(["a"] * 300, dtype=object)
    first = cal.observe(curves, draft_len, np.full(300, 8), w, tenants, WORKLOADS)
    assert set(first) == {(WORKLOADS[0], None)}
    second = cal.observe(curves, draft_len, np.full(300, 8), w, tenants, WORKLOADS)
    assert set(second) == {(WORKLOADS[0], None), (WORKLOADS[0], "a")}
    assert second[(WORKLOADS[0], None)].bias[0] > 0  # always accepted: the correction raises the curve
    assert sorted(cal.reset(WORKLOADS[0]), key=str) == sorted([(WORKLOADS[0], None), (WORKLOADS[0], "a")], key=str)


def test_newton_with_no_signal_stays_at_the_identity_and_from_json_names_what_is_wrong():
    a, b = fit_position(np.zeros(0), np.zeros(0), prior=10.0)
    assert (a, b) == (1.0, 0.0)
    good = Calibration(np.full(K, 1.5), np.full(K, -0.2), 40)
    assert Calibration.from_json(good.to_json()).events == 40
    with pytest.raises(CalibrationError, match="slope must be 24 finite numbers"):
        Calibration.from_json({"slope": [1.0] * 3, "bias": [0.0] * K})
    with pytest.raises(CalibrationError, match="'slope' and 'bias'"):
        Calibration.from_json({"bias": [0.0] * K})


def test_the_refit_takes_the_shift_the_score_prefers_and_the_smaller_one_on_a_tie():
    """The shift is chosen by what the caller's counterfactual score says it buys, not by the log loss."""
    from predictor.online.calibrator import ScopeFitter

    n = 400
    draft_len = np.full(n, 8)
    curves = _curves(n, 5, draft_len)
    label = np.random.default_rng(5).integers(0, 9, n)
    shifts = (-1.0, -0.5, 0.0, 0.5, 1.0)
    seen = []

    def score(recent):
        seen.append(recent)
        # prefers corrected curves whose mean expected length is closest to 5.3
        return lambda corrected: -abs(float(corrected.sum(axis=1).mean()) - 5.3)

    fitter = ScopeFitter(window=1000, prior=1e9, shifts=shifts)  # a prior this strong keeps the fit at the identity
    fitter.add(curves, draft_len, label, np.ones(n, dtype=bool), np.full(n, "r", dtype=object), np.arange(n))
    chosen = fitter.fit(score)
    means = {s: float(apply(curves, draft_len, np.ones(K), np.full(K, s)).sum(axis=1).mean()) for s in shifts}
    best = min(shifts, key=lambda s: abs(means[s] - 5.3))
    assert np.allclose(chosen.bias, best, atol=1e-6) and np.allclose(chosen.slope, 1.0, atol=1e-6)
    assert seen[0].position.tolist() == list(range(n)) and seen[0].request[0] == "r"  # the paths' inputs
    flat = ScopeFitter(window=1000, prior=1e9, shifts=shifts)
    flat.add(curves, draft_len, label)
    assert np.allclose(flat.fit(lambda recent: lambda corrected: 1.0).bias, 0.0, atol=1e-6)  # a tie: no move


def test_a_paying_refit_is_served_only_after_a_window_of_later_drafts_confirms_it():
    """An unconfirmed scope's paying refit starts a trial (not served); the trial is due once its
    workload has that many later drafts, and only a gain there confirms the scope, which then serves
    each refit that pays until one does not. A reset forgets trials and confirmations."""
    seen = {"sql": 1000, "code_edit": 5000}  # each workload's drafts held so far (WorkloadPromoter.seen)
    shift = Calibration.identity()
    cal = Calibrator(CalibrationConfig(confirm=True))
    scope = ("sql", None)
    assert cal.admit(scope, shift, pays=False, now=1000) is False and cal.due(0, seen.get) == {}  # no trial without a win
    assert cal.admit(scope, shift, pays=True, now=1000) is False  # a win: on trial, not served
    assert cal.on_trial(scope) and not cal.on_trial(("code_edit", None))
    seen = {"sql": 1060, "code_edit": 5500}
    assert cal.due(100, seen.get) == {} and cal.due(60, seen.get) == {scope: shift}  # only sql drafts count
    assert cal.admit(scope, shift, pays=True, now=1060) is False and cal.due(100, {"sql": 1100}.get) == {scope: shift}
    cal.settle(scope, gained=False)  # lost on the later window: no trial, not confirmed
    assert cal.due(0, seen.get) == {} and cal.admit(scope, shift, pays=True, now=1100) is False
    cal.settle(scope, gained=True)
    assert cal.admit(scope, shift, pays=True) is True  # confirmed: each paying refit is served
    assert cal.admit(scope, shift, pays=False) is False and cal.admit(scope, shift, pays=True) is False  # ended
    cal.reset("sql")
    assert cal.due(0, seen.get) == {} and cal.admit(scope, shift, pays=True) is False
    assert cal.due(0, seen.get) == {scope: shift}
    cal.settle(scope, gained=True)
    cal.reset()
    assert cal.admit(scope, shift, pays=True) is False  # a new champion: confirmed again from scratch
    assert Calibrator(CalibrationConfig(confirm=False)).admit(scope, shift, pays=True) is True


def test_tenant_scopes_are_bounded_and_the_longest_unseen_go_first():
    cal = Calibrator(CalibrationConfig(every=10_000, max_tenant_scopes=3))
    draft_len = np.full(20, 8)
    curves = _curves(20, 0, draft_len)
    w = np.full(20, WORKLOADS.index("sql"))
    for name in ("a", "b", "c", "d", "e"):  # a rotating client: one new tenant name per call
        cal.observe(curves, draft_len, np.full(20, 4), w, np.array([name] * 20, dtype=object), WORKLOADS)
    assert cal.tenant_scopes() == 3 and cal.evicted == 2
    assert cal.take_forgotten() == [("sql", "a"), ("sql", "b")] and cal.take_forgotten() == []  # to clear in SQL
    assert sorted(k for k in cal._scopes if k[1] is not None) == [("sql", "c"), ("sql", "d"), ("sql", "e")]
    assert ("sql", None) in cal._scopes  # the workload's own scope is never evicted
    cal.admit(("sql", "c"), Calibration.identity(), pays=True)  # c on trial ...
    mixed = np.array(["c"] * 10 + ["f"] * 10, dtype=object)
    cal.observe(curves, draft_len, np.full(20, 4), w, mixed, WORKLOADS)  # ... and seen again: d goes, not c
    assert sorted(k[1] for k in cal._scopes if k[1] is not None) == ["c", "e", "f"] and cal.on_trial(("sql", "c"))
    for name in ("g", "h", "i"):
        cal.observe(curves, draft_len, np.full(20, 4), w, np.array([name] * 20, dtype=object), WORKLOADS)
    assert not cal.on_trial(("sql", "c")) and cal.evicted == 6  # evicted with its trial
    assert sorted(t for _, t in cal.take_forgotten()) == ["c", "d", "e", "f"]
    with pytest.raises(ValueError, match="max_tenant_scopes must be >= 1"):
        Calibrator(CalibrationConfig(max_tenant_scopes=0))
