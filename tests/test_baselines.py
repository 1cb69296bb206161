"""The Overview's priced counterfactuals, worked out by hand on a profile with round numbers."""
from __future__ import annotations

from datetime import timedelta

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dashboard.charts import segments
from predictor.decision.profiles import CostProfile, DrafterProfile
from predictor.evaluation.baselines import LabelledDraft, cycle_ms, model_alone, no_speculation, path_cost, suffix_alone

# batch 1: a step verifying q tokens costs 10 + 2 q ms; a model draft of k positions 1 + 0.5 k ms
FLAT = CostProfile("flat", base_ms=10.0, per_token_ms=2.0, draft_token_ms=0.5, draft_call_ms=1.0)


def test_a_cycle_is_priced_by_the_tokens_it_verifies():
    assert cycle_ms(FLAT, 1, 1) == 12.0 and cycle_ms(FLAT, 1, 5) == 20.0
    plain = no_speculation(FLAT, 1, 100)
    assert (plain.cycles, plain.ms, plain.ms_per_1k) == (100, 1200.0, 12000.0)
    # 40 cycles verifying 160 draft tokens (q = 5 on average) and 10 model calls of 3 positions:
    served = path_cost("x", FLAT, 1, 100, 40, 160, model_calls=10, model_positions=30)
    assert served.ms == 40 * 20.0 + 10 * (1.0 + 0.5 * 3)
    assert served.speedup_over(plain) == pytest.approx(1200.0 / 825.0)


def test_suffix_alone_walks_each_request_verifying_whole_drafts():
    drafts = [  # request a: a draft at every position 0..9; b: drafts at 0 and 2 only
        *(LabelledDraft("a", p, 4, 3 if p in (0, 4) else 0) for p in range(10)),
        ("b", 0, 2, 2), ("b", 2, 6, 6),
    ]
    cost = suffix_alone(drafts, FLAT, 1)
    # a: p0 draft 4 accepts 3 -> 4 tokens, p4 accepts 3 -> p8, p8 accepts 0 -> p9, p9 -> p10: 4 cycles,
    #    10 tokens, 16 draft tokens; b: p0 accepts 2 -> p3 overshoots p2 (no draft at 3, last is 2): 1 cycle
    #    of 3 tokens, then done. In all 5 cycles, 13 tokens, 18 draft tokens verified.
    assert (cost.cycles, cost.tokens, cost.query_tokens - cost.cycles) == (5, 13, 18)
    assert cost.ms == pytest.approx(5 * cycle_ms(FLAT, 1, (5 + 18) / 5))


def test_model_alone_uses_what_was_observed_else_the_prior():
    prior = DrafterProfile("d", draft_len=3, acceptance=0.5)
    cost, source = model_alone({"sql": 300, "chat": 100}, {"sql": (50, 100)}, prior, FLAT, 1)
    # sql: 2 accepted per draft -> 3 tokens a cycle -> 100 cycles; chat: the prior's chain mean at k 3
    chat_cycles = round(100 / (1 + prior.mean_accepted_for("chat")))
    assert cost.cycles == 100 + chat_cycles and cost.model_calls == cost.cycles
    assert source == {"sql": "observed over 50 drafts", "chat": "prior (d)"}
    assert cost.ms == pytest.approx(cost.cycles * (cycle_ms(FLAT, 1, 4) + 1.0 + 0.5 * 3))


@given(st.lists(st.integers(min_value=0, max_value=600), min_size=1, max_size=40))
def test_segments_break_exactly_at_gaps(minutes):
    at = pd.to_datetime(sorted(set(minutes)), unit="m", utc=True)
    out = segments(pd.DataFrame({"at": at}), "at", timedelta(minutes=5))
    gaps = sum(1 for a, b in zip(at, at[1:]) if b - a > pd.Timedelta(minutes=5))
    assert out["segment"].nunique() == gaps + 1
    same = out["segment"].eq(out["segment"].shift())
    close = out["at"].diff() <= pd.Timedelta(minutes=5)
    assert (same.iloc[1:] == close.iloc[1:]).all()
