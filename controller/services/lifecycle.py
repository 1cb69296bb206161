"""The one lifecycle every background service shares (event writer, statistics writer, control
poller, learner): a daemon thread that runs `round()` and sleeps for the delay it returns;
`flush()` does the pending work now in the caller's thread; `stop()` ends the thread, then
flushes once more; `health()` says how it is doing. One retry policy (`Backoff`) paces every
retry after a failed write or read.

A service stops only itself: whoever wires several of them stops them in order (ServiceStack).
Rounds hold one lock (`_round_lock`), and so must a subclass's `flush()`: a flush from another
thread then never interleaves with a round.
"""
from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Self

from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger("hvd.services")
PR_SET_NAME = 15  # linux/prctl.h
NATIVE_NAME_BYTES = 15  # the kernel keeps a thread's name in 16 bytes, the last a NUL


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` in the operating system too (Linux: its first 15 bytes), so
    `top -H`, `ps -L` and /proc/<pid>/task/*/comm tell HVD's threads from the engine's in the vLLM
    worker they share: Python 3.11 names its threads for Python only. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:NATIVE_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl to call: the name stays Python's only
        pass


@dataclass
class Backoff:
    """Exponential backoff: each failure waits twice as long as the last, up to `maximum`; a
    success goes back to `initial`."""

    initial: float
    maximum: float

    def __post_init__(self) -> None:
        self.current = self.initial

    def failed(self) -> float:
        """The delay before the retry of what just failed."""
        delay = self.current
        self.current = min(self.current * 2, self.maximum)
        return delay

    def succeeded(self) -> None:
        self.current = self.initial


@dataclass(frozen=True)
class Health:
    name: str
    running: bool
    failures: int
    last_error: str | None
    last_success: float | None  # unix time
    failing: int = 0  # failures since the last success: > 0 means retrying with back-off
    # How far the service has got, for services that follow the event log (the learner's cursor):
    # {"cursor": last event id read, "cursor_at": unix time of that event}; None for the others.
    progress: dict | None = None

    @property
    def state(self) -> str:
        return "stopped" if not self.running else "retrying" if self.failing else "ok"

    def to_json(self) -> dict:
        out = {"name": self.name, "state": self.state, "failures": self.failures, "failing": self.failing,
               "last_error": self.last_error, "last_success": self.last_success}
        if self.progress is not None:
            out["progress"] = self.progress
        return out


def first_line(exc: BaseException) -> str:
    msg = str(exc).strip()
    return msg.splitlines()[0] if msg else type(exc).__name__


class BackgroundService:
    """Subclasses implement `round()` (one unit of work; returns the seconds until the next) and,
    if stopping must leave nothing behind, `flush()`."""

    name = "hvd-service"
    run_at_start = False  # True: the first round runs as soon as the thread starts

    def __init__(self, interval: float, max_backoff: float) -> None:
        self.interval = interval
        self.retry = Backoff(interval, max_backoff)
        self.failures = 0
        self.failing = 0  # consecutive failures
        self.last_error: str | None = None
        self.last_success: float | None = None
        self._round_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def round(self) -> float:
        raise NotImplementedError

    def flush(self) -> bool:
        """Do what is pending now; True if nothing is left."""
        return True

    def start(self) -> Self:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """End the thread (it finishes its round), then flush: True if nothing is left pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._round_lock:
            return self.flush()

    def health(self) -> Health:
        return Health(self.name, self._thread is not None and self._thread.is_alive(), self.failures,
                      self.last_error, self.last_success, self.failing, self.progress())

    def progress(self) -> dict | None:
        """Where the service stands in the event log (see Health.progress); None: not applicable."""
        return None

    def failed(self, exc: BaseException) -> None:
        """Count a failure (the round that saw it returns `self.retry.failed()`); the first of a
        run of failures is logged, so an outage is one warning, not one per retry."""
        self.failures += 1
        self.failing += 1
        self.last_error = first_line(exc)
        if self.failing == 1:
            log.warning("%s: %s; retrying with back-off", self.name, self.last_error)

    def succeeded(self) -> None:
        if self.failing:
            log.warning("%s: recovered after %d failed attempts", self.name, self.failing)
        self.failing = 0
        self.retry.succeeded()
        self.last_success = time.time()

    def _loop(self) -> None:
        name_native_thread(self.name)
        delay = 0.0 if self.run_at_start else self.interval
        while not self._stop.wait(delay):
            with self._round_lock:
                try:
                    delay = self.round()
                except Exception as exc:  # a round must not end the service: log, back off, retry
                    if not isinstance(exc, SQLAlchemyError):  # a database error is an outage, logged once
                        log.exception("%s: round failed", self.name)
                    self.failed(exc)
                    delay = self.retry.failed()
