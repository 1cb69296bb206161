"""Counterfactual replay along request paths (predictor.online.counterfactual.Paths, replay_paths): each
policy walks its own path through hindsight-labelled drafts, and it judges what per-draft replay
gets wrong."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.decision.profiles import cost_profiles
from predictor.gate.mlp import SURVIVAL_K
from predictor.online.counterfactual import SEGMENT, Paths, concurrency, gain, replay_paths

K = SURVIVAL_K
COST = cost_profiles()["cpu-smollm2"]
NO_MODEL = np.zeros(3)


def sure(n: int, draft_len: np.ndarray) -> np.ndarray:
    """Curves certain of every drafted token: the allocator verifies whole drafts."""
    return (np.arange(K)[None, :] < np.asarray(draft_len)[:, None]).astype(np.float32) * np.ones((n, 1), np.float32)


def hopeless(n: int) -> np.ndarray:
    return np.zeros((n, K), np.float32)


def copy_run(request: str = "r", length: int = 8) -> tuple:
    """One request copying a stretch it has seen: at position p the cache drafts what is left of the
    stretch and all of it is accepted (labels length, length - 1, ..., 1)."""
    draft_len = np.arange(length, 0, -1)
    return (np.full(length, request, dtype=object), np.arange(length), draft_len, draft_len.copy(),
            np.zeros(length, dtype=bool))


def test_a_policy_that_verifies_jumps_past_the_drafts_it_made_redundant():
    """Along the path a sure policy takes a run of good drafts in one step, as serving would (priced
    draft by draft at each decision point, 0, 3 and 6, it would be credited 9 + 6 + 3 tokens)."""
    request, position, draft_len, label, decided = copy_run(length=8)
    decided[[0, 3, 6]] = True  # where a cautious champion happened to decide
    paths = Paths.of(request, position, draft_len, label, decided)
    walked = replay_paths(sure(8, draft_len), paths, NO_MODEL, COST)
    assert walked.tokens == 9 and walked.ms == pytest.approx(COST.step_ms(1, 9))  # one step: 8 accepted + 1
    # Verifying nothing walks the run one token a step.
    idle = replay_paths(hopeless(8), paths, NO_MODEL, COST)
    assert idle.tokens == 8 and idle.ms == pytest.approx(8 * COST.step_ms(1, 1))


def test_drafts_of_unknown_position_stand_alone():
    """Each decided draft of unknown position is a path of one step: its whole draft verified (sure
    curves), 1 + its label tokens at the price of verifying it; the shadow draft is no choice."""
    n = 5
    draft_len = np.array([4, 7, 1, 12, 3])
    label = np.array([4, 2, 0, 12, 1])
    decided = np.array([True, True, False, True, True])  # an unknown shadow draft is never a choice
    paths = Paths.of(np.full(n, "", dtype=object), np.full(n, -1), draft_len, label, decided)
    walked = replay_paths(sure(n, draft_len), paths, NO_MODEL, COST)
    kept_len, kept_label = draft_len[decided], label[decided]
    alone = (float(np.sum(1 + np.minimum(kept_label, kept_len))), sum(COST.step_ms(1, 1 + k) for k in kept_len), 4)
    assert (walked.tokens, walked.ms, walked.drafts) == pytest.approx(alone)


def test_positions_without_a_draft_are_walked_and_a_position_drafted_twice_keeps_the_later_draft():
    request = np.array(["a", "a", "a", "b"], dtype=object)
    position = np.array([10, 14, 14, 3])  # a's positions 11-13 had no cache draft
    draft_len = np.array([1, 9, 2, 1])
    label = np.array([1, 9, 2, 0])
    paths = Paths.of(request, position, draft_len, label, np.zeros(4, dtype=bool))
    assert paths.draft_len.tolist() == [1, 0, 0, 0, 2, 1] and paths.span.tolist() == [5, 1]  # a: 10..14, then b: 3
    out = replay_paths(sure(4, draft_len), paths, NO_MODEL, COST)
    # a: 10 (+2), 12 (+1, nothing drafted), 13 (+1), 14 (+3) ends past 14; b: 3 (+1).
    assert out.tokens == 2 + 1 + 1 + 3 + 1
    assert out.ms == pytest.approx(COST.step_ms(1, 2) + 2 * COST.step_ms(1, 1) + COST.step_ms(1, 3) + COST.step_ms(1, 2))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 80), requests=st.integers(1, 5))
def test_every_path_covers_its_span_and_policies_are_sliced_alike(seed, n, requests):
    rng = np.random.default_rng(seed)
    request = rng.integers(0, requests, n).astype(str).astype(object)
    position = rng.integers(0, 3 * SEGMENT, n)
    draft_len = rng.integers(1, K + 1, n)
    label = rng.integers(0, draft_len + 1)
    paths = Paths.of(request, position, draft_len, label, rng.random(n) < 0.3, batch=1)
    span = int(paths.span.sum())
    a = replay_paths(sure(n, draft_len), paths, NO_MODEL, COST)
    b = replay_paths(hopeless(n), paths, NO_MODEL, COST)
    assert b.tokens == span and b.ms == pytest.approx(span * COST.step_ms(1, 1))
    assert a.tokens >= span
    assert len(a.each[0]) == len(b.each[0]) == paths.segments
    assert a.each[0].sum() == pytest.approx(a.tokens) and b.each[1].sum() == pytest.approx(b.ms)
    assert gain(b, b) == 0.0


def test_the_model_drafter_meets_the_same_luck_under_every_policy():
    request, position, draft_len, label, decided = copy_run(length=6)
    label[:] = 0  # the cache is always wrong: the model draft is the only speculation that pays
    paths = Paths.of(request, position, draft_len, label, decided, seed=3)
    model = np.array([0.9, 0.8, 0.7])
    first = replay_paths(hopeless(6), paths, model, COST)
    again = replay_paths(hopeless(6), Paths.of(request, position, draft_len, label, decided, seed=3), model, COST)
    assert (first.tokens, first.ms) == (again.tokens, again.ms)
    assert first.tokens >= 6 and first.ms > 0


def test_concurrency_is_read_from_how_decisions_interleave():
    two = np.array(["a", "b", "a", "b", "a"], dtype=object)
    assert concurrency(two, np.ones(5, dtype=bool)) == 2
    assert concurrency(np.array(["a", "a", "b", "b"], dtype=object), np.ones(4, dtype=bool)) == 1
    assert concurrency(two, np.array([True, False, True, False, True])) == 1  # shadow drafts are not steps
    assert concurrency(two, np.zeros(5, dtype=bool)) == 1


@settings(max_examples=100, deadline=None)
@given(order=st.lists(st.integers(0, 6), min_size=1, max_size=60))
def test_concurrency_is_the_most_decision_spans_that_overlap(order):
    request = np.array([str(r) for r in order], dtype=object)
    spans = {r: (order.index(r), len(order) - 1 - order[::-1].index(r)) for r in set(order)}
    brute = max(sum(1 for lo, hi in spans.values() if lo <= i <= hi) for i in range(len(order)))
    assert concurrency(request, np.ones(len(order), dtype=bool)) == brute


def test_paths_served_together_are_walked_together_at_the_batch_price():
    """Two requests served at once: each step plans both with one allocate call and charges each
    half the step; once one is done the other walks alone at batch 1's price."""
    request = np.array(["a", "b", "a", "b", "a"], dtype=object)
    position = np.array([0, 0, 1, 1, 2])  # a spans 3 positions, b 2 (b's last step ends it)
    draft_len = np.ones(5, dtype=np.int64)
    label = np.zeros(5, dtype=np.int64)
    paths = Paths.of(request, position, draft_len, label, np.ones(5, dtype=bool))
    assert paths.batch == 2
    out = replay_paths(hopeless(5), paths, NO_MODEL, COST)
    assert out.tokens == 5
    assert out.ms == pytest.approx(2 * COST.step_ms(2, 2) + COST.step_ms(1, 1))
    alone = replay_paths(hopeless(5), Paths.of(request, position, draft_len, label, np.ones(5, dtype=bool), batch=1),
                         NO_MODEL, COST)
    assert alone.tokens == 5 and alone.ms == pytest.approx(5 * COST.step_ms(1, 1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 80), requests=st.integers(1, 5), batch=st.integers(2, 4))
def test_batched_paths_cover_their_spans_and_are_sliced_alike(seed, n, requests, batch):
    rng = np.random.default_rng(seed)
    request = rng.integers(0, requests, n).astype(str).astype(object)
    position = rng.integers(0, 3 * SEGMENT, n)
    draft_len = rng.integers(1, K + 1, n)
    label = rng.integers(0, draft_len + 1)
    paths = Paths.of(request, position, draft_len, label, rng.random(n) < 0.3, batch=batch)
    span = int(paths.span.sum())
    a = replay_paths(sure(n, draft_len), paths, NO_MODEL, COST)
    b = replay_paths(hopeless(n), paths, NO_MODEL, COST)
    assert b.tokens == span and a.tokens >= span
    assert len(a.each[0]) == len(b.each[0]) == paths.segments
    assert a.each[1].sum() == pytest.approx(a.ms) and b.each[0].sum() == pytest.approx(b.tokens)
