"""The competitors' own rules for "which draft, how long", rebuilt from their published descriptions
over HVD's suffix drafts, model-drafter fallback and cost model, so that only the decision differs.

One rule per module (`trtllm`, `sglang_hybrid`, `vllm_adaptive`), each a small stateful class with a
two-verb protocol like river's estimators: `plan(view, cost)` says what each request of a step
verifies, `learn(outcome)` takes what the engine verified and accepted (only that: each rule sees
its own censoring, as it would in its engine). The runtime (controller.core.runtime) and the
offline simulator (predictor.evaluation.simulator) both call these classes.
"""
from __future__ import annotations

from predictor.decision.rivals.sglang_hybrid import SglangHybrid
from predictor.decision.rivals.step_view import Outcome, RivalRule, RulePlan, StepView, conditional_probs
from predictor.decision.rivals.trtllm import TrtllmRule
from predictor.decision.rivals.vllm_adaptive import VllmAdaptive

RIVAL_RULES: dict[str, type] = {"vllm-adaptive": VllmAdaptive, "sglang-hybrid": SglangHybrid, "trtllm": TrtllmRule}


def make_rival(name: str, seed: int = 0) -> RivalRule:
    """A fresh rule (cold start) by its runtime name."""
    try:
        cls = RIVAL_RULES[name]
    except KeyError:
        raise ValueError(f"unknown rival rule {name!r}; known: {tuple(RIVAL_RULES)}") from None
    return cls(seed=seed)


__all__ = ["RIVAL_RULES", "make_rival", "Outcome", "RivalRule", "RulePlan", "StepView", "conditional_probs",
           "SglangHybrid", "TrtllmRule", "VllmAdaptive"]
