"""Oracle labels: lcp, its vectorised twin lcp_many, and resolved_at."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.labels import lcp, lcp_many, resolved_at


@pytest.mark.parametrize(
    ("draft", "truth", "expected"),
    [
        ([], [1, 2, 3], 0),  # empty draft
        ([1, 2, 3], [], 0),  # empty truth
        ([], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),  # full match
        ([1, 2, 3], [1, 2, 3, 4, 5], 3),  # truth continues past the draft
        ([1, 2, 3, 4, 5], [1, 2, 3], 3),  # draft longer than truth
        ([9, 2, 3], [1, 2, 3], 0),  # mismatch at 0
        ([1, 2, 9, 4], [1, 2, 3, 4], 2),  # mismatch in the middle, later tokens equal again
        ([1, 2, 3, 9], [1, 2, 3, 4], 3),  # mismatch at the last draft token
        ((5, 6), np.array([5, 6, 7]), 2),  # tuple / ndarray inputs
    ],
)
def test_lcp_hand_built(draft, truth, expected):
    assert lcp(draft, truth) == expected


def _lcp_many_by_loop(drafts: list[list[int]], positions: list[int], truth: list[int]) -> list[int]:
    return [lcp(d, truth[p:]) for d, p in zip(drafts, positions)]


def _call_many(drafts, positions, truth):
    lengths = np.array([len(d) for d in drafts], dtype=np.int64)
    flat = np.array([t for d in drafts for t in d], dtype=np.int32)
    return lcp_many(flat, lengths, np.array(positions, dtype=np.int64), np.array(truth, dtype=np.int32))


def test_lcp_many_hand_built():
    truth = [1, 2, 3, 4, 5, 6]
    drafts = [[2, 3, 4], [], [9], [5, 6, 7, 8], [6], [3, 4, 5, 6]]
    positions = [1, 2, 0, 4, 5, 2]
    got = _call_many(drafts, positions, truth)
    assert got.tolist() == [3, 0, 0, 2, 1, 4]
    assert got.dtype == np.int64


def test_lcp_many_empty_inputs():
    assert _call_many([], [], [1, 2]).tolist() == []
    assert _call_many([[], []], [0, 1], [1, 2]).tolist() == [0, 0]


def test_lcp_many_tokens_past_end_of_truth_never_match():
    # The draft at the last position proposes [3, 3]: only the first token can be checked.
    truth = [3, 3, 3]
    assert _call_many([[3, 3], [3, 3, 3, 3]], [2, 0], truth).tolist() == [1, 3]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_lcp_many_equals_loop(data):
    vocab = data.draw(st.integers(1, 4))  # small vocabulary: long matches are common
    truth = data.draw(st.lists(st.integers(0, vocab), min_size=1, max_size=30))
    n = data.draw(st.integers(0, 12))
    drafts, positions = [], []
    for _ in range(n):
        # positions up to len(truth) - 1, biased towards the end via a second strategy
        pos = data.draw(st.one_of(st.integers(0, len(truth) - 1),
                                  st.integers(max(0, len(truth) - 3), len(truth) - 1)))
        if data.draw(st.booleans()):
            # a draft copied from truth (maybe running past its end), perhaps with one token changed
            k = data.draw(st.integers(0, 8))
            d = list(truth[pos : pos + k]) + data.draw(st.lists(st.integers(0, vocab), max_size=3))
            if d and data.draw(st.booleans()):
                i = data.draw(st.integers(0, len(d) - 1))
                d[i] = vocab + 1
        else:
            d = data.draw(st.lists(st.integers(0, vocab), max_size=8))
        drafts.append(d)
        positions.append(pos)
    got = _call_many(drafts, positions, truth)
    assert got.tolist() == _lcp_many_by_loop(drafts, positions, truth)


def test_resolved_at_values():
    positions = np.array([1, 2, 3, 4, 5])
    labels = np.array([0, 2, 4, 1, 0])
    lengths = np.array([3, 4, 4, 1, 0])
    # mismatch at index y seen after y+1 tokens; a full match after k tokens; no draft: resolved at once
    assert resolved_at(positions, labels, lengths).tolist() == [2, 5, 7, 5, 5]
