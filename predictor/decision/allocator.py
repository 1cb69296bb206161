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

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

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
    if batch in (None, 1):
        one = _one_request(cache_survival, cache_len, model_survival, mode)
        if one is not None:  # a batch-1 step: allocate_each's plan, in plain floats
            return _allocate_one(*one, cost)
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
    # The step's time at every query count a plan below can reach (the same numbers step.ms gives)
    line = step.line_upto(base_query + se.shape[1] * n + len(ranked) + 1)
    may_model = (mode == AUTO) | (mode == NO_CACHE) | forced
    no_model = np.zeros(n, dtype=bool)
    first_rate = n / step.ms(n, 0)
    for k in range(k_from, se.shape[1] + 1):
        can_model = may_model if k else no_model
        model_gain = cum_model[:, k]
        rate = first_rate
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
            q0 = base_query + k * users
            times = line[q0 : q0 + len(gains)] + step.draft[k if users else 0]
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


def _one_request(cache_survival, cache_len, model_survival, mode) -> tuple[list[float], int, list[float], int] | None:
    """One request's valid inputs as plain values (its survival curve, draft length, the model
    drafter's curve, its mode); None when they are not one valid request's (the general path then
    decides, or raises what `_check` says)."""
    s, lengths, se = np.asarray(cache_survival), np.asarray(cache_len), np.asarray(model_survival)
    modes = np.zeros(1, dtype=np.int8) if mode is None else np.asarray(mode)
    if not (s.ndim == 2 and se.ndim == 2 and lengths.shape == (1,) and modes.shape == (1,) and s.shape[0] == 1
            and se.shape[0] == 1 and lengths.dtype.kind in "iu" and modes.dtype.kind in "iu"):
        return None
    (length,), (m,) = lengths.tolist(), modes.tolist()
    row, model_row = s[0].tolist(), se[0].tolist()
    if length < 0 or not AUTO <= m <= FORCE_NONE:
        return None
    for v in row:
        if not 0.0 <= v <= 1.0:  # NaN fails too
            return None
    for v in model_row:
        if not 0.0 <= v <= 1.0:
            return None
    return [float(v) for v in row], length, [float(v) for v in model_row], m


class Single(NamedTuple):
    """One request's plan (`allocate_one`), as plain values."""

    source: int
    length: int
    model_k: int
    expected: float
    step_ms: float
    rate: float
    tau: float


def allocate_one(cache_survival: Sequence[float], cache_len: int, model_survival: Sequence[float],
                 cost: CostProfile, mode: int = AUTO) -> Single:
    """`allocate` for a batch of one request, in and out as plain values (the survival curves as
    sequences of floats): the same plan bit for bit, without the round trips through one-row
    arrays that would cost a batch-1 step more than the planning."""
    if cache_len < 0:
        raise ValueError("cache_len must be >= 0")
    for name, curve in (("cache_survival", cache_survival), ("model_survival", model_survival)):
        for v in curve:
            if not 0.0 <= v <= 1.0:  # NaN fails too
                raise ValueError(f"{name} must hold probabilities in [0, 1]")
    if not AUTO <= mode <= FORCE_NONE:
        raise ValueError(f"mode must be one of {MODES}")
    return _plan_one(cache_survival, cache_len, model_survival, mode, cost)


def _allocate_one(s: list[float], length: int, se: list[float], mode: int, cost: CostProfile) -> Allocation:
    one = _plan_one(s, length, se, mode, cost)
    return Allocation(np.array([one.source], dtype=np.int8), np.array([one.length], dtype=np.int64), one.model_k,
                      np.array([one.expected]), one.step_ms, one.rate, np.array([one.tau]))


def _plan_one(s: Sequence[float], length: int, se: Sequence[float], mode: int, cost: CostProfile) -> Single:
    """`allocate_each` for one step of one request, operation for operation in Python floats (IEEE
    doubles, as numpy's float64), so the plan is the same bit for bit: the runtime plans every
    batch-1 step, and there some twenty numpy calls on one-row arrays cost far more than the
    arithmetic they do."""
    width, k_max = len(s), len(se)
    length = min(length, width)
    step = _step_cost(cost, 1, k_max)
    cache_ms, model_ms = step.one_request_ms(width)
    # np.cumsum: the first term as is, then one addition per term (a draft's curve is 0 past its length)
    cum_cache = [0.0, *accumulate([*s[:length], *[0.0] * (width - length)])]
    cum_model = [0.0, *accumulate(se)]
    prefixes = range(width + 1)
    if mode == FORCE_MODEL and k_max > 0:
        cache_ok = [False] * (width + 1)
    elif mode == FULL_CACHE:
        cache_ok = [p == length for p in prefixes]
    elif mode == AUTO:
        cache_ok = [p <= length for p in prefixes]
    else:
        cache_ok = [p == 0 for p in prefixes]
    model_ok = mode in (AUTO, NO_CACHE, FORCE_MODEL)
    scores = [(1.0 + c) / t if ok else -1.0 for c, t, ok in zip(cum_cache, cache_ms, cache_ok)]
    scores += [(1.0 + c) / t if model_ok else -1.0 for c, t in zip(cum_model[1:], model_ms[1:])]
    best = _argmax(scores)
    is_model = best > width
    model_k = best - width if is_model else 0
    verified = model_k if is_model else best
    source = MODEL if is_model else (CACHE if verified > 0 else NONE)
    expected = 1.0 + (cum_model[model_k] if is_model else cum_cache[verified])
    step_ms = (step.draft[model_k] if is_model else 0.0) + (cache_ms[verified] if verified <= width
                                                             else step.scalar_ms(1 + verified, 0))
    rate = expected / step_ms
    fallback = 0.0
    if k_max and model_ok:
        f = cum_model[model_k] - rate * step.marginal * model_k
        fallback = f if not f < 0.0 else 0.0  # np.maximum(f, 0.0)
    tau = rate * step.marginal * length + fallback
    return Single(source, verified, model_k, expected, float(step_ms), float(rate), tau)


def _argmax(values: list[float]) -> int:
    """np.argmax: the first maximum, or the first NaN if there is one."""
    best, top = 0, values[0]
    for i, v in enumerate(values):
        if v != v:
            return i
        if v > top:
            best, top = i, v
    return best


_STEP_COSTS: dict[tuple[int, int, int], tuple[CostProfile, "_StepCost"]] = {}


def _step_cost(cost: CostProfile, batch: int, k_max: int) -> "_StepCost":
    """Steps of one engine run share a handful of (profile, batch, k_max): read each once. Keyed
    by the profile object, not its value: hashing a profile's dozen fields on every step cost more
    than the lookup saves (an entry holds its profile, so the id is not reused while it is kept)."""
    key = (id(cost), batch, k_max)
    hit = _STEP_COSTS.get(key)
    if hit is not None and hit[0] is cost:
        return hit[1]
    if len(_STEP_COSTS) >= 256:
        _STEP_COSTS.clear()
    step = _StepCost(cost, batch, k_max)
    _STEP_COSTS[key] = (cost, step)
    return step


class _StepCost:
    """The cost profile read at one batch size (scalars, no per-call parsing)."""

    def __init__(self, cost: CostProfile, batch: int, k_max: int) -> None:
        self.base, self.per_query = cost.step_line(batch)
        self.compute = cost.compute_ms_per_token
        self.marginal = max(self.per_query, self.compute)
        self.draft = [float(cost.draft_ms(batch, k)) for k in range(k_max + 1)]
        self._tables: dict[int, tuple[list[float], list[float]]] = {}
        self._line = np.zeros(0)

    def scalar_ms(self, query: int, k: int) -> float:
        """`ms` of one query count, in Python floats (the same operations)."""
        t = self.base + self.per_query * query
        if self.compute:
            c = self.compute * query
            t = t if (t >= c or t != t) else c  # np.maximum
        return float(t + self.draft[k])

    def one_request_ms(self, width: int) -> tuple[list[float], list[float]]:
        """A one-request step's time verifying each cache prefix (0..width tokens), and with the model
        draft of each length k (0..k_max): the same for every step of a run, so computed once."""
        tables = self._tables.get(width)
        if tables is None:
            tables = self._tables[width] = ([self.scalar_ms(1 + p, 0) for p in range(width + 1)],
                                            [self.scalar_ms(1 + k, k) for k in range(len(self.draft))])
        return tables

    def line_upto(self, count: int) -> np.ndarray:
        """`ms(q, 0) - draft[0]` for q = 0..count-1 at least (the step without the drafter), as
        `ms` computes it element by element: the allocator slices its candidate plans' times from
        it instead of computing them again for every k and round."""
        line = self._line  # (another thread may grow it meanwhile: what is returned is long enough)
        if len(line) < count:
            q = np.arange(max(count, 2 * len(line)))
            line = self.base + self.per_query * q
            if self.compute:
                line = np.maximum(line, self.compute * q)
            self._line = line
        return line

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
