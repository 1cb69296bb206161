"""Aggregates labelled events into per-bucket deltas in memory and adds them to `stat_buckets`.

Off the decode path: events are handed over in lists (`add`), aggregated under a lock, and flushed
every `flush_interval` seconds with one additive upsert (storage.stats.upsert_buckets). If the
database refuses, the pending deltas are kept (at most `max_pending_keys` keys; beyond that the
oldest keys are dropped and counted in `dropped_keys`) and retried with exponential backoff. A
batch whose commit went through but whose answer was lost is not added twice: its receipt tells
(controller.services.batch_writer). Every `prune_every` writes (and at the first) buckets older than
`keep_days` are deleted (the serving stack sets storage.stats.KEEP_STAT_DAYS, 30): every replica's
writer prunes, so the retention holds while any runs.

Producers (the event writer, the runtime's step counts) only add; this service alone writes.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from controller.services.batch_writer import BatchWriter
from storage.models import utcnow
from storage.stats import (BUCKET_SECONDS, BucketDelta, BucketKey, EventLike, add_dropped, add_steps,
                           aggregate_into, merge_deltas, prune_buckets, upsert_buckets)


class StatsWriter(BatchWriter):
    name = "hvd-stats-writer"

    def __init__(self, engine: Engine, flush_interval: float = 5.0, max_pending_keys: int = 100_000,
                 bucket_seconds: int = BUCKET_SECONDS, max_backoff: float = 2.0,
                 keep_days: float | None = None, prune_every: int = 120,
                 clock: Callable[[], datetime] = utcnow) -> None:
        if max_pending_keys < 1:
            raise ValueError(f"max_pending_keys must be >= 1, got {max_pending_keys}")
        if keep_days is not None and not keep_days > 0:
            raise ValueError(f"keep_days must be > 0 (or None: keep every bucket), got {keep_days}")
        super().__init__(engine, flush_interval, max_backoff, None if keep_days is None else max(1, prune_every))
        self.keep_days, self.clock = keep_days, clock
        self.max_pending_keys = max_pending_keys
        self.bucket_seconds = bucket_seconds
        self.dropped_keys = 0
        self._pending: dict[BucketKey, BucketDelta] = {}

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
        """Keys not yet known to be written: pending, and in a batch whose commit's answer was lost."""
        with self._lock:
            return len(self._pending) + self.in_doubt()

    def _bound(self) -> None:
        # dicts keep insertion order: the first keys are the oldest.
        excess = len(self._pending) - self.max_pending_keys
        if excess > 0:
            for key in list(self._pending)[:excess]:
                del self._pending[key]
            self.dropped_keys += excess

    # --- writing (controller.services.batch_writer) ------------------------------------------------

    def write(self, session: Session, batch: dict[BucketKey, BucketDelta]) -> None:
        upsert_buckets(session, batch)

    def put_back(self, batch: dict[BucketKey, BucketDelta]) -> None:
        self._pending = merge_deltas(batch, self._pending)
        self._bound()

    def prune_rows(self, session: Session) -> int:
        return prune_buckets(session, self.clock() - timedelta(days=self.keep_days))
