"""Offline policy simulator: decode every held-out trace under each policy, step by step.

One cycle is one target forward of one request; it emits accepted + 1 tokens (no more than the trace
has left; draft tokens past what it accepted count as wasted). The first output token comes from
prefill: one plain cycle (one query token, no draft) under every policy, in the request's lane like any
other cycle; the prompt itself is not priced. Cache drafts accept their oracle label (cut to the
verified length l: min(label, l)); the model drafter is SIMULATED: one draw per (trace, position) of
the accepted count of a chain at the profile's longest draft, from a seeded generator so that every
policy faces the same luck at the same position (common random numbers); a step that drafts k tokens
accepts min(draw, k).

Batch 1 decodes every trace alone. Batch b > 1 runs b lanes in lockstep: traces fill the lanes in
order as others finish, and each engine step costs `CostProfile.step_ms(active lanes, query tokens of
the step, the model draft length if any lane used the drafter)`. Policies with a fixed plan per row
(everything but the allocator at batch > 1) walk each trace once and are then laid on the lanes; the
allocator (`hvd`, `oracle-length`) is asked once per engine step for the whole batch, with
`predictor.decision.allocator.allocate`, the code the runtime runs.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from predictor.decision.allocator import AUTO, FORCE_NONE, allocate, allocate_each
from predictor.decision.binary_rule import model_beats_plain, thresholds
from predictor.decision.profiles import CostProfile, DrafterProfile, accepted_from_survival, known_survival
from predictor.decision.rivals import RIVAL_RULES, Outcome, StepView, make_rival
from storage.workloads import WORKLOADS

RIVALS: tuple[str, ...] = tuple(RIVAL_RULES)  # the competitors' rules (predictor.decision.rivals), decided online
POLICIES: tuple[str, ...] = ("none", "suffix", "model", "arctic", *RIVALS, "hvd", "hvd-binary", "oracle", "oracle-length")
ALLOCATED: tuple[str, ...] = ("hvd", "oracle-length")  # decided by predictor.decision.allocator
RIVAL_LANES_B1 = 64  # batch 1: this many one-request engines advance in lockstep, one rule learning from all
# (cost profile, batch size) pairs the report gives ms_per_1k for.
SETTINGS: tuple[tuple[str, int], ...] = (("cpu-smollm2", 1), ("cpu-smollm2", 8), ("gpu-8b", 1), ("gpu-8b", 64))
NONE, CACHE, MODEL = 0, 1, 2
_CHUNK = 1 << 16  # rows per allocate_each call: bounds the (rows x K) float64 temporaries


def setting_name(cost: CostProfile, batch: int) -> str:
    return f"{cost.name}/b{batch}"


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
    """Tokens and decode cycles of some traces (the simulator's, and the replay engine's live ones).
    For a lockstep run at batch b > 1, `cycles` counts engine steps and `time_ms` sums their cost.
    `first_tokens` and `first_ms` are the tokens and time of the steps in which some request took its
    prefill cycle: left out, the rest is what an engine's decode-only steps measure (decode_ms_per_1k)."""

    tokens: int = 0
    cycles: int = 0
    wasted: int = 0
    cache_cycles: int = 0
    model_cycles: int = 0
    time_ms: float = 0.0
    first_tokens: int = 0
    first_ms: float = 0.0

    def add(self, other: "Tally") -> None:
        self.tokens += other.tokens
        self.cycles += other.cycles
        self.wasted += other.wasted
        self.cache_cycles += other.cache_cycles
        self.model_cycles += other.model_cycles
        self.time_ms += other.time_ms
        self.first_tokens += other.first_tokens
        self.first_ms += other.first_ms

    @property
    def cycles_per_1k(self) -> float:
        return 1000.0 * self.cycles / max(self.tokens, 1)

    @property
    def ms_per_1k(self) -> float:
        return 1000.0 * self.time_ms / max(self.tokens, 1)

    @property
    def decode_ms_per_1k(self) -> float:
        """Engine ms per 1000 tokens over the steps without a prefill cycle in them."""
        return 1000.0 * (self.time_ms - self.first_ms) / max(self.tokens - self.first_tokens, 1)


@dataclass
class SimInput:
    """Rows of held-out traces, each trace's rows contiguous and in position order (t = 1..L-1)."""

    trace: np.ndarray
    position: np.ndarray
    draft_len: np.ndarray
    label: np.ndarray
    score: np.ndarray
    predicted: np.ndarray  # the gate's expected accepted length per row
    traces: np.ndarray  # the trace indices simulated (traces of one token have no rows)
    output_len: np.ndarray  # per trace index
    trace_workload: np.ndarray  # per trace index
    survival: np.ndarray | None = None  # (rows, K) the gate's S(j) per row; None: a point-estimate gate
    # What the competitors' rules read: the suffix match length and (rows, K) each draft token's
    # probability given the ones before it (predictor.decision.rivals.step_view.conditional_matrix).
    match_len: np.ndarray | None = None
    token_prob: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.trace)
        for name in ("position", "draft_len", "label", "score", "predicted"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SimInput.{name} has {len(getattr(self, name))} rows, trace has {n}")
        if self.survival is not None and (self.survival.ndim != 2 or len(self.survival) != n):
            raise ValueError(f"SimInput.survival must be (rows, K) with {n} rows, got shape {self.survival.shape}")
        if self.match_len is not None and len(self.match_len) != n:
            raise ValueError(f"SimInput.match_len has {len(self.match_len)} rows, trace has {n}")
        if self.token_prob is not None and (self.token_prob.ndim != 2 or len(self.token_prob) != n):
            raise ValueError(f"SimInput.token_prob must be (rows, K) with {n} rows, got shape {self.token_prob.shape}")


@dataclass(frozen=True)
class Plan:
    """What a policy verifies at each row, fixed per row: NONE/CACHE/MODEL and how many draft tokens
    (the cache prefix, or the model draft length k)."""

    source: np.ndarray  # int8
    length: np.ndarray  # int64


@dataclass(frozen=True)
class Walk:
    """Every cycle of every trace under a fixed plan, grouped by trace (in `SimInput.traces` order),
    each trace's cycles in order; cycle 0 is the prefill."""

    trace: np.ndarray
    index: np.ndarray  # the cycle's number within its trace
    query: np.ndarray  # query tokens: 1 + the draft tokens verified
    model_k: np.ndarray  # the model draft length the cycle used (0: the drafter was not called)
    emitted: np.ndarray
    wasted: np.ndarray
    cache: np.ndarray  # bool: verified a cache draft


def model_accepted(rows: int, drafter: DrafterProfile, seed: int, workload: np.ndarray | None = None) -> np.ndarray:
    """Accepted tokens of the simulated model drafter per row, drawn from the survival curve of each
    row's workload (index into WORKLOADS; the profile's overall curve without one)."""
    u = np.random.default_rng(seed).random(rows)
    if workload is None:
        return accepted_from_survival(drafter.survival_for(""), u)
    return accepted_from_survival(model_curves(drafter)[np.asarray(workload, dtype=np.int64)], u)


def _row_values(of_workload, default: float, rows: int, workload: np.ndarray | None) -> np.ndarray:
    if workload is None:
        return np.full(rows, default, dtype=np.float64)
    table = np.array([of_workload(w) for w in WORKLOADS], dtype=np.float64)
    return table[np.asarray(workload, dtype=np.int64)]


def model_curves(drafter: DrafterProfile) -> np.ndarray:
    """(len(WORKLOADS), draft_len): the drafter's survival curve per workload, the allocator's input."""
    return np.stack([drafter.survival_for(w) for w in WORKLOADS])


def decisions(policy: str, data: SimInput, drafter: DrafterProfile, cost: CostProfile, batch: int = 1) -> np.ndarray:
    """What each fixed-plan policy verifies at each row (NONE, CACHE or MODEL), whole drafts."""
    has_cache = data.draft_len > 0
    rows = len(has_cache)
    if policy == "none":
        return np.full(rows, NONE, dtype=np.int8)
    if policy == "suffix":
        return np.where(has_cache, CACHE, NONE).astype(np.int8)
    if policy == "model":
        return np.full(rows, MODEL, dtype=np.int8)
    if policy == "arctic":
        return np.where(has_cache & (data.score >= drafter.draft_len), CACHE, MODEL).astype(np.int8)
    if policy in ("hvd-binary", "oracle"):
        tau, fallback = binary_rule(data, drafter, cost, batch)
        value = data.predicted if policy == "hvd-binary" else data.label
        return np.where(has_cache & (value > tau), CACHE, fallback).astype(np.int8)
    raise ValueError(f"unknown fixed-plan policy {policy!r}; known: {POLICIES} ({ALLOCATED} need plan())")


def binary_rule(data: SimInput, drafter: DrafterProfile, cost: CostProfile, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """tau and the fallback per row under the binary goodput rule, priced as the runtime prices it: a
    request's share of a step at this batch size (CostProfile.per_request). The fallback is the model
    drafter unless a plain step beats it (then tau is against a plain step): predictor.decision.binary_rule,
    the runtime's code."""
    share = cost.per_request(batch)
    k_e = drafter.draft_len
    mu_e = _row_values(drafter.mean_accepted_for, drafter.mean_accepted, len(data.trace), data.trace_workload[data.trace])
    beats = model_beats_plain(mu_e, k_e, share)
    return thresholds(data.draft_len, mu_e, beats, k_e, share), np.where(beats, MODEL, NONE).astype(np.int8)


class Simulator:
    """Every policy on one SimInput and one model drafter (one draw per row), with the fixed plans'
    walks kept so that each is walked once whatever the number of settings it is priced in."""

    def __init__(self, data: SimInput, drafter: DrafterProfile, model_acc: np.ndarray) -> None:
        if len(model_acc) != len(data.trace):
            raise ValueError(f"model_acc has {len(model_acc)} rows, the input {len(data.trace)}")
        self.data = data
        self.drafter = drafter
        self.model_acc = np.asarray(model_acc, dtype=np.int64)
        self._curves = model_curves(drafter)
        self._row_workload = np.asarray(data.trace_workload, dtype=np.int64)[data.trace]
        self._start = trace_starts(data)
        self._order = np.full(len(data.output_len), -1, dtype=np.int64)  # trace index -> place in data.traces
        self._order[data.traces] = np.arange(len(data.traces))
        self._walks: dict[tuple, Walk] = {}
        self._rival_runs: dict[tuple, tuple[Tally, dict[int, Tally]]] = {}
        self.seed = 0
        self._cache_width = max(int(data.draft_len.max(initial=0)), 1)

    def uses_allocator(self, policy: str) -> bool:
        """`hvd` with a point-estimate gate falls back to the binary rule."""
        return policy == "oracle-length" or (policy == "hvd" and self.data.survival is not None)

    def plan(self, policy: str, cost: CostProfile, batch: int = 1) -> Plan:
        """The per-row plan: fixed-plan policies at any batch size, the allocator's at batch 1 only."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {POLICIES}")
        if policy in RIVALS:
            raise ValueError(f"{policy} learns as it decides: it has no fixed plan (use per_trace() or lanes())")
        if policy == "hvd" and not self.uses_allocator(policy):
            policy = "hvd-binary"
        if policy in ALLOCATED:
            if batch != 1:
                raise ValueError(f"{policy} decides per engine step at batch {batch}: use lanes()")
            return self._allocated_plan(policy, cost)
        source = decisions(policy, self.data, self.drafter, cost, batch)
        length = np.where(source == CACHE, self.data.draft_len, np.where(source == MODEL, self.drafter.draft_len, 0))
        return Plan(source, length.astype(np.int64))

    def _allocated_plan(self, policy: str, cost: CostProfile) -> Plan:
        n = len(self.data.trace)
        source = np.zeros(n, dtype=np.int8)
        length = np.zeros(n, dtype=np.int64)
        for lo in range(0, n, _CHUNK):
            rows = np.arange(lo, min(lo + _CHUNK, n))
            s, lengths, se = self._inputs(policy, rows)
            a = allocate_each(s, lengths, se, cost)
            source[rows], length[rows] = a.source, a.length
        return Plan(source, length)

    def _inputs(self, policy: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The allocator's inputs for some rows: cache survival, cache lengths, model survival. For
        oracle-length the curves are the truth: 1 up to the accepted length, then 0."""
        lengths = self.data.draft_len[rows]
        if policy == "hvd":
            return self.data.survival[rows], lengths, self._curves[self._row_workload[rows]]
        s = known_survival(self.data.label[rows], self._cache_width)
        se = known_survival(self.model_acc[rows], self.drafter.draft_len)
        return s, lengths, se

    def walk(self, policy: str, cost: CostProfile, batch: int = 1) -> Walk:
        """Every cycle of every trace under the policy's fixed plan (kept: plans that do not depend on
        the cost profile or the batch size are walked once)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {POLICIES}")
        if policy in ("none", "suffix", "model", "arctic"):
            key: tuple = (policy,)
        elif self.uses_allocator(policy):
            key = (policy, cost)
        else:  # the binary rule prices at the per-request share of the step
            key = ("hvd-binary" if policy == "hvd" else policy, cost.per_request(batch))
        if key not in self._walks:
            self._walks[key] = walk(self.plan(policy, cost, batch), self.data, self.model_acc)
        return self._walks[key]

    def per_trace(self, policy: str, cost: CostProfile, decide: CostProfile | None = None) -> dict[int, Tally]:
        """Batch 1: one Tally per trace index, every cycle priced with `cost`; the policy decides with
        `decide` if given (what a replica decides with before its live fit, priced at what steps cost)."""
        if policy in RIVALS:
            return self._rival_run(policy, cost, 1, self.data.traces, decide or cost)[1]
        w = self.walk(policy, decide or cost, 1)
        ms = np.asarray(cost.step_ms(1, w.query, w.model_k), dtype=np.float64)
        slots = len(self.data.traces)
        place = self._order[w.trace]

        def per(values: np.ndarray) -> list:
            return np.bincount(place, weights=values, minlength=slots).tolist()

        cycles = np.bincount(place, minlength=slots).tolist()
        tokens, wasted, cache, model, time = (per(w.emitted), per(w.wasted), per(w.cache), per(w.model_k > 0), per(ms))
        first = w.index == 0
        first_tokens, first_ms = per(np.where(first, w.emitted, 0)), per(np.where(first, ms, 0.0))
        return {int(t): Tally(tokens=int(round(tokens[i])), cycles=cycles[i], wasted=int(round(wasted[i])),
                              cache_cycles=int(round(cache[i])), model_cycles=int(round(model[i])), time_ms=time[i],
                              first_tokens=int(round(first_tokens[i])), first_ms=first_ms[i])
                for i, t in enumerate(self.data.traces.tolist())}

    def lanes(self, policy: str, cost: CostProfile, batch: int, traces: Sequence[int] | np.ndarray,
              decide: CostProfile | None = None) -> Tally:
        """Batch `batch`: the given traces (indices, in arrival order) on `batch` lanes in lockstep.
        One Tally: tokens, engine steps (`cycles`), rejected draft tokens, request-cycles that verified
        a cache / model draft, and the engine time, every step priced with `cost`; the policy decides
        with `decide` if given, else with `cost`."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        traces = np.asarray(traces, dtype=np.int64)
        if len(traces) and (traces.min() < 0 or traces.max() >= len(self._order) or self._order[traces].min() < 0):
            raise ValueError("lanes(): every trace must be one of the SimInput's traces")
        if policy in RIVALS:
            return self._rival_run(policy, cost, batch, traces, decide or cost)[0]
        if batch > 1 and self.uses_allocator(policy):
            return self._allocated_lanes(policy, cost, batch, traces, decide or cost)
        return _fixed_lanes(self.walk(policy, decide or cost, batch), traces, len(self._order), cost, batch)

    def _allocated_lanes(self, policy: str, cost: CostProfile, batch: int, traces: np.ndarray,
                         decide: CostProfile) -> Tally:
        """The allocator at every engine step, for the lanes' current rows at once."""
        data, out = self.data, Tally()
        length_of, start, label, draw = data.output_len, self._start, data.label, self.model_acc
        engine = Lanes(batch, traces, length_of)
        while (step := engine.running()) is not None:
            trace, t = step
            n = len(trace)
            decode = t > 0
            if not decode.any():  # every lane is on its prefill cycle: a plain step
                engine.advance(np.zeros(n, dtype=np.int64))
                ms = float(cost.step_ms(n, n))
                out.tokens += n
                out.cycles += 1
                out.time_ms += ms
                out.first_tokens += n
                out.first_ms += ms
                continue
            rows = np.where(decode, start[trace] + t - 1, 0)
            s, lengths, se = self._inputs(policy, rows)
            lengths = np.where(decode, lengths, 0)
            s = s[:, : max(int(lengths.max()), 1)]  # nothing past the step's longest draft counts
            mode = np.where(decode, AUTO, FORCE_NONE).astype(np.int8)
            a = allocate(s, lengths, se, decide, mode)
            left = length_of[trace] - t
            accepted = np.where(a.source == CACHE, np.minimum(label[rows], a.length),
                                np.where(a.source == MODEL, np.minimum(draw[rows], a.length), 0))
            accepted = np.where(decode, np.minimum(accepted, left), 0)
            engine.advance(accepted)
            tokens = int(np.where(decode, np.minimum(accepted + 1, left), 1).sum())
            ms = float(cost.step_ms(n, n + int(a.length.sum()), a.model_k))
            out.tokens += tokens
            out.cycles += 1
            out.wasted += int((a.length - accepted).sum())
            out.cache_cycles += int(np.count_nonzero(a.source == CACHE))
            out.model_cycles += int(np.count_nonzero(a.source == MODEL))
            out.time_ms += ms
            if not decode.all():
                out.first_tokens += tokens
                out.first_ms += ms
        return out

    def _rival_run(self, policy: str, cost: CostProfile, batch: int, traces: np.ndarray,
                   decide: CostProfile) -> tuple[Tally, dict[int, Tally]]:
        """A competitor's rule, cold, deciding every engine step and learning from what it verified
        (min(label, verified) for a cache prefix, the drawn acceptance for the model draft): at
        batch b one engine of b lanes, at batch 1 RIVAL_LANES_B1 one-request engines in lockstep,
        each step priced alone. The Tally of all, and one per trace (batch 1's figures)."""
        traces = np.asarray(traces, dtype=np.int64)
        key = (policy, cost, batch, decide, traces.tobytes())
        if key in self._rival_runs:
            return self._rival_runs[key]
        data = self.data
        if data.match_len is None or data.token_prob is None:
            raise ValueError(f"{policy} needs SimInput.match_len and SimInput.token_prob (what its engine reads)")
        rule = make_rival(policy, self.seed)
        slots = len(self._order)
        acc = {name: np.zeros(slots) for name in ("tokens", "cycles", "wasted", "cache", "model", "ms", "ftok", "fms")}
        out = Tally()
        width = batch if batch > 1 else RIVAL_LANES_B1
        length_of, start, label, draw = data.output_len, self._start, data.label, self.model_acc
        engine = Lanes(width, traces, length_of)
        while (step := engine.running()) is not None:
            trace, t = step
            n = len(trace)
            decode = t > 0
            if decode.any():
                rows = np.where(decode, start[trace] + t - 1, 0)
                cache_len = np.where(decode, data.draft_len[rows], 0).astype(np.int64)
                view = StepView(cache_len, np.where(decode, data.match_len[rows], 0).astype(np.int64),
                                np.where(decode, data.score[rows], 0.0).astype(np.float64),
                                data.token_prob[rows].astype(np.float64), decode,
                                self._curves[self._row_workload[rows]], batch)
                plan = rule.plan(view, decide)
                source, length, model_k = plan.source, plan.length, plan.model_k
                verified_acc = np.where(source == CACHE, np.minimum(label[rows], length),
                                        np.where(source == MODEL, np.minimum(draw[rows], length), 0))
                rule.learn(Outcome(source, length, verified_acc, view.token_prob, steps=n if batch == 1 else 1))
            else:  # every lane on its prefill cycle: a plain step, nothing to decide
                source, length, model_k = np.zeros(n, np.int8), np.zeros(n, np.int64), 0
                verified_acc = np.zeros(n, np.int64)
            left = length_of[trace] - t
            accepted = np.where(decode, np.minimum(verified_acc, left), 0)
            engine.advance(accepted)
            emitted = np.where(decode, np.minimum(accepted + 1, left), 1)
            is_cache, is_model = source == CACHE, source == MODEL
            if batch == 1:
                ms = np.asarray(cost.step_ms(1, 1 + length, np.where(is_model, length, 0)), dtype=np.float64)
                for name, v in (("tokens", emitted), ("cycles", 1), ("wasted", length - accepted), ("cache", is_cache),
                                ("model", is_model), ("ms", ms), ("ftok", np.where(decode, 0, emitted)),
                                ("fms", np.where(decode, 0.0, ms))):
                    np.add.at(acc[name], trace, v)
                continue
            ms = float(cost.step_ms(n, n + int(length.sum()), model_k))
            tokens = int(emitted.sum())
            out.tokens += tokens
            out.cycles += 1
            out.wasted += int((length - accepted).sum())
            out.cache_cycles += int(np.count_nonzero(is_cache))
            out.model_cycles += int(np.count_nonzero(is_model))
            out.time_ms += ms
            if not decode.all():
                out.first_tokens += tokens
                out.first_ms += ms
        per: dict[int, Tally] = {}
        if batch == 1:
            for t in traces.tolist():
                per[t] = Tally(tokens=int(acc["tokens"][t]), cycles=int(acc["cycles"][t]), wasted=int(acc["wasted"][t]),
                               cache_cycles=int(acc["cache"][t]), model_cycles=int(acc["model"][t]),
                               time_ms=float(acc["ms"][t]), first_tokens=int(acc["ftok"][t]), first_ms=float(acc["fms"][t]))
                out.add(per[t])
        self._rival_runs[key] = (out, per)
        return out, per


class Lanes:
    """`width` engine lanes in lockstep, taking traces in arrival order: each step, the running
    lanes' traces and their positions (0: the prefill cycle); then how many tokens each accepted."""

    def __init__(self, width: int, traces: np.ndarray, output_len: np.ndarray) -> None:
        self.trace = np.full(width, -1, dtype=np.int64)
        self.t = np.zeros(width, dtype=np.int64)
        self._traces, self._output_len, self._queued = traces, output_len, 0
        self._lanes = np.zeros(0, dtype=np.int64)

    def running(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Free lanes take the next traces; (trace, position) per running lane, None when all are done."""
        free = np.flatnonzero(self.trace < 0)
        take = min(len(free), len(self._traces) - self._queued)
        if take:
            self.trace[free[:take]] = self._traces[self._queued : self._queued + take]
            self.t[free[:take]] = 0
            self._queued += take
        self._lanes = np.flatnonzero(self.trace >= 0)
        if not len(self._lanes):
            return None
        return self.trace[self._lanes], self.t[self._lanes]

    def advance(self, accepted: np.ndarray) -> None:
        """The running lanes emitted accepted + 1 tokens each; a finished trace frees its lane."""
        lanes = self._lanes
        self.t[lanes] += accepted + 1
        self.trace[lanes[self.t[lanes] >= self._output_len[self.trace[lanes]]]] = -1


def trace_starts(data: SimInput) -> np.ndarray:
    """Per trace index, its first row (the rows of one trace are contiguous; 0 for traces without rows)."""
    start = np.zeros(len(data.output_len), dtype=np.int64)
    if len(data.trace):
        firsts = np.concatenate(([0], np.flatnonzero(np.diff(data.trace)) + 1))
        start[data.trace[firsts]] = firsts
    return start


def walk(plan: Plan, data: SimInput, model_acc: np.ndarray) -> Walk:
    """All traces advance together, one cycle per round; a trace leaves when it has emitted its length."""
    n_traces = len(data.traces)
    trace_ids = np.asarray(data.traces, dtype=np.int64)
    total = np.asarray(data.output_len, dtype=np.int64)[trace_ids]
    start = trace_starts(data)[trace_ids]
    is_cache = plan.source == CACHE
    accepted = np.where(is_cache, np.minimum(data.label, plan.length),
                        np.where(plan.source == MODEL, np.minimum(model_acc, plan.length), 0)).astype(np.int64)
    model_k = np.where(plan.source == MODEL, plan.length, 0).astype(np.int64)
    parts: list[tuple[np.ndarray, ...]] = [(np.arange(n_traces), np.zeros(n_traces, np.int64), np.ones(n_traces, np.int64),
                                           np.zeros(n_traces, np.int64), np.ones(n_traces, np.int64),
                                           np.zeros(n_traces, np.int64), np.zeros(n_traces, bool))]
    who = np.flatnonzero(total > 1)
    t = np.ones(len(who), dtype=np.int64)
    cycle = 1
    while len(who):
        r = start[who] + t - 1
        left = total[who] - t
        a = np.minimum(accepted[r], left)
        k = plan.length[r]
        parts.append((who, np.full(len(who), cycle), 1 + k, model_k[r], np.minimum(a + 1, left), k - a, is_cache[r]))
        t += a + 1
        going = t < total[who]
        who, t = who[going], t[going]
        cycle += 1
    place, index, query, mk, emitted, wasted, cache = (np.concatenate(c) for c in zip(*parts))
    order = np.lexsort((index, place))
    return Walk(trace_ids[place[order]], index[order], query[order], mk[order], emitted[order], wasted[order],
                cache[order])


def _fixed_lanes(w: Walk, traces: np.ndarray, trace_ids: int, cost: CostProfile, batch: int) -> Tally:
    """Lay the walked traces on `batch` lanes (each next trace takes the first lane to free up) and
    price every engine step."""
    out = Tally()
    if not len(traces):
        return out
    rank = np.full(trace_ids, -1, dtype=np.int64)
    rank[traces] = np.arange(len(traces))
    pick = rank[w.trace] >= 0
    w_rank, index = rank[w.trace[pick]], w.index[pick]
    cycles = np.bincount(w_rank, minlength=len(traces))
    begin = np.zeros(len(traces), dtype=np.int64)
    free = [0] * min(batch, len(traces))  # the step each lane is free from
    for i, c in enumerate(cycles.tolist()):
        at = heapq.heappop(free)
        begin[i] = at
        heapq.heappush(free, at + c)
    step = begin[w_rank] + index
    steps = int(step.max()) + 1
    active = np.bincount(step, minlength=steps)
    query = np.bincount(step, weights=w.query[pick], minlength=steps)
    model_k = np.zeros(steps, dtype=np.int64)
    np.maximum.at(model_k, step, w.model_k[pick])
    step_ms = np.zeros(steps, dtype=np.float64)
    for n in np.unique(active).tolist():
        at = active == n
        step_ms[at] = cost.step_ms(n, query[at], model_k[at])
    first = np.bincount(step, weights=index == 0, minlength=steps) > 0  # a request's prefill cycle is in the step
    emitted = w.emitted[pick]
    out.tokens = int(emitted.sum())
    out.first_tokens = int(emitted[first[step]].sum())
    out.first_ms = float(step_ms[first].sum())
    time = float(step_ms.sum())
    out.cycles = steps
    out.wasted = int(w.wasted[pick].sum())
    out.cache_cycles = int(np.count_nonzero(w.cache[pick]))
    out.model_cycles = int(np.count_nonzero(w.model_k[pick]))
    out.time_ms = time
    return out


def simulate(policy: str, data: SimInput, drafter: DrafterProfile, cost: CostProfile,
             model_acc: np.ndarray) -> dict[int, Tally]:
    """Decode every trace alone (batch 1) under `policy`; one Tally per trace index."""
    return Simulator(data, drafter, model_acc).per_trace(policy, cost)


def figures(tally: Tally, baseline_ms_per_token: float) -> Figures:
    tokens = max(tally.tokens, 1)
    return Figures(
        cycles_per_1k=1000.0 * tally.cycles / tokens,
        tokens_per_cycle=tokens / max(tally.cycles, 1),
        wasted_per_1k=1000.0 * tally.wasted / tokens,
        speedup=baseline_ms_per_token / (tally.time_ms / tokens) if tally.time_ms else 0.0,
        cache_share=tally.cache_cycles / max(tally.cycles, 1),
    )
