"""tau from the goodput rule: verify the cache draft iff its expected tokens per millisecond beat
the model drafter's.

    (y_hat + 1) / t(1 + k_c)  >  (mu_e + 1) / (t(1 + k_e) + k_e * t_d)
    tau*(k_c) = (mu_e + 1) * t(1 + k_c) / (t(1 + k_e) + k_e * t_d) - 1

On a memory-bound GPU (per-token cost ~ 0) tau* ~ mu_e; on a CPU a long wrong draft costs real time,
so tau* grows with the cache draft's length.
"""
from __future__ import annotations

import numpy as np

from predictor.profiles import CostProfile


def model_step_ms(cost: CostProfile, model_draft_len: int) -> float:
    return cost.target_ms(1 + model_draft_len) + model_draft_len * cost.draft_token_ms


def tau_star(cache_draft_len: np.ndarray, mu_e: float | np.ndarray, model_draft_len: int, cost: CostProfile) -> np.ndarray:
    """Threshold on the predicted accepted length, per cache draft length."""
    k_c = np.asarray(cache_draft_len, dtype=np.float64)
    cache_ms = cost.base_ms + cost.per_token_ms * (1.0 + k_c)
    return (mu_e + 1.0) * cache_ms / model_step_ms(cost, model_draft_len) - 1.0
