"""A background thread that drains the event queue into SQL in batches (one transaction each).

If a write fails (database down, locked), the batch is kept and retried with backoff up to
`max_buffered` events; beyond that the oldest are dropped and counted. The decode path never sees
any of this: it only ever touches the queue.

With a `stats` writer (controller.services.stats_writer.StatsWriter), the same thread also aggregates every
event it takes off the queue into statistics buckets (before any raw-sample buffering or drop),
records the queue's drop count as it grows, and flushes the statistics on their own interval.
With `keep_events`, the raw sample is pruned to the newest `keep_events` rows every `prune_every`
successful flushes.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.core.events import EventQueue, LabelledEvent
from storage.engine import session_scope
from storage.events import insert_events, record_health
from storage.stats import prune_events

if TYPE_CHECKING:
    from controller.services.stats_writer import StatsWriter


class EventWriter:
    def __init__(self, engine: Engine, events: EventQueue, batch_size: int = 2000, flush_interval: float = 0.5,
                 max_buffered: int = 200_000, stats: "StatsWriter | None" = None, keep_events: int | None = None,
                 prune_every: int = 20, replica: str | None = None) -> None:
        self.engine = engine
        self.replica = replica  # when set, a heartbeat row (queue depth, flush latency) goes with each batch
        self.events = events
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_buffered = max_buffered
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_flush_seconds = 0.0
        self.stats = stats
        self.keep_events = keep_events
        self.prune_every = max(1, prune_every)
        self.pruned = 0
        self._flushes = 0
        self._dropped_seen = 0  # queue drops already recorded into the stats
        self._buffer: deque[LabelledEvent] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "EventWriter":
        self._thread = threading.Thread(target=self._run, name="hvd-event-writer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Drain what is queued, write it, and stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self.stats is not None:
                self._note([])
                self.stats.stop()

    def _loop(self) -> None:
        backoff = self.flush_interval
        while True:
            stopping = self._stop.is_set()
            if not stopping and self.events.depth() < self.batch_size:
                # Batch by time: one wake-up per interval, not one per event. On a CPU-bound host
                # the engine's main thread shares its core with this one (threads inherit its
                # binding), and a wake-up plus a commit per decode step cost it ~1 ms a step.
                stopping = self._stop.wait(self.flush_interval)
            self._take(self.events.get_batch(self.batch_size))
            ok = True
            if self._buffer:
                ok = self.flush()
                if ok:
                    self._flushes += 1
                    if self.keep_events is not None and self._flushes % self.prune_every == 0:
                        self.prune()
            if self.stats is not None:
                self.stats.maybe_flush()
            if not ok:
                if stopping:
                    return
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            else:
                backoff = self.flush_interval
                if stopping and self.events.depth() == 0:
                    if self.keep_events is not None and self._flushes % self.prune_every != 0:
                        self.prune()
                    return

    def drain_now(self) -> bool:
        """Synchronous use (no thread running): move everything queued into SQL now."""
        while got := self.events.get_batch(self.batch_size):
            self._take(got)
        ok = self.flush()
        if self.stats is not None:
            ok = self.stats.flush() and ok
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
        try:
            with session_scope(self.engine) as session:
                n = prune_events(session, self.keep_events)
        except SQLAlchemyError as exc:
            self.failures += 1
            self.last_error = str(exc).splitlines()[0]
            return 0
        self.pruned += n
        return n

    def flush(self) -> bool:
        """Write the buffer in batches; False (buffer kept) if the database refused."""
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
                self.failures += 1
                self.last_error = str(exc).splitlines()[0]
                return False
            self.last_flush_seconds = time.perf_counter() - start
            for _ in batch:
                self._buffer.popleft()
            self.written += len(batch)
        return True
