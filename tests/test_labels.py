"""Oracle labels: the longest common prefix of a draft and the realised output."""
from __future__ import annotations

import numpy as np
import pytest

from predictor.drafting.common_prefix import lcp


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
