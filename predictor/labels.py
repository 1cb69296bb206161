"""Oracle labels: how many draft tokens greedy verification would accept.

Under greedy verification the target accepts the longest common prefix (LCP) of the draft and the
tokens it actually emits, so once the realised output covers a draft its label is exact, whether
or not it was verified (hindsight labelling).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lcp(draft: Sequence[int], truth: Sequence[int]) -> int:
    """Length of the longest common prefix of `draft` and `truth`."""
    n = min(len(draft), len(truth))
    for i in range(n):
        if draft[i] != truth[i]:
            return i
    return n


def lcp_many(draft_flat: np.ndarray, lengths: np.ndarray, positions: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """LCPs of many drafts against one realised sequence, in array operations.

    Draft i is `draft_flat[offsets[i] : offsets[i] + lengths[i]]` (drafts laid end to end) and
    proposes the continuation `truth[positions[i]:]`. Tokens past the end of `truth` never match.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    labels = np.zeros(n, dtype=np.int64)
    if n == 0 or lengths.sum() == 0:
        return labels
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    segment = np.repeat(np.arange(n), lengths)
    index_in_draft = np.arange(len(draft_flat)) - offsets[segment]
    truth_pos = np.asarray(positions, dtype=np.int64)[segment] + index_in_draft
    inside = truth_pos < len(truth)
    matches = inside & (draft_flat == truth[np.minimum(truth_pos, len(truth) - 1)])
    # First mismatch per draft (or its length when all match), via a min over each segment.
    value = np.where(matches, lengths[segment], index_in_draft)
    nonempty = lengths > 0
    labels[nonempty] = np.minimum.reduceat(value, offsets[nonempty])
    return labels


def resolved_at(positions: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Output length at which each draft's label becomes known (mismatch seen, or all matched)."""
    return positions + np.minimum(labels + 1, lengths)
