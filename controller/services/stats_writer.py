"""Aggregates labelled events into per-bucket deltas in memory and adds them to `stat_buckets`.

Off the decode path: events are handed over in lists (`add`), aggregated under a lock, and flushed
every `flush_interval` seconds with one additive upsert (storage.stats.upsert_buckets). If the
database refuses, the pending deltas are kept (at most `max_pending_keys` keys; beyond that the
oldest keys are dropped and counted in `dropped_keys`) and retried with exponential backoff.

It can run its own thread (`start`/`stop`), or be driven by another writer thread through
`maybe_flush()` / `flush()` (controller.services.event_writer.EventWriter does that).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from storage.engine import session_scope
from storage.stats import (BUCKET_SECONDS, BucketDelta, BucketKey, EventLike, add_dropped, add_steps,
                           aggregate_into, merge_deltas, upsert_buckets)


class StatsWriter:
    def __init__(self, engine: Engine, flush_interval: float = 5.0, max_pending_keys: int = 100_000,
                 bucket_seconds: int = BUCKET_SECONDS, max_backoff: float = 30.0) -> None:
        if max_pending_keys < 1:
            raise ValueError(f"max_pending_keys must be >= 1, got {max_pending_keys}")
        self.engine = engine  # swappable (e.g. after a failover)
        self.flush_interval = flush_interval
        self.max_pending_keys = max_pending_keys
        self.bucket_seconds = bucket_seconds
        self.max_backoff = max_backoff
        self.flushes = 0  # successful flushes that wrote something
        self.written_keys = 0
        self.dropped_keys = 0
        self.failures = 0
        self.last_error: str | None = None
        self._pending: dict[BucketKey, BucketDelta] = {}
        self._lock = threading.Lock()  # guards _pending and the counters above
        self._flush_lock = threading.Lock()  # one flush at a time
        self._backoff = flush_interval
        self._next_flush = time.monotonic() + flush_interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- producers (any thread) ---------------------------------------------------------------

    def add(self, events: Iterable[EventLike]) -> None:
        with self._lock:
            aggregate_into(self._pending, events, self.bucket_seconds)
            self._bound()

    def add_steps(self, at: float, tenant: str, workload: str, version: int | None, tokens: int, cycles: int) -> None:
        with self._lock:
            add_steps(self._pending, at, tenant, workload, version, tokens, cycles, self.bucket_seconds)
            self._bound()

    def add_dropped(self, at: float, count: int) -> None:
        with self._lock:
            add_dropped(self._pending, at, count, self.bucket_seconds)
            self._bound()

    def pending_keys(self) -> int:
        with self._lock:
            return len(self._pending)

    def pending(self) -> dict[BucketKey, BucketDelta]:
        """A copy of the deltas not yet written."""
        with self._lock:
            return merge_deltas({}, self._pending)

    def _bound(self) -> None:
        # dicts keep insertion order: the first keys are the oldest.
        excess = len(self._pending) - self.max_pending_keys
        if excess > 0:
            for key in list(self._pending)[:excess]:
                del self._pending[key]
            self.dropped_keys += excess

    # --- flushing -------------------------------------------------------------------------------

    def flush(self) -> bool:
        """Write all pending deltas now; False (deltas kept) if the database refused."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            try:
                with session_scope(self.engine) as session:
                    upsert_buckets(session, batch)
            except SQLAlchemyError as exc:
                with self._lock:
                    # The failed batch is older than anything added meanwhile: put it first.
                    self._pending = merge_deltas(batch, self._pending)
                    self._bound()
                    self.failures += 1
                    self.last_error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self._next_flush = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self.max_backoff)
                return False
            with self._lock:
                self.flushes += 1
                self.written_keys += len(batch)
            self._backoff = self.flush_interval
            self._next_flush = time.monotonic() + self.flush_interval
            return True

    def maybe_flush(self) -> bool | None:
        """Flush if the interval (or, after a failure, the backoff) has elapsed; None if not due."""
        if time.monotonic() < self._next_flush:
            return None
        return self.flush()

    # --- own thread (optional) -------------------------------------------------------------

    def start(self) -> "StatsWriter":
        self._thread = threading.Thread(target=self._run, name="hvd-stats-writer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0, attempts: int = 3) -> bool:
        """Stop the thread (if any) and drain: a final flush, retried up to `attempts` times.
        True if nothing is left pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for i in range(attempts):
            if self.flush():
                return True
            if i + 1 < attempts:
                time.sleep(min(self.flush_interval, 0.5))
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.maybe_flush()
            self._stop.wait(max(0.0, min(self._next_flush - time.monotonic(), self.flush_interval)) or 0.01)
