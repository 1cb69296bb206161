"""Feature schema stability and the feature columns."""
from __future__ import annotations

import numpy as np
import pytest

from predictor.drafting import features
from predictor.drafting.cache_drafter import TREE_GLOBAL, CacheDraft
from predictor.drafting.features import FEATURE_NAMES, MAX_NESTING, NUM_FEATURES, DraftContext, feature_matrix, schema_hash
from predictor.drafting.token_classes import BRACKET, NEWLINE, TokenClasses
from storage.workloads import WORKLOADS

# Computed from the code when these tests were written. If this fails, a feature column changed:
# bump FEATURE_SCHEMA_VERSION deliberately and update this literal (stored models become unloadable).
SCHEMA_HASH = "0326dd8fe44d1dce711fbddae6474d3f0385c57f6a536cef810c7e3a75dcd7ec"


def test_schema_hash_is_pinned():
    assert schema_hash() == SCHEMA_HASH


def test_schema_names():
    assert NUM_FEATURES == len(FEATURE_NAMES) == 39
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    assert FEATURE_NAMES[0] == "match_len"
    assert FEATURE_NAMES[-len(WORKLOADS):] == tuple(f"workload_{w}" for w in WORKLOADS)


def test_schema_hash_depends_on_names(monkeypatch):
    monkeypatch.setattr(features, "FEATURE_NAMES", FEATURE_NAMES[:-1])
    assert features.schema_hash() != SCHEMA_HASH
    monkeypatch.undo()
    monkeypatch.setattr(features, "FEATURE_SCHEMA_VERSION", features.FEATURE_SCHEMA_VERSION + 1)
    assert features.schema_hash() != SCHEMA_HASH


# ---------------------------------------------------------------- the columns, by hand

CLASSES = TokenClasses(flags=np.array([0, 0, 0, NEWLINE, BRACKET], dtype=np.uint8),
                       depth_delta=[0] * 5, ends_line=[False] * 5)


def test_feature_matrix_hand_computed():
    with_draft = DraftContext(
        CacheDraft([3, 4, 1], [0.5, 0.25, 1.0], 1.75, match_len=4, tree=TREE_GLOBAL, other_score=0.5, other_len=2,
                   trees_agree=1),
        continues_prev=3, position=9, context_len=19, nesting=12, at_line_start=True, workload=1,
        prev_agree=0.5, prev_gap=3, has_prev=True, last_label=2.0, mean_label=1.5, n_resolved=4, agree_2=1.0,
        agree_4=0.0, hit_streak=7, on_policy=True)
    without = DraftContext(CacheDraft([], [], match_len=5), 0, 2, 12, -1, False, 0, 0.0, 0, False, 0.0, 0.0, 0,
                           0.0, 0.0, 0)
    x = feature_matrix([with_draft, without], CLASSES)
    assert x.shape == (2, NUM_FEATURES) and x.dtype == np.float32
    got = dict(zip(FEATURE_NAMES, x[0].tolist()))
    expected = {
        "match_len": 4, "draft_len": 3, "score": 1.75, "score_per_token": 1.75 / 3, "prob_min": 0.25,
        "prob_mean": 1.75 / 3, "prob_first": 0.5, "prob_last": 1.0, "source_prompt": 0, "source_global": 1,
        "log_position": np.log1p(9), "log_context_len": np.log1p(19), "draft_has_newline": 1,
        "draft_has_bracket": 1, "draft_has_quote": 0, "draft_has_digit": 0, "nesting_depth": MAX_NESTING,
        "at_line_start": 1, "prev_agree": 0.5, "log_prev_gap": np.log1p(3), "has_prev": 1, "last_label": 2,
        "mean_label": 1.5, "log_n_resolved": np.log1p(4), "other_tree_score": 0.5, "other_tree_len": 2,
        "trees_agree": 1 / 3, "continues_prev": 1, "agree_2": 1, "agree_4": 0, "log_hit_streak": np.log1p(7),
        "first_token_newline": 1, "first_token_bracket_quote": 0,
        "on_policy": 1,
    } | {f"workload_{w}": float(i == 1) for i, w in enumerate(WORKLOADS)}
    assert got == pytest.approx(expected)
    # no draft: the draft's columns are 0 (a match that found nothing to draft included)
    got = dict(zip(FEATURE_NAMES, x[1].tolist()))
    assert got == pytest.approx({name: 0.0 for name in FEATURE_NAMES} | {
        "log_position": np.log1p(2), "log_context_len": np.log1p(12), f"workload_{WORKLOADS[0]}": 1.0})
