"""Served traffic recorded as traces (HVD_RECORD): every finished request's prompt and output, with
its workload and tenant, one JSON line each in the documented trace format (docs/guides/traces.md),
so that what the engine served can be replayed (`hvd eval --traces`) with the costs it measured.
The line's `engine` field keeps the token ids the engine emitted: replay reads the output exactly as
served, and the features mark it as the verifying model's own (DraftContext.on_policy).

Opt-in and bounded (controller.services.jsonl_log): at most `max_requests` requests per process are
recorded, at most `max_pending` wait to be written. The decode path only appends token ids to a
queue; detokenising and writing happen in the service's thread."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controller.services.jsonl_log import JsonlLog
from predictor.data.tokens import TraceTokenizer


@dataclass(frozen=True, slots=True)
class ServedRequest:
    request_id: str
    tenant: str
    workload: str
    prompt: np.ndarray  # token ids
    output: np.ndarray  # token ids, the first (prefill) token included


class TraceRecorder(JsonlLog[ServedRequest]):
    name = "hvd-trace-recorder"
    setting, what = "HVD_RECORD", "requests"

    def __init__(self, path: str | Path, tokenizer: TraceTokenizer, *, replica: str, model: str,
                 max_requests: int = 10_000, max_pending: int = 1_000, interval: float = 2.0) -> None:
        super().__init__(path, max_requests, max_pending, interval)
        self.tokenizer = tokenizer
        self.replica, self.model = replica, model

    def line(self, r: ServedRequest) -> dict | None:
        """The trace line of one served request (none for a request that output nothing)."""
        if not len(r.output):
            return None
        trace_id = f"{self.replica}:{r.request_id}"
        return {"trace_id": trace_id, "session_id": trace_id, "source": "recorded", "model": self.model,
                "run": self.replica, "workload": r.workload, "tenant": r.tenant,
                "context": self.tokenizer.decode(r.prompt), "output": self.tokenizer.decode(r.output),
                "engine": {"output_ids": r.output.tolist()}}
