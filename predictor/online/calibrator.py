"""Fast calibration, the learning side: the per-position fits of the corrections that
predictor.gate.calibration applies, per workload and per tenant, and which of them the leader serves.

The survival gate's curve is a product of conditional probabilities h_j = P(accept j | accepted
j - 1). The correction keeps that shape: h'_j = sigmoid(slope_j * logit(h_j) + bias_j), so the
corrected curve is still monotone and still zero past the draft's end. Each position's two numbers
are fitted by a few Newton steps on the recent drafts that reached it (a draft accepted a tokens out
of L says "accepted" at positions 1..a and, if a < L, "rejected" at a + 1), with a Gaussian prior
at the identity so that a position with little data stays as the MLP says. This is the fast path
next to the slow one (the MLP learner), like the per-position acceptance estimates vLLM keeps for
its own drafters: a new workload's systematic error (drafts predicted at 0.47 tokens accepting 0.72)
is fixed within hundreds of drafts instead of a promotion cycle of 20k.

A fit to the log loss makes the curves right on average, which is not what the allocator needs:
it verifies the drafts whose curves are highest, and a curve that is right on average can still
rank and price drafts worse than the uncorrected one (measured: halving the calibration gap made
decisions slightly worse). So each refit then chooses between the fit and the uncorrected curves
with every position's logit moved by one shift from a small grid, by what each buys: the counterfactual goodput of the allocator's choices along the
scope's recent request paths (the caller's `score`, predictor.online.counterfactual.replay_paths). One
number per scope learned from the objective itself; the learner serves it only if it also wins on
the drafts held back from it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from predictor.gate.calibration import Calibration, apply_to_logits, conditional, logit
from predictor.gate.mlp import SURVIVAL_K


def observations(curves: np.ndarray, draft_len: np.ndarray, label: np.ndarray) -> Iterable[tuple[int, np.ndarray, np.ndarray]]:
    """(position index j, logit h_j, accepted 0/1) of every position the drafts reached."""
    z = logit(conditional(curves))
    j = np.arange(z.shape[1])[None, :]
    lab = np.asarray(label)[:, None]
    reached = (j <= lab) & (j < np.asarray(draft_len)[:, None])  # positions 1..a accepted, a + 1 rejected
    for p in range(z.shape[1]):
        rows = reached[:, p]
        if rows.any():
            yield p, z[rows, p], (lab[rows, 0] > p).astype(np.float64)


def fit_position(z: np.ndarray, y: np.ndarray, prior: float, iterations: int = 25) -> tuple[float, float]:
    """slope, bias minimising the log loss of sigmoid(slope * z + bias) against y plus
    prior / 2 * ((slope - 1)^2 + bias^2): damped Newton steps from the identity (each step halved
    until the loss falls: far from the optimum a full step overshoots, and when every z is alike
    slope and bias are nearly one direction)."""
    def loss(a: float, b: float) -> float:
        u = a * z + b
        return float(np.sum(np.logaddexp(0.0, u) - y * u) + 0.5 * prior * ((a - 1.0) ** 2 + b * b))

    a, b = 1.0, 0.0
    current = loss(a, b)
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(a * z + b, -30.0, 30.0)))
        w = p * (1.0 - p)
        g = np.array([np.dot(p - y, z) + prior * (a - 1.0), np.sum(p - y) + prior * b])
        h = np.array([[np.dot(w, z * z) + prior, np.dot(w, z)], [np.dot(w, z), np.sum(w) + prior]])
        step = np.linalg.solve(h, g)
        t = 1.0
        while t > 1e-4:
            trial = loss(a - t * step[0], b - t * step[1])
            if trial <= current:
                break
            t *= 0.5
        else:
            break
        a, b, current = a - t * step[0], b - t * step[1], trial
        if np.max(np.abs(t * step)) < 1e-6:
            break
    return float(np.clip(a, 0.05, 20.0)), float(np.clip(b, -20.0, 20.0))


@dataclass(frozen=True)
class Recent:
    """A scope's recent labelled drafts as arrays, with the raw curves of the gate that served them."""

    curves: np.ndarray
    draft_len: np.ndarray
    label: np.ndarray
    decided: np.ndarray  # bool: a step's decision point
    request: np.ndarray  # object: request ids ("" unknown)
    position: np.ndarray  # int64: output position (-1 unknown)


# A scope's recent drafts -> (corrected curves for them -> goodput in tokens per ms): the caller's
# counterfactual replay (predictor.online.counterfactual.replay_paths), set up once per fit.
Score = Callable[[Recent], Callable[[np.ndarray], float]]


class ScopeFitter:
    """The recent observations of one scope (a workload, or a tenant's workload) and its fit."""

    def __init__(self, window: int, prior: float, shifts: tuple[float, ...] = (0.0,), scored: int = 2000) -> None:
        self.window, self.prior, self.shifts, self.scored = window, prior, shifts, scored
        self._z = [deque(maxlen=window) for _ in range(SURVIVAL_K)]
        self._y = [deque(maxlen=window) for _ in range(SURVIVAL_K)]
        # (raw curve, length, label, decided, request, position) of the recent drafts
        self._recent: deque[tuple] = deque(maxlen=window)
        self.events = 0
        self.pending = 0  # labelled drafts since the last fit

    def add(self, curves: np.ndarray, draft_len: np.ndarray, label: np.ndarray, decided: np.ndarray | None = None,
            request: np.ndarray | None = None, position: np.ndarray | None = None) -> None:
        """Labelled drafts with the raw curves of the gate serving them. `decided` marks the steps'
        decision points, `request` and `position` place each draft on its request's path (what the
        shift is scored along); unknown: every draft a decision point of its own."""
        for p, z, y in observations(curves, draft_len, label):
            self._z[p].extend(z.tolist())
            self._y[p].extend(y.tolist())
        n = len(label)
        self._recent.extend(zip(np.asarray(curves), np.asarray(draft_len).tolist(), np.asarray(label).tolist(),
                                [True] * n if decided is None else np.asarray(decided, dtype=bool).tolist(),
                                [""] * n if request is None else list(request),
                                [-1] * n if position is None else np.asarray(position).tolist()))
        self.events += n
        self.pending += n

    def fit(self, score: Score | None = None) -> Calibration:
        """The log-loss fit, then (given `score`) the best of it and of the identity moved by each
        shift of the grid, by the score along the newest `scored` drafts' paths (ties: the smaller
        move). Each candidate costs a replay (~5 ms for 2,000 drafts): few candidates, few drafts."""
        self.pending = 0
        slope, bias = np.ones(SURVIVAL_K), np.zeros(SURVIVAL_K)
        for p in range(SURVIVAL_K):
            if self._z[p]:
                slope[p], bias[p] = fit_position(np.array(self._z[p]), np.array(self._y[p]), self.prior)
        if score is None or not self._recent or self.shifts == (0.0,):
            return Calibration(slope, bias, self.events)
        newest = list(self._recent)[-self.scored:]
        curves, lengths, labels, decided, request, position = zip(*newest)
        recent = Recent(np.stack(curves), np.array(lengths, dtype=np.int64), np.array(labels),
                        np.array(decided, dtype=bool), np.array(request, dtype=object), np.array(position, dtype=np.int64))
        goodput = score(recent)
        logits = logit(conditional(recent.curves))
        identity = np.ones(SURVIVAL_K), np.zeros(SURVIVAL_K)
        candidates = [(*identity, shift) for shift in self.shifts] + [(slope, bias, 0.0)]
        best, best_key = Calibration(slope, bias, self.events), None
        for a, b, shift in candidates:  # on a tie the first, the smaller move (the identity before the fit)
            candidate = Calibration(a, b + shift, self.events)
            key = (round(goodput(apply_to_logits(logits, recent.draft_len, candidate.slope, candidate.bias)), 9),
                   -abs(shift))
            if best_key is None or key > best_key:
                best, best_key = candidate, key
        return best


@dataclass(frozen=True)
class CalibrationConfig:
    enabled: bool = True
    every: int = 300  # labelled drafts of a scope between fits
    window: int = 4000  # recent observations kept per position and scope
    prior: float = 30.0  # pseudo-observations pulling each position to the identity
    tenant_min_events: int = 5000  # a tenant's workload gets its own correction from this much traffic
    margin: float = 0.01  # served only if the counterfactual replay says it beats the uncorrected curves by this
    # logit shifts of the identity tried beside the fit, scored by counterfactual goodput on the newest
    # `scored` drafts of the scope
    shifts: tuple[float, ...] = (-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0)
    scored: int = 2000
    # A scope's corrections are served only once one of them, after paying on the window it was
    # judged on, still gained on a window of later drafts (Calibrator.admit). A refit is judged on a
    # window that shares nine tenths of its drafts with the last refit's, so over a stream a
    # correction now and then pays by luck; the later window is a look it was not chosen on.
    confirm: bool = True
    # Tenant scopes kept at most (their names come from clients): beyond it the tenant scopes seen
    # longest ago are forgotten, with their trials and confirmations, and counted (`evicted`).
    max_tenant_scopes: int = 1000


@dataclass
class _Trial:
    """A scope's paying correction, not served, waiting for a window of drafts after it."""

    calibration: Calibration
    since: int  # the workload's drafts held (WorkloadPromoter.seen) when the trial began


class Calibrator:
    """The leader's fast calibration: scopes are (workload, None) and, once they have enough
    traffic, (workload, tenant). `observe` returns the scopes whose correction was refitted."""

    def __init__(self, config: CalibrationConfig | None = None) -> None:
        self.config = config or CalibrationConfig()
        if self.config.max_tenant_scopes < 1:
            raise ValueError(f"max_tenant_scopes must be >= 1, got {self.config.max_tenant_scopes}")
        self._scopes: dict[tuple[str, str | None], ScopeFitter] = {}
        self._trials: dict[tuple[str, str | None], _Trial] = {}
        self._confirmed: set[tuple[str, str | None]] = set()
        self._last_seen: dict[tuple[str, str], int] = {}  # tenant scope -> the observe call that last fed it
        self._calls = 0
        self.evicted = 0  # tenant scopes forgotten to stay within max_tenant_scopes
        self._forgotten: list[tuple[str, str | None]] = []  # evicted since take_forgotten

    def observe(self, curves: np.ndarray, draft_len: np.ndarray, label: np.ndarray, workload: np.ndarray,
                tenant: np.ndarray, workloads: tuple[str, ...], decided: np.ndarray | None = None,
                request: np.ndarray | None = None, position: np.ndarray | None = None,
                score: Callable[[str], Score] | None = None) -> dict[tuple[str, str | None], Calibration]:
        """Labelled drafts in; the scopes refitted out. `score(workload)` prices a workload's
        drafts along their paths (see ScopeFitter.fit); without it the fit is the log-loss one alone."""
        cfg = self.config
        n = len(label)
        decided = np.ones(n, dtype=bool) if decided is None else np.asarray(decided, dtype=bool)
        request = np.full(n, "", dtype=object) if request is None else np.asarray(request, dtype=object)
        position = np.full(n, -1, dtype=np.int64) if position is None else np.asarray(position, dtype=np.int64)
        changed: dict[tuple[str, str | None], Calibration] = {}
        if not cfg.enabled:
            return changed
        self._calls += 1
        # Each draft's rows by scope in one pass (not a mask per tenant: O(drafts), whatever the tenants).
        rows: dict[tuple[str, str | None], list[int]] = {}
        for i, (w, t) in enumerate(zip(workload.tolist(), tenant.tolist())):
            rows.setdefault((workloads[w], None), []).append(i)
            rows.setdefault((workloads[w], t), []).append(i)
        keys = sorted((k for k in rows if k[1] is None), key=lambda k: workloads.index(k[0]))
        keys += sorted((k for k in rows if k[1] is not None), key=lambda k: (workloads.index(k[0]), k[1]))
        for key in keys:
            sel = np.asarray(rows[key], dtype=np.int64)
            fitter = self._scopes.setdefault(key, ScopeFitter(cfg.window, cfg.prior, cfg.shifts, cfg.scored))
            fitter.add(curves[sel], draft_len[sel], label[sel], decided[sel], request[sel], position[sel])
            if key[1] is not None:
                self._last_seen[key] = self._calls
            ready = fitter.events >= cfg.tenant_min_events if key[1] is not None else True
            if ready and fitter.pending >= cfg.every:
                changed[key] = fitter.fit(None if score is None else score(key[0]))
        self._bound_tenants()
        return changed

    def _bound_tenants(self) -> None:
        """Forget the tenant scopes seen longest ago beyond max_tenant_scopes (a scope keeps a window
        of drafts: tenants named by clients must not grow the learner without bound)."""
        excess = len(self._last_seen) - self.config.max_tenant_scopes
        if excess <= 0:
            return
        for key in sorted(self._last_seen, key=self._last_seen.__getitem__)[:excess]:
            del self._last_seen[key]
            self._scopes.pop(key, None)
            self._trials.pop(key, None)
            self._confirmed.discard(key)
            self._forgotten.append(key)
        self.evicted += excess

    def take_forgotten(self) -> list[tuple[str, str | None]]:
        """The tenant scopes evicted since the last call: their served corrections go too (the
        learner clears them), or every replica would keep loading one per tenant ever seen."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten

    def tenant_scopes(self) -> int:
        return len(self._last_seen)

    def admit(self, key: tuple[str, str | None], calibration: Calibration, pays: bool, now: int = 0) -> bool:
        """Whether a refit of scope `key` that `pays` (or not) on its held-back window is served.
        With `confirm`, an unconfirmed scope's paying refit starts a trial instead (not served; see
        `due` and `settle`; `now`: its workload's drafts held so far); a confirmed scope serves each
        refit that pays, and one that does not pay ends the confirmation."""
        if not self.config.confirm or key in self._confirmed:
            if not pays:
                self._confirmed.discard(key)
            return pays
        if pays and key not in self._trials:
            self._trials[key] = _Trial(calibration, now)
        return False

    def on_trial(self, key: tuple[str, str | None]) -> bool:
        return key in self._trials

    def due(self, drafts: int, seen: Callable[[str], int]) -> dict[tuple[str, str | None], Calibration]:
        """The trials with at least `drafts` drafts of their workload since they began (`seen`: a
        workload's drafts held so far): a held-back window of that size is now made only of drafts
        the trial's correction was not chosen on."""
        return {k: t.calibration for k, t in self._trials.items() if seen(k[0]) - t.since >= drafts}

    def settle(self, key: tuple[str, str | None], gained: bool) -> None:
        """A trial judged on its later window: confirmed if its correction still gained there."""
        del self._trials[key]
        if gained:
            self._confirmed.add(key)

    def reset(self, workload: str | None = None) -> list[tuple[str, str | None]]:
        """Forget the scopes of `workload` (all, if None), their trials and confirmations: a drift,
        or a new champion whose outputs the old corrections do not fit. Returns the scopes forgotten."""
        gone = [k for k in self._scopes if workload is None or k[0] == workload]
        for k in gone:
            del self._scopes[k]
            self._last_seen.pop(k, None)
        for k in [k for k in self._trials if workload is None or k[0] == workload]:
            del self._trials[k]
        self._confirmed = {k for k in self._confirmed if workload is not None and k[0] != workload}
        return gone
