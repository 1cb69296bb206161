"""Hindsight: labels as soon as the realised output decides them, and the history features."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from predictor.drafting.cache_drafter import CacheDraft
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import DraftContext
from predictor.drafting.hindsight import Hindsight
from predictor.drafting.token_classes import NEWLINE, TokenClasses

# Token 1 is what the output realises at every position; a draft with label y is y ones, then twos.
# Token 3 opens a bracket and ends a line, token 4 closes a bracket.
CLASSES = TokenClasses(flags=np.array([0, 0, 0, NEWLINE, 0], dtype=np.uint8),
                       depth_delta=[0, 0, 0, 1, -1], ends_line=[False, False, False, True, False])


NO_DRAFT = CacheDraft([], [])


def draft(tokens: list[int]) -> CacheDraft:
    return CacheDraft(tokens, [1.0] * len(tokens), float(len(tokens)))


HISTORY = DraftContext._fields[DraftContext._fields.index("prev_agree"):]


def histories(labels: np.ndarray, lengths: np.ndarray) -> SimpleNamespace:
    """The tracker driven as dense replay drives it: at each position t the history is read, the
    draft made at t (lengths[t] tokens, the first labels[t] right) joins it, then out[t] is realised.
    Returns each history field of DraftContext as an array over t."""
    h = Hindsight(np.array([0], dtype=np.int32), 0, CLASSES)
    rows = []
    for y, k in zip(labels.tolist(), lengths.tolist()):
        rows.append(h.draft_context(NO_DRAFT))
        if k:
            h.add(draft([1] * y + [2] * (k - y)))
        h.append(np.array([1], dtype=np.int32))
    return SimpleNamespace(**{name: np.array([getattr(r, name) for r in rows]) for name in HISTORY})


# ---------------------------------------------------------------- history, by hand

#            t: 0  1  2  3  4  5  6  7
LENGTHS = np.array([0, 4, 0, 2, 3, 0, 2, 1])
LABELS = np.array([0, 2, 0, 2, 0, 0, 1, 1])
# drafts at 1, 3, 4 resolve at 1+3=4, 3+2=5, 4+1=5; drafts at 6 and 7 resolve at 8 (past the end)


def test_history_hand_computed():
    h = histories(LABELS, LENGTHS)
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


def test_history_partial_agreement():
    # one draft of 5 at position 0 with label 3: agreement seen so far is min(3, gap)/min(5, gap)
    lengths = np.array([5, 0, 0, 0, 0, 0, 0])
    labels = np.array([3, 0, 0, 0, 0, 0, 0])
    h = histories(labels, lengths)
    np.testing.assert_allclose(h.prev_agree, [0, 1, 1, 1, 3 / 4, 3 / 5, 3 / 5])
    np.testing.assert_array_equal(h.prev_gap, [0, 1, 2, 3, 4, 5, 6])
    # resolved once the mismatch at index 3 is realised: t = 0 + 4
    np.testing.assert_array_equal(h.n_resolved, [0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(h.last_label, [0, 0, 0, 0, 3, 3, 3])


def test_history_without_drafts_is_all_zero():
    h = histories(np.zeros(6, dtype=np.int64), np.zeros(6, dtype=np.int64))
    for name in HISTORY:
        assert not np.any(getattr(h, name)), name


@st.composite
def _history_case(draw):
    n = draw(st.integers(1, 24))
    lengths = np.array(draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 5, 8]), min_size=n, max_size=n)))
    labels = np.array([draw(st.integers(0, k)) for k in lengths])
    return lengths, labels


@st.composite
def _hidden_change(draw):
    """A request, a draft position s, a time t and two labels a != b for s, both >= t - s."""
    lengths, labels = draw(_history_case())
    n = len(lengths)
    s = draw(st.integers(0, n - 1))
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
    the draft at s has shown at most t - s tokens, so the features at t are unchanged, although the
    tracker holds the draft's later tokens."""
    lengths, labels, s, t, b = case
    changed = labels.copy()
    changed[s] = b
    before, after = histories(labels, lengths), histories(changed, lengths)
    for name in HISTORY:
        assert getattr(before, name)[t] == getattr(after, name)[t], (name, t, s, labels[s], b)


def test_history_does_see_a_resolved_change():
    """The converse, so the property above is not vacuous: once resolved, the label shows."""
    lengths = np.array([4, 0, 0, 0, 0, 0])
    before = histories(np.array([1, 0, 0, 0, 0, 0]), lengths)
    after = histories(np.array([3, 0, 0, 0, 0, 0]), lengths)
    assert before.mean_label[2] == 1 and after.mean_label[2] == 0  # label 1 resolved at t=2, label 3 not yet
    assert before.prev_agree[2] == 0.5 and after.prev_agree[2] == 1.0


# ---------------------------------------------------------------- labels


def test_labels_come_when_decided_and_at_the_end():
    h = Hindsight(np.array([0], dtype=np.int32), 0, CLASSES)
    full = h.add(draft([1, 1]))  # both tokens right: decided once both are realised
    assert h.append(np.array([1], dtype=np.int32)) == []
    wrong = h.add(draft([2, 1, 1]))  # first token wrong: decided by the next token
    assert h.append(np.array([1], dtype=np.int32)) == [(full, 2), (wrong, 0)]
    open_ended = h.add(draft([1, 1, 1]))
    assert h.append(np.array([1, 1], dtype=np.int32)) == []  # 2 of 3 right so far
    assert h.finish() == [(open_ended, 2)]  # the request ended: what was realised decides


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_labels_are_the_lcp_with_the_realised_output(data):
    """Drafts at random positions, tokens fed in random chunks: every draft's label is its LCP with
    what the output realised from its position on."""
    out = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=30))
    h = Hindsight(np.array([0], dtype=np.int32), 0, CLASSES)
    made, labels, t = [], {}, 0
    while t < len(out):
        if data.draw(st.booleans()):
            tokens = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=8))
            made.append((h.add(draft(tokens)), tokens, t))
        n = data.draw(st.integers(1, 3))
        labels.update(h.append(np.array(out[t : t + n], dtype=np.int32)))
        t += n
    labels.update(h.finish())
    assert len(labels) == len(made)
    for tracked, tokens, at in made:
        assert labels[tracked] == lcp(tokens, out[at:])


# ---------------------------------------------------------------- the draft's context


def test_draft_context_reads_the_output_so_far():
    h = Hindsight(np.array([0, 0, 0], dtype=np.int32), 2, CLASSES)
    h.append(np.array([3, 1], dtype=np.int32))  # a bracket opens
    h.add(draft([1, 3, 4, 1]))
    h.append(np.array([1, 3], dtype=np.int32))  # the draft's first two tokens come true; another bracket opens
    c = h.draft_context(draft([4, 1, 9]))
    assert (c.position, c.context_len, c.nesting, c.at_line_start, c.workload) == (4, 7, 2, True, 2)
    assert c.continues_prev == 2  # the earlier draft's unrealised tail [4, 1] begins the new one
    assert c.prev_gap == 2 and c.prev_agree == 1.0
    assert h.tokens.tolist() == [0, 0, 0, 3, 1, 1, 3]
