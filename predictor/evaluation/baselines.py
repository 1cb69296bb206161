"""What the same traffic costs served three ways: as HVD served it, by the suffix cache alone, and by
the model drafter alone, in simulated milliseconds per 1000 tokens under a cost profile.

Tokens per cycle alone flatters long drafts: a cycle that verifies 24 draft tokens costs more than one
that verifies none, and the model drafter costs a call per step. Here every cycle is priced by the
cost profile (a request's share of a step at a nominal batch size), so the Overview's speedup counts
verification and drafting. The baselines are counterfactuals from the hindsight labels: every cache
draft's exact accepted length is known, verified or not, and the cache drafts in the shadow of each
output position let the suffix-alone trajectory be walked exactly; the model drafter's acceptance
is known only where it ran, so its baseline uses its observed mean per workload (else the drafter
profile's prior) at its draft length.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from predictor.decision.profiles import CostProfile, DrafterProfile


@dataclass(frozen=True)
class PathCost:
    """One way of serving: its exact counts and its simulated time."""

    name: str
    tokens: int
    cycles: int
    query_tokens: int  # verified per request-cycle: 1 + the draft tokens verified
    model_calls: int
    model_positions: int
    ms: float

    @property
    def ms_per_1k(self) -> float | None:
        return None if not self.tokens else 1000.0 * self.ms / self.tokens

    @property
    def tokens_per_cycle(self) -> float | None:
        return None if not self.cycles else self.tokens / self.cycles

    def speedup_over(self, other: "PathCost") -> float | None:
        """How much faster per token this path is than `other` (> 1: faster)."""
        mine, theirs = self.ms_per_1k, other.ms_per_1k
        return None if not mine or theirs is None else theirs / mine


def cycle_ms(profile: CostProfile, batch: int, query_tokens: float) -> float:
    """One request's share of a step at `batch` running requests that each verify `query_tokens`."""
    base, per_query = profile.step_line(batch)
    b = max(batch, 1)
    step = max(base + per_query * b * query_tokens, profile.compute_ms_per_token * b * query_tokens)
    return step / b


def path_cost(name: str, profile: CostProfile, batch: int, tokens: int, cycles: int, draft_tokens: int,
              model_calls: int = 0, model_positions: int = 0) -> PathCost:
    """Price `cycles` verifying `draft_tokens` draft tokens in all (their mean per cycle), plus the
    model drafter's calls (each a share of one call for the batch)."""
    query = cycles + draft_tokens
    ms = cycles * cycle_ms(profile, batch, query / cycles) if cycles else 0.0
    if model_calls:
        ms += model_calls * float(profile.draft_ms(batch, model_positions / model_calls)) / max(batch, 1)
    return PathCost(name, tokens, cycles, query, model_calls, model_positions, ms)


def no_speculation(profile: CostProfile, batch: int, tokens: int) -> PathCost:
    return path_cost("no speculation", profile, batch, tokens, tokens, 0)


class LabelledDraft(NamedTuple):
    """A cache draft made at an output position (decision point or shadow), with its hindsight label."""

    request_id: str
    position: int
    draft_len: int
    accepted: int


def suffix_alone(drafts: Sequence[LabelledDraft | tuple[str, int, int, int]], profile: CostProfile, batch: int) -> PathCost:
    """Walk each request from its first to its last drafted position verifying the whole cache draft
    at every step (no draft at a position: a plain decode step): what the suffix cache alone would
    have done on the same outputs."""
    by_request: dict[str, dict[int, LabelledDraft]] = {}
    for d in map(LabelledDraft._make, drafts):
        by_request.setdefault(d.request_id, {})[d.position] = d
    tokens = cycles = draft_tokens = 0
    for at in by_request.values():
        p, last = min(at), max(at)
        while p <= last:
            d = at.get(p)
            gained = 1 if d is None else min(d.accepted, d.draft_len) + 1
            draft_tokens += 0 if d is None else d.draft_len
            tokens += gained
            cycles += 1
            p += gained
    return path_cost("suffix cache alone", profile, batch, tokens, cycles, draft_tokens)


def model_alone(tokens_by_workload: Mapping[str, int], observed: Mapping[str, tuple[int, int]],
                prior: DrafterProfile, profile: CostProfile, batch: int) -> tuple[PathCost, dict[str, str]]:
    """The model drafter at its draft length k on every step, each workload's tokens at its observed
    mean accepted tokens per draft (`observed`: workload -> (drafts, accepted tokens)) or, with no
    observation, the drafter profile's prior. Returns the cost and where each workload's mean came from."""
    k = prior.draft_len
    tokens = cycles = 0
    source: dict[str, str] = {}
    for workload, n in tokens_by_workload.items():
        drafts, accepted = observed.get(workload, (0, 0))
        if drafts:
            mean = accepted / drafts
            source[workload] = f"observed over {drafts:,} drafts"
        else:
            mean = prior.mean_accepted_for(workload)
            source[workload] = f"prior ({prior.name})"
        tokens += n
        cycles += round(n / (1.0 + min(mean, k)))
    return path_cost("model drafter alone", profile, batch, tokens, cycles, cycles * k, cycles, cycles * k), source
