"""The model drafter's survival curve per workload, measured live from hindsight.

Like vLLM's per-position acceptance counters, but per workload and conditional: for draft position j,
how many verified model drafts reached j (every earlier position was accepted) and how many of those
accepted j. S(j) is the product of the conditional rates up to j. Each workload starts from the
measured drafter profile as a prior worth `prior_drafts` drafts, and old evidence fades with
`decay` per observed draft so a head that does worse on today's traffic is noticed within about
1/decay drafts.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from predictor.decision.profiles import DrafterProfile


class DrafterSurvival:
    def __init__(self, profile: DrafterProfile, workloads: Sequence[str], k_max: int | None = None,
                 prior_drafts: float = 50.0, decay: float = 0.002) -> None:
        if prior_drafts <= 0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"prior_drafts must be > 0 and decay in [0, 1); got {prior_drafts}, {decay}")
        self.workloads = tuple(workloads)
        self.k_max = profile.draft_len if k_max is None else k_max
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        self.decay = decay
        prior = np.stack([_conditional(profile.survival_for(w), self.k_max) for w in self.workloads])
        self._prior_reached = np.full_like(prior, prior_drafts)
        self._prior_accepted = prior * prior_drafts
        self.reached = np.zeros_like(prior)
        self.accepted = np.zeros_like(prior)
        self.drafts = np.zeros(len(self.workloads), dtype=np.int64)
        self._curves = self._compute()

    def observe(self, workload: int, draft_len: int, accepted: int) -> None:
        """One verified model draft of `draft_len` tokens of which the first `accepted` were taken."""
        if not 0 <= accepted <= draft_len:
            raise ValueError(f"accepted {accepted} outside [0, draft_len {draft_len}]")
        seen = min(accepted + 1, draft_len, self.k_max)
        if self.decay:
            self.reached[workload] *= 1.0 - self.decay
            self.accepted[workload] *= 1.0 - self.decay
        self.reached[workload, :seen] += 1.0
        self.accepted[workload, : min(accepted, self.k_max)] += 1.0
        self.drafts[workload] += 1
        rate = (self.accepted[workload] + self._prior_accepted[workload]) / (self.reached[workload] + self._prior_reached[workload])
        self._curves[workload] = np.cumprod(rate)

    def curve(self, workload: int) -> np.ndarray:
        """S(j), j = 1..k_max, for one workload (index into `workloads`)."""
        return self._curves[workload]

    def curves(self, workload: np.ndarray) -> np.ndarray:
        """(n, k_max): each request's workload's curve."""
        return self._curves[np.asarray(workload, dtype=np.int64)]

    def mean_accepted(self, workload: int, k: int | None = None) -> float:
        return float(self._curves[workload, : self.k_max if k is None else k].sum())

    def _compute(self) -> np.ndarray:
        return np.cumprod((self.accepted + self._prior_accepted) / (self.reached + self._prior_reached), axis=1)


def _conditional(survival: np.ndarray, k_max: int) -> np.ndarray:
    """Per-position conditional acceptance from a survival curve, extended past its end with its last rate."""
    s = np.asarray(survival, dtype=np.float64)
    previous = np.concatenate(([1.0], s[:-1]))
    cond = np.divide(s, previous, out=np.zeros_like(s), where=previous > 0)
    if len(cond) < k_max:
        cond = np.concatenate([cond, np.full(k_max - len(cond), cond[-1] if len(cond) else 0.0)])
    return np.clip(cond[:k_max], 0.0, 1.0)
