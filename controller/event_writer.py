"""A background thread that drains the event queue into SQL in batches (one transaction each).

If a write fails (database down, locked), the batch is kept and retried with backoff up to
`max_buffered` events; beyond that the oldest are dropped and counted. The decode path never sees
any of this: it only ever touches the queue.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.events import EventQueue, LabelledEvent
from storage.engine import session_scope
from storage.events import insert_events


class EventWriter:
    def __init__(self, engine: Engine, events: EventQueue, batch_size: int = 2000, flush_interval: float = 0.5,
                 max_buffered: int = 200_000) -> None:
        self.engine = engine
        self.events = events
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_buffered = max_buffered
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_flush_seconds = 0.0
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
        backoff = self.flush_interval
        while True:
            stopping = self._stop.is_set()
            self._buffer.extend(self.events.get_batch(self.batch_size, timeout=0.0 if stopping else self.flush_interval))
            while len(self._buffer) > self.max_buffered:
                self._buffer.popleft()
                self.dropped += 1
            if self._buffer:
                if self.flush():
                    backoff = self.flush_interval
                else:
                    if stopping:
                        return
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
            elif stopping and self.events.depth() == 0:
                return

    def flush(self) -> bool:
        """Write the buffer in batches; False (buffer kept) if the database refused."""
        while self._buffer:
            batch = [self._buffer[i].to_row() for i in range(min(self.batch_size, len(self._buffer)))]
            start = time.perf_counter()
            try:
                with session_scope(self.engine) as session:
                    insert_events(session, batch)
            except SQLAlchemyError as exc:
                self.failures += 1
                self.last_error = str(exc).splitlines()[0]
                return False
            self.last_flush_seconds = time.perf_counter() - start
            for _ in batch:
                self._buffer.popleft()
            self.written += len(batch)
        return True
