"""The suffix-cache drafter: arctic-inference's SuffixDecodingCache, queried per tree.

vLLM's `method="suffix"` asks the cache for one draft and gets the better of two trees (the
request's own prompt tree and the global tree of earlier responses). The gate needs to know which
tree spoke, so this wrapper queries the two trees separately with exactly the arguments vLLM uses
and applies the same tie rule (prompt tree wins ties). Offline replay and the live runtime both
draft through this class, so the labels the predictor learns from are the drafts it will gate.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
from arctic_inference.suffix_decoding import SuffixDecodingCache
from arctic_inference.suffix_decoding._C import SuffixTree

from predictor.labels import lcp

SOURCE_NONE = 0
SOURCE_PROMPT = 1
SOURCE_GLOBAL = 2
SOURCE_NAMES = {SOURCE_NONE: "none", SOURCE_PROMPT: "prompt", SOURCE_GLOBAL: "global"}


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's suffix defaults (`SpeculativeConfig`, method="suffix")."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    num_speculative_tokens: int = 24

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {self.max_tree_depth}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


@dataclass(frozen=True)
class CacheDraft:
    """One cache draft and what the gate may know about it before verification."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: int = SOURCE_NONE
    # The tree that lost: its score, length, and how many leading tokens both trees agree on.
    other_score: float = 0.0
    other_len: int = 0
    trees_agree: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)


class CacheDrafter:
    """Per-request prompt trees plus one global response tree, as one serving process holds."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._cache = SuffixDecodingCache(
            max_tree_depth=self.config.max_tree_depth,
            max_cached_requests=self.config.max_cached_requests,
        )

    @property
    def active_requests(self) -> frozenset[Hashable]:
        return frozenset(self._cache.active_requests)

    def start(self, req_id: Hashable, prompt_token_ids: np.ndarray | Sequence[int]) -> None:
        """Begin a request; a finished request's cached response under the same id is evicted first."""
        if req_id in self._cache.cached_requests and req_id not in self._cache.active_requests:
            self._cache.evict_cached_response(req_id)
        self._cache.start_request(req_id, _as_int32(prompt_token_ids))

    def extend(self, req_id: Hashable, token_ids: np.ndarray | Sequence[int]) -> None:
        """Append realised output tokens (they become draftable for every request)."""
        if len(token_ids):
            self._cache.add_active_response(req_id, _as_int32(token_ids))

    def stop(self, req_id: Hashable) -> None:
        self._cache.stop_request(req_id)

    def draft(self, req_id: Hashable, context: np.ndarray, max_spec_tokens: int | None = None) -> CacheDraft:
        """Draft after `context` (the request's prompt + output so far; only its tail is matched)."""
        cfg = self.config
        limit = cfg.num_speculative_tokens if max_spec_tokens is None else max_spec_tokens
        pattern = _as_int32(context[-cfg.max_tree_depth :])
        local = self._cache._local_trees[req_id]
        args = (limit, cfg.max_spec_factor, 0.0, cfg.min_token_prob, False)
        d_prompt = SuffixTree.speculate_ndarray(local, pattern, *args)
        d_global = SuffixTree.speculate_ndarray(self._cache._global_tree, pattern, *args)
        if d_prompt.score >= d_global.score:
            best, other, source = d_prompt, d_global, SOURCE_PROMPT
        else:
            best, other, source = d_global, d_prompt, SOURCE_GLOBAL
        token_ids = list(best.token_ids)
        if not token_ids:
            return CacheDraft(match_len=int(best.match_len))
        other_ids = list(other.token_ids)
        return CacheDraft(token_ids, list(best.probs), float(best.score), int(best.match_len), source,
                          float(other.score), len(other_ids), lcp(token_ids, other_ids))


def _as_int32(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int32)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
