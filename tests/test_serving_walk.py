"""The serving walk over a head's per-position hits, and its alignment with the trainer's own figure."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_training.serving_walk import Tally, chains, right_at_every_start, walk

# A row of n tokens, a first answer row, and per-step hits (before chaining and bounds).
rows = st.integers(4, 40).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n - 3), st.integers(1, 4).flatmap(
        lambda k: st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=k, max_size=k))))


def _chain(n: int, hits: list[list[bool]]) -> np.ndarray:
    """Hits as chains() makes them: step j wrong past the row's end, then each a prefix of the last."""
    tokens = np.arange(n) + 100
    predicted = []
    for j, h in enumerate(hits):
        right = np.full(n, -1)  # the token step j at row r should predict, where there is one
        right[: max(0, n - 2 - j)] = tokens[2 + j:]
        predicted.append(np.where(np.array(h), right, -1))
    return chains(predicted, tokens)


def _walk_by_tokens(chain: np.ndarray, first: int) -> tuple[int, list[int]]:
    """Serving told token by token: the next token to produce is at index t; a draft is made there."""
    k, n = chain.shape
    drafts, accepted, t = 0, [0] * k, first + 2
    while t < n:
        drafts += 1
        j = 0
        while j < k and chain[j, t - 2]:
            accepted[j] += 1
            j += 1
        t += j + 1  # the accepted tokens and the target's own
    return drafts, accepted


@given(rows)
@settings(max_examples=200, deadline=None)
def test_the_walk_is_serving_token_by_token(row):
    n, first, hits = row
    chain = _chain(n, hits)
    drafts, accepted = walk(chain, first)
    assert (drafts, accepted.tolist()) == _walk_by_tokens(chain, first)
    answer = n - 2 - first
    assert answer <= drafts + int(accepted.sum()) <= answer + 1  # the last bonus token may fall past the end
    assert all(a >= b for a, b in zip(accepted, accepted[1:]))


@given(rows)
@settings(max_examples=100, deadline=None)
def test_chains_are_prefixes_and_end_with_the_row(row):
    n, _, hits = row
    chain = _chain(n, hits)
    for j in range(chain.shape[0]):
        assert not chain[j, max(0, n - 2 - j):].any()  # nothing to predict past the last token
        if j:
            assert not (chain[j] & ~chain[j - 1]).any()


def test_a_perfect_head_drafts_once_per_k_plus_one_tokens_and_a_blind_one_once_per_token():
    n, first, k = 30, 3, 3
    perfect = _chain(n, [[True] * n] * k)
    assert walk(perfect, first)[0] == int(np.ceil((n - 2 - first) / (k + 1)))
    assert right_at_every_start(perfect, first).tolist() == [n - 2 - first - j for j in range(k)]
    blind = _chain(n, [[False] * n] * k)
    assert walk(blind, first)[0] == n - 2 - first
    assert walk(blind, first)[1].tolist() == [0] * k


def test_where_drafts_start_is_why_serving_gets_less_than_the_average():
    """Half easy, half hard: every start counts once in the average, but serving covers the easy
    half with few drafts and the hard half with one draft per token."""
    n, k = 2 + 400, 3
    easy = [True] * 200 + [False] * 200
    chain = _chain(n, [easy + [False] * 2] * k)
    t = Tally()
    t.add(chain, 0)
    assert t.average.tolist() == [0.5, 0.5, 0.5]
    assert t.drafts == 50 + 200 and t.accepted.tolist() == [50, 50, 50]
    assert t.served.sum() == pytest.approx(150 / 250)


def test_the_average_is_the_trainers_own_figure_on_held_out_answers():
    """The committed head on three held-out answers: the trainer's held-out full_acc (its own loss
    pass, targets from the verifier's hidden states) against the average over the same rows here."""
    import torch
    from speculators.losses import resolve_loss_config

    from controller.engines import vllm_engine as ve
    from eagle3_training.hidden_states import HiddenStateReader, training_row
    from eagle3_training.serving_walk import head_chains, held_out_samples, load_head, row_inputs

    samples = held_out_samples(rows=3, max_new_tokens=96)
    assert len(samples) == 3 and all(0 < len(s.output_ids) <= 96 for s in samples)
    tally = Tally()
    for _, chain, first in head_chains(ve.EAGLE_HEAD, samples, ve.MODEL_FP32):
        tally.add(chain, first)
    model = load_head(ve.EAGLE_HEAD, ve.MODEL_FP32)
    reader = HiddenStateReader(ve.MODEL_FP32, dtype=torch.float32)
    right, total = np.zeros(3), np.zeros(3)
    for s in samples:
        kept, mask, keep_from = training_row(s, 128)
        hs = reader(list(s.prompt_ids) + list(s.output_ids))[keep_from:]
        with torch.no_grad():
            _, _, metrics = model(**row_inputs(hs, kept), ttt_steps=3,
                                  verifier_last_hidden_states=hs[1:, 3].unsqueeze(0),
                                  loss_mask=torch.tensor([mask[1:]], dtype=torch.bool),
                                  loss_config=resolve_loss_config("kl_div", "eager"))
        for j in range(3):
            right[j] += float(metrics[f"full_acc_{j}_sum"])
            total[j] += float(metrics[f"full_acc_{j}_total"])
    trainer = right / total
    assert trainer[0] > 0.2  # a trained head: an off-by-one row alignment would be near 0
    # The trainer's targets are the verifier's best draft-vocabulary token (here: the answer's own
    # token) and it counts starts a little differently at a row's end: close, not equal.
    assert tally.average == pytest.approx(trainer, abs=0.03)
    assert tally.served.sum() < tally.average.sum()


def test_a_head_on_other_target_layers_is_refused_by_name(tmp_path):
    import json

    from eagle3_training.serving_walk import head_chains

    (tmp_path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 10, 20]}))
    with pytest.raises(ValueError, match=r"layers \[1, 10, 20\]"):
        next(head_chains(tmp_path, [], tmp_path))
