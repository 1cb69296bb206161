"""The AUC that the rivals' estimator fit and the predictor's reports quote: Mann-Whitney with ties
counted half, checked against the pairwise definition."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from predictor.evaluation.gate_quality import auc


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=40))
def test_auc_is_the_share_of_positive_negative_pairs_ranked_right_ties_half(pairs):
    score = np.array([s for s, _ in pairs], dtype=np.float64)
    positive = np.array([p for _, p in pairs])
    pos, neg = score[positive], score[~positive]
    got = auc(score, positive)
    if not len(pos) or not len(neg):
        assert math.isnan(got)
        return
    want = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
    assert got == pytest.approx(want, abs=1e-12)


def test_auc_at_its_ends():
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([1, 1, 0, 0])) == 0.0
    assert auc(np.full(6, 0.5), np.array([0, 1, 0, 1, 0, 1])) == 0.5
