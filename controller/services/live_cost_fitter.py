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
are what the next prices should follow), and a fit that fails is counted and logged once, leaving
the engine on its last good prices."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from controller.services.lifecycle import Health, first_line, name_native_thread
from predictor.decision.live_cost import CostWindow, LiveCostModel, LiveFit, StepSample, fit_window

log = logging.getLogger("hvd.services")


class LiveCostFitter:
    name = "hvd-live-cost"

    def __init__(self, fit: Callable[[CostWindow], LiveFit] = fit_window) -> None:
        self._fit = fit
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: CostWindow | None = None
        self._done: LiveFit | None = None
        self._thread: threading.Thread | None = None
        self.fits = 0
        self.failures = 0
        self.failing = 0  # failures since the last fit that worked
        self.last_error: str | None = None
        self.last_success: float | None = None  # unix time of the last fit that worked

    def start(self) -> "LiveCostFitter":
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

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

    def stop(self, timeout: float = 5.0) -> bool:
        """End the thread (a fit under way finishes first); True: it holds nothing that must be written."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        return True

    def health(self) -> Health:
        """As the stack's services say it (the heartbeat row, the dashboard): `retrying` while fits fail."""
        return Health(self.name, self._thread is not None and self._thread.is_alive(), self.failures,
                      self.last_error, self.last_success, self.failing)

    def _loop(self) -> None:
        name_native_thread(self.name)
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                window, self._pending = self._pending, None
            if window is None:
                continue
            try:
                fit = self._fit(window)
            except Exception as exc:  # a bad window must not end the thread: the old prices stay
                self.failures += 1
                self.failing += 1
                self.last_error = first_line(exc)
                if self.failures == 1:
                    log.exception("%s: a refit failed (logged once); the engine keeps its last prices", self.name)
                continue
            with self._lock:
                self._done = fit
            self.fits += 1
            self.failing = 0
            self.last_success = time.time()


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
