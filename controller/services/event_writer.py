"""Drains the event queue into SQL in batches (one transaction each), off the decode path.

If a write fails (database down, locked), the batch is kept and retried with backoff up to
`max_buffered` events; beyond that the oldest are dropped and counted. The decode path never sees
any of this: it only ever touches the queue.

With a `stats` writer (controller.services.stats_writer.StatsWriter), every event taken off the
queue is also aggregated into statistics buckets (before any raw-sample buffering or drop), and the
queue's drop count is recorded as it grows; the statistics writer flushes on its own. With
`keep_events`, the raw sample is pruned to the newest `keep_events` rows every `prune_every`
successful writes, and once more when the writer stops.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.core.events import EventQueue, LabelledEvent
from controller.services.lifecycle import BackgroundService
from storage.engine import session_scope
from storage.events import insert_events, record_health
from storage.stats import prune_events

if TYPE_CHECKING:
    from controller.services.stats_writer import StatsWriter


class EventWriter(BackgroundService):
    name = "hvd-event-writer"

    def __init__(self, engine: Engine, events: EventQueue, batch_size: int = 2000, flush_interval: float = 0.5,
                 max_buffered: int = 200_000, stats: "StatsWriter | None" = None, keep_events: int | None = None,
                 prune_every: int = 20, replica: str | None = None) -> None:
        super().__init__(flush_interval, max_backoff=10.0)
        self.engine = engine
        self.replica = replica  # when set, a heartbeat row (queue depth, flush latency) goes with each batch
        self.events = events
        self.batch_size = batch_size
        self.max_buffered = max_buffered
        self.written = 0
        self.dropped = 0
        self.last_flush_seconds = 0.0
        self.stats = stats
        self.keep_events = keep_events
        self.prune_every = max(1, prune_every)
        self.pruned = 0
        self._unpruned = 0  # successful writes since the last prune
        self._dropped_seen = 0  # queue drops already recorded into the stats
        self._buffer: deque[LabelledEvent] = deque()

    def round(self) -> float:
        # Batch by time: one wake-up per interval, not one per event. On a CPU-bound host the
        # engine's main thread shares its core with this one (threads inherit its binding), and a
        # wake-up plus a commit per decode step cost it ~1 ms a step.
        self._take(self.events.get_batch(self.batch_size))
        if self._buffer:
            if not self._write():
                return self.retry.failed()
            if self._unpruned >= self.prune_every:
                self.prune()
        self.succeeded()
        return 0.0 if self.events.depth() >= self.batch_size else self.interval

    def flush(self) -> bool:
        """Move everything queued into SQL now; False (kept, bounded) if the database refused."""
        with self._round_lock:
            while got := self.events.get_batch(self.batch_size):
                self._take(got)
            self._note([])
            return self._write()

    def stop(self, timeout: float = 30.0) -> bool:
        """Drain what is queued, write it, apply the retention limit, and stop."""
        ok = super().stop(timeout)
        if ok and self._unpruned:
            self.prune()
        return ok

    def _take(self, events: list[LabelledEvent]) -> None:
        """Into the statistics, then into the bounded buffer (oldest dropped and counted)."""
        self._note(events)
        self._buffer.extend(events)
        while len(self._buffer) > self.max_buffered:
            self._buffer.popleft()
            self.dropped += 1

    def _note(self, events: list[LabelledEvent]) -> None:
        """Aggregate `events` into the stats and record queue drops since the last call."""
        if self.stats is None:
            return
        if events:
            self.stats.add(events)
        dropped = self.events.dropped
        if dropped > self._dropped_seen:
            self.stats.add_dropped(time.time(), dropped - self._dropped_seen)
            self._dropped_seen = dropped

    def prune(self) -> int:
        """Apply the retention limit to the raw sample; 0 if disabled or the database refused."""
        if self.keep_events is None:
            return 0
        self._unpruned = 0
        try:
            with session_scope(self.engine) as session:
                n = prune_events(session, self.keep_events)
        except SQLAlchemyError as exc:
            self.failed(exc)
            return 0
        self.pruned += n
        return n

    def _write(self) -> bool:
        """Write the buffer in batches; False (buffer kept) if the database refused."""
        wrote = bool(self._buffer)
        while self._buffer:
            batch = [self._buffer[i].to_row() for i in range(min(self.batch_size, len(self._buffer)))]
            start = time.perf_counter()
            try:
                with session_scope(self.engine) as session:
                    insert_events(session, batch)
                    if self.replica is not None:
                        record_health(session, replica=self.replica, queue_depth=self.events.depth(),
                                      events_written=self.written + len(batch),
                                      events_dropped=self.events.dropped + self.dropped,
                                      flush_ms=1000.0 * self.last_flush_seconds)
            except SQLAlchemyError as exc:
                self.failed(exc)
                return False
            self.last_flush_seconds = time.perf_counter() - start
            for _ in batch:
                self._buffer.popleft()
            self.written += len(batch)
        self._unpruned += wrote
        return True
