"""Served traffic recorded as traces (HVD_RECORD): every finished request's prompt and output, with
its workload and tenant, one JSON line each in the documented trace format (docs/guides/traces.md),
so that what the engine served can be replayed (`hvd eval --traces`) with the costs it measured.
The line's `engine` field keeps the token ids the engine emitted: replay reads the output exactly as
served, and the features mark it as the verifying model's own (DraftContext.on_policy).

Opt-in and bounded: at most `max_requests` requests per process are recorded (then recording stops,
said once), and at most `max_pending` wait to be written (more are dropped and counted). The
decode path only appends token ids to a queue; detokenising and writing happen in the service's
thread. A file that cannot be written is said once per new error; the requests waiting are kept
until the bound, then dropped and counted."""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controller.services.lifecycle import BackgroundService
from predictor.data.tokens import TraceTokenizer

log = logging.getLogger("hvd.record")


@dataclass(frozen=True, slots=True)
class ServedRequest:
    request_id: str
    tenant: str
    workload: str
    prompt: np.ndarray  # token ids
    output: np.ndarray  # token ids, the first (prefill) token included


class TraceRecorder(BackgroundService):
    name = "hvd-trace-recorder"

    def __init__(self, path: str | Path, tokenizer: TraceTokenizer, *, replica: str, model: str,
                 max_requests: int = 10_000, max_pending: int = 1_000, interval: float = 2.0) -> None:
        if max_requests < 1 or max_pending < 1:
            raise ValueError(f"max_requests and max_pending must be >= 1, got {max_requests} and {max_pending}")
        super().__init__(interval, max_backoff=30.0)
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.replica, self.model = replica, model
        self.max_requests, self.max_pending = max_requests, max_pending
        self.accepted = 0  # requests taken for recording (at most max_requests)
        self.written = 0
        self.dropped = 0  # taken but not written: the queue was full
        self._pending: deque[ServedRequest] = deque()
        self._lock = threading.Lock()
        self._told_full = False

    def add(self, request: ServedRequest) -> None:
        """From the decode path: never waits on the file."""
        with self._lock:
            if self.accepted >= self.max_requests:
                if not self._told_full:
                    self._told_full = True
                    log.warning("HVD_RECORD: %d requests recorded to %s; recording stops (the bound)",
                                self.max_requests, self.path)
                return
            self.accepted += 1
            if len(self._pending) >= self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(request)

    def record(self, r: ServedRequest) -> dict:
        """The trace line of one served request."""
        trace_id = f"{self.replica}:{r.request_id}"
        return {"trace_id": trace_id, "session_id": trace_id, "source": "recorded", "model": self.model,
                "run": self.replica, "workload": r.workload, "tenant": r.tenant,
                "context": self.tokenizer.decode(r.prompt), "output": self.tokenizer.decode(r.output),
                "engine": {"output_ids": r.output.tolist()}}

    def flush(self) -> bool:
        with self._round_lock:
            with self._lock:
                batch = list(self._pending)
                self._pending.clear()
            if not batch:
                return True
            try:
                lines = "".join(json.dumps(self.record(r), ensure_ascii=False) + "\n" for r in batch if len(r.output))
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
