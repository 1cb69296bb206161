"""The suffix-cache drafter: arctic-inference's SuffixDecodingCache, queried per tree.

vLLM's `method="suffix"` asks the cache for one draft and gets the better of two trees (the
request's own prompt tree and the global tree of earlier responses). The gate needs to know which
tree spoke, so this wrapper queries the two trees separately with exactly the arguments vLLM uses
and applies the same tie rule (prompt tree wins ties). Offline replay and the live runtime both
draft through this class, so the labels the predictor learns from are the drafts it will gate.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from arctic_inference.suffix_decoding import SuffixDecodingCache
from arctic_inference.suffix_decoding._C import SuffixTree

from predictor.drafting.common_prefix import lcp

# Which suffix tree a draft came from (a draft's `tree`).
TREE_NONE = 0
TREE_PROMPT = 1
TREE_GLOBAL = 2


@dataclass(frozen=True)
class SuffixConfig:
    """The cache's shape: vLLM's suffix defaults (`SpeculativeConfig`, method="suffix") but for how
    far a draft may run past its match. vLLM's suffix method verifies every draft whole, so it caps a
    draft at the match's length (`max_spec_factor` 1); HVD cuts each draft where its predictor says
    the next token stops paying, so it asks the cache for up to 4 times the match and lets the cut
    decide (docs/results/figures.md, "Wider drafts"). `VLLM_SUFFIX` is vLLM's own shape, the baseline."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 4.0
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
        if self.max_spec_factor < 0.0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")


# The drafts vLLM's `method="suffix"` makes (its SpeculativeConfig defaults): what the simulator's
# `suffix` and `arctic` baselines verify, as `bench/vllm_methods.py`'s suffix server does.
VLLM_SUFFIX = SuffixConfig(max_spec_factor=1.0)


class CacheDraft(NamedTuple):
    """One cache draft and what the gate may know about it before verification (a NamedTuple
    because replay makes one per output position)."""

    token_ids: list[int]
    probs: list[float]
    score: float = 0.0
    match_len: int = 0
    tree: int = TREE_NONE
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
        self._args = _speculate_args(self.config)
        self._vllm_args = _speculate_args(replace(self.config, max_spec_factor=VLLM_SUFFIX.max_spec_factor,
                                                  min_token_prob=VLLM_SUFFIX.min_token_prob))

    def start(self, req_id: Hashable, prompt_token_ids: np.ndarray | Sequence[int]) -> None:
        """Begin a request; a finished request's cached response under the same id is evicted first."""
        if req_id in self._cache.cached_requests and req_id not in self._cache.active_requests:
            self._cache.evict_cached_response(req_id)
        self._cache.start_request(req_id, _as_int32(prompt_token_ids))

    def extend(self, req_id: Hashable, token_ids: np.ndarray | Sequence[int]) -> None:
        """Append realised output tokens (they become draftable for every request)."""
        if len(token_ids):
            _extend_trees(self._cache, req_id, _as_int32(token_ids))

    def stop(self, req_id: Hashable) -> None:
        self._cache.stop_request(req_id)

    def draft(self, req_id: Hashable, context: np.ndarray) -> CacheDraft:
        """Draft after `context` (the request's prompt + output so far; only its tail is matched)."""
        d_prompt, d_global = self._both_trees(req_id, context, self._args)
        if d_prompt.score >= d_global.score:
            best, other, tree = d_prompt, d_global, TREE_PROMPT
        else:
            best, other, tree = d_global, d_prompt, TREE_GLOBAL
        token_ids = best.token_ids  # each read of a native list is a fresh copy
        if not token_ids:
            return CacheDraft([], [], match_len=best.match_len)
        other_ids = other.token_ids
        return CacheDraft(token_ids, best.probs, best.score, best.match_len, tree, other.score, len(other_ids),
                          lcp(token_ids, other_ids))

    def vllm_draft(self, req_id: Hashable, context: np.ndarray) -> tuple[list[int], float]:
        """(tokens, score) of the draft vLLM's suffix method would make here (`VLLM_SUFFIX`'s shape, the
        better tree, prompt tree on ties): the baseline offline replay labels beside HVD's draft."""
        d_prompt, d_global = self._both_trees(req_id, context, self._vllm_args)
        best = d_prompt if d_prompt.score >= d_global.score else d_global
        return best.token_ids, best.score

    def _both_trees(self, req_id: Hashable, context: np.ndarray, args: tuple) -> tuple:
        """(the prompt tree's draft, the global tree's) after `context`, drafted with `args`."""
        pattern = _as_int32(context[-self.config.max_tree_depth :])
        return (_speculate(self._cache._local_trees[req_id], pattern, *args),
                _speculate(self._cache._global_tree, pattern, *args))


def _speculate_args(cfg: SuffixConfig) -> tuple:
    """vLLM's speculate arguments, by position (max_spec_offset 0, no tree speculation)."""
    return (cfg.num_speculative_tokens, cfg.max_spec_factor, 0.0, cfg.min_token_prob, False)


# Where this module reaches into SuffixDecodingCache's trees (arctic-inference 0.3.0, pinned by the
# Makefile): `draft` queries the request's prompt tree and the global tree separately with vLLM's
# arguments (HVD's `max_spec_factor`; its `speculate` returns only the better of the two drafts; the gate needs
# both; the native call takes them by position), and `_extend_trees` appends
# tokens as its `add_active_response` does, without that wrapper's per-call checks (the runtime
# appends a token at a time, per request, every step).
_speculate = SuffixTree.speculate_ndarray  # (tree, pattern, max_spec_tokens, max_spec_factor,
#                                             max_spec_offset, min_token_prob, use_tree_spec) -> Draft
_extend = SuffixTree.extend_ndarray  # (tree, seq_id, tokens)


def _extend_trees(cache: SuffixDecodingCache, req_id: Hashable, tokens: np.ndarray) -> None:
    """`cache.add_active_response(req_id, tokens)` for an int32 contiguous array: the request's
    prompt tree, and its response in the global tree while it is cached there."""
    tree = cache._local_trees.get(req_id)
    if tree is None:
        raise ValueError(f"Request '{req_id}' is not active")
    if tokens.ndim != 1:
        raise ValueError(f"ndarray input must have ndim=1, got ndim={tokens.ndim}")
    _extend(tree, 0, tokens)
    seq_id = cache._req_to_seq_id.get(req_id)
    if seq_id is not None:
        _extend(cache._global_tree, seq_id, tokens)


_INT32 = np.dtype(np.int32)


def _as_int32(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """The tokens as the contiguous int32 vector the native calls take (what the runtime passes
    already is one: the check is cheaper than numpy's)."""
    if tokens.__class__ is np.ndarray and tokens.dtype is _INT32 and tokens.strides == (4,):
        return tokens
    return np.ascontiguousarray(tokens, dtype=np.int32)
