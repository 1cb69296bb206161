"""Drafter and cost profiles for the policy simulator and the goodput rule, from profiles.toml."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROFILES_FILE = Path(__file__).with_name("profiles.toml")
DEFAULT_COST_PROFILE = "gpu-8b"  # what decisions and reports are priced with unless told otherwise


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class DrafterProfile:
    """A model drafter for the simulator and the allocator's prior: a draft of `draft_len` tokens
    whose survival curve S(j) = P(accepted >= j) is either MEASURED per position (`survival`, and
    per workload `survival_by_workload`, from vLLM's per-position acceptance counters) or a chain
    where each token is accepted with probability `acceptance` (per workload where `by_workload`
    says) given the earlier ones were. `measured` says the figures were measured under an engine,
    not assumed; the draws the simulator makes from the curve are simulated either way."""

    name: str
    draft_len: int
    acceptance: float
    description: str = ""
    by_workload: dict[str, float] = field(default_factory=dict)
    measured: bool = False
    survival: tuple[float, ...] = ()
    survival_by_workload: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.draft_len < 1:
            raise ProfileError(f"drafter {self.name}: draft_len must be >= 1, got {self.draft_len}")
        for label, value in [("acceptance", self.acceptance), *((f"by_workload.{w}", a) for w, a in self.by_workload.items())]:
            if not 0.0 <= value < 1.0:
                raise ProfileError(f"drafter {self.name}: {label} must be in [0, 1), got {value}")
        object.__setattr__(self, "survival", tuple(float(v) for v in self.survival))
        object.__setattr__(self, "survival_by_workload",
                           {w: tuple(float(v) for v in c) for w, c in self.survival_by_workload.items()})
        curves = ([("survival", self.survival)] if self.survival else []) + \
            [(f"survival_by_workload.{w}", c) for w, c in self.survival_by_workload.items()]
        for label, curve in curves:
            if len(curve) != self.draft_len:
                raise ProfileError(f"drafter {self.name}: {label} must give {self.draft_len} positions "
                                   f"(draft_len), got {len(curve)}")
            if not all(0.0 <= v < 1.0 for v in curve) or any(b > a for a, b in zip(curve, curve[1:])):
                raise ProfileError(f"drafter {self.name}: {label} must be non-increasing in [0, 1), got {list(curve)}")

    def _measured_curve(self, workload: str) -> tuple[float, ...] | None:
        """The measured S(j) that applies to a workload: its own, else the overall one unless the
        workload has its own chain acceptance; None where the profile is a chain."""
        curve = self.survival_by_workload.get(workload)
        if curve is None and self.survival and workload not in self.by_workload:
            curve = self.survival
        return curve

    def acceptance_for(self, workload: str) -> float:
        """The per-token chain acceptance: the profile's, or the chain with the measured curve's mean."""
        curve = self._measured_curve(workload)
        if curve is not None:
            return chain_acceptance(sum(curve), self.draft_len)
        return self.by_workload.get(workload, self.acceptance)

    def survival_for(self, workload: str) -> np.ndarray:
        """S(j) = P(accepted >= j), j = 1..draft_len, of this drafter on a workload: the allocator's
        prior for the model drafter before live drafts are seen, and what the simulator draws from."""
        curve = self._measured_curve(workload)
        if curve is not None:
            return np.array(curve, dtype=np.float64)
        return np.cumprod(np.full(self.draft_len, self.acceptance_for(workload), dtype=np.float64))

    def mean_accepted_for(self, workload: str) -> float:
        return float(self.survival_for(workload).sum())

    @property
    def mean_accepted(self) -> float:
        if self.survival:
            return float(sum(self.survival))
        return chain_mean(self.acceptance, self.draft_len)

    @property
    def tokens_per_cycle(self) -> float:
        return 1.0 + self.mean_accepted


def accepted_from_survival(survival: np.ndarray, u: "float | np.ndarray") -> "int | np.ndarray":
    """Accepted tokens of a draft drawn with uniform u: #{j : u < S(j)}, so P(accepted >= j) = S(j).
    For a chain (S(j) = p^j) this is floor(log u / log p) capped at the draft length. `survival` is
    one curve, or one curve per draw ((n, k) against n draws)."""
    s = np.asarray(survival, dtype=np.float64)
    out = (np.asarray(u, dtype=np.float64)[..., None] < s).sum(axis=-1)
    return int(out) if out.ndim == 0 else out.astype(np.int64)


def known_survival(accepted: np.ndarray, width: int) -> np.ndarray:
    """The survival curves of drafts whose accepted lengths are known: S(j) = 1 for j <= accepted, 0
    after ((n, width) float64). What a perfect predictor would say; accepted_from_survival's inverse."""
    return (np.arange(1, width + 1)[None, :] <= np.asarray(accepted)[:, None]).astype(np.float64)


def chain_mean(acceptance: float, draft_len: int) -> float:
    """Mean accepted tokens of a chain draft: sum_{i=1..k} acceptance^i."""
    return sum(acceptance**i for i in range(1, draft_len + 1))


def chain_acceptance(mean_accepted: float, draft_len: int) -> float:
    """The per-token acceptance whose chain has this mean (the inverse of chain_mean, by bisection)."""
    if not 0.0 <= mean_accepted < draft_len:
        raise ProfileError(f"mean accepted {mean_accepted} is outside [0, {draft_len})")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_mean(mid, draft_len) < mean_accepted else (lo, mid)
    return lo


@dataclass(frozen=True)
class CostProfile:
    """What one engine step costs, for the simulator, the goodput rule and the allocator.

    One target forward over n query tokens at batch 1: t(n) = base_ms + per_token_ms * n. Where a
    batch-8 fit exists (n query tokens for each of 8 requests) the base and the per-request slope are
    interpolated linearly in the batch size (and extrapolated past 8); without one, each running
    request adds `per_request_ms` (its KV cache read) to the base. `compute_ms_per_token` is a
    compute-bound floor: a step of Q query tokens takes at least Q times it, which is what makes a
    GPU's verification dear at large batch. The model drafter costs `draft_call_ms` per call plus
    `draft_token_ms` per drafted position (the batch-8 figure interpolated likewise), paid once per
    step whatever the number of requests that use it."""

    name: str
    base_ms: float
    per_token_ms: float
    draft_token_ms: float
    description: str = ""
    # The same fit at batch 8 (n query tokens for each of 8 requests), where measured.
    batch8_base_ms: float | None = None
    batch8_per_token_ms: float | None = None
    batch8_draft_token_ms: float | None = None
    draft_call_ms: float = 0.0
    per_request_ms: float = 0.0
    compute_ms_per_token: float = 0.0
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.base_ms <= 0 or self.per_token_ms < 0 or self.draft_token_ms < 0:
            raise ProfileError(f"cost profile {self.name}: base_ms must be > 0 and the others >= 0")
        if (self.batch8_base_ms is None) != (self.batch8_per_token_ms is None):
            raise ProfileError(f"cost profile {self.name}: give both batch8_base_ms and batch8_per_token_ms, or neither")
        for label in ("batch8_base_ms", "batch8_per_token_ms", "batch8_draft_token_ms", "draft_call_ms",
                      "per_request_ms", "compute_ms_per_token"):
            value = getattr(self, label)
            if value is not None and not value >= 0:
                raise ProfileError(f"cost profile {self.name}: {label} must be >= 0, got {value}")

    def target_ms(self, query_tokens: float) -> float:
        return self.base_ms + self.per_token_ms * query_tokens

    def _batch_weight(self, batch: int) -> float:
        return (max(batch, 1) - 1) / 7.0

    def step_line(self, batch: int) -> tuple[float, float]:
        """(base ms, ms per query token of the whole step) of the memory-bound line at this batch size."""
        if self.batch8_base_ms is None:
            return self.base_ms + self.per_request_ms * (max(batch, 1) - 1), self.per_token_ms
        w = self._batch_weight(batch)
        base = self.base_ms + w * (self.batch8_base_ms - self.base_ms)
        per_request_slope = self.per_token_ms + w * (self.batch8_per_token_ms - self.per_token_ms)
        return base, per_request_slope / max(batch, 1)

    def draft_ms(self, batch: int, model_k: "int | np.ndarray") -> "float | np.ndarray":
        """The model drafter's cost for one step that drafts `model_k` positions (0: not called)."""
        per_token = self.draft_token_ms
        if self.batch8_draft_token_ms is not None:
            per_token += self._batch_weight(batch) * (self.batch8_draft_token_ms - self.draft_token_ms)
        k = np.asarray(model_k, dtype=np.float64)
        out = np.where(k > 0, self.draft_call_ms + k * per_token, 0.0)
        return float(out) if out.ndim == 0 else out

    def step_ms(self, batch: int, query_tokens: "float | np.ndarray", model_k: "int | np.ndarray" = 0) -> "float | np.ndarray":
        """One whole engine step: `batch` running requests, `query_tokens` verified in all (one per
        request plus their draft tokens), the model drafter called for `model_k` positions."""
        base, per_query = self.step_line(batch)
        q = np.asarray(query_tokens, dtype=np.float64)
        out = np.maximum(base + per_query * q, self.compute_ms_per_token * q) + self.draft_ms(batch, model_k)
        return float(out) if out.ndim == 0 else out

    def per_request(self, batch: int) -> "CostProfile":
        """One request's share of a step with `batch` running requests: the batch-1 and batch-8 fits
        interpolated (linearly in the batch size) and divided by the batch. The goodput rule then
        weighs a request's extra query tokens against its share of the step, so verification grows
        dearer as batches fill a compute-bound machine. Without a batch-8 fit: the batch-1 profile."""
        if self.batch8_base_ms is None or batch <= 1:
            return self
        w = self._batch_weight(batch)
        base = self.base_ms + w * (self.batch8_base_ms - self.base_ms)
        per_token = self.per_token_ms + w * (self.batch8_per_token_ms - self.per_token_ms)
        return CostProfile(f"{self.name}@{batch}", base / batch, per_token / batch, self.draft_token_ms / batch)


def _load(path: Path = PROFILES_FILE) -> dict:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def drafter_profiles(path: Path = PROFILES_FILE) -> dict[str, DrafterProfile]:
    return {name: DrafterProfile(name=name, **spec) for name, spec in _load(path).get("drafter", {}).items()}


def cost_profiles(path: Path = PROFILES_FILE) -> dict[str, CostProfile]:
    out = {}
    for name, spec in _load(path).get("cost", {}).items():
        spec = dict(spec)
        if "sources" in spec:
            spec["sources"] = tuple(spec["sources"])
        out[name] = CostProfile(name=name, **spec)
    return out


def pick(profiles: dict, names: list[str] | None, kind: str) -> list:
    """The named profiles, in the given order; an unknown name lists the known ones."""
    if not names:
        return list(profiles.values())
    unknown = [n for n in names if n not in profiles]
    if unknown:
        raise ProfileError(f"unknown {kind} profile(s) {unknown}; known: {sorted(profiles)}")
    return [profiles[n] for n in names]
