"""What a competitor's rule sees of one engine step and what it learns from afterwards: plain arrays,
one row per running request, built the same way by the runtime and the offline simulator."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from predictor.decision.allocator import CACHE, MODEL, NONE
from predictor.decision.profiles import CostProfile

__all__ = ["CACHE", "MODEL", "NONE", "Outcome", "RivalRule", "RulePlan", "StepView", "conditional_matrix", "conditional_probs"]


@dataclass(frozen=True)
class StepView:
    """One step's requests, as the rule's engine would know them before verification."""

    cache_len: np.ndarray  # int64: each request's suffix draft length (0: the cache had nothing)
    match_len: np.ndarray  # int64: the suffix match the draft continues
    score: np.ndarray  # float64: the suffix tree's score (sum of the draft's path probabilities)
    token_prob: np.ndarray  # float64 (n, K): each draft token's probability given the ones before it, 0 past the draft
    allowed: np.ndarray  # bool: the request may speculate this step
    model_survival: np.ndarray  # (n, k_max) the model drafter's curve per request; 0 columns: no model drafter
    batch: int  # running requests in the engine (what batch-dependent rules read); 1: every request alone

    @property
    def n(self) -> int:
        return len(self.cache_len)

    @property
    def model_k(self) -> int:
        return int(self.model_survival.shape[1]) if self.model_survival.ndim == 2 else 0


@dataclass(frozen=True)
class RulePlan:
    """What each request verifies: NONE, CACHE or MODEL and how many draft tokens; `model_k` is the
    model draft length of the step (0 when no request uses the drafter). At batch 1 with several
    requests (the simulator's independent lanes) each MODEL row drafts its own `length`."""

    source: np.ndarray  # int8
    length: np.ndarray  # int64
    model_k: int


@dataclass(frozen=True)
class Outcome:
    """What the engine verified for some requests of one step and how much of it it accepted.
    `steps` is the number of engine steps these rows stand for (the simulator's batch-1 lanes run
    many one-request engines in lockstep)."""

    source: np.ndarray  # int8 NONE, CACHE or MODEL
    verified: np.ndarray  # int64 draft tokens verified
    accepted: np.ndarray  # int64 draft tokens accepted (<= verified)
    token_prob: np.ndarray  # float64 (m, K) the verified cache drafts' token probabilities (rows of StepView.token_prob)
    steps: int = 1


class RivalRule(Protocol):
    name: str

    def plan(self, view: StepView, cost: CostProfile) -> RulePlan: ...

    def learn(self, outcome: Outcome) -> None: ...

    def state(self) -> dict: ...


def conditional_probs(path_probs: Sequence[Sequence[float]], width: int) -> np.ndarray:
    """(n, width) each draft token's probability given the tokens before it, from arctic-inference's
    `probs`, which are cumulative path probabilities (the product of child/parent counts down the
    tree, so their sum is the draft's score): q_j = p_j / p_(j-1), q_1 = p_1."""
    out = np.zeros((len(path_probs), width), dtype=np.float64)
    for i, p in enumerate(path_probs):
        k = min(len(p), width)
        if k:
            row = np.asarray(p[:k], dtype=np.float64)
            out[i, 0] = row[0]
            if k > 1:
                with np.errstate(divide="ignore", invalid="ignore"):
                    out[i, 1:k] = np.where(row[:-1] > 0, row[1:] / row[:-1], 0.0)
    return np.clip(out, 0.0, 1.0)


def conditional_matrix(path_probs: np.ndarray, draft_len: np.ndarray, width: int,
                       rows: np.ndarray | None = None) -> np.ndarray:
    """`conditional_probs` for drafts laid end to end (ReplayResult.token_probs), for the drafts
    `rows` picks (a mask or indices; all by default): (rows, width) float32."""
    lens_all = np.asarray(draft_len, dtype=np.int64)
    flat = np.asarray(path_probs, dtype=np.float32)
    if int(lens_all.sum()) != len(flat):
        raise ValueError(f"{len(flat)} token probabilities for drafts of {int(lens_all.sum())} tokens in all: "
                         "a replay made before token probabilities were kept (replay again)")
    start_all = np.cumsum(lens_all) - lens_all
    pick = np.arange(len(lens_all)) if rows is None else np.arange(len(lens_all))[rows]
    lens, start = lens_all[pick], start_all[pick]
    keep = np.minimum(lens, width)
    row = np.repeat(np.arange(len(pick)), keep)
    j = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
    at = start[row] + j
    p = flat[at].astype(np.float64)
    prev = np.where(j > 0, flat[np.maximum(at - 1, 0)], 1.0).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(prev > 0, p / prev, 0.0)
    out = np.zeros((len(pick), width), dtype=np.float32)
    out[row, j] = np.clip(q, 0.0, 1.0)
    return out


def fallback_source(view: StepView) -> np.ndarray:
    """Where a rule does not take the cache draft: the model drafter if the step may use it, else nothing."""
    return np.full(view.n, MODEL if view.model_k else NONE, dtype=np.int8)


def finish(view: StepView, source: np.ndarray) -> RulePlan:
    """The plan of a rule that verifies whole drafts: the cache draft's length or the model draft's."""
    source = np.where(view.allowed, source, NONE).astype(np.int8)
    source = np.where((source == CACHE) & (view.cache_len <= 0), NONE, source).astype(np.int8)
    k = view.model_k
    length = np.where(source == CACHE, view.cache_len, np.where(source == MODEL, k, 0)).astype(np.int64)
    return RulePlan(source, length, k if (source == MODEL).any() else 0)
