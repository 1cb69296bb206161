"""TensorRT-LLM's suffix-automaton rule: the suffix draft when its match is long enough, else the
model drafter.

Source: TensorRT-LLM PR #11434 (suffix-automaton speculative decoding combined with the model
drafter: the automaton's draft is used when its match length is at least 4, otherwise the
drafter's); PR #12130 adds the cross-request pool, which HVD's global suffix tree already is.
Constant: MIN_MATCH_LEN = 4. Nothing is learned."""
from __future__ import annotations

import numpy as np

from predictor.decision.profiles import CostProfile
from predictor.decision.rivals.step_view import CACHE, Outcome, RulePlan, StepView, fallback_source, finish

MIN_MATCH_LEN = 4


class TrtllmRule:
    name = "trtllm"

    def __init__(self, seed: int = 0, min_match_len: int = MIN_MATCH_LEN) -> None:
        if min_match_len < 1:
            raise ValueError(f"min_match_len must be >= 1, got {min_match_len}")
        self.min_match_len = min_match_len

    def plan(self, view: StepView, cost: CostProfile) -> RulePlan:
        take = (view.cache_len > 0) & (view.match_len >= self.min_match_len)
        return finish(view, np.where(take, CACHE, fallback_source(view)))

    def learn(self, outcome: Outcome) -> None:
        """A fixed rule: nothing to learn."""

    def state(self) -> dict:
        return {"min_match_len": self.min_match_len}
