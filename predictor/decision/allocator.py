"""The verification allocator: what one engine step verifies, for the whole batch at once.

Each running request may verify its cache draft cut to any length l (0..its length), the model
drafter's draft (one length k for the step: the drafter runs once for every request that uses it),
or nothing. A request that verifies l cache tokens expects 1 + S(1) + ... + S(l) tokens, where
S(j) = P(accepted >= j) is its draft's survival curve; with the model draft, 1 + Se(1) + ... + Se(k)
from the model drafter's curve. The step costs T(batch, query tokens) from the cost profile, plus the
drafter's call when any request uses it. The allocator maximises expected tokens per millisecond of
the step.

How: for each model length k (0 = drafter not called), requests first pick between the model draft
and their cache draft at the current rate r (Dinkelbach: a slot is worth verifying iff its survival
beats r times the marginal cost of a query token). The cache slots of the requests that keep the
cache are then sorted by survival (one request's slots come out as a prefix because S is monotone)
and the best prefix of that order is found exactly against the whole step-cost curve, convex or
not. The rate found feeds one more round; the best k wins. Everything is vectorised over the batch.

The same code decides on the live runtime, the replay engine and the offline simulator.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from predictor.decision.profiles import CostProfile

NONE, CACHE, MODEL = 0, 1, 2
# What a request may do (per-request constraints from overrides, opt-outs, the binary rule).
AUTO = 0  # the allocator chooses: a cache prefix, the model draft, or nothing
FULL_CACHE = 1  # its whole cache draft (an override said so, or a fixed tau was beaten)
NO_CACHE = 2  # the model draft or nothing (a fixed tau was not beaten)
FORCE_MODEL = 3  # the model draft (hybrid switched off to the model drafter)
FORCE_NONE = 4  # no speculation (opted out, backed off)
MODES = (AUTO, FULL_CACHE, NO_CACHE, FORCE_MODEL, FORCE_NONE)
ROUNDS = 2


@dataclass(frozen=True)
class Allocation:
    """The step's plan. `length` is the number of draft tokens each request verifies (its cache
    prefix, k for model rows, 0 for none); `tau` the break-even expected accepted length at which a
    request's whole cache draft would pay at this step's rate (what operators see as tau)."""

    source: np.ndarray  # int8 per request
    length: np.ndarray  # int64 per request
    model_k: int
    expected: np.ndarray  # float64 expected tokens per request (1 + the survival mass verified)
    step_ms: float
    rate: float  # expected tokens per millisecond of the step
    tau: np.ndarray  # float64 per request


def allocate(cache_survival: np.ndarray, cache_len: np.ndarray, model_survival: np.ndarray, cost: CostProfile,
             mode: np.ndarray | None = None, batch: int | None = None) -> Allocation:
    """The plan that maximises expected tokens per millisecond of the step.

    cache_survival: (n, K) S(j) of each request's cache draft, zero past its length (rows without a
    draft are all zero). cache_len: (n,) draft lengths. model_survival: (n, k_max) the model drafter's
    curve for each request's workload (k_max = the longest model draft allowed; 0 columns: no model
    drafter). mode: per-request constraint (MODES), AUTO by default. batch: the batch size the cost
    profile is read at (default n)."""
    s = np.asarray(cache_survival, dtype=np.float64)
    n = s.shape[0] if s.ndim == 2 else -1
    lengths = np.asarray(cache_len, dtype=np.int64)
    se = np.asarray(model_survival, dtype=np.float64)
    if se.ndim == 1 and len(lengths) == 0:
        se = se.reshape(0, 0)
    mode = np.zeros(len(lengths), dtype=np.int8) if mode is None else np.asarray(mode, dtype=np.int8)
    _check(s, lengths, se, mode)
    if n == 0:
        empty = np.zeros(0)
        return Allocation(np.zeros(0, np.int8), np.zeros(0, np.int64), 0, empty, 0.0, 0.0, empty)
    if n == 1 and batch in (None, 1):
        return allocate_each(s, lengths, se, cost, mode).step(0)
    width = s.shape[1]
    lengths = np.minimum(lengths, width)
    s = np.where(np.arange(width)[None, :] < lengths[:, None], s, 0.0)
    step = _step_cost(cost, n if batch is None else batch, se.shape[1])
    cum_cache = np.zeros((n, width + 1))
    np.cumsum(s, axis=1, out=cum_cache[:, 1:])
    cum_model = np.zeros((n, se.shape[1] + 1))
    np.cumsum(se, axis=1, out=cum_model[:, 1:])
    rows = np.arange(n)
    full = mode == FULL_CACHE
    full_gain = cum_cache[rows, lengths]
    # The AUTO requests' cache slots, best first, once for every k (one request's come out as a prefix).
    auto = mode == AUTO
    slots = np.where(auto[:, None], s, 0.0).ravel()
    order = np.argsort(-slots, kind="stable")
    ranked = slots[order]
    count = int(np.count_nonzero(ranked))
    order, ranked = order[:count], ranked[:count]
    slot_row = order // width
    base_tokens = n + float(full_gain[full].sum())
    base_query = n + int(lengths[full].sum())
    forced = mode == FORCE_MODEL
    k_from = 1 if (forced.any() and se.shape[1] > 0) else 0
    best = None
    for k in range(k_from, se.shape[1] + 1):
        can_model = (mode == AUTO) | (mode == NO_CACHE) | forced if k else np.zeros(n, dtype=bool)
        model_gain = cum_model[:, k]
        rate = n / step.ms(n, 0)
        for _ in range(ROUNDS):
            threshold = rate * step.marginal
            cache_value = np.where(auto, np.maximum(s - threshold, 0.0).sum(axis=1), 0.0)
            model_value = model_gain - threshold * k
            use_model = can_model & (forced | ((model_value > cache_value) & ~full & (model_value > 0.0)))
            users = int(np.count_nonzero(use_model))
            if users and np.any(use_model[slot_row]):
                keep = ~use_model[slot_row]
                kept_ranked, kept_order = ranked[keep], order[keep]
            else:
                kept_ranked, kept_order = ranked, order
            gains = np.empty(len(kept_ranked) + 1)
            gains[0] = base_tokens + (float(model_gain[use_model].sum()) if users else 0.0)
            np.cumsum(kept_ranked, out=gains[1:])
            gains[1:] += gains[0]
            times = step.ms(base_query + k * users + np.arange(len(gains)), k if users else 0)
            ratios = gains / times
            m = int(np.argmax(ratios))
            plan_rate = float(ratios[m])
            if best is None or plan_rate > best[0] + 1e-12:
                best = (plan_rate, k if users else 0, use_model, kept_order[:m], float(times[m]))
            if plan_rate <= rate:
                break
            rate = plan_rate
    rate, k, use_model, chosen, step_ms = best
    length = np.where(full, lengths, np.where(use_model, k, 0)).astype(np.int64)
    if len(chosen):
        length += np.bincount(chosen // width, minlength=n)
    source = np.where(use_model, MODEL, np.where(length > 0, CACHE, NONE)).astype(np.int8)
    expected = 1.0 + np.where(use_model, cum_model[:, k], cum_cache[rows, np.where(source == CACHE, length, 0)])
    can_model = (mode != FORCE_NONE) & (k > 0)
    fallback = np.where(can_model, np.maximum(cum_model[:, k] - rate * step.marginal * k, 0.0), 0.0)
    tau = rate * step.marginal * lengths + fallback
    return Allocation(source, length, k, expected, step_ms, rate, tau)


@dataclass(frozen=True)
class Allocations:
    """Many independent single-request steps decided at once (batch 1): one entry per step."""

    source: np.ndarray
    length: np.ndarray
    model_k: np.ndarray
    expected: np.ndarray
    step_ms: np.ndarray
    tau: np.ndarray

    def step(self, i: int) -> Allocation:
        return Allocation(self.source[i : i + 1], self.length[i : i + 1], int(self.model_k[i]),
                          self.expected[i : i + 1], float(self.step_ms[i]),
                          float(self.expected[i] / self.step_ms[i]), self.tau[i : i + 1])


def allocate_each(cache_survival: np.ndarray, cache_len: np.ndarray, model_survival: np.ndarray, cost: CostProfile,
                  mode: np.ndarray | None = None) -> Allocations:
    """`allocate` for m independent steps of one request each (batch 1), exactly and all at once: each
    step's options (every cache prefix, the model draft at every k, nothing) are few enough to score
    them all. The offline simulator decides every position of every trace with one call."""
    s = np.asarray(cache_survival, dtype=np.float64)
    lengths = np.asarray(cache_len, dtype=np.int64)
    se = np.asarray(model_survival, dtype=np.float64)
    m = len(lengths)
    mode = np.zeros(m, dtype=np.int8) if mode is None else np.asarray(mode, dtype=np.int8)
    _check(s, lengths, se, mode)
    width, k_max = s.shape[1], se.shape[1]
    lengths = np.minimum(lengths, width)
    step = _step_cost(cost, 1, k_max)
    cum_cache = np.zeros((m, width + 1))
    np.cumsum(np.where(np.arange(width)[None, :] < lengths[:, None], s, 0.0), axis=1, out=cum_cache[:, 1:])
    cum_model = np.zeros((m, k_max + 1))
    np.cumsum(se, axis=1, out=cum_model[:, 1:])
    prefix = np.arange(width + 1)
    cache_rate = (1.0 + cum_cache) / step.ms(1 + prefix, 0)[None, :]
    cache_ok = (prefix[None, :] <= lengths[:, None]) & ((mode == AUTO)[:, None] | (prefix == 0)[None, :])
    full = mode == FULL_CACHE
    cache_ok[full] = prefix[None, :] == lengths[full, None]
    cache_ok[(mode == FORCE_MODEL) & (k_max > 0)] = False
    ks = np.arange(1, k_max + 1)
    model_rate = (1.0 + cum_model[:, 1:]) / np.array([step.ms(1 + k, k) for k in ks.tolist()])[None, :]
    model_ok = np.broadcast_to(((mode == AUTO) | (mode == NO_CACHE) | (mode == FORCE_MODEL))[:, None], model_rate.shape)
    scores = np.concatenate([np.where(cache_ok, cache_rate, -1.0), np.where(model_ok, model_rate, -1.0)], axis=1)
    best = np.argmax(scores, axis=1)
    is_model = best > width
    model_k = np.where(is_model, best - width, 0)
    length = np.where(is_model, model_k, best).astype(np.int64)
    source = np.where(is_model, MODEL, np.where(length > 0, CACHE, NONE)).astype(np.int8)
    rows = np.arange(m)
    expected = 1.0 + np.where(is_model, cum_model[rows, model_k], cum_cache[rows, np.where(is_model, 0, length)])
    step_ms = np.where(is_model, np.array(step.draft)[model_k], 0.0) + step.ms(1 + length, 0)
    rate = expected / step_ms
    fallback = np.where(model_ok[:, 0] if k_max else False,
                        np.maximum(cum_model[rows, model_k] - rate * step.marginal * model_k, 0.0), 0.0)
    tau = rate * step.marginal * lengths + fallback
    return Allocations(source, length, model_k.astype(np.int64), expected, step_ms, tau)


@functools.lru_cache(maxsize=256)
def _step_cost(cost: CostProfile, batch: int, k_max: int) -> "_StepCost":
    """Steps of one engine run share a handful of (profile, batch, k_max): read each once."""
    return _StepCost(cost, batch, k_max)


class _StepCost:
    """The cost profile read at one batch size (scalars, no per-call parsing)."""

    def __init__(self, cost: CostProfile, batch: int, k_max: int) -> None:
        self.base, self.per_query = cost.step_line(batch)
        self.compute = cost.compute_ms_per_token
        self.marginal = max(self.per_query, self.compute)
        self.draft = [float(cost.draft_ms(batch, k)) for k in range(k_max + 1)]

    def ms(self, query: "int | np.ndarray", k: int) -> "float | np.ndarray":
        t = self.base + self.per_query * query
        if self.compute:
            t = np.maximum(t, self.compute * query)
        return t + self.draft[k]


def _check(s: np.ndarray, lengths: np.ndarray, se: np.ndarray, mode: np.ndarray) -> None:
    n = len(lengths)
    if s.ndim != 2 or s.shape[0] != n:
        raise ValueError(f"cache_survival must be (n, K) with n = {n} rows, got shape {s.shape}")
    if se.ndim != 2 or se.shape[0] != n or mode.shape != (n,):
        raise ValueError(f"model_survival and mode need one row per request ({n}); got {se.shape} and {mode.shape}")
    if n and lengths.min() < 0:
        raise ValueError("cache_len must be >= 0")
    for name, a in (("cache_survival", s), ("model_survival", se)):
        if a.size and not (a.min() >= 0.0 and a.max() <= 1.0):  # NaN fails both comparisons
            raise ValueError(f"{name} must hold probabilities in [0, 1]")
    if n and (mode.min() < AUTO or mode.max() > FORCE_NONE):
        raise ValueError(f"mode must be one of {MODES}")
