"""The per-request decision: verify the cache draft, use the fallback drafter, or decode plainly.

tau comes from the goodput rule (predictor.goodput) with the live mean accepted length of the model
drafter. With "none" as the fallback the rule compares the cache draft with a plain step:
verify iff (y_hat + 1) / t(1 + k_c) > 1 / t(1), i.e. tau = t(1 + k_c) / t(1) - 1.
Above `max_running_for_speculation` running requests the step backs off: no speculation at all, or
cache drafts only (`backoff="cache_only"`), because verification is no longer nearly free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from predictor.goodput import model_step_ms, tau_star
from predictor.profiles import CostProfile, cost_profiles

NONE, CACHE, MODEL = 0, 1, 2
SOURCE_NAMES = {NONE: "none", CACHE: "cache", MODEL: "model"}
FALLBACKS = ("model", "none")
BACKOFFS = ("none", "cache_only")


def _default_cost() -> CostProfile:
    return cost_profiles()["gpu-8b"]


@dataclass(frozen=True)
class DecisionConfig:
    fallback: str = "model"  # what a step does when the cache draft is not verified
    model_draft_len: int = 3
    initial_model_accepted: float = 0.75  # prior for the model drafter's mean accepted length
    model_mean_decay: float = 0.01  # weight of each new observation in the running mean
    cost: CostProfile = field(default_factory=_default_cost)
    max_running_for_speculation: int | None = None  # back off above this many running requests
    backoff: str = "none"
    fixed_tau: float | None = None  # overrides the goodput rule (tests, operators)

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.backoff not in BACKOFFS:
            raise ValueError(f"backoff must be one of {BACKOFFS}, got {self.backoff!r}")
        if self.model_draft_len < 1:
            raise ValueError(f"model_draft_len must be >= 1, got {self.model_draft_len}")
        if not 0.0 < self.model_mean_decay <= 1.0:
            raise ValueError(f"model_mean_decay must be in (0, 1], got {self.model_mean_decay}")
        if self.max_running_for_speculation is not None and self.max_running_for_speculation < 1:
            raise ValueError("max_running_for_speculation must be >= 1 or None")

    def speculation_allowed(self, running: int) -> bool:
        """False only when backing off to no speculation at all."""
        return not (self.over_limit(running) and self.backoff == "none")

    def over_limit(self, running: int) -> bool:
        return self.max_running_for_speculation is not None and running > self.max_running_for_speculation

    def update_model_mean(self, mean: float, accepted: int) -> float:
        return (1.0 - self.model_mean_decay) * mean + self.model_mean_decay * accepted


def effective_cost(config: DecisionConfig, batch: int) -> CostProfile:
    """The cost profile for one request's share of a step with `batch` requests."""
    return config.cost.per_request(batch)


def model_beats_plain(mu_e: float, config: DecisionConfig, batch: int = 1) -> bool:
    """The goodput rule applied to the fallback itself: a model drafter that accepts too little
    (a random head, a workload it was not trained on) loses to plain decoding."""
    cost = effective_cost(config, batch)
    return (mu_e + 1.0) / model_step_ms(cost, config.model_draft_len) > 1.0 / cost.target_ms(1)


def thresholds(cache_len: np.ndarray, mu_e: float, config: DecisionConfig, fallback: str) -> np.ndarray:
    if config.fixed_tau is not None:
        return np.full(len(cache_len), config.fixed_tau, dtype=np.float64)
    cost = effective_cost(config, max(len(cache_len), 1))
    if fallback == "none":
        return cost.target_ms(1 + np.asarray(cache_len, dtype=np.float64)) / cost.target_ms(1) - 1.0
    return tau_star(cache_len, mu_e, config.model_draft_len, cost)


def decide(predicted: np.ndarray, cache_len: np.ndarray, mu_e: float, config: DecisionConfig,
           allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source per request, tau per request); tau is NaN where no cache draft was scored."""
    n = len(cache_len)
    fallback = config.fallback
    if config.over_limit(n) and config.backoff == "cache_only":
        fallback = "none"
    if fallback == "model" and config.fixed_tau is None and not model_beats_plain(mu_e, config, max(n, 1)):
        fallback = "none"
    tau = thresholds(cache_len, mu_e, config, fallback)
    has = np.asarray(cache_len) > 0
    with np.errstate(invalid="ignore"):
        verify_cache = has & (predicted > tau)
    fallback_source = MODEL if fallback == "model" else NONE
    source = np.where(verify_cache, CACHE, fallback_source).astype(np.int8)
    source[~np.asarray(allowed, dtype=bool)] = NONE
    return source, np.where(has, tau, np.nan).astype(np.float32)
