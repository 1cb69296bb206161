"""The per-request decision rules: which draft each request of a step verifies, if any.

`allocator` (the default): the verification allocator (predictor.decision.allocator) plans the whole step
from each cache draft's survival curve, the model drafter's live curve per workload and the cost
profile at the step's batch size: a cache prefix, the model draft (one length k for the step) or
nothing per request.

`binary` (the seed's rule, and what a point-estimate predictor serves with): verify the whole cache
draft iff the predicted accepted length beats tau from the goodput rule (predictor.decision.binary_rule) with the
live mean accepted length of the model drafter; with "none" as the fallback the rule compares the
cache draft with a plain step: verify iff (y_hat + 1) / t(1 + k_c) > 1 / t(1), i.e.
tau = t(1 + k_c) / t(1) - 1.

`arctic`: ArcticInference's rule, the baseline HVD must beat: verify the cache draft iff its
suffix-tree score reaches the model drafter's draft length.

`vllm-adaptive`, `sglang-hybrid`, `trtllm`: the competitors' own rules over the same drafts and
costs (predictor.decision.rivals, each citing its source); they ignore the predictor and the tenants'
tau overrides, and the learning ones learn only from what they verified.

Above `max_running_for_speculation` running requests the step backs off: no speculation at all, or
cache drafts only (`backoff="cache_only"`), because verification is no longer nearly free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from predictor.decision.allocator import CACHE, MODEL, NONE
from predictor.decision.binary_rule import model_beats_plain, thresholds
from predictor.decision.drafter_survival import DrafterSurvival
from predictor.decision.rivals import RIVAL_RULES
from predictor.decision.profiles import (
    DEFAULT_COST_PROFILE,
    CostProfile,
    DrafterProfile,
    chain_acceptance,
    cost_profiles,
)
from storage.workloads import WORKLOADS

SOURCE_NAMES = {NONE: "none", CACHE: "cache", MODEL: "model"}
FALLBACKS = ("model", "none")
BACKOFFS = ("none", "cache_only")
RULES = ("allocator", "binary", "arctic", *RIVAL_RULES)
DEFAULT_MODEL_ACCEPTED = 0.75  # the model drafter's mean accepted length at k = 3 when no profile is given


def _default_cost() -> CostProfile:
    return cost_profiles()[DEFAULT_COST_PROFILE]


def _default_drafter() -> DrafterProfile:
    return DrafterProfile("prior", draft_len=3, acceptance=chain_acceptance(DEFAULT_MODEL_ACCEPTED, 3),
                          description=f"a chain with mean accepted length {DEFAULT_MODEL_ACCEPTED} at k = 3")


@dataclass(frozen=True)
class DecisionConfig:
    fallback: str = "model"  # what a step does when the cache draft is not verified
    model_draft_len: int = 3  # the longest model draft (the allocator picks k in 1..this per step)
    drafter: DrafterProfile = field(default_factory=_default_drafter)  # prior of the model drafter's curves
    model_mean_decay: float = 0.002  # how fast old model drafts fade from the drafter's live curves
    cost: CostProfile = field(default_factory=_default_cost)
    max_running_for_speculation: int | None = None  # back off above this many running requests
    backoff: str = "none"
    fixed_tau: float | None = None  # every request held to this tau (the binary decision), not the rule's
    rule: str = "allocator"

    def __post_init__(self) -> None:
        if self.rule == "gate":
            raise ValueError(f"rule 'gate' was renamed: 'binary' is the predicted length against tau (the old "
                             f"gate), 'allocator' the default; rule must be one of {RULES}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.backoff not in BACKOFFS:
            raise ValueError(f"backoff must be one of {BACKOFFS}, got {self.backoff!r}")
        if self.model_draft_len < 1:
            raise ValueError(f"model_draft_len must be >= 1, got {self.model_draft_len}")
        if not 0.0 <= self.model_mean_decay < 1.0:
            raise ValueError(f"model_mean_decay must be in [0, 1), got {self.model_mean_decay}")
        if self.max_running_for_speculation is not None and self.max_running_for_speculation < 1:
            raise ValueError("max_running_for_speculation must be >= 1 or None")

    def speculation_allowed(self, running: int) -> bool:
        """False only when backing off to no speculation at all."""
        return not (self.over_limit(running) and self.backoff == "none")

    def over_limit(self, running: int) -> bool:
        return self.max_running_for_speculation is not None and running > self.max_running_for_speculation

    def model_drafting(self, running: int) -> bool:
        """Whether the model drafter may be used in a step with this many running requests."""
        return not (self.fallback == "none" or (self.over_limit(running) and self.backoff == "cache_only"))

    def model_survival(self) -> DrafterSurvival:
        """The model drafter's live survival curves per workload (k = 1..model_draft_len), from the
        drafter profile as prior. The runtime and the tau tuner each keep one, fed the same model
        events, so their mean accepted lengths agree."""
        return DrafterSurvival(self.drafter, WORKLOADS, k_max=self.model_draft_len, decay=self.model_mean_decay)


def effective_rule(rule: str, gate_kind: str) -> str:
    """The rule a predictor of this kind serves with: a point-estimate gate has no survival curve
    for the allocator, so it keeps the binary rule."""
    return "binary" if rule == "allocator" and gate_kind != "survival" else rule  # the rivals read no predictor


def fallback_sources(mu_e: np.ndarray, config: DecisionConfig, batch: int) -> np.ndarray:
    """Per request, what a step does without the cache draft: the model drafter, unless the goodput
    rule says plain decoding beats it (a random head, a workload it was not trained on), or the
    configuration says none, or a cache-only back-off is in force."""
    n = len(mu_e)
    if not config.model_drafting(batch):
        return np.full(n, NONE, dtype=np.int8)
    if config.fixed_tau is not None:
        return np.full(n, MODEL, dtype=np.int8)
    beats = model_beats_plain(mu_e, config.model_draft_len, config.cost.per_request(batch))
    return np.where(beats, MODEL, NONE).astype(np.int8)


def rule_thresholds(cache_len: np.ndarray, mu_e: np.ndarray, fallback: np.ndarray, config: DecisionConfig) -> np.ndarray:
    """tau from the goodput rule, per request: against the model drafter (with its live mean
    accepted length) or against a plain step."""
    n = len(cache_len)
    if config.fixed_tau is not None:
        return np.full(n, config.fixed_tau, dtype=np.float64)
    return thresholds(cache_len, mu_e, fallback == MODEL, config.model_draft_len, config.cost.per_request(max(n, 1)))


OFF_NONE, OFF_MODEL, OFF_CACHE = 0, 1, 2  # hybrid switched off by an override: always model / always cache


def decide(predicted: np.ndarray, cache_len: np.ndarray, tau: np.ndarray, fallback: np.ndarray,
           allowed: np.ndarray, off: np.ndarray | None = None) -> np.ndarray:
    """The binary rule's source per request: the cache draft iff there is one and its prediction
    beats tau; else the fallback. Overrides can switch the hybrid off per request; opted-out
    requests get none."""
    has = np.asarray(cache_len) > 0
    with np.errstate(invalid="ignore"):
        verify_cache = has & (predicted > tau)
    source = np.where(verify_cache, CACHE, fallback).astype(np.int8)
    if off is not None:
        source[off == OFF_MODEL] = MODEL
        source[(off == OFF_CACHE) & has] = CACHE
        source[(off == OFF_CACHE) & ~has] = NONE
    source[~np.asarray(allowed, dtype=bool)] = NONE
    return source
