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
from predictor.features import NUM_FEATURES, DraftContext, feature_matrix
from predictor.hindsight import Hindsight, TrackedDraft
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
                 shadow_drafts: bool = True, stats_sink=None) -> None:
        self.gate = gate
        self.version_id = version_id
        self.classes = classes
        self.decision = decision or DecisionConfig()
        self.events = events if events is not None else EventQueue()
        self._drafter_factory = drafter_factory
        # Draft (in the shadow) at every output position, not only where steps land, so live
        # features match the dense replay the predictor learned from; costs one more suffix
        # lookup per accepted token.
        self.shadow_drafts = shadow_drafts
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
        for inp in inputs:
            self._check(inp)
        n = len(inputs)
        self.stats.steps += 1
        speculating = self.decision.speculation_allowed(n)
        rows = _StepDrafts()
        main_row = np.full(n, -1, dtype=np.int64)  # the row of each request's draft at its current position
        states = []
        for i, inp in enumerate(inputs):
            drafting = inp.speculate and speculating
            st = self._observe(inp, rows, shadow=drafting and self.shadow_drafts)
            states.append(st)
            if drafting:
                main_row[i] = self._draft(st, rows)
        has_row = main_row >= 0
        lengths = np.zeros(n, dtype=np.int64)
        predicted = np.full(n, np.nan, dtype=np.float32)
        x, row_pred = self._predict(rows)
        lengths[has_row] = rows.lengths()[main_row[has_row]]
        predicted[has_row] = row_pred[main_row[has_row]]
        allowed = np.array([st.speculate for st in states], dtype=bool) & speculating
        if self.decision.rule == "arctic":
            plan_source, tau = self._decide_arctic(rows, main_row, lengths, allowed)
        else:
            plan_source, tau = self._decide(states, predicted, lengths, allowed)
        decision = ["shadow"] * len(rows)
        row_tau = [float("nan")] * len(rows)
        for i in np.flatnonzero(has_row).tolist():
            decision[main_row[i]], row_tau[main_row[i]] = SOURCE_NAMES[int(plan_source[i])], float(tau[i])
        self._record(rows, x, row_pred, decision, row_tau)
        for i, st in enumerate(states):
            self.stats.decisions[SOURCE_NAMES[int(plan_source[i])]] += 1
            if plan_source[i] == MODEL:
                st.model_draft = ModelDraftRecord(st.hindsight.output_len, self.decision.model_draft_len)
        cache_drafts = [rows.contexts[r].draft.token_ids if r >= 0 else [] for r in main_row.tolist()]
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
            rows = _StepDrafts()
            self._observe(RequestInput(req_id, last_tokens, None, st.tenant, st.workload, st.speculate), rows,
                          shadow=self.shadow_drafts and st.speculate)
            x, row_pred = self._predict(rows)
            self._record(rows, x, row_pred, ["shadow"] * len(rows), [float("nan")] * len(rows))
            self._report_emitted()
        del self.requests[req_id]
        st.model_draft = None  # planned after the last token: never verified
        for tracked, label in st.hindsight.finish():
            record = st.records.pop(tracked)
            if record.position < st.hindsight.output_len:  # a draft made after the last token says nothing
                self._emit_cache(st, record, label)
        self.drafter.stop(req_id)

    def reset_cache(self) -> None:
        """A fresh suffix cache (a new deployment); only allowed with no request running."""
        if self.requests:
            raise RequestInputError(f"cannot reset the cache with {len(self.requests)} requests running")
        self.drafter = self._drafter_factory(self.drafter.config)

    # ---------------------------------------------------------------- internals
    def _check(self, inp: RequestInput) -> None:
        """Refuse a bad request before the step changes anything."""
        if inp.req_id in self.requests:
            return
        if inp.prompt is None:
            raise RequestInputError(f"request {inp.req_id!r} seen for the first time without its prompt")
        if inp.workload not in WORKLOADS:
            raise RequestInputError(f"request {inp.req_id!r}: unknown workload {inp.workload!r}; known: {WORKLOADS}")

    def _observe(self, inp: RequestInput, rows: "_StepDrafts", shadow: bool) -> RequestState:
        """Take in the tokens the request emitted since the last step and label the drafts they
        decide. With `shadow`, the cache also drafts at each intermediate position, exactly as
        offline replay does, so the features the gate sees do not depend on how many tokens each
        step emitted."""
        st = self.requests.get(inp.req_id)
        new = np.asarray(inp.new_tokens, dtype=np.int32)
        if st is None:
            prompt = np.asarray(inp.prompt, dtype=np.int32)
            st = RequestState(inp.req_id, inp.tenant, inp.workload, inp.speculate,
                              Hindsight(prompt, WORKLOADS.index(inp.workload), self.classes))
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
        chunks = [new[j : j + 1] for j in range(len(new))] if shadow and len(new) > 1 else [new]
        for j, chunk in enumerate(chunks):
            if len(chunk):
                self.drafter.extend(inp.req_id, chunk)
            for tracked, label in st.hindsight.append(chunk):
                record = st.records.pop(tracked, None)
                if record is None:  # drafted in this step: labelled once the step has scored it
                    rows.labelled.append((st, tracked, label))
                else:
                    self._emit_cache(st, record, label)
            if shadow and j < len(chunks) - 1:
                self._draft(st, rows)
        return st

    def _draft(self, st: RequestState, rows: "_StepDrafts") -> int:
        """Draft at the request's current position; the draft joins its history at once (later
        positions of this step see it). Returns its row (-1: the cache had nothing)."""
        d = self.drafter.draft(st.req_id, st.hindsight.tokens)
        if not d.length:
            return -1
        return rows.add(st, st.hindsight.draft_context(d), st.hindsight.add(d))

    def _predict(self, rows: "_StepDrafts") -> tuple[np.ndarray, np.ndarray]:
        """The feature matrix of the step's drafts and the gate's predictions, one call for all."""
        if not len(rows):
            return np.zeros((0, NUM_FEATURES), dtype=np.float32), np.zeros(0, dtype=np.float32)
        x = feature_matrix(rows.contexts, self.classes)
        return x, self.gate.predict(x)

    def _record(self, rows: "_StepDrafts", x: np.ndarray, predicted: np.ndarray, decision: list[str],
                tau: list[float]) -> None:
        """Each draft of the step gets its record, complete; the drafts this step both made and
        labelled go out now."""
        for r, (st, tracked) in enumerate(rows.owners):
            st.records[tracked] = CacheDraftRecord(tracked.position, len(tracked.tokens), decision[r],
                                                   float(predicted[r]), tau[r], self.version_id, x[r].tobytes())
        self.stats.cache_drafts += len(rows)
        for st, tracked, label in rows.labelled:
            self._emit_cache(st, st.records.pop(tracked), label)

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

    def _decide_arctic(self, rows: "_StepDrafts", main_row: np.ndarray, lengths: np.ndarray,
                       allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ArcticInference baseline: the cache draft iff its score reaches the model drafter's
        draft length, else the fallback; the gate's prediction is still logged, never used."""
        n = len(main_row)
        score = np.zeros(n, dtype=np.float64)
        has_row = main_row >= 0
        score[has_row] = rows.scores()[main_row[has_row]]
        threshold = float(self.decision.model_draft_len)
        fallback = np.full(n, NONE if self.decision.fallback == "none" else MODEL, dtype=np.int8)
        source = decide(score, lengths, np.full(n, threshold - 1e-9), fallback, allowed)
        return source, np.where(lengths > 0, threshold, np.nan).astype(np.float32)

    def _emit_cache(self, st: RequestState, d: CacheDraftRecord, label: int) -> None:
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, d.position, DRAFTER_CACHE,
                                      d.decision, d.draft_len, label, d.predicted, d.tau, d.version_id, d.features))

    def _report_emitted(self) -> None:
        if self._emitted and self.stats_sink is not None:
            now = self._clock()
            for (tenant, workload), (tokens, cycles) in self._emitted.items():
                self.stats_sink.add_steps(now, tenant, workload, self.version_id or 0, tokens, cycles)
        self._emitted = {}

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


class _StepDrafts:
    """The cache drafts of one step (each request's own and the shadow drafts in between), in rows."""

    def __init__(self) -> None:
        self.contexts: list[DraftContext] = []
        self.owners: list[tuple[RequestState, TrackedDraft]] = []
        self.labelled: list[tuple[RequestState, TrackedDraft, int]] = []  # drafts of this step labelled in it

    def __len__(self) -> int:
        return len(self.contexts)

    def add(self, st: RequestState, context: DraftContext, tracked: TrackedDraft) -> int:
        self.contexts.append(context)
        self.owners.append((st, tracked))
        return len(self.contexts) - 1

    def lengths(self) -> np.ndarray:
        return np.fromiter((c.draft.length for c in self.contexts), dtype=np.int64, count=len(self.contexts))

    def scores(self) -> np.ndarray:
        return np.fromiter((c.draft.score for c in self.contexts), dtype=np.float64, count=len(self.contexts))
