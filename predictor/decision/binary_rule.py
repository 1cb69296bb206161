"""The binary rule, tau from the goodput rule: verify the cache draft iff its expected tokens per
millisecond beat the fallback's. One implementation for the runtime (controller.core.decision) and
the simulator (predictor.evaluation.simulator).

Against the model drafter (mean accepted length mu_e at draft length k_e):

    (y_hat + 1) / t(1 + k_c)  >  (mu_e + 1) / (t(1 + k_e) + k_e * t_d)
    tau*(k_c) = (mu_e + 1) * t(1 + k_c) / (t(1 + k_e) + k_e * t_d) - 1

Against a plain step (when the model drafter does not beat one: a random head, a workload it was not
trained on): (y_hat + 1) / t(1 + k_c) > 1 / t(1), i.e. tau = t(1 + k_c) / t(1) - 1.

On a memory-bound GPU (per-token cost ~ 0) tau* ~ mu_e; on a CPU a long wrong draft costs real time,
so tau* grows with the cache draft's length. `cost` is what one request pays: a request's share of
the step at its batch size (CostProfile.per_request).
"""
from __future__ import annotations

import numpy as np

from predictor.decision.profiles import CostProfile


def model_step_ms(cost: CostProfile, model_draft_len: int) -> float:
    return cost.target_ms(1 + model_draft_len) + model_draft_len * cost.draft_token_ms


def tau_star(cache_draft_len: np.ndarray, mu_e: float | np.ndarray, model_draft_len: int, cost: CostProfile) -> np.ndarray:
    """Threshold on the predicted accepted length, per cache draft length."""
    k_c = np.asarray(cache_draft_len, dtype=np.float64)
    cache_ms = cost.base_ms + cost.per_token_ms * (1.0 + k_c)
    return (mu_e + 1.0) * cache_ms / model_step_ms(cost, model_draft_len) - 1.0


def model_beats_plain(mu_e: float | np.ndarray, model_draft_len: int, cost: CostProfile) -> np.ndarray:
    """Per request, whether the model drafter (mean accepted length mu_e) yields more tokens per
    millisecond than a plain step: the binary rule's fallback is the model drafter where it does."""
    return (np.asarray(mu_e) + 1.0) / model_step_ms(cost, model_draft_len) > 1.0 / cost.target_ms(1)


def thresholds(cache_len: np.ndarray, mu_e: float | np.ndarray, against_model: np.ndarray, model_draft_len: int,
               cost: CostProfile) -> np.ndarray:
    """tau per request: tau* against the model drafter where `against_model`, else against a plain step."""
    k = np.asarray(cache_len, dtype=np.float64)
    against_plain = cost.target_ms(1 + k) / cost.target_ms(1) - 1.0
    return np.where(against_model, tau_star(k, np.asarray(mu_e, dtype=np.float64), model_draft_len, cost), against_plain)
