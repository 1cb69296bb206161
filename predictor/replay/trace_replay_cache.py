"""Replay results cached on disk, keyed by everything that determines them.

Warm start and evaluation replay the same traces; the replay is deterministic, so the second one
reads the arrays back instead of rebuilding every suffix tree.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from predictor.data.tokens import REPO_ROOT, TraceTokenizer, tokenizer_path
from predictor.data.traces import TraceRecord
from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.features import schema_hash
from predictor.replay.trace_replay import ProgressFn, ReplayResult, replay

REPLAY_VERSION = 6  # 2: token_probs; 3: recorded engine tokens; 4: first_token; 5: lead_tokens; 6: vLLM's own draft beside HVD's. Bump when replay semantics change without a feature schema change
DEFAULT_CACHE_DIR = REPO_ROOT / "var" / "cache"
_ARRAYS = ("trace", "position", "draft_len", "label", "score", "features", "output_len", "workload", "token_probs", "lead_tokens", "vllm_len", "vllm_label", "vllm_score")


def replay_key(records: Sequence[TraceRecord], config: SuffixConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": REPLAY_VERSION, "schema": schema_hash(), "suffix": asdict(config)}).encode())
    h.update(hashlib.sha256(tokenizer_path().read_bytes()).digest())
    for r in records:
        h.update(json.dumps([r.trace_id, r.session_id, r.turn, r.source, r.workload, r.model, r.run,
                             r.context if isinstance(r.context, str) else [[m.role, m.content] for m in r.context],
                             r.output, None if r.engine is None else r.engine.output_ids]).encode())
    return h.hexdigest()


def cached_replay(records: Sequence[TraceRecord], tokenizer: TraceTokenizer, config: SuffixConfig | None = None,
                  cache_dir: Path | None = DEFAULT_CACHE_DIR, progress: ProgressFn | None = None) -> ReplayResult:
    """replay(), or its saved result when the same inputs were replayed before (cache_dir=None: off)."""
    config = config or SuffixConfig()
    if cache_dir is None:
        return replay(records, tokenizer, config, progress)
    path = Path(cache_dir) / f"replay-{replay_key(records, config)[:24]}.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                arrays = {name: z[name] for name in _ARRAYS}
            return ReplayResult(records=list(records), **arrays)
        except (OSError, KeyError, ValueError):
            path.unlink(missing_ok=True)  # a damaged cache file is rebuilt, never trusted
    result = replay(records, tokenizer, config, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")  # processes replaying the same traces at once each write their own
    np.savez(tmp, **{name: getattr(result, name) for name in _ARRAYS})
    tmp.replace(path)
    return result
