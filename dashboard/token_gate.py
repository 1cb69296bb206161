"""The admin token check with a limit on wrong tries, kept free of Streamlit so it is tested with a fake clock.

A wrong token is counted against the browser session that typed it and against the client address
it came from: a person who mistypes is locked out of their own session only, while a script that
opens a fresh session for every guess trips its address's limit. No limit is process-wide, so an
attacker cannot lock the admin out from another address (behind a proxy that hides the clients'
addresses, every client shares one, as before). During a lockout no token is compared at all, the
right one included, so the lockout gives away nothing about a guess. `wrong_total` counts every
wrong try, for alerting on guessing spread over many addresses.
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
    client_failures: int = 20  # wrong tries from one client address, any sessions, that lock that address
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
        self._sessions: dict[str, _Failures] = {}
        self._clients: dict[str, _Failures] = {}
        self.wrong_total = 0

    def attempt(self, session: str, typed: str, configured: str, client: str = "") -> Outcome:
        """Compare `typed` with `configured` (constant time) unless `session` or its `client` address
        ("" when unknown) is locked out."""
        with self._lock:
            now = self._clock()
            mine = self._sessions.setdefault(session, _Failures())
            theirs = self._clients.setdefault(client, _Failures())
            wait = max(mine.lock_left(now), theirs.lock_left(now))
            if wait > 0:
                return Outcome(Verdict.LOCKED, wait)
            if hmac.compare_digest(typed.encode("utf-8", "surrogatepass"), configured.encode("utf-8", "surrogatepass")):
                return Outcome(Verdict.OK)
            mine.add(now, self.limits, self.limits.session_failures)
            theirs.add(now, self.limits, self.limits.client_failures)
            self.wrong_total += 1
            for table in (self._sessions, self._clients):
                self._forget_idle(table, now)
            return Outcome(Verdict.WRONG)

    def _forget_idle(self, table: dict[str, _Failures], now: float) -> None:
        """Drop sessions and addresses with nothing left to remember, so many of them cannot grow
        memory for good."""
        if len(table) < 1000:
            return
        for key in [k for k, f in table.items()
                    if f.lock_left(now) == 0 and all(t <= now - self.limits.window_s for t in f.times)]:
            del table[key]
