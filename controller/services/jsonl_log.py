"""A bounded, append-only JSON-lines file the decode path feeds without waiting (HVD_RECORD's served
requests, HVD_STEP_LOG's steps).

At most `max_items` items per process are taken (then taking stops, said once) and at most
`max_pending` wait to be written (more are dropped, the oldest first, and counted). The decode path
only appends an item to a queue; a subclass's `line(item)` makes its JSON in the service's thread,
where the file is written. A file that cannot be written is said once per new error; the items
waiting are kept until the bound, then dropped and counted."""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from pathlib import Path
from typing import Generic, TypeVar

from controller.services.lifecycle import BackgroundService

log = logging.getLogger("hvd.services")
Item = TypeVar("Item")


class JsonlLog(BackgroundService, Generic[Item]):
    setting = ""  # the setting that names the file, for the log
    what = "items"

    def __init__(self, path: str | Path, max_items: int, max_pending: int, interval: float = 2.0) -> None:
        if max_items < 1 or max_pending < 1:
            raise ValueError(f"{self.setting}: its bounds must be >= 1, got at most {max_items} {self.what} and at "
                             f"most {max_pending} pending")
        super().__init__(interval, max_backoff=30.0)
        self.path = Path(path)
        self.max_items, self.max_pending = max_items, max_pending
        self.accepted = 0  # items taken (at most max_items)
        self.written = 0
        self.dropped = 0  # taken but not written: the queue was full
        self._pending: deque[Item] = deque()
        self._lock = threading.Lock()
        self._told_full = False

    def line(self, item: Item) -> dict | None:
        """The item's JSON line (None: nothing to write)."""
        raise NotImplementedError

    def add(self, item: Item) -> None:
        """From the decode path: never waits on the file."""
        with self._lock:
            if self.accepted >= self.max_items:
                if not self._told_full:
                    self._told_full = True
                    log.warning("%s: %d %s written to %s; it stops (the bound)", self.setting, self.max_items,
                                self.what, self.path)
                return
            self.accepted += 1
            if len(self._pending) >= self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(item)

    def flush(self) -> bool:
        with self._round_lock:
            with self._lock:
                batch = list(self._pending)
                self._pending.clear()
            if not batch:
                return True
            try:
                lines = "".join(json.dumps(line, ensure_ascii=False) + "\n"
                                for line in map(self.line, batch) if line is not None)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(lines)
            except OSError as exc:
                with self._lock:  # back in front of what came meanwhile, within the bound
                    keep = batch[max(0, len(batch) + len(self._pending) - self.max_pending):]
                    self.dropped += len(batch) - len(keep)
                    self._pending.extendleft(reversed(keep))
                self.failed(exc)
                return False
            self.written += len(batch)
            self.succeeded()
            return True

    def round(self) -> float:
        return self.interval if self.flush() else self.retry.failed()
