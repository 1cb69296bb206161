"""What the runtime remembers about one running request: its tokens, the cache drafts still
waiting for their labels, and the hindsight history the features read.

The history quantities are exactly those of `predictor.features.dense_history`, kept incrementally
over whatever positions the engine actually drafted at (every position when the engine emits one
token per step, one position per step otherwise); a test holds the two to the same values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from predictor.labels import lcp

_RECENT = 4  # agree_2 / agree_4 look this far back


@dataclass(slots=True)
class CacheDraftRecord:
    position: int
    tokens: list[int]
    decision: str
    predicted: float
    tau: float
    version_id: int | None
    features: bytes
    label: int | None = None


@dataclass(slots=True)
class ModelDraftRecord:
    position: int
    draft_len: int


@dataclass
class RequestState:
    req_id: str
    tenant: str
    workload: str
    workload_index: int
    prompt_len: int
    speculate: bool = True
    buffer: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # prompt + output
    length: int = 0  # valid tokens in buffer
    out: list[int] = field(default_factory=list)  # output tokens as a list, for cheap prefix comparisons
    nesting: int = 0
    pending: list[CacheDraftRecord] = field(default_factory=list)
    recent: dict[int, CacheDraftRecord] = field(default_factory=dict)  # position -> draft, last few
    latest: CacheDraftRecord | None = None
    model_draft: ModelDraftRecord | None = None
    resolved_count: int = 0
    resolved_sum: float = 0.0
    last_resolved_pos: int = -1
    last_resolved_label: int = 0
    first_tokens: dict[int, int] = field(default_factory=dict)  # position -> first draft token, until realised
    streak: int = 0  # consecutive realised positions, ending at the last one, whose draft's first token was right

    @classmethod
    def create(cls, req_id: str, tenant: str, workload: str, workload_index: int, prompt: np.ndarray,
               speculate: bool) -> "RequestState":
        state = cls(req_id, tenant, workload, workload_index, len(prompt), speculate)
        state.buffer = np.zeros(max(64, 2 * len(prompt)), dtype=np.int32)
        state.buffer[: len(prompt)] = prompt
        state.length = len(prompt)
        return state

    @property
    def output_len(self) -> int:
        return self.length - self.prompt_len

    def context(self) -> np.ndarray:
        return self.buffer[: self.length]

    def append(self, tokens: np.ndarray, depth_delta: np.ndarray) -> None:
        n = len(tokens)
        if n == 0:
            return
        if self.length + n > len(self.buffer):
            grown = np.zeros(max(2 * len(self.buffer), self.length + n), dtype=np.int32)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        start = self.output_len
        self.buffer[self.length : self.length + n] = tokens
        self.length += n
        new = tokens.tolist()
        self.out.extend(new)
        self.nesting += int(depth_delta[tokens].sum()) if n > 1 else int(depth_delta[new[0]])
        for i, token in enumerate(new):
            first = self.first_tokens.pop(start + i, None)
            self.streak = self.streak + 1 if first is not None and first == token else 0

    def resolve(self, final: bool = False) -> list[CacheDraftRecord]:
        """Cache drafts whose labels the realised output now determines (all of them if final)."""
        t = self.output_len
        done, still = [], []
        for d in self.pending:
            k = len(d.tokens)
            m = min(k, t - d.position)
            y = lcp(d.tokens[:m], self.out[d.position : d.position + m])
            if y < m or m == k:  # mismatch seen, or every token matched: the label is final
                d.label = y
                done.append(d)
                self._count_resolved(d)
            elif final:
                d.label = y
                done.append(d)
            else:
                still.append(d)
        self.pending = still
        return done

    def _count_resolved(self, d: CacheDraftRecord) -> None:
        self.resolved_count += 1
        self.resolved_sum += d.label
        if d.position > self.last_resolved_pos:
            self.last_resolved_pos = d.position
            self.last_resolved_label = d.label

    def history(self) -> tuple[float, int, bool, float, float, int, float, float, int]:
        """(prev_agree, prev_gap, has_prev, last_label, mean_label, n_resolved, agree_2, agree_4,
        hit_streak) at the current position, as dense_history defines them."""
        t = self.output_len
        prev = self.latest
        gap = t - prev.position if prev is not None else 0
        prev_agree = self._agreement(prev, gap) if prev is not None else 0.0
        mean = self.resolved_sum / self.resolved_count if self.resolved_count else 0.0
        a2 = self._agreement(self.recent[t - 2], 2) if (t - 2) in self.recent else 0.0
        a4 = self._agreement(self.recent[t - 4], 4) if (t - 4) in self.recent else 0.0
        return (prev_agree, gap, prev is not None, float(self.last_resolved_label), mean, self.resolved_count,
                a2, a4, self.streak)

    def _agreement(self, d: CacheDraftRecord, j: int) -> float:
        m = min(len(d.tokens), j)
        return lcp(d.tokens[:m], self.out[d.position : d.position + m]) / max(m, 1)

    def add_draft(self, d: CacheDraftRecord) -> None:
        self.pending.append(d)
        self.latest = d
        self.first_tokens[d.position] = d.tokens[0]
        self.recent[d.position] = d
        for p in [p for p in self.recent if p < d.position - _RECENT]:
            del self.recent[p]
