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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.decision import CACHE, MODEL, SOURCE_NAMES, DecisionConfig, decide
from controller.events import DRAFTER_CACHE, DRAFTER_MODEL, EventQueue, LabelledEvent
from controller.request_state import CacheDraftRecord, ModelDraftRecord, RequestState
from predictor.cache_drafter import CacheDrafter, SuffixConfig
from predictor.features import DraftColumns, HistoryColumns, draft_features
from predictor.mlp import GatePredictor
from predictor.tokens import TokenClasses
from predictor.traces import WORKLOADS


class RuntimeError_(RuntimeError):
    pass


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
                 drafter_factory: Callable[[SuffixConfig | None], CacheDrafter] = CacheDrafter) -> None:
        self.gate = gate
        self.version_id = version_id
        self.classes = classes
        self.decision = decision or DecisionConfig()
        self.events = events if events is not None else EventQueue()
        self._drafter_factory = drafter_factory
        self.drafter = drafter_factory(suffix)
        self.requests: dict[str, RequestState] = {}
        self.stats = RuntimeStats()
        self.mu_e = self.decision.initial_model_accepted  # running mean accepted length of the model drafter
        self._clock = clock

    def set_gate(self, gate: GatePredictor, version_id: int | None) -> None:
        """Swap the predictor between steps (a new champion); in-flight drafts keep their version."""
        self.gate, self.version_id = gate, version_id

    # ---------------------------------------------------------------- the step
    def step(self, inputs: Sequence[RequestInput], finished: Sequence[str] = ()) -> StepPlan:
        for req_id in finished:
            self.finish(req_id)
        states = [self._observe(inp) for inp in inputs]
        n = len(states)
        self.stats.steps += 1
        lengths = np.zeros(n, dtype=np.int64)
        tokens: list[int] = []
        probs: list[float] = []
        score = np.zeros(n, dtype=np.float32)
        match = np.zeros(n, dtype=np.int32)
        source = np.zeros(n, dtype=np.int8)
        other = np.zeros((n, 4), dtype=np.float32)
        history = np.zeros((n, 9), dtype=np.float64)
        drafts: list[list[int]] = [[] for _ in range(n)]
        speculating = self.decision.speculation_allowed(n)
        for i, st in enumerate(states):
            if not (st.speculate and speculating):
                continue
            d = self.drafter.draft(st.req_id, st.context())
            if not d.length:
                continue
            lengths[i] = d.length
            drafts[i] = d.token_ids
            tokens.extend(d.token_ids)
            probs.extend(d.probs)
            score[i], match[i], source[i] = d.score, d.match_len, d.source
            prev = st.latest
            cont = 0
            if prev is not None:
                gap = st.output_len - prev.position
                cont = _lcp_tail(prev.tokens, gap, d.token_ids)
            other[i] = (d.other_score, d.other_len, d.trees_agree, cont)
            history[i] = st.history()
        has = lengths > 0
        predicted = np.full(n, np.nan, dtype=np.float32)
        x = None
        if has.any():
            positions = np.array([st.output_len for st in states], dtype=np.int64)
            columns = DraftColumns(lengths, np.asarray(tokens, dtype=np.int32), np.asarray(probs, dtype=np.float32),
                                   score, match, source, other[:, 0], other[:, 1], other[:, 2], other[:, 3])
            hist = HistoryColumns(*(history[:, j] for j in range(9)))
            x = draft_features(
                columns, positions=positions,
                context_len=np.array([st.length for st in states], dtype=np.int64),
                nesting=np.array([st.nesting for st in states], dtype=np.int64),
                at_line_start=np.array([self.classes.ends_line[st.buffer[st.length - 1]] if st.output_len else False
                                        for st in states]),
                history=hist, workload=np.array([st.workload_index for st in states]), classes=self.classes)
            predicted[has] = self.gate.predict(x[has])
        plan_source, tau = decide(predicted, lengths, self.mu_e, self.decision,
                                  np.array([st.speculate for st in states]) & speculating)
        self._record(states, plan_source, drafts, lengths, predicted, tau, x)
        return StepPlan([st.req_id for st in states], plan_source,
                        [drafts[i] if plan_source[i] == CACHE else [] for i in range(n)], predicted, tau, lengths)

    def finish(self, req_id: str, last_tokens: Sequence[int] | np.ndarray = ()) -> None:
        """The request ended (after emitting `last_tokens`, if the engine has not reported them):
        label its remaining drafts with what was realised, and forget it."""
        st = self.requests.get(req_id)
        if st is None:
            return
        if len(last_tokens):
            self._observe(RequestInput(req_id, last_tokens, None, st.tenant, st.workload, st.speculate))
        del self.requests[req_id]
        st.model_draft = None  # planned after the last token: never verified
        for d in st.resolve(final=True):
            if d.position < st.output_len:  # a draft made after the last token says nothing
                self._emit_cache(st, d)
        self.drafter.stop(req_id)

    def reset_cache(self) -> None:
        """A fresh suffix cache (a new deployment); only allowed with no request running."""
        if self.requests:
            raise RuntimeError_(f"cannot reset the cache with {len(self.requests)} requests running")
        self.drafter = self._drafter_factory(self.drafter.config)

    # ---------------------------------------------------------------- internals
    def _observe(self, inp: RequestInput) -> RequestState:
        st = self.requests.get(inp.req_id)
        new = np.asarray(inp.new_tokens, dtype=np.int32)
        if st is None:
            if inp.prompt is None:
                raise RuntimeError_(f"request {inp.req_id!r} seen for the first time without its prompt")
            if inp.workload not in WORKLOADS:
                raise RuntimeError_(f"request {inp.req_id!r}: unknown workload {inp.workload!r}; known: {WORKLOADS}")
            prompt = np.asarray(inp.prompt, dtype=np.int32)
            st = RequestState.create(inp.req_id, inp.tenant, inp.workload, WORKLOADS.index(inp.workload), prompt,
                                     inp.speculate)
            self.requests[inp.req_id] = st
            self.drafter.start(inp.req_id, prompt)
            self.stats.requests_seen += 1
        st.speculate = inp.speculate
        if len(new):
            self.drafter.extend(inp.req_id, new)
            st.append(new, self.classes.depth_delta)
        if st.model_draft is not None:
            accepted = max(0, min(len(new) - 1, st.model_draft.draft_len))
            self._emit_model(st, st.model_draft, accepted)
            st.model_draft = None
        for d in st.resolve():
            self._emit_cache(st, d)
        return st

    def _record(self, states: list[RequestState], plan_source: np.ndarray, drafts: list[list[int]],
                lengths: np.ndarray, predicted: np.ndarray, tau: np.ndarray, x: np.ndarray | None) -> None:
        for i, st in enumerate(states):
            choice = int(plan_source[i])
            self.stats.decisions[SOURCE_NAMES[choice]] += 1
            if lengths[i]:
                self.stats.cache_drafts += 1
                st.add_draft(CacheDraftRecord(st.output_len, drafts[i], SOURCE_NAMES[choice], float(predicted[i]),
                                              float(tau[i]), self.version_id, x[i].tobytes()))
            if choice == MODEL:
                st.model_draft = ModelDraftRecord(st.output_len, self.decision.model_draft_len)

    def _emit_cache(self, st: RequestState, d: CacheDraftRecord) -> None:
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, d.position, DRAFTER_CACHE,
                                      d.decision, len(d.tokens), int(d.label), d.predicted, d.tau, d.version_id,
                                      d.features))

    def _emit_model(self, st: RequestState, m: ModelDraftRecord, accepted: int) -> None:
        self.stats.model_drafts += 1
        self.stats.model_accepted += accepted
        self.mu_e = self.decision.update_model_mean(self.mu_e, accepted)
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, m.position, DRAFTER_MODEL,
                                      "model", m.draft_len, accepted, None, None, self.version_id, None))


def _lcp_tail(prev: list[int], gap: int, cur: list[int]) -> int:
    """Leading tokens of `cur` equal to the previous draft's part beyond what was realised since."""
    tail = prev[gap:]
    n = min(len(tail), len(cur))
    for i in range(n):
        if tail[i] != cur[i]:
            return i
    return n
