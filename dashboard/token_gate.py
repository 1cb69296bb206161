"""The admin token check with a limit on wrong tries, kept free of Streamlit so it is tested with a fake clock.

A wrong token is counted against the browser session that typed it and against the whole process:
a person who mistypes is locked out of their own session only, while a script that opens a fresh
session for every guess trips the process-wide limit. During a lockout no token is compared at all,
the right one included, so the lockout gives away nothing about a guess.
"""
from __future__ import annotations

import hmac
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class Verdict(Enum):
    OK = "ok"
    WRONG = "wrong"
    LOCKED = "locked"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    retry_after_s: float = 0.0  # when LOCKED: seconds until tokens are compared again


@dataclass(frozen=True)
class Limits:
    session_failures: int = 5  # wrong tries per session within `window_s` that lock the session
    process_failures: int = 20  # wrong tries across all sessions within `window_s` that lock everyone
    window_s: float = 600.0
    lockout_s: float = 600.0


@dataclass
class _Failures:
    """Times of the wrong tries inside the window, and the end of the current lockout (if any)."""

    times: deque[float] = field(default_factory=deque)
    locked_until: float = float("-inf")

    def lock_left(self, now: float) -> float:
        return max(0.0, self.locked_until - now)

    def add(self, now: float, limits: Limits, limit: int) -> None:
        while self.times and self.times[0] <= now - limits.window_s:
            self.times.popleft()
        self.times.append(now)
        if len(self.times) >= limit:
            self.locked_until = now + limits.lockout_s
            self.times.clear()


class TokenGate:
    """Thread-safe (Streamlit runs each session in its own thread); one per process."""

    def __init__(self, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._process = _Failures()
        self._sessions: dict[str, _Failures] = {}

    def attempt(self, session: str, typed: str, configured: str) -> Outcome:
        """Compare `typed` with `configured` (constant time) unless `session` or the process is locked out."""
        with self._lock:
            now = self._clock()
            mine = self._sessions.setdefault(session, _Failures())
            wait = max(mine.lock_left(now), self._process.lock_left(now))
            if wait > 0:
                return Outcome(Verdict.LOCKED, wait)
            if hmac.compare_digest(typed.encode("utf-8", "surrogatepass"), configured.encode("utf-8", "surrogatepass")):
                return Outcome(Verdict.OK)
            mine.add(now, self.limits, self.limits.session_failures)
            self._process.add(now, self.limits, self.limits.process_failures)
            self._forget_idle(now)
            return Outcome(Verdict.WRONG)

    def _forget_idle(self, now: float) -> None:
        """Drop sessions with nothing left to remember, so many sessions cannot grow memory for good."""
        if len(self._sessions) < 1000:
            return
        for key in [k for k, f in self._sessions.items()
                    if f.lock_left(now) == 0 and all(t <= now - self.limits.window_s for t in f.times)]:
            del self._sessions[key]
