"""Feature schema stability and the dense history features."""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from predictor import features
from predictor.features import FEATURE_NAMES, NUM_FEATURES, dense_history, schema_hash
from predictor.traces import WORKLOADS

# Computed from the code when these tests were written. If this fails, a feature column changed:
# bump FEATURE_SCHEMA_VERSION deliberately and update this literal (stored models become unloadable).
SCHEMA_HASH = "e0fa3927c88462199079792571a47aaea2cd7aaca3ba69d2a70c9c9bfdcab913"


def test_schema_hash_is_pinned():
    assert schema_hash() == SCHEMA_HASH


def test_schema_names():
    assert NUM_FEATURES == len(FEATURE_NAMES) == 38
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    assert FEATURE_NAMES[0] == "match_len"
    assert FEATURE_NAMES[-len(WORKLOADS):] == tuple(f"workload_{w}" for w in WORKLOADS)


def test_schema_hash_depends_on_names(monkeypatch):
    monkeypatch.setattr(features, "FEATURE_NAMES", FEATURE_NAMES[:-1])
    assert features.schema_hash() != SCHEMA_HASH
    monkeypatch.undo()
    monkeypatch.setattr(features, "FEATURE_SCHEMA_VERSION", features.FEATURE_SCHEMA_VERSION + 1)
    assert features.schema_hash() != SCHEMA_HASH


# ---------------------------------------------------------------- dense_history, by hand

#            t: 0  1  2  3  4  5  6  7
LENGTHS = np.array([0, 4, 0, 2, 3, 0, 2, 1])
LABELS = np.array([0, 2, 0, 2, 0, 0, 1, 1])
# drafts at 1, 3, 4 resolve at 1+3=4, 3+2=5, 4+1=5; drafts at 6 and 7 resolve at 8 (past the end)


def test_dense_history_hand_computed():
    h = dense_history(LABELS, LENGTHS)
    np.testing.assert_array_equal(h.has_prev, [0, 0, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(h.prev_gap, [0, 0, 1, 2, 1, 1, 2, 1])
    np.testing.assert_allclose(h.prev_agree, [0, 0, 1, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(h.n_resolved, [0, 0, 0, 0, 1, 3, 3, 3])
    np.testing.assert_allclose(h.mean_label, [0, 0, 0, 0, 2, 4 / 3, 4 / 3, 4 / 3])
    # the latest-positioned resolved draft: the one at 1 (label 2) at t=4, then the one at 4 (label 0)
    np.testing.assert_array_equal(h.last_label, [0, 0, 0, 0, 2, 0, 0, 0])
    np.testing.assert_allclose(h.agree_2, [0, 0, 0, 1, 0, 1, 0, 0])
    np.testing.assert_allclose(h.agree_4, [0, 0, 0, 0, 0, 0.5, 0, 1])
    np.testing.assert_array_equal(h.hit_streak, [0, 0, 1, 0, 1, 0, 0, 1])


def test_dense_history_partial_agreement():
    # one draft of 5 at position 0 with label 3: agreement seen so far is min(3, gap)/min(5, gap)
    lengths = np.array([5, 0, 0, 0, 0, 0, 0])
    labels = np.array([3, 0, 0, 0, 0, 0, 0])
    h = dense_history(labels, lengths)
    np.testing.assert_allclose(h.prev_agree, [0, 1, 1, 1, 3 / 4, 3 / 5, 3 / 5])
    np.testing.assert_array_equal(h.prev_gap, [0, 1, 2, 3, 4, 5, 6])
    # resolved once the mismatch at index 3 is realised: t = 0 + 4
    np.testing.assert_array_equal(h.n_resolved, [0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(h.last_label, [0, 0, 0, 0, 3, 3, 3])


def test_dense_history_no_drafts_is_all_zero():
    h = dense_history(np.zeros(6, dtype=np.int64), np.zeros(6, dtype=np.int64))
    for field in dataclasses.fields(h):
        assert not np.any(getattr(h, field.name)), field.name


@st.composite
def _history_case(draw):
    n = draw(st.integers(1, 24))
    lengths = np.array(draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 5, 8]), min_size=n, max_size=n)))
    labels = np.array([draw(st.integers(0, k)) for k in lengths])
    s = draw(st.integers(0, n - 1))
    t = draw(st.integers(0, n - 1))
    return lengths, labels, s, t, draw(st.integers(0, 8))


@st.composite
def _hidden_change(draw):
    """A request, a draft position s, a time t and two labels a != b for s, both >= t - s."""
    lengths, labels, s, _, _ = draw(_history_case())
    n = len(lengths)
    k = draw(st.integers(1, 8))
    lengths[s] = k
    t = s + draw(st.integers(-s, min(k - 1, n - 1 - s)))
    lo = max(t - s, 0)
    a, b = draw(st.lists(st.integers(lo, k), min_size=2, max_size=2, unique=True))
    labels[s] = a
    return lengths, labels, s, t, b


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_hidden_change())
def test_history_at_t_ignores_what_is_not_yet_known(case):
    """Changing y_s from a to b, both >= t - s, cannot be observed by time t (out[:t] known):
    the draft at s has shown at most t - s tokens, so the features at t are unchanged."""
    lengths, labels, s, t, b = case
    changed = labels.copy()
    changed[s] = b
    before, after = dense_history(labels, lengths), dense_history(changed, lengths)
    for field in dataclasses.fields(before):
        x, y = getattr(before, field.name)[t], getattr(after, field.name)[t]
        assert x == y, (field.name, t, s, labels[s], b)


def test_history_does_see_a_resolved_change():
    """The converse, so the property above is not vacuous: once resolved, the label shows."""
    lengths = np.array([4, 0, 0, 0, 0, 0])
    before = dense_history(np.array([1, 0, 0, 0, 0, 0]), lengths)
    after = dense_history(np.array([3, 0, 0, 0, 0, 0]), lengths)
    assert before.mean_label[2] == 1 and after.mean_label[2] == 0  # label 1 resolved at t=2, label 3 not yet
    assert before.prev_agree[2] == 0.5 and after.prev_agree[2] == 1.0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_history_case())
def test_history_is_prefix_stable(case):
    """Features at t do not depend on anything drafted at or after t: truncating the request there
    leaves them unchanged (positions < t keep their values)."""
    lengths, labels, _, t, _ = case
    assume(t >= 1)
    full = dense_history(labels, lengths)
    cut = dense_history(labels[:t], lengths[:t])
    for field in dataclasses.fields(full):
        # n_resolved etc. count resolutions at <= position; the truncated run drops none before t
        np.testing.assert_array_equal(getattr(full, field.name)[:t], getattr(cut, field.name), err_msg=field.name)
