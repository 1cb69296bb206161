"""The one way the aggregating writers write to SQL: producers fold into a pending map under a lock
(never touching the database); each round takes the whole map and writes it in one transaction. If
the database refuses, the batch goes back in front of whatever arrived meanwhile (it is older) and
the round backs off; `stop()` drains, retrying a few times.

Additive writes must not count a batch twice when a commit went through but its answer was lost
with the connection. So each batch's transaction also records a receipt (this writer's id and the
batch's sequence number, storage.events.record_receipt, as the event writer does). A batch whose
write failed before its commit goes straight back in front of the pending map; one whose commit
failed is held "in doubt", and before anything else is written the writer asks whether its receipt
names that batch: if so the batch is forgotten as written, else it goes back in front.

Subclasses say how a batch is written (`write`), how a failed one is put back within their bound
(`put_back`, under the lock), and optionally what is still open and must be closed before a round
or a stop (`close_open`, under the lock) and their table's retention (`prune_rows`, applied at the
first write and every `prune_every` writes after; None: never).
"""
from __future__ import annotations

import threading
import time
import uuid

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from controller.services.lifecycle import BackgroundService
from storage.engine import session_scope
from storage.events import chunk_committed, record_receipt


class BatchWriter(BackgroundService):
    def __init__(self, engine: Engine, interval: float, max_backoff: float, prune_every: int | None = None) -> None:
        if prune_every is not None and prune_every < 1:
            raise ValueError(f"prune_every must be >= 1 (or None: no retention), got {prune_every}")
        super().__init__(interval, max_backoff)
        self.prune_every = prune_every
        self.pruned = 0  # rows deleted by the retention
        self._unpruned = 0 if prune_every is None else prune_every - 1  # the first write prunes: a replica
        # that restarts often still does
        self.engine = engine  # swappable (e.g. after a failover)
        self._pending: dict = {}  # insertion order: oldest first
        self._lock = threading.Lock()  # guards _pending and the subclass's counters
        self.writer_id = f"{self.name[:20]}:{uuid.uuid4().hex[:16]}"  # its receipts' key (40 characters at most)
        self._seq = 0  # the last batch's number
        self._in_doubt: tuple[int, dict] | None = None  # a batch whose commit's answer was lost

    def write(self, session: Session, batch: dict) -> None:
        raise NotImplementedError

    def put_back(self, batch: dict) -> None:
        """Under the lock: `batch` failed to write; keep it ahead of `self._pending`, within the bound."""
        raise NotImplementedError

    def close_open(self) -> None:
        """Under the lock: move whatever is still open into `self._pending`."""

    def prune_rows(self, session: Session) -> int:
        """Apply the table's retention in `session`; the rows deleted."""
        raise NotImplementedError

    def after_write(self) -> None:
        self._unpruned += 1
        if self.prune_every is not None and self._unpruned >= self.prune_every:
            self.prune()

    def prune(self) -> int:
        """Apply the retention now; 0 if there is none or the database refused (tried again after
        the next `prune_every` writes)."""
        self._unpruned = 0
        if self.prune_every is None:
            return 0
        try:
            with session_scope(self.engine) as session:
                n = self.prune_rows(session)
        except SQLAlchemyError as exc:
            self.failed(exc)
            return 0
        self.pruned += n
        return n

    def flush(self) -> bool:
        """Write everything pending now; False (all of it kept) if the database refused."""
        with self._round_lock:
            if not self._settle():
                return False
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            self._seq += 1
            committing = False
            try:
                with session_scope(self.engine) as session:
                    self.write(session, batch)
                    record_receipt(session, self.writer_id, self._seq, len(batch))
                    committing = True  # what fails from here on may have committed
            except SQLAlchemyError as exc:
                with self._lock:
                    if committing:
                        self._in_doubt = (self._seq, batch)  # written or not: the receipt will tell
                    else:
                        self.put_back(batch)  # certainly not written: back in front, within the bound
                    self.failed(exc)
                return False
            self.succeeded()
            self.after_write()
            return True

    def _settle(self) -> bool:
        """Resolve the batch in doubt: forgotten if its receipt shows it committed, else put back in
        front of the pending map. False (still in doubt) while the database cannot be asked."""
        if self._in_doubt is None:
            return True
        seq, batch = self._in_doubt
        try:
            with session_scope(self.engine) as session:
                committed = chunk_committed(session, self.writer_id, seq)
        except SQLAlchemyError as exc:
            with self._lock:
                self.failed(exc)
            return False
        self._in_doubt = None
        with self._lock:
            if not committed:
                self.put_back(batch)
        if committed:
            self.after_write()
        return True

    def in_doubt(self) -> int:
        """Keys of the batch whose commit's answer was lost (0: none)."""
        return 0 if self._in_doubt is None else len(self._in_doubt[1])

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
