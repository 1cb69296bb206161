"""The live cost model's refits, on their own thread, so no decode step waits for one.

Why: the plugin refits its step-time line at 50 decode steps and then every 200
(predictor/decision/live_cost.py). In the step that made it due the refit took 0.5-1.4 ms, and 3-7
ms with the compute floor (`python bench/live_cost_fit.py`): learning on the decode path, which
HVD's serving rule forbids.
Here the step only hands over a copy of the window (`submit`, a lock and a reference) and a later
step picks up the finished fit (`take`, the same). The fit runs while the engine's forward pass
holds the cores: torch releases the GIL there, so the thread mostly runs in time the decode thread
spends waiting anyway.

One window at a time: a window submitted while an older one waits replaces it (the newest steps
are what the next prices should follow). The thread is a BackgroundService like the replica's
other services: a fit that fails is counted and logged at the first of a run of failures, its
health says `retrying` until a fit works again, and the engine keeps its last good prices."""
from __future__ import annotations

import threading
from collections.abc import Callable

from controller.services.lifecycle import BackgroundService
from predictor.decision.live_cost import CostWindow, LiveCostModel, LiveFit, StepSample, fit_window

IDLE_WAIT = 1.0  # seconds a round waits for a window before it ends (and the thread checks for stop)


class LiveCostFitter(BackgroundService):
    name = "hvd-live-cost"
    run_at_start = True

    def __init__(self, fit: Callable[[CostWindow], LiveFit] = fit_window) -> None:
        super().__init__(interval=0.0, max_backoff=0.0)  # a round waits on its own (IDLE_WAIT)
        self._fit = fit
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: CostWindow | None = None
        self._done: LiveFit | None = None
        self.fits = 0

    def submit(self, window: CostWindow) -> None:
        """Fit `window` soon, off the caller's thread; never waits."""
        with self._lock:
            self._pending = window
        self._wake.set()

    def take(self) -> LiveFit | None:
        """The newest finished fit not taken yet, else None; never waits."""
        with self._lock:
            fit, self._done = self._done, None
        return fit

    def round(self) -> float:
        """Fit the window handed over, once there is one (waiting up to IDLE_WAIT for it)."""
        self._wake.wait(IDLE_WAIT)
        self._wake.clear()
        with self._lock:
            window, self._pending = self._pending, None
        if window is None:
            return 0.0
        try:
            fit = self._fit(window)
        except Exception as exc:  # a bad window must not end the thread: the old prices stay
            self.failed(exc)
            return 0.0
        with self._lock:
            self._done = fit
        self.succeeded()
        self.fits += 1  # last: a reader that sees the count sees the health it leaves
        return 0.0

    def stop(self, timeout: float = 5.0) -> bool:
        """End the thread (a fit under way finishes first); it holds nothing that must be written."""
        self._stop.set()
        self._wake.set()  # a round waiting for a window ends now
        return super().stop(timeout)


def follow(model: LiveCostModel, fitter: LiveCostFitter, sample: StepSample | None) -> LiveFit | None:
    """One engine step's part in the live fit: a decode step's `sample` goes into `model`'s window,
    a due refit to `fitter`'s thread; the fit the thread finished meanwhile, if any and newer than
    the model's, is adopted and returned (the caller then prices with it). Never waits."""
    if sample is not None:
        model.record(sample)
        if model.due:
            fitter.submit(model.take_window())
    fit = fitter.take()
    return fit if fit is not None and model.adopt(fit) else None
