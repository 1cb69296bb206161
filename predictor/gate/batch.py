"""Labelled cache drafts as arrays: what the online learner consumes, what the tau tuner and the
per-workload promotion watch, built from the runtime's hindsight events."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    """Labelled cache drafts as arrays: what the learner consumes."""

    features: np.ndarray  # float32 (n x NUM_FEATURES)
    label: np.ndarray  # float32
    draft_len: np.ndarray  # int
    workload: np.ndarray  # int index into WORKLOADS
    tau: np.ndarray  # the threshold each draft was (or would have been) held to
    tenant: np.ndarray | None = None  # object array of tenant names, where known
    decided: np.ndarray | None = None  # bool: a step's decision point (else a shadow draft), where known
    request: np.ndarray | None = None  # object array of request ids, where known
    position: np.ndarray | None = None  # int64: output tokens emitted when the draft was made, where known

    OPTIONAL = ("tenant", "decided", "request", "position")

    def take(self, rows: np.ndarray | slice) -> "Batch":
        return Batch(self.features[rows], self.label[rows], self.draft_len[rows], self.workload[rows], self.tau[rows],
                     *(None if getattr(self, name) is None else getattr(self, name)[rows] for name in self.OPTIONAL))

    @staticmethod
    def join(parts: "list[Batch]") -> "Batch":
        def cat(name: str) -> np.ndarray | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else np.concatenate(values)

        return Batch(*(cat(name) for name in ("features", "label", "draft_len", "workload", "tau", *Batch.OPTIONAL)))
