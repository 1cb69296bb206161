"""The one way the aggregating writers write to SQL: producers fold into a pending map under a lock
(never touching the database); each round takes the whole map and writes it in one transaction. If
the database refuses, the batch goes back in front of whatever arrived meanwhile (it is older) and
the round backs off; `stop()` drains, retrying a few times.

Subclasses say how a batch is written (`write`), how a failed one is put back within their bound
(`put_back`, under the lock), and optionally what is still open and must be closed before a round
or a stop (`close_open`, under the lock) and what follows a successful write (`after_write`).
"""
from __future__ import annotations

import threading
import time

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from controller.services.lifecycle import BackgroundService
from storage.engine import session_scope


class BatchWriter(BackgroundService):
    def __init__(self, engine: Engine, interval: float, max_backoff: float) -> None:
        super().__init__(interval, max_backoff)
        self.engine = engine  # swappable (e.g. after a failover)
        self._pending: dict = {}  # insertion order: oldest first
        self._lock = threading.Lock()  # guards _pending and the subclass's counters

    def write(self, session: Session, batch: dict) -> None:
        raise NotImplementedError

    def put_back(self, batch: dict) -> None:
        """Under the lock: `batch` failed to write; keep it ahead of `self._pending`, within the bound."""
        raise NotImplementedError

    def close_open(self) -> None:
        """Under the lock: move whatever is still open into `self._pending`."""

    def after_write(self) -> None:
        """After a successful write, outside the lock."""

    def flush(self) -> bool:
        """Write everything pending now; False (all of it kept) if the database refused."""
        with self._round_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            try:
                with session_scope(self.engine) as session:
                    self.write(session, batch)
            except SQLAlchemyError as exc:
                with self._lock:
                    self.put_back(batch)
                    self.failed(exc)
                return False
            self.succeeded()
            self.after_write()
            return True

    def round(self) -> float:
        with self._lock:
            self.close_open()
        return self.interval if self.flush() else self.retry.failed()

    def stop(self, timeout: float = 30.0, attempts: int = 3) -> bool:
        """Stop the thread (if any), close what is open and write everything, retried up to
        `attempts` times. True if nothing is left pending."""
        with self._lock:
            self.close_open()
        if super().stop(timeout):
            return True
        for _ in range(attempts - 1):
            time.sleep(min(self.interval, 0.5))
            if self.flush():
                return True
        return False
