"""Offline policy simulator: decode every held-out trace under each gating policy, step by step.

One cycle is one target forward; it emits accepted + 1 tokens (the first output token comes from
prefill and costs one cycle under every policy). Cache drafts accept their oracle label; the model
drafter is SIMULATED: a chain of k_e tokens, each accepted with probability `acceptance` given the
previous ones were, drawn once per (trace, position) from a seeded generator so that every policy
faces the same luck at the same position (common random numbers).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from predictor.goodput import model_step_ms, tau_star
from predictor.profiles import CostProfile, DrafterProfile
from predictor.traces import WORKLOADS

POLICIES: tuple[str, ...] = ("none", "suffix", "model", "arctic", "hvd", "oracle")
NONE, CACHE, MODEL = 0, 1, 2


@dataclass
class Figures:
    """Per-policy outcome over a set of traces."""

    cycles_per_1k: float
    tokens_per_cycle: float
    wasted_per_1k: float
    speedup: float
    cache_share: float  # fraction of cycles that verified a cache draft

    def to_json(self) -> dict[str, float]:
        return {k: round(float(v), 4) for k, v in asdict(self).items()}


@dataclass
class Tally:
    """Tokens and decode cycles of some traces (the simulator's, and the replay engine's live ones)."""

    tokens: int = 0
    cycles: int = 0
    wasted: int = 0
    cache_cycles: int = 0
    model_cycles: int = 0
    time_ms: float = 0.0

    def add(self, other: "Tally") -> None:
        self.tokens += other.tokens
        self.cycles += other.cycles
        self.wasted += other.wasted
        self.cache_cycles += other.cache_cycles
        self.model_cycles += other.model_cycles
        self.time_ms += other.time_ms

    @property
    def cycles_per_1k(self) -> float:
        return 1000.0 * self.cycles / max(self.tokens, 1)


@dataclass
class SimInput:
    """Rows of held-out traces, each trace's rows contiguous and in position order (t = 1..L-1)."""

    trace: np.ndarray
    position: np.ndarray
    draft_len: np.ndarray
    label: np.ndarray
    score: np.ndarray
    predicted: np.ndarray
    traces: np.ndarray  # the trace indices simulated (traces of one token have no rows)
    output_len: np.ndarray  # per trace index
    trace_workload: np.ndarray  # per trace index


def model_accepted(rows: int, drafter: DrafterProfile, seed: int, workload: np.ndarray | None = None) -> np.ndarray:
    """Accepted tokens of the simulated model drafter per row: P(a >= i) = acceptance ** i, with the
    acceptance of each row's workload (index into WORKLOADS) where the profile has one."""
    u = np.random.default_rng(seed).random(rows)
    p = _row_values(drafter.acceptance_for, drafter.acceptance, rows, workload)
    with np.errstate(divide="ignore"):
        a = np.where(p > 0.0, np.floor(np.log(np.maximum(u, 1e-300)) / np.log(np.where(p > 0.0, p, 0.5))), 0.0)
    return np.minimum(a, drafter.draft_len).astype(np.int64)


def _row_values(of_workload, default: float, rows: int, workload: np.ndarray | None) -> np.ndarray:
    if workload is None:
        return np.full(rows, default, dtype=np.float64)
    table = np.array([of_workload(w) for w in WORKLOADS], dtype=np.float64)
    return table[np.asarray(workload, dtype=np.int64)]


def decisions(policy: str, data: SimInput, drafter: DrafterProfile, cost: CostProfile) -> np.ndarray:
    """What each policy verifies at each row (NONE, CACHE or MODEL)."""
    has_cache = data.draft_len > 0
    if policy == "none":
        return np.full(len(has_cache), NONE, dtype=np.int8)
    if policy == "suffix":
        return np.where(has_cache, CACHE, NONE).astype(np.int8)
    if policy == "model":
        return np.full(len(has_cache), MODEL, dtype=np.int8)
    if policy == "arctic":
        return np.where(has_cache & (data.score >= drafter.draft_len), CACHE, MODEL).astype(np.int8)
    mu_e = _row_values(drafter.mean_accepted_for, drafter.mean_accepted, len(has_cache), data.trace_workload[data.trace])
    tau = tau_star(data.draft_len, mu_e, drafter.draft_len, cost)
    if policy == "hvd":
        return np.where(has_cache & (data.predicted > tau), CACHE, MODEL).astype(np.int8)
    if policy == "oracle":
        return np.where(has_cache & (data.label > tau), CACHE, MODEL).astype(np.int8)
    raise ValueError(f"unknown policy {policy!r}; known: {POLICIES}")


def simulate(policy: str, data: SimInput, drafter: DrafterProfile, cost: CostProfile,
             model_acc: np.ndarray) -> dict[int, Tally]:
    """Decode every trace under `policy`; one Tally per trace index."""
    choice = decisions(policy, data, drafter, cost)
    accepted = np.where(choice == CACHE, data.label, np.where(choice == MODEL, model_acc, 0)).astype(np.int64)
    drafted = np.where(choice == CACHE, data.draft_len, np.where(choice == MODEL, drafter.draft_len, 0)).astype(np.int64)
    step_ms = np.where(
        choice == CACHE, cost.target_ms(1) + cost.per_token_ms * data.draft_len,
        np.where(choice == MODEL, model_step_ms(cost, drafter.draft_len), cost.target_ms(1)),
    )
    acc_l, drafted_l, ms_l, cache_l = accepted.tolist(), drafted.tolist(), step_ms.tolist(), (choice == CACHE).tolist()
    tallies: dict[int, Tally] = {}
    starts = _trace_starts(data.trace)
    for trace in data.traces.tolist():
        start = starts.get(trace, 0)
        length = int(data.output_len[trace])
        tally = Tally(tokens=length, cycles=1, time_ms=cost.target_ms(1))  # prefill emits token 0
        t = 1
        while t < length:
            r = start + t - 1
            a = min(acc_l[r], length - t)
            tally.cycles += 1
            tally.time_ms += ms_l[r]
            tally.wasted += drafted_l[r] - a
            tally.cache_cycles += cache_l[r]
            t += a + 1
        tallies[trace] = tally
    return tallies


def figures(tally: Tally, baseline_ms_per_token: float) -> Figures:
    tokens = max(tally.tokens, 1)
    return Figures(
        cycles_per_1k=1000.0 * tally.cycles / tokens,
        tokens_per_cycle=tokens / max(tally.cycles, 1),
        wasted_per_1k=1000.0 * tally.wasted / tokens,
        speedup=baseline_ms_per_token / (tally.time_ms / tokens) if tally.time_ms else 0.0,
        cache_share=tally.cache_cycles / max(tally.cycles, 1),
    )


def _trace_starts(trace: np.ndarray) -> dict[int, int]:
    """First row of each trace (rows of one trace are contiguous)."""
    if len(trace) == 0:
        return {}
    change = np.flatnonzero(np.diff(trace)) + 1
    firsts = np.concatenate(([0], change))
    return {int(trace[i]): int(i) for i in firsts}
