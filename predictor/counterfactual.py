"""What serving would have got from a predictor on drafts whose outcome is known: counterfactual
replay under the serving decision rule and the cost profile.

Hindsight labels give every cache draft's accepted length, whether it was verified or not, so any
predictor can be replayed on the same drafts: its survival curves (with the fast calibration it
would serve with) go through the allocator exactly as at serving (one request's step, every cache
prefix, the model draft at every k, or nothing), and the step's outcome is read from the label:
a verified cache prefix of l tokens yields 1 + min(label, l) tokens, the model draft its expected
tokens (its outcome is not in the label), nothing 1 token; each at the step's cost. Goodput is
tokens per millisecond over a window. Promotion compares champion and challenger this way, per
workload, on drafts the challenger has not trained on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from predictor.allocator import CACHE, MODEL, allocate_each
from predictor.calibration import Calibration
from predictor.calibration import apply as apply_calibration
from predictor.profiles import CostProfile


@dataclass(frozen=True)
class CounterfactualPolicy:
    """predictor.workload_promotion's margins and windows."""

    holdout: int = 3000  # newest labelled drafts per workload held back from the challenger
    check_every: int = 1000  # new drafts of a workload between comparisons
    margin: float = 0.01  # the challenger's goodput must beat the champion's by this fraction
    rollback_margin: float = 0.01  # a promoted champion losing by more than this to its predecessor goes


@dataclass(frozen=True)
class Goodput:
    tokens: float
    ms: float
    drafts: int
    # per draft (tokens, ms), in window order: what the evidence behind a comparison is read from
    each: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)

    @property
    def per_ms(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


def served_curves_from(raw: np.ndarray, draft_len: np.ndarray, calibration: Calibration | None) -> np.ndarray:
    """The curves the runtime would plan with: the gate's own, corrected if a calibration is set."""
    if calibration is None or calibration.is_identity:
        return raw
    return apply_calibration(raw, draft_len, calibration.slope, calibration.bias)


def replay_goodput(curves: np.ndarray, draft_len: np.ndarray, label: np.ndarray, model_survival: np.ndarray,
                   cost: CostProfile) -> Goodput:
    """Tokens and milliseconds the allocator's choices would have yielded on these drafts."""
    if not len(draft_len):
        return Goodput(0.0, 0.0, 0)
    plan = allocate_each(curves, draft_len, model_survival, cost)
    realised = np.where(plan.source == CACHE, 1.0 + np.minimum(label, plan.length),
                        np.where(plan.source == MODEL, plan.expected, 1.0))
    return Goodput(float(realised.sum()), float(plan.step_ms.sum()), len(draft_len), (realised, plan.step_ms))


def gain(challenger: Goodput, champion: Goodput) -> float:
    """The challenger's goodput over the champion's, minus one (0 when there is nothing to compare)."""
    if champion.per_ms <= 0 or not champion.drafts:
        return 0.0
    return challenger.per_ms / champion.per_ms - 1.0


def gain_interval(challenger: Goodput, champion: Goodput, blocks: int = 10, z: float = 2.0) -> tuple[float, float]:
    """A rough interval for `gain` from `blocks` contiguous slices of the same drafts (contiguous,
    since neighbouring drafts of one request are alike): mean block gain -+ z standard errors.
    (0, 0) without per-draft outcomes or with too few drafts to split."""
    if challenger.each is None or champion.each is None or champion.drafts < 2 * blocks:
        return 0.0, 0.0
    gains = []
    for part in np.array_split(np.arange(champion.drafts), blocks):
        (tb, mb), (ta, ma) = ((e[0][part], e[1][part]) for e in (challenger.each, champion.each))
        gains.append((tb.sum() / mb.sum()) / (ta.sum() / ma.sum()) - 1.0 if ta.sum() > 0 else 0.0)
    mean, se = float(np.mean(gains)), float(np.std(gains, ddof=1) / np.sqrt(blocks))
    return mean - z * se, mean + z * se


def wins(challenger: Goodput, champion: Goodput, margin: float) -> tuple[bool, float]:
    """Whether the challenger wins by `margin` and clearly (its interval above zero); and the gain."""
    g = gain(challenger, champion)
    low, _ = gain_interval(challenger, champion)
    return g >= margin and low > 0.0, g
