"""Oracle labels: how many draft tokens greedy verification would accept.

Under greedy verification the target accepts the longest common prefix (LCP) of the draft and the
tokens it actually emits, so once the realised output covers a draft its label is exact, whether
or not it was verified (hindsight labelling).
"""
from __future__ import annotations

from collections.abc import Sequence


def lcp(draft: Sequence[int], truth: Sequence[int]) -> int:
    """Length of the longest common prefix of `draft` and `truth`."""
    n = 0
    for a, b in zip(draft, truth):
        if a != b:
            return n
        n += 1
    return n
