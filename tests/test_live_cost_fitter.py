"""The live cost model's refits run on their own thread (controller.services.live_cost_fitter): the
step that makes a refit due hands over its window and goes on; a later step prices with the fit.
Real threads, real fits; waits are bounded by events, not by sleeping."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from controller.services.live_cost_fitter import LiveCostFitter, follow
from predictor.decision.live_cost import CostWindow, LiveCostModel, LiveFit, StepSample, fit_window
from predictor.decision.profiles import cost_profiles

WAIT = 30.0  # seconds: a bound for a thread that is not stuck, never reached when things work


def _steps(n: int, seed: int = 0) -> list[StepSample]:
    """Steps on the line 20 + 3 batch + 1.5 query tokens (+ 2 + 1 k with the drafter), 3% noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = int(rng.integers(1, 9))
        q = b + int(rng.integers(0, 6 * b + 1))
        k = int(rng.choice([0, 0, 3]))
        ms = (20 + 3 * b + 1.5 * q + (2 + k if k else 0)) * float(rng.lognormal(0, 0.03))
        out.append(StepSample(b, q, k, ms / 1000))
    return out


def _until(predicate, what: str) -> None:
    done = threading.Event()
    for _ in range(int(WAIT / 0.01)):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError(f"not within {WAIT} s: {what}")


@pytest.fixture
def fitter():
    f = LiveCostFitter().start()
    yield f
    f.stop()


def test_a_window_fitted_on_the_thread_is_the_fit_of_the_same_window_in_the_caller(fitter):
    model = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=200, refit_every=200)
    for s in _steps(250):
        model.record(s)
    window = model.take_window()
    fitter.submit(window)
    _until(lambda: fitter.fits == 1, "one fit")
    fit = fitter.take()
    assert fit == fit_window(window)
    assert fit.fitted_at == 250 and fit.samples == 250
    a, b, c, _, _ = fit.coefficients
    assert a + b == pytest.approx(23, rel=0.05) and c == pytest.approx(1.5, rel=0.05)
    assert fitter.take() is None  # taken once


def test_the_window_is_a_copy_the_engine_goes_on_filling_the_buffer(fitter):
    model = LiveCostModel(cost_profiles()["cpu-smollm2"], window=300, min_samples=200, refit_every=200)
    steps = _steps(600, seed=1)
    for s in steps[:250]:
        model.record(s)
    window = model.take_window()
    before = (window.xt.copy(), window.ms.copy())
    for s in steps[250:]:
        model.record(s)  # wraps the ring buffer over the rows the window holds
    assert np.array_equal(window.xt, before[0]) and np.array_equal(window.ms, before[1])


def test_follow_records_every_decode_step_hands_over_due_windows_and_adopts_the_fits(fitter):
    model = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=200, refit_every=200)
    adopted: list[LiveFit] = []
    for i, s in enumerate(_steps(1000, seed=2)):
        fit = follow(model, fitter, s)
        if fit is not None:
            adopted.append(fit)
        if i % 7 == 0:
            assert follow(model, fitter, None) in (None, model.current)  # a prefill step: nothing recorded
    assert model.observed == 1000
    assert not model.due  # the window at step 1000 was handed over

    def last_fit_adopted() -> bool:
        fit = follow(model, fitter, None)
        if fit is not None:
            adopted.append(fit)
        return model.current is not None and model.current.fitted_at == 1000

    _until(last_fit_adopted, "the fit of the window at step 1000")
    assert [f.fitted_at for f in adopted] == sorted({f.fitted_at for f in adopted})  # newer each time
    assert all(f.fitted_at % 200 == 0 for f in adopted)
    assert model.current is adopted[-1]
    a, b, c, _, _ = model.current.coefficients
    assert a + b == pytest.approx(23, rel=0.05) and c == pytest.approx(1.5, rel=0.05)


def test_a_fit_older_than_the_current_one_is_not_adopted():
    model = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=200, refit_every=200)
    steps = _steps(400, seed=3)
    for s in steps[:200]:
        model.record(s)
    old = model.take_window()
    for s in steps[200:]:
        model.record(s)
    new = fit_window(model.take_window())
    assert model.adopt(new) and model.current is new
    assert not model.adopt(fit_window(old)) and model.current is new


def test_due_counts_from_the_last_window_taken_not_from_the_last_fit_back():
    model = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=50, refit_every=100)
    steps = _steps(300, seed=4)
    for s in steps[:49]:
        model.record(s)
    assert not model.due
    model.record(steps[49])
    assert model.due
    model.take_window()  # in flight: no fit back yet
    assert not model.due and model.current is None
    for s in steps[50:149]:
        model.record(s)
    assert not model.due
    model.record(steps[149])
    assert model.due


def test_the_newest_window_replaces_one_still_waiting():
    """While a fit runs, windows that come in replace each other: the thread fits the newest next."""
    started, release = threading.Event(), threading.Event()
    fitted: list[int] = []

    def slow_fit(window: CostWindow) -> LiveFit:
        fitted.append(window.observed)
        if len(fitted) == 1:
            started.set()
            assert release.wait(WAIT)
        return fit_window(window)

    fitter = LiveCostFitter(slow_fit).start()
    try:
        model = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=200, refit_every=200)
        steps = iter(_steps(800, seed=5))
        windows = []
        for _ in range(3):
            for _ in range(200):
                model.record(next(steps))
            windows.append(model.take_window())
        fitter.submit(windows[0])
        assert started.wait(WAIT)
        fitter.submit(windows[1])
        fitter.submit(windows[2])
        release.set()
        _until(lambda: fitter.fits == 2, "two fits")
        assert fitted == [200, 600]
        assert fitter.take().fitted_at == 600
    finally:
        fitter.stop()


def test_a_failing_fit_is_counted_and_logged_once_per_run_and_the_thread_fits_the_next_window(caplog):
    calls = []

    def flaky(window: CostWindow) -> LiveFit:
        calls.append(window.observed)
        if window.ms[0] < 0:
            raise FloatingPointError("a poisoned window")
        return fit_window(window)

    fitter = LiveCostFitter(flaky).start()
    try:
        model = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=200, refit_every=200)
        for s in _steps(200, seed=6):
            model.record(s)
        good = model.take_window()
        bad = CostWindow(good.xt, -good.ms, good.observed, good.prior_theta, good.prior_floor, good.prior_weight,
                         good.floor)
        with caplog.at_level(logging.WARNING, logger="hvd.services"):
            for _ in range(2):
                fitter.submit(bad)
                _until(lambda n=len(calls): len(calls) > n, "the bad window's fit")
            _until(lambda: fitter.failures == 2, "two failures")
            assert [r.getMessage() for r in caplog.records] == [
                "hvd-live-cost: a poisoned window; retrying with back-off"]  # the first of the run only
            assert fitter.take() is None and fitter.last_error == "a poisoned window"
            assert fitter.health().state == "retrying" and fitter.health().last_success is None
            fitter.submit(good)
            _until(lambda: fitter.fits == 1, "the good window's fit")
        assert caplog.records[-1].getMessage() == "hvd-live-cost: recovered after 2 failed attempts"
        assert fitter.take() == fit_window(good)
        health = fitter.health()
        assert health.running and health.failures == 2 and health.state == "ok" and health.last_success is not None
    finally:
        fitter.stop()
    assert not fitter.health().running


def test_the_fitter_thread_names_itself_for_top():
    fitter = LiveCostFitter().start()
    try:
        names = {t.name for t in threading.enumerate()}
        assert "hvd-live-cost" in names
    finally:
        fitter.stop()
    assert "hvd-live-cost" not in {t.name for t in threading.enumerate()}
