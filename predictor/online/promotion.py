"""Shadow evaluation and the promotion rule: when the online learner's challenger replaces the
champion.

Both models are scored on the same labelled events with the same tau before the challenger learns
from them (prequential), over a sliding window: the goodput proxy (tokens per millisecond of the
steps each model's decisions imply) and the mean absolute error. The policy promotes a challenger
that beats the champion's goodput by a margin, over enough events, without worse calibration.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# (label, draft_len, decided_cache, workload) -> (tokens, milliseconds) of the step that decision implies
GoodputFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class ShadowScore:
    events: int
    champion_goodput: float
    challenger_goodput: float
    champion_mae: float
    challenger_mae: float

    @property
    def gain(self) -> float:
        return self.challenger_goodput / self.champion_goodput - 1.0 if self.champion_goodput > 0 else 0.0

    def to_json(self) -> dict:
        return {"events": self.events, "champion_goodput": round(self.champion_goodput, 6),
                "challenger_goodput": round(self.challenger_goodput, 6), "champion_mae": round(self.champion_mae, 5),
                "challenger_mae": round(self.challenger_mae, 5), "gain": round(self.gain, 5)}


class ShadowWindow:
    """The last `size` events as each model would have served them."""

    def __init__(self, goodput: GoodputFn, size: int) -> None:
        self.goodput = goodput
        self._rows: deque[tuple[float, float, float, float, float, float]] = deque(maxlen=size)

    def add(self, label: np.ndarray, draft_len: np.ndarray, tau: np.ndarray, workload: np.ndarray,
            champion: np.ndarray, challenger: np.ndarray) -> None:
        """Both models' predictions for the same events, held to the same tau."""
        tok_a, ms_a = self.goodput(label, draft_len, champion > tau, workload)
        tok_b, ms_b = self.goodput(label, draft_len, challenger > tau, workload)
        err_a, err_b = np.abs(champion - label), np.abs(challenger - label)
        self._rows.extend(zip(tok_a.tolist(), ms_a.tolist(), tok_b.tolist(), ms_b.tolist(), err_a.tolist(),
                              err_b.tolist()))

    def score(self) -> ShadowScore | None:
        if not self._rows:
            return None
        w = np.array(self._rows)
        return ShadowScore(len(w), w[:, 0].sum() / w[:, 1].sum(), w[:, 2].sum() / w[:, 3].sum(), w[:, 4].mean(),
                           w[:, 5].mean())

    def clear(self) -> None:
        self._rows.clear()


@dataclass(frozen=True)
class PromotionPolicy:
    min_events: int = 20_000  # scored events since the last promotion before another
    margin: float = 0.01  # challenger goodput must beat the champion's by this fraction
    max_mae_increase: float = 0.05  # and its calibration must not be worse by more than this

    def earned(self, score: ShadowScore | None, events_since_promotion: int) -> bool:
        return (score is not None and events_since_promotion >= self.min_events and score.gain >= self.margin
                and score.challenger_mae <= score.champion_mae + self.max_mae_increase)
