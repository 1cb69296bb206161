"""The per-step runtime every engine calls: one call per engine step for the whole batch.

In: the running requests (id, tokens sampled since the last step, prompt on first sight, tenant,
workload, opt-out) and the requests that finished. Out: per request, the draft to verify and its
source (cache, model drafter, or none), the gate's prediction and the tau it was held to.

Per step: each request's realised tokens go into the suffix cache and label the drafts they cover
(hindsight); every speculating request gets one cache lookup; the features of all cache drafts form
one matrix and the gate runs once over it; the decision is one vectorised comparison. Labelled
events go onto a bounded queue and never wait for SQL.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.core.decision import (CACHE, MODEL, NONE, OFF_CACHE, OFF_MODEL, SOURCE_NAMES, DecisionConfig, decide,
                                 fallback_sources, rule_thresholds)
from controller.core.events import DRAFTER_CACHE, DRAFTER_MODEL, EventQueue, LabelledEvent
from controller.core.request_state import CacheDraftRecord, ModelDraftRecord, RequestState
from predictor.cache_drafter import CacheDrafter, SuffixConfig
from predictor.features import DraftColumns, HistoryColumns, draft_features
from predictor.mlp import GatePredictor
from predictor.tokens import TokenClasses
from predictor.traces import WORKLOADS
from storage.overrides import OverrideSnapshot


class RequestInputError(ValueError):
    """A request the runtime cannot take: unknown workload, first sight without a prompt."""


@dataclass(slots=True)
class RequestInput:
    req_id: str
    new_tokens: Sequence[int] | np.ndarray  # sampled since the last step (first step: the prefill token)
    prompt: Sequence[int] | np.ndarray | None = None  # required the first time a request is seen
    tenant: str = "default"
    workload: str = "chat"
    speculate: bool = True  # per-request opt-out


@dataclass
class StepPlan:
    req_ids: list[str]
    source: np.ndarray  # int8 per request: NONE, CACHE or MODEL
    drafts: list[list[int]]  # the cache draft for CACHE rows, [] otherwise (the engine drafts MODEL rows)
    predicted: np.ndarray  # float32, NaN where no cache draft was scored
    tau: np.ndarray  # float32, NaN where no cache draft was scored
    cache_len: np.ndarray  # int: length of the cache draft that was considered (0 if none)
    cache_drafts: list[list[int]] = field(default_factory=list)  # every request's cache draft, verified or not

    def rows(self, source: int) -> list[int]:
        return np.flatnonzero(self.source == source).tolist()


@dataclass
class RuntimeStats:
    steps: int = 0
    requests_seen: int = 0
    cache_drafts: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: {"cache": 0, "model": 0, "none": 0})
    model_accepted: int = 0
    model_drafts: int = 0


class Runtime:
    def __init__(self, gate: GatePredictor, classes: TokenClasses, decision: DecisionConfig | None = None,
                 events: EventQueue | None = None, version_id: int | None = None,
                 suffix: SuffixConfig | None = None, clock=time.time,
                 drafter_factory: Callable[[SuffixConfig | None], CacheDrafter] = CacheDrafter,
                 dense_history: bool = True, stats_sink=None) -> None:
        self.gate = gate
        self.version_id = version_id
        self.classes = classes
        self.decision = decision or DecisionConfig()
        self.events = events if events is not None else EventQueue()
        self._drafter_factory = drafter_factory
        # Draft (in the shadow) at every output position, not only where steps land, so live
        # features match the dense replay the predictor learned from; costs one more suffix
        # lookup per accepted token.
        self.dense_history = dense_history
        self._deferred: list[tuple[RequestState, CacheDraftRecord]] = []
        # Tokens and cycles per (tenant, workload), handed to the statistics writer once per step.
        self.stats_sink = stats_sink
        self._emitted: dict[tuple[str, str], list[int]] = {}
        self.drafter = drafter_factory(suffix)
        self.requests: dict[str, RequestState] = {}
        self.stats = RuntimeStats()
        # Live mean accepted length of the model drafter, per workload.
        self.mu_e = {w: self.decision.prior_model_mean(w) for w in WORKLOADS}
        self.controls = Controls()
        self._clock = clock

    def set_controls(self, controls: "Controls") -> None:
        """New learned corrections and overrides (from the control poller), used from the next step."""
        self.controls = controls

    def set_gate(self, gate: GatePredictor, version_id: int | None) -> None:
        """Swap the predictor between steps (a new champion); in-flight drafts keep their version."""
        self.gate, self.version_id = gate, version_id

    # ---------------------------------------------------------------- the step
    def step(self, inputs: Sequence[RequestInput], finished: Sequence[str] = ()) -> StepPlan:
        for req_id in finished:
            self.finish(req_id)
        n = len(inputs)
        self.stats.steps += 1
        speculating = self.decision.speculation_allowed(n)
        rows = _DraftRows()
        main_row = np.full(n, -1, dtype=np.int64)  # the row of each request's draft at its current position
        states = []
        for i, inp in enumerate(inputs):
            st = self._observe(inp, rows if (self.dense_history and inp.speculate and speculating) else None)
            states.append(st)
            if inp.speculate and speculating:
                main_row[i] = self._draft_row(st, rows, shadow=False)
        lengths = np.zeros(n, dtype=np.int64)
        predicted = np.full(n, np.nan, dtype=np.float32)
        if rows.count:
            x = rows.features(self.classes)
            row_pred = self.gate.predict(x)
            has_row = main_row >= 0
            lengths[has_row] = rows.lengths[main_row[has_row]]
            predicted[has_row] = row_pred[main_row[has_row]]
        allowed = np.array([st.speculate for st in states], dtype=bool) & speculating
        if self.decision.rule == "arctic":
            plan_source, tau = self._decide_arctic(rows, main_row, lengths, allowed)
        else:
            plan_source, tau = self._decide(states, predicted, lengths, allowed)
        if rows.count:
            self._record(rows, x, row_pred, main_row, plan_source, tau)
        self._emit_deferred()
        for i, st in enumerate(states):
            self.stats.decisions[SOURCE_NAMES[int(plan_source[i])]] += 1
            if plan_source[i] == MODEL:
                st.model_draft = ModelDraftRecord(st.output_len, self.decision.model_draft_len)
        cache_drafts = [rows.drafts[main_row[i]] if main_row[i] >= 0 else [] for i in range(n)]
        drafts = [cache_drafts[i] if plan_source[i] == CACHE else [] for i in range(n)]
        self._report_emitted()
        return StepPlan([st.req_id for st in states], plan_source, drafts, predicted, tau, lengths, cache_drafts)

    def finish(self, req_id: str, last_tokens: Sequence[int] | np.ndarray = ()) -> None:
        """The request ended (after emitting `last_tokens`, if the engine has not reported them):
        label its remaining drafts with what was realised, and forget it."""
        st = self.requests.get(req_id)
        if st is None:
            return
        if len(last_tokens):
            rows = _DraftRows() if self.dense_history and st.speculate else None
            self._observe(RequestInput(req_id, last_tokens, None, st.tenant, st.workload, st.speculate), rows)
            if rows is not None and rows.count:
                x = rows.features(self.classes)
                none = np.zeros(0, dtype=np.int64)
                self._record(rows, x, self.gate.predict(x), none, none, none)
            self._emit_deferred()
            self._report_emitted()
        del self.requests[req_id]
        st.model_draft = None  # planned after the last token: never verified
        for d in st.resolve(final=True):
            if d.position < st.output_len:  # a draft made after the last token says nothing
                self._emit_cache(st, d)
        self.drafter.stop(req_id)

    def reset_cache(self) -> None:
        """A fresh suffix cache (a new deployment); only allowed with no request running."""
        if self.requests:
            raise RequestInputError(f"cannot reset the cache with {len(self.requests)} requests running")
        self.drafter = self._drafter_factory(self.drafter.config)

    # ---------------------------------------------------------------- internals
    def _observe(self, inp: RequestInput, rows: "_DraftRows | None" = None) -> RequestState:
        """Take in the tokens the request emitted since the last step. With `rows` (dense history),
        the cache also drafts at each intermediate position, exactly as offline replay does, so the
        features the gate sees do not depend on how many tokens each step emitted."""
        st = self.requests.get(inp.req_id)
        new = np.asarray(inp.new_tokens, dtype=np.int32)
        if st is None:
            if inp.prompt is None:
                raise RequestInputError(f"request {inp.req_id!r} seen for the first time without its prompt")
            if inp.workload not in WORKLOADS:
                raise RequestInputError(f"request {inp.req_id!r}: unknown workload {inp.workload!r}; known: {WORKLOADS}")
            prompt = np.asarray(inp.prompt, dtype=np.int32)
            st = RequestState.create(inp.req_id, inp.tenant, inp.workload, WORKLOADS.index(inp.workload), prompt,
                                     inp.speculate)
            self.requests[inp.req_id] = st
            self.drafter.start(inp.req_id, prompt)
            self.stats.requests_seen += 1
        st.speculate = inp.speculate
        if len(new):
            tally = self._emitted.setdefault((st.tenant, st.workload), [0, 0])
            tally[0] += len(new)
            tally[1] += 1
        if st.model_draft is not None:
            accepted = max(0, min(len(new) - 1, st.model_draft.draft_len))
            self._emit_model(st, st.model_draft, accepted)
            st.model_draft = None
        steps = [new[j : j + 1] for j in range(len(new))] if rows is not None and len(new) > 1 else [new]
        for j, chunk in enumerate(steps):
            if len(chunk):
                self.drafter.extend(inp.req_id, chunk)
                st.append(chunk, self.classes.depth_delta)
            for d in st.resolve():
                self._emit_cache(st, d)
            if rows is not None and j < len(steps) - 1:
                self._draft_row(st, rows, shadow=True)
        return st

    def _decide(self, states: list[RequestState], predicted: np.ndarray, lengths: np.ndarray,
                allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """tau per request: the goodput rule with its workload's live model-drafter estimate, plus
        the learned correction of that workload, then the tenant's overrides (precedence
        tenant+workload > tenant > workload auto > default); then the decision."""
        n = len(states)
        controls = self.controls
        mu = np.array([self.mu_e[st.workload] for st in states], dtype=np.float64)
        fallback = fallback_sources(mu, self.decision, n)
        tau = rule_thresholds(lengths, mu, fallback, self.decision)
        if controls.corrections and self.decision.fixed_tau is None:
            tau = tau + np.array([controls.corrections.get(st.workload, 0.0) for st in states])
        off = None
        if len(controls.overrides):
            now = datetime.now(timezone.utc)
            off = np.zeros(n, dtype=np.int8)
            for i, st in enumerate(states):
                eff = controls.overrides.resolve(st.tenant, st.workload, float(tau[i]), float(tau[i]), now)
                if eff.mode == "off_model":
                    off[i] = OFF_MODEL
                elif eff.mode == "off_cache":
                    off[i] = OFF_CACHE
                elif eff.tau is not None:
                    tau[i] = eff.tau
        source = decide(predicted, lengths, tau, fallback, allowed, off)
        return source, np.where(lengths > 0, tau, np.nan).astype(np.float32)

    def _decide_arctic(self, rows: "_DraftRows", main_row: np.ndarray, lengths: np.ndarray,
                       allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ArcticInference baseline: the cache draft iff its score reaches the model drafter's
        draft length, else the fallback; the gate's prediction is still logged, never used."""
        n = len(main_row)
        score = np.zeros(n, dtype=np.float64)
        has_row = main_row >= 0
        if rows.count:
            score[has_row] = rows.scores[main_row[has_row]]
        threshold = float(self.decision.model_draft_len)
        fallback = np.full(n, NONE if self.decision.fallback == "none" else MODEL, dtype=np.int8)
        source = decide(score, lengths, np.full(n, threshold - 1e-9), fallback, allowed)
        return source, np.where(lengths > 0, threshold, np.nan).astype(np.float32)

    def _draft_row(self, st: RequestState, rows: "_DraftRows", shadow: bool) -> int:
        """Draft at the request's current position; the draft joins its history at once (later
        positions of this step see it), its features and prediction are filled in per batch."""
        d = self.drafter.draft(st.req_id, st.context())
        if not d.length:
            return -1
        prev = st.latest
        cont = _lcp_tail(prev.tokens, st.output_len - prev.position, d.token_ids) if prev is not None else 0
        record = CacheDraftRecord(st.output_len, d.token_ids, "shadow" if shadow else "", 0.0, float("nan"),
                                  self.version_id, b"")
        row = rows.add(st, d, cont, st.history(), record, self.classes)
        st.add_draft(record)
        return row

    def _record(self, rows: "_DraftRows", x: np.ndarray, predicted: np.ndarray, main_row: np.ndarray,
                plan_source: np.ndarray, tau: np.ndarray) -> None:
        decision_of_row = {int(r): (SOURCE_NAMES[int(plan_source[i])], float(tau[i]))
                           for i, r in enumerate(main_row) if r >= 0}
        for r, record in enumerate(rows.records):
            record.predicted = float(predicted[r])
            record.features = x[r].tobytes()
            if r in decision_of_row:
                record.decision, record.tau = decision_of_row[r]
        self.stats.cache_drafts += rows.count

    def _emit_cache(self, st: RequestState, d: CacheDraftRecord) -> None:
        if not d.features:  # labelled within the step that drafted it: wait for its features
            self._deferred.append((st, d))
            return
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, d.position, DRAFTER_CACHE,
                                      d.decision, len(d.tokens), int(d.label), d.predicted, d.tau, d.version_id,
                                      d.features))

    def _report_emitted(self) -> None:
        if self._emitted and self.stats_sink is not None:
            now = self._clock()
            for (tenant, workload), (tokens, cycles) in self._emitted.items():
                self.stats_sink.add_steps(now, tenant, workload, self.version_id or 0, tokens, cycles)
        self._emitted = {}

    def _emit_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for st, d in deferred:
            self._emit_cache(st, d)

    def _emit_model(self, st: RequestState, m: ModelDraftRecord, accepted: int) -> None:
        self.stats.model_drafts += 1
        self.stats.model_accepted += accepted
        self.mu_e[st.workload] = self.decision.update_model_mean(self.mu_e[st.workload], accepted)
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, m.position, DRAFTER_MODEL,
                                      "model", m.draft_len, accepted, None, None, self.version_id, None))


@dataclass(frozen=True)
class Controls:
    """What the control plane tells a running runtime: per-workload corrections to the rule's tau
    (learned by the leader) and the active overrides. Swapped whole, never mutated."""

    corrections: dict[str, float] = field(default_factory=dict)
    overrides: OverrideSnapshot = field(default_factory=OverrideSnapshot)


class _DraftRows:
    """Raw per-draft quantities of one step (main and shadow drafts), then one feature matrix."""

    def __init__(self) -> None:
        self.count = 0
        self.drafts: list[list[int]] = []
        self.records: list[CacheDraftRecord] = []
        self._tokens: list[int] = []
        self._probs: list[float] = []
        self._scalar: list[tuple] = []  # score, match, source, other x4, position, context, nesting, line start, workload
        self._history: list[tuple] = []

    def add(self, st: RequestState, d, cont: int, history: tuple, record: CacheDraftRecord,
            classes: TokenClasses) -> int:
        self.drafts.append(d.token_ids)
        self.records.append(record)
        self._tokens.extend(d.token_ids)
        self._probs.extend(d.probs)
        line_start = bool(classes.ends_line[st.out[-1]]) if st.out else False
        self._scalar.append((d.score, d.match_len, d.source, d.other_score, d.other_len, d.trees_agree, cont,
                             st.output_len, st.length, st.nesting, line_start, st.workload_index))
        self._history.append(history)
        self.count += 1
        return self.count - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(d) for d in self.drafts), dtype=np.int64, count=self.count)

    @property
    def scores(self) -> np.ndarray:
        return np.fromiter((t[0] for t in self._scalar), dtype=np.float64, count=self.count)

    def features(self, classes: TokenClasses) -> np.ndarray:
        sc = np.array(self._scalar, dtype=np.float64)
        hist = np.array(self._history, dtype=np.float64)
        columns = DraftColumns(self.lengths, np.asarray(self._tokens, dtype=np.int32),
                               np.asarray(self._probs, dtype=np.float32), sc[:, 0], sc[:, 1], sc[:, 2].astype(np.int8),
                               sc[:, 3], sc[:, 4], sc[:, 5], sc[:, 6])
        return draft_features(columns, positions=sc[:, 7], context_len=sc[:, 8], nesting=sc[:, 9],
                              at_line_start=sc[:, 10], history=HistoryColumns(*(hist[:, j] for j in range(9))),
                              workload=sc[:, 11].astype(np.int64), classes=classes)


def _lcp_tail(prev: list[int], gap: int, cur: list[int]) -> int:
    """Leading tokens of `cur` equal to the previous draft's part beyond what was realised since."""
    tail = prev[gap:]
    n = min(len(tail), len(cur))
    for i in range(n):
        if tail[i] != cur[i]:
            return i
    return n
