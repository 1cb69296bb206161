"""Trace replay: rebuild the cache state a serving process would have had, draft at every output
position, and label every draft with its oracle accepted length.

Scope: one serving process (one global tree) per deployment, i.e. per (producing model, run). The
bundled sources repeat the same tasks across producing models and runs; letting one model's
outputs draft for another's would inflate cache acceptance far beyond what any real deployment
sees. Sessions of a deployment arrive in order, their turns in order, one request at a time.

The cache state, hence every draft and label, depends only on the realised outputs, never on which
drafts a policy chose to verify; so one dense replay serves every policy the simulator compares.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import TraceRecord
from predictor.drafting.cache_drafter import CacheDrafter, SuffixConfig
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import NUM_FEATURES, DraftContext, feature_matrix
from predictor.drafting.hindsight import Hindsight
from predictor.drafting.token_classes import token_classes
from storage.workloads import WORKLOADS

# Draft tokens kept per row: as many as the model drafter drafts (vllm_engine.MODEL_DRAFT_LEN).
LEAD_TOKENS = 3

ProgressFn = Callable[[int, int], None]


@dataclass
class ReplayResult:
    """Plain arrays: one row per output position t >= 1 of every replayed trace."""

    trace: np.ndarray  # int32: index into `records`
    position: np.ndarray  # int32: t, the number of output tokens already emitted
    draft_len: np.ndarray  # int16: k, 0 when the cache had nothing to propose
    label: np.ndarray  # int16: y, tokens greedy verification accepts
    score: np.ndarray  # float32: the cache's own score (sum of path probabilities)
    features: np.ndarray  # float32 (rows x NUM_FEATURES)
    records: list[TraceRecord] = field(default_factory=list)
    # float32: every draft's path probabilities (arctic-inference's `probs`), the rows' drafts laid end
    # to end in row order (row i's are draft_len[i] values from sum(draft_len[:i])): what rules that
    # read per-token confidences (predictor.decision.rivals) see
    token_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    output_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    workload: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))  # per trace
    # int32 (rows, LEAD_TOKENS): the draft's first LEAD_TOKENS token ids, -1 past its end. Only the
    # lead is kept (whole drafts would dwarf the other arrays): enough to compare each draft with the
    # model drafter's, which is no longer (bench/eagle_agreement.py)
    lead_tokens: np.ndarray = field(default_factory=lambda: np.zeros((0, LEAD_TOKENS), dtype=np.int32))
    # The draft vLLM's suffix method would have made at the row (cache_drafter.VLLM_SUFFIX: HVD asks
    # the cache for longer ones): its length, accepted length and score, what the simulator's
    # `suffix` and `arctic` baselines verify
    vllm_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    vllm_label: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    vllm_score: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))

    @property
    def rows(self) -> int:
        return len(self.position)

    def row_workload(self) -> np.ndarray:
        return self.workload[self.trace]


def deployments(records: Iterable[TraceRecord]) -> dict[tuple[str, str, str], list[TraceRecord]]:
    """Records grouped by (source, model, run), each group in arrival order."""
    groups: dict[tuple[str, str, str], list[TraceRecord]] = {}
    for record in records:
        groups.setdefault((record.source, record.model, record.run), []).append(record)
    return groups


def replay(
    records: Sequence[TraceRecord],
    tokenizer: TraceTokenizer,
    config: SuffixConfig | None = None,
    progress: ProgressFn | None = None,
) -> ReplayResult:
    """Replay `records` (in arrival order) and label every output position."""
    config = config or SuffixConfig()
    index = {id(r): i for i, r in enumerate(records)}
    parts: list[_TraceRows] = []
    output_len = np.zeros(len(records), dtype=np.int32)
    done = 0
    for group in deployments(records).values():
        drafter = CacheDrafter(config)
        for record in group:
            i = index[id(record)]
            rows = _replay_one(drafter, record, i, tokenizer)
            output_len[i] = rows.output_len
            parts.append(rows)
            done += 1
            if progress is not None:
                progress(done, len(records))
        tokenizer.clear_cache()
    workload = np.array([WORKLOADS.index(r.workload) for r in records], dtype=np.int8)
    return _concat(parts, list(records), output_len, workload)


@dataclass
class _TraceRows:
    trace: int
    output_len: int
    position: np.ndarray
    draft_len: np.ndarray
    label: np.ndarray
    score: np.ndarray
    features: np.ndarray
    token_probs: np.ndarray
    lead_tokens: np.ndarray  # int32 (rows, LEAD_TOKENS): the draft's first tokens, -1 past its end
    vllm_len: np.ndarray
    vllm_label: np.ndarray
    vllm_score: np.ndarray


def _replay_one(drafter: CacheDrafter, record: TraceRecord, trace: int, tokenizer: TraceTokenizer) -> _TraceRows:
    prompt = tokenizer.encode_context(record)
    out = tokenizer.output_tokens(record)
    n = len(out)
    req_id = f"{trace}"
    drafter.start(req_id, prompt)
    request = Hindsight(prompt, WORKLOADS.index(record.workload), token_classes(tokenizer),
                        on_policy=record.engine is not None)
    rows: list[DraftContext] = []
    labels = [0] * max(n - 1, 0)  # per position t >= 1
    vllm = np.zeros((max(n - 1, 0), 3), dtype=np.float64)  # per position t >= 1: length, accepted, score
    out_list = [int(x) for x in out]
    for t in range(n):
        token = out[t : t + 1]
        drafter.extend(req_id, token)
        for d, y in request.append(token):
            labels[d.position - 1] = y
        if t + 1 < n:  # a draft after every output token but the last
            draft = drafter.draft(req_id, request.tokens)
            rows.append(request.draft_context(draft))
            if draft.token_ids:
                request.add(draft)
            v_tokens, v_score = drafter.vllm_draft(req_id, request.tokens)
            if v_tokens:
                vllm[t] = (len(v_tokens), lcp(v_tokens, out_list[t + 1 : t + 1 + len(v_tokens)]), v_score)
    for d, y in request.finish():
        labels[d.position - 1] = y
    drafter.stop(req_id)
    drafts = [r.draft for r in rows]
    return _TraceRows(trace, n, np.arange(1, max(n, 1), dtype=np.int32),
                      np.fromiter((len(d.token_ids) for d in drafts), dtype=np.int16, count=len(drafts)),
                      np.array(labels, dtype=np.int16),
                      np.fromiter((d.score for d in drafts), dtype=np.float32, count=len(drafts)),
                      feature_matrix(rows, token_classes(tokenizer)),
                      np.fromiter((p for d in drafts for p in d.probs), dtype=np.float32),
                      lead_tokens([d.token_ids for d in drafts]),
                      vllm[:, 0].astype(np.int16), vllm[:, 1].astype(np.int16), vllm[:, 2].astype(np.float32))


def lead_tokens(drafts: Sequence[Sequence[int]]) -> np.ndarray:
    """(len(drafts), LEAD_TOKENS) int32: each draft's first LEAD_TOKENS token ids, -1 past its end."""
    out = np.full((len(drafts), LEAD_TOKENS), -1, dtype=np.int32)
    for i, d in enumerate(drafts):
        lead = d[:LEAD_TOKENS]
        out[i, : len(lead)] = lead
    return out


def _concat(parts: list[_TraceRows], records: list[TraceRecord], output_len: np.ndarray,
            workload: np.ndarray) -> ReplayResult:
    def cat(name: str, dtype: type, empty_shape: tuple[int, ...] = (0,)) -> np.ndarray:
        arrays = [getattr(p, name) for p in parts]
        return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(empty_shape, dtype=dtype)

    trace = np.concatenate([np.full(len(p.position), p.trace, dtype=np.int32) for p in parts]) if parts else np.zeros(0, np.int32)
    return ReplayResult(
        trace=trace,
        position=cat("position", np.int32),
        draft_len=cat("draft_len", np.int16),
        label=cat("label", np.int16),
        score=cat("score", np.float32),
        features=cat("features", np.float32, (0, NUM_FEATURES)),
        records=records,
        token_probs=cat("token_probs", np.float32),
        output_len=output_len,
        lead_tokens=cat("lead_tokens", np.int32, (0, LEAD_TOKENS)),
        workload=workload,
        vllm_len=cat("vllm_len", np.int16),
        vllm_label=cat("vllm_label", np.int16),
        vllm_score=cat("vllm_score", np.float32),
    )
