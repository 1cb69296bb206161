"""SGLang's hybrid suffix + MTP backend selector, over HVD's suffix drafts and model drafter: one
backend per verify batch (the suffix drafts, the model drafter's, or none), by the batch's mean
suffix score against a threshold that rises with batch size, gated on realised acceptance.

Source: sgl-project/sglang PR #27628 ("Hybrid suffix mtp v2"),
python/sglang/srt/speculative/hybrid_backend_selector.py, read for its rule and constants (no code
copied). Per verify batch of bs requests, in order:
1. no suffix scores yet (an empty batch) -> suffix;
2. mean suffix score >= T_high(bs), T_high through (1, 2.0), (16, 4.5), (32, 7.5), the last slope
   extrapolated: suffix if the acceptance EMAs are not warm (each >= 3 samples), or if the mean
   score >= 5.0 (SFX_GATE_OVERRIDE), or if ema_suffix - ema_mtp >= break_even(bs), break_even
   through (1, 2.0), (4, 2.8), (16, 6.0), (32, 6.0); else the model drafter;
3. mean score below T_high -> the model drafter;
4. none at bs >= 64; for 16 <= bs < 64, once warm, none where the picked backend's EMA is below its
   floor (suffix: (1, 1.0), (16, 1.5), (32, 2.0); model: (1, 0.5), (16, 0.8), (32, 1.0));
5. a model pick becomes suffix with probability 0.01 (exploration, keeping the suffix EMA fresh).
The EMAs (alpha 0.05, the first sample initialises) follow each backend's mean accept length per
step, the bonus token included (accepted + 1); steps without speculation are not recorded.
"""
from __future__ import annotations

import numpy as np

from predictor.decision.profiles import CostProfile
from predictor.decision.rivals.step_view import CACHE, MODEL, NONE, Outcome, RulePlan, StepView, finish

T_HIGH = ((1, 2.0), (16, 4.5), (32, 7.5))
BREAK_EVEN = ((1, 2.0), (4, 2.8), (16, 6.0), (32, 6.0))
SUFFIX_FLOOR = ((1, 1.0), (16, 1.5), (32, 2.0))
MODEL_FLOOR = ((1, 0.5), (16, 0.8), (32, 1.0))
SFX_GATE_OVERRIDE = 5.0
EMA_ALPHA = 0.05
EMA_WARMUP_N = 3
NONE_MIN_BS = 16
NONE_FORCE_BS = 64
EXPLORE_P = 0.01


def piecewise(points: tuple[tuple[int, float], ...], bs: int) -> float:
    """Linear through `points`, flat below the first, the last segment's slope past the last."""
    if bs <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if bs <= x1:
            return y0 + (y1 - y0) * (bs - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (bs - x1)


class _Ema:
    __slots__ = ("value", "n")

    def __init__(self) -> None:
        self.value, self.n = 0.0, 0

    def add(self, x: float) -> None:
        self.value = x if self.n == 0 else (1.0 - EMA_ALPHA) * self.value + EMA_ALPHA * x
        self.n += 1


class SglangHybrid:
    name = "sglang-hybrid"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self.ema = {CACHE: _Ema(), MODEL: _Ema()}
        self.choices = {NONE: 0, CACHE: 0, MODEL: 0}  # verify batches per backend

    @property
    def warm(self) -> bool:
        return all(e.n >= EMA_WARMUP_N for e in self.ema.values())

    def choose(self, mean_score: float, bs: int, has_scores: bool, model_ok: bool) -> int:
        """The backend of one verify batch."""
        if bs >= NONE_FORCE_BS:
            return NONE
        if not has_scores:
            return CACHE
        sfx, mtp = self.ema[CACHE].value, self.ema[MODEL].value
        if mean_score >= piecewise(T_HIGH, bs):
            pick = CACHE if (not self.warm or mean_score >= SFX_GATE_OVERRIDE
                             or sfx - mtp >= piecewise(BREAK_EVEN, bs)) else MODEL
        else:
            pick = MODEL
        if not model_ok and pick == MODEL:
            pick = CACHE  # no model drafter this step: the suffix drafts or, where a request has none, nothing
        if NONE_MIN_BS <= bs and self.warm:
            if (pick == CACHE and sfx < piecewise(SUFFIX_FLOOR, bs)) or (pick == MODEL and mtp < piecewise(MODEL_FLOOR, bs)):
                pick = NONE
        if pick == MODEL and self._rng.random() < EXPLORE_P:
            pick = CACHE
        return pick

    def plan(self, view: StepView, cost: CostProfile) -> RulePlan:
        """One backend for the batch; at batch 1 with several requests (independent one-request
        engines) one per request, in order, each with the EMAs as they stand."""
        scores = np.where(view.allowed, view.score, 0.0)
        live = view.allowed
        model_ok = view.model_k > 0
        if view.batch == 1 and view.n > 1:
            picks = [self.choose(float(s), 1, True, model_ok) if a else NONE for s, a in zip(scores.tolist(), live.tolist())]
            backend = np.array(picks, dtype=np.int8)
        else:
            bs = max(view.batch, 1)
            if not live.any():
                backend = np.full(view.n, NONE, dtype=np.int8)
            else:
                pick = self.choose(float(scores[live].mean()), bs, True, model_ok)
                backend = np.full(view.n, pick, dtype=np.int8)
        for b in backend[live].tolist() if view.batch == 1 and view.n > 1 else backend[:1].tolist():
            self.choices[b] += 1
        return finish(view, backend)

    def learn(self, outcome: Outcome) -> None:
        """Each verify batch's mean accept length (accepted + 1) into its backend's EMA. Rows that
        are their own engine steps (outcome.steps == rows > 1) are batches of one, in order."""
        spec = outcome.source != NONE
        src, acc = outcome.source[spec].tolist(), (outcome.accepted[spec] + 1).tolist()
        if not src:
            return
        if outcome.steps > 1 and outcome.steps == len(outcome.source):
            for s, a in zip(src, acc):
                self.ema[s].add(float(a))
            return
        for backend in (CACHE, MODEL):
            mine = [a for s, a in zip(src, acc) if s == backend]
            if mine:
                self.ema[backend].add(sum(mine) / len(mine))

    def state(self) -> dict:
        return {"ema_suffix": round(self.ema[CACHE].value, 3), "ema_model": round(self.ema[MODEL].value, 3),
                "warm": self.warm, "batches": {"none": self.choices[NONE], "suffix": self.choices[CACHE],
                                               "model": self.choices[MODEL]}}
