"""Fast calibration: a per-position logistic correction of the champion's survival curves, learned
from a few hundred labelled drafts per workload (and per tenant once it has traffic), applied at
serving without a new predictor version.

The survival gate's curve is a product of conditional probabilities h_j = P(accept j | accepted
j - 1). The correction keeps that shape: h'_j = sigmoid(slope_j * logit(h_j) + bias_j), so the
corrected curve is still monotone and still zero past the draft's end.

The fitting (per scope, from labelled drafts) is predictor.online.calibrator's; this module is what
serving needs to apply a correction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.gate.mlp import SURVIVAL_K

EPS = 1e-6


@dataclass(frozen=True)
class Calibration:
    """One scope's correction (slope and bias per draft position); the identity changes nothing."""

    slope: np.ndarray  # float64 (SURVIVAL_K,)
    bias: np.ndarray  # float64 (SURVIVAL_K,)
    events: int = 0  # labelled drafts it was fitted on

    @staticmethod
    def identity() -> "Calibration":
        return Calibration(np.ones(SURVIVAL_K), np.zeros(SURVIVAL_K), 0)

    @property
    def is_identity(self) -> bool:
        return bool(np.all(self.slope == 1.0) and np.all(self.bias == 0.0))

    def to_json(self) -> dict:
        return {"slope": [round(float(v), 6) for v in self.slope], "bias": [round(float(v), 6) for v in self.bias],
                "events": self.events}

    @staticmethod
    def from_json(value: dict) -> "Calibration":
        """From storage; CalibrationError naming the field if it is not a correction of this shape."""
        try:
            slope = np.asarray(value["slope"], dtype=np.float64)
            bias = np.asarray(value["bias"], dtype=np.float64)
            events = int(value.get("events", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"calibration must hold 'slope' and 'bias' lists of numbers: {exc}") from exc
        for name, a in (("slope", slope), ("bias", bias)):
            if a.shape != (SURVIVAL_K,) or not np.all(np.isfinite(a)):
                raise CalibrationError(f"calibration {name} must be {SURVIVAL_K} finite numbers, got shape {a.shape}")
        return Calibration(slope, bias, events)


class CalibrationError(ValueError):
    pass


def conditional(curves: np.ndarray) -> np.ndarray:
    """h_j = S(j) / S(j - 1), with S(0) = 1; 0 where S(j - 1) is 0."""
    s = np.asarray(curves, dtype=np.float64)
    prev = np.concatenate([np.ones((len(s), 1)), s[:, :-1]], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(prev > 0, np.clip(s / np.where(prev > 0, prev, 1.0), 0.0, 1.0), 0.0)


def logit(h: np.ndarray) -> np.ndarray:
    h = np.clip(h, EPS, 1.0 - EPS)
    return np.log(h) - np.log1p(-h)


def apply(curves: np.ndarray, draft_len: np.ndarray, slope: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Corrected survival curves, float32 like the gate's. `slope` and `bias` are (K,) for one
    scope or (n, K) row by row; positions past each draft's length stay 0."""
    s = np.asarray(curves, dtype=np.float64)
    if not len(s):
        return np.asarray(curves, dtype=np.float32)
    return apply_to_logits(logit(conditional(s)), draft_len, slope, bias)


def apply_to_logits(logits: np.ndarray, draft_len: np.ndarray, slope: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """`apply` on curves already turned into conditional logits (many corrections of the same curves
    need them once)."""
    width = logits.shape[1]
    h = 1.0 / (1.0 + np.exp(-np.clip(np.asarray(slope)[..., :width] * logits + np.asarray(bias)[..., :width],
                                      -30.0, 30.0)))
    inside = np.arange(width)[None, :] < np.asarray(draft_len)[:, None]
    return np.where(inside, np.cumprod(np.where(inside, h, 1.0), axis=1), 0.0).astype(np.float32)
