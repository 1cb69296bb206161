"""The per-step runtime every engine calls: one call per engine step for the whole batch.

In: the running requests (id, tokens sampled since the last step, prompt on first sight, tenant,
workload, opt-out) and the requests that finished. Out: per request, the draft to verify (a prefix
of its cache draft, or the model drafter's draft of the step's length k) and its source (cache,
model drafter, or none), the gate's prediction and the tau it was held to.

Per step: each request's realised tokens go into the suffix cache and label the drafts they cover
(hindsight); every speculating request gets one cache lookup; the features of all cache drafts form
one matrix and the gate runs once over it (a survival curve per draft); the allocator then plans the
whole step in one vectorised call (predictor.decision.allocator), the model drafter's curves coming from its
live per-workload estimate. Labelled events go onto a bounded queue and never wait for SQL.

tau under the allocator: a request's automatic tau is its break-even expected accepted length
(`Allocation.tau`: the length at which its whole cache draft pays at the step's rate). Overrides
resolve against it; a fixed tau, or bounds that move it, hold the request to the binary decision
(whole draft iff the predicted length beats tau, else the model draft or nothing). The plan shows
the tau each request was held to; the events carry the automatic one, so the workload's tau
history reflects the allocator, not a tenant's override.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from controller.core import request_end
from controller.core.decision import (CACHE, MODEL, NONE, OFF_CACHE, OFF_MODEL, SOURCE_NAMES, DecisionConfig, decide,
                                      effective_rule, fallback_sources, rule_thresholds)
from controller.core.events import DRAFTER_CACHE, DRAFTER_MODEL, EventQueue, LabelledEvent, quick_init
from controller.core.request_state import CacheDraftRecord, RequestState, VerifiedDraft
from controller.core.snapshot import Controls, ServingSnapshot
from predictor.decision.allocator import AUTO, FORCE_MODEL, FORCE_NONE, FULL_CACHE, NO_CACHE, allocate, allocate_one
from predictor.decision.profiles import CostProfile, known_survival
from predictor.decision.rivals import RIVAL_RULES, Outcome, StepView, conditional_probs, make_rival
from predictor.drafting.cache_drafter import CacheDrafter, SuffixConfig
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import NUM_FEATURES, DraftContext, feature_matrix
from predictor.drafting.hindsight import Hindsight, TrackedDraft
from predictor.drafting.token_classes import TokenClasses
from predictor.gate.calibration import apply as apply_calibration
from predictor.gate.mlp import GatePredictor
from storage.overrides import EffectiveTau
from storage.workloads import WORKLOADS

if TYPE_CHECKING:
    from controller.core.metrics import HvdMetrics

_log = logging.getLogger("hvd.runtime")


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
    # The output still to come, known only to a replay engine serving the upper bound: given, the
    # request's cache draft is decided by its true accepted length instead of the gate's curve
    # (a perfect predictor; its events still carry the gate's predictions).
    continuation: Sequence[int] | np.ndarray | None = None
    # Draft tokens the engine verified for this request in the step that produced `new_tokens`
    # (vLLM's scheduled spec tokens): fewer than planned when its scheduler cut the draft to fit
    # the token budget, 0 when the request was preempted before verifying. None: what was planned.
    verified: int | None = None
    # Tokens the engine sampled for it in that step, when the scheduler kept fewer (`new_tokens`: it
    # cut the rest at max_tokens or a stop token): what was accepted counts from this. None: as many
    # as `new_tokens`.
    sampled: int | None = None
    # The output is the verifying model's own (live traffic, a trace the engine recorded), not text
    # another model wrote: DraftContext.on_policy. Read, like the prompt, when the request is first seen.
    on_policy: bool = False
    # Where the request can end, as the engine would end it: the output tokens it may still emit
    # after `new_tokens` (its max_tokens less its output; None: no limit known), and the token ids
    # that end it when emitted (its eos unless ignore_eos, its stop ids). A draft token past either
    # cannot be output, and the request's last token comes free as the step's bonus token: the plan
    # verifies none of them (`_request_ends`, controller.core.request_end).
    room: int | None = None
    stops: Sequence[int] = ()

    _TOKEN_FIELDS = ("new_tokens", "prompt", "continuation")

    def to_json(self) -> dict:
        """Plain JSON values (token ids as lists): recorded step inputs kept in files, replayed later."""
        return {f: (np.asarray(v).tolist() if f in RequestInput._TOKEN_FIELDS and v is not None else v)
                for f, v in ((f, getattr(self, f)) for f in RequestInput.__dataclass_fields__)}

    @classmethod
    def from_json(cls, values: dict) -> "RequestInput":
        """`to_json`'s inverse (token ids as int32 arrays); a field added since the file was written
        takes its default."""
        return cls(**{k: (np.array(v, dtype=np.int32) if k in cls._TOKEN_FIELDS and v is not None else v)
                      for k, v in values.items()})


@dataclass
class StepPlan:
    req_ids: list[str]
    source: np.ndarray  # int8 per request: NONE, CACHE or MODEL
    drafts: list[list[int]]  # CACHE rows: the cache draft cut to what is verified; [] otherwise (the engine drafts MODEL rows)
    predicted: np.ndarray  # float32 expected accepted length of the whole cache draft, NaN where none was scored
    tau: np.ndarray  # float32 the tau each request was held to, NaN where no cache draft was scored
    cache_len: np.ndarray  # int: length of the cache draft that was considered (0 if none)
    cache_drafts: list[list[int]] = field(default_factory=list)  # every request's whole cache draft, verified or not
    model_k: int = 0  # the model draft length of the step (every MODEL row drafts k tokens); 0 without MODEL rows

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
    # Verified drafts (cache prefixes and model drafts) as the engine counts them, from the tokens
    # each request reports the step after.
    verified_drafts: int = 0
    verified_tokens: int = 0
    verified_accepted: int = 0
    # Of the verified drafts an allocator planned: the tokens its curves promised over what was
    # verified, and the tokens accepted. promised_accepted / promised below 1: the predictor
    # over-promises on the drafts it acts on (even when it is calibrated over all drafts: the
    # allocator verifies the tokens whose curves are highest, and so those the curves overrate).
    promised: float = 0.0
    promised_accepted: int = 0
    accepted_count: dict[int, int] = field(default_factory=dict)  # verified drafts per number of tokens accepted
    truncated: int = 0  # cache drafts verified shorter than the cache made them
    engine_cut: int = 0  # planned drafts the engine verified shorter than planned (or not at all)
    # accepted draft tokens the scheduler then cut from the output (past max_tokens or a stop token):
    # counted accepted (as vLLM counts them), absent from the output and so from hindsight labels
    accepted_not_output: int = 0
    model_k_steps: dict[int, int] = field(default_factory=dict)  # steps per model draft length
    mixed_steps: int = 0  # steps verifying cache and model drafts side by side

    def count_verified(self, draft_len: int, accepted: int) -> None:
        self.verified_drafts += 1
        self.verified_tokens += draft_len
        self.verified_accepted += accepted
        self.accepted_count[accepted] = self.accepted_count.get(accepted, 0) + 1


# The per-request values a step passes between its phases are plain lists where only Python reads
# them (a step of a few requests would spend more on numpy calls than on the work), arrays where
# numpy computes with them or the engine receives them (docs/design/runtime.md, "What a step costs").


@quick_init
@dataclass(frozen=True, slots=True)
class _Observed:
    """Observe: the step's requests after taking in their tokens, and the step's cache drafts."""

    states: list[RequestState]
    rows: "_StepDrafts"
    main_row: list[int]  # the row of each request's draft at its current position (-1: none)
    workload: list[int]  # each request's workload index
    allowed: list[bool]  # the request may speculate this step


@quick_init
@dataclass(frozen=True, slots=True)
class _Scored:
    """Score: the gate's view of every draft of the step, and of each request's own."""

    x: np.ndarray  # the feature rows of every draft (shadow drafts included)
    row_pred: np.ndarray  # each draft's expected accepted length
    lengths: np.ndarray  # int64 per request: its cache draft's length (0: none)
    predicted: np.ndarray  # float32 per request: its cache draft's expected accepted length (NaN: none)
    curves: np.ndarray | None  # per request: its cache draft's survival curve (the allocator only)
    length_list: list[int]  # `lengths` as a list
    model_room: list[int] | None = None  # per request: the longest model draft it can output (None: any)


@quick_init
@dataclass(frozen=True, slots=True)
class _Planned:
    """Plan: what each request verifies."""

    source: np.ndarray  # int8 NONE, CACHE or MODEL per request
    verify_len: list[int]  # tokens verified per request
    model_k: int
    tau: np.ndarray  # float32: the tau each request was held to
    auto_tau: list[float]  # its automatic tau (what the events carry)
    token_prob: np.ndarray | None = None  # a rival rule's view of the cache drafts' token probabilities


class Runtime:
    def __init__(self, gate: GatePredictor, classes: TokenClasses, decision: DecisionConfig | None = None,
                 events: EventQueue | None = None, version_id: int | None = None,
                 suffix: SuffixConfig | None = None, clock=time.time,
                 drafter_factory: Callable[[SuffixConfig | None], CacheDrafter] = CacheDrafter,
                 shadow_drafts: bool = True, stats_sink=None, metrics: "HvdMetrics | None" = None) -> None:
        self.classes = classes
        self.decision = decision or DecisionConfig()
        self.events = events if events is not None else EventQueue()
        # Prometheus counters (controller.core.metrics): the step's decisions here, the labelled
        # drafts as they pass through the queue.
        self.metrics = metrics
        if metrics is not None:
            self.events.observer = metrics
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
        # The model drafter's survival curve per workload, live from hindsight; its mean accepted
        # length at the configured k is what the binary rule calls mu_e.
        self.model_curves = self.decision.model_survival()
        # A competitor's rule (predictor.decision.rivals) in place of HVD's, with what it verified
        # since its last step, which it learns from before it plans the next.
        self.rival = make_rival(self.decision.rule) if self.decision.rule in RIVAL_RULES else None
        self._rival_seen: list[tuple[int, int, int, tuple[float, ...] | None]] = []
        self._clock = clock  # the one clock: event times and override expiry
        self._told_binary = False
        self._snapshot = ServingSnapshot(gate, version_id, self._rule_for(gate, version_id))
        self._report_versions()

    @property
    def mu_e(self) -> dict[str, float]:
        """The model drafter's live mean accepted length per workload (at the configured k): what
        the binary rule calls mu_e. Read when the binary rule decides, not kept up to date after
        every model draft's label (the curves it comes from are)."""
        return {w: self.model_curves.mean_accepted(i) for i, w in enumerate(WORKLOADS)}

    # ---------------------------------------------------------------- the control plane
    @property
    def snapshot(self) -> ServingSnapshot:
        """What the next step decides with."""
        return self._snapshot

    def publish(self, *, gate: GatePredictor | None = None, version_id: int | None = None,
                workload_gates: Mapping[str, tuple[GatePredictor, int]] | None = None,
                controls: Controls | None = None) -> None:
        """A new snapshot from any thread (the control poller): the given parts replace the current
        ones in one assignment; a step already running keeps the snapshot it started with. A new
        `gate` comes with its `version_id`."""
        old = self._snapshot
        if gate is None:
            gate, version_id = old.gate, old.version_id
        snap = ServingSnapshot(gate, version_id,
                               old.rule if gate is old.gate else self._rule_for(gate, version_id),
                               dict(workload_gates) if workload_gates is not None else old.workload_gates,
                               controls if controls is not None else old.controls)
        self._snapshot = snap
        if _versions_of(snap) != _versions_of(old):
            self._report_versions()

    def set_cost(self, cost: CostProfile) -> None:
        """Price the next steps with `cost` (the engine's live cost model). Called between steps
        by the thread that runs them."""
        self.decision = replace(self.decision, cost=cost)

    def set_controls(self, controls: Controls) -> None:
        """New learned corrections and overrides, used from the next step."""
        self.publish(controls=controls)

    def set_gate(self, gate: GatePredictor, version_id: int | None) -> None:
        """Swap the predictor between steps (a new champion); in-flight drafts keep their version."""
        self.publish(gate=gate, version_id=version_id)

    def set_workload_gates(self, gates: Mapping[str, tuple[GatePredictor, int]]) -> None:
        """The per-workload champions; workloads not in it use `gate`."""
        self.publish(workload_gates=gates)

    @property
    def gate(self) -> GatePredictor:
        return self._snapshot.gate

    @property
    def version_id(self) -> int | None:
        return self._snapshot.version_id

    @property
    def workload_gates(self) -> Mapping[str, tuple[GatePredictor, int]]:
        return self._snapshot.workload_gates

    @property
    def controls(self) -> Controls:
        return self._snapshot.controls

    @property
    def rule(self) -> str:
        return self._snapshot.rule

    def version_for(self, workload: str) -> int | None:
        """The predictor version deciding `workload`'s drafts."""
        return self._snapshot.version_for(workload)

    def _report_versions(self) -> None:
        if self.metrics is not None:
            snap = self._snapshot
            self.metrics.versions(snap.version_id, {w: snap.version_for(w) for w in WORKLOADS})

    def _rule_for(self, gate: GatePredictor, version_id: int | None) -> str:
        """The rule a predictor serves with: a point-estimate version keeps the binary rule."""
        rule = effective_rule(self.decision.rule, gate.kind)
        if rule != self.decision.rule and not self._told_binary:
            self._told_binary = True
            _log.warning("predictor v%s is a point estimate (no survival curve): deciding with the binary rule "
                         "instead of the %s; a survival predictor (hvd warmstart) brings it back",
                         version_id, self.decision.rule)
        return rule

    # ---------------------------------------------------------------- the step
    def step(self, inputs: Sequence[RequestInput], finished: Sequence[str] = ()) -> StepPlan:
        """One engine step: observe, score, plan, commit, all on one snapshot of the control plane."""
        for req_id in finished:
            self.finish(req_id)
        for inp in inputs:
            self._check(inp)
        snap = self._snapshot
        now = self._clock()
        self.stats.steps += 1
        observed = self._observe_step(inputs)
        scored = self._score(snap, observed, inputs)
        planned = self._plan(snap, observed, scored, now)
        return self._commit(snap, observed, scored, planned, now)

    def _observe_step(self, inputs: Sequence[RequestInput]) -> _Observed:
        """Every request takes in its tokens (labelling the drafts they decide) and, if it may
        speculate, drafts from the suffix cache at its current position."""
        speculating = self.decision.speculation_allowed(len(inputs))
        shadow_drafts = self.shadow_drafts
        rows = _StepDrafts()
        main_row: list[int] = []
        states = []
        for inp in inputs:
            drafting = inp.speculate and speculating
            st = self._observe(inp, rows, shadow=drafting and shadow_drafts)
            states.append(st)
            main_row.append(self._draft(st, rows) if drafting else -1)
        allowed = [bool(st.speculate) and speculating for st in states]
        return _Observed(states, rows, main_row, [st.hindsight.workload for st in states], allowed)

    def _score(self, snap: ServingSnapshot, ob: _Observed, inputs: Sequence[RequestInput]) -> _Scored:
        """The gate once over every draft of the step; each request's own draft's expected length
        (and curve, for the allocator), or its true one where a replay engine serves the upper bound."""
        n = len(ob.states)
        main_row, contexts = ob.main_row, ob.rows.contexts
        has_row = [i for i, r in enumerate(main_row) if r >= 0]
        main = [main_row[i] for i in has_row]
        allocating = snap.rule == "allocator"
        x, row_pred, row_curves = self._predict(snap, ob.rows, curves=allocating)
        # None unless an engine says where its requests end
        useful, model_room = _request_ends(inputs, ob.rows, main_row, self.model_curves.k_max)
        length_list = useful or [len(contexts[r].draft.token_ids) if r >= 0 else 0 for r in main_row]
        lengths = np.array(length_list, dtype=np.int64)
        pred = row_pred.tolist()  # float32 values (float64 with calibration): stored below as float32
        predicted = np.array([pred[r] if r >= 0 else np.nan for r in main_row], dtype=np.float32)
        known = _known_lengths(inputs, ob.rows, main_row)  # None unless a replay engine serves a perfect predictor
        if known is not None:
            predicted = np.where(np.isnan(known), predicted, known).astype(np.float32)
        if useful is not None:
            predicted = np.minimum(predicted, lengths).astype(np.float32)  # NaN stays NaN
        curves = None
        if allocating:
            if n == 1 and main and known is None and row_curves.dtype == np.float32:
                curves = row_curves[main[0] : main[0] + 1]  # a view: read only from here on
            elif len(has_row) == n and row_curves.dtype == np.float32:
                curves = row_curves[main]
            else:
                curves = np.zeros((n, row_curves.shape[1]), dtype=np.float32)
                if has_row:
                    curves[has_row] = row_curves[main]
            if known is not None:
                sure = ~np.isnan(known)
                curves[sure] = known_survival(known[sure], curves.shape[1])
        return _Scored(x, row_pred, lengths, predicted, curves, length_list, model_room)

    def _plan(self, snap: ServingSnapshot, ob: _Observed, sc: _Scored, now: float) -> _Planned:
        """The rule the snapshot serves with decides what each request verifies."""
        if snap.rule == "allocator":
            return self._allocate(snap, ob.states, ob.workload, sc, ob.allowed, now)
        if self.rival is not None:
            return self._plan_rival(ob, sc)
        allowed = np.array(ob.allowed, dtype=bool)
        if snap.rule == "arctic":
            source, tau = self._decide_arctic(ob.rows, np.array(ob.main_row, dtype=np.int64), sc.lengths, allowed)
        else:
            source, tau = self._decide(snap, ob.states, sc.predicted, sc.lengths, allowed, now)
        k = self.decision.model_draft_len
        model_k = k if (source == MODEL).any() else 0
        verify_len = np.where(source == CACHE, sc.lengths, np.where(source == MODEL, k, 0))
        return _Planned(source, verify_len.tolist(), model_k, tau, tau.tolist())

    def _commit(self, snap: ServingSnapshot, ob: _Observed, sc: _Scored, pl: _Planned, now: float) -> StepPlan:
        """Every draft of the step gets its record; what is verified is remembered until the engine
        reports it; decisions go to the counters; the plan goes back to the engine."""
        rows, states = ob.rows, ob.states
        source = pl.source.tolist()
        cut = [v if s == CACHE else 0 for s, v in zip(source, pl.verify_len)]  # cache tokens verified per request
        row_of, held = ob.main_row, pl.auto_tau
        decision = ["shadow"] * len(rows)
        row_tau = [float("nan")] * len(rows)
        row_verified: list[int | None] = [None] * len(rows)
        row_promised: list[float | None] = [None] * len(rows)
        curves = sc.curves
        cache_promise: list[tuple[float, ...] | None] = [None] * len(row_of)  # S(1..c) of each verified cache prefix
        for i, r in enumerate(row_of):
            if r >= 0:
                decision[r], row_tau[r] = SOURCE_NAMES[source[i]], held[i]
                if source[i] == CACHE:
                    row_verified[r] = cut[i]
                    if curves is not None:
                        cache_promise[i] = tuple(curves[i, : cut[i]].tolist())
                        row_promised[r] = sum(cache_promise[i])
        self._record(snap, rows, sc.x, sc.row_pred, decision, row_tau, now, row_verified, row_promised)
        stats = self.stats
        decisions, owners, model_k = stats.decisions, rows.owners, pl.model_k
        for i, (st, src, c) in enumerate(zip(states, source, cut)):
            decisions[SOURCE_NAMES[src]] += 1
            if src == MODEL:
                promised = None if curves is None else tuple(self.model_curves.curve(ob.workload[i])[:model_k].tolist())
                st.verifying = VerifiedDraft(st.hindsight.output_len, model_k, True, snap.version_for(st.workload),
                                             promised=promised)
            elif src == CACHE:
                st.verifying = VerifiedDraft(st.hindsight.output_len, c, False, None, owners[row_of[i]][1],
                                             None if pl.token_prob is None else tuple(pl.token_prob[i].tolist()),
                                             cache_promise[i])
        if model_k:
            stats.model_k_steps[model_k] = stats.model_k_steps.get(model_k, 0) + 1
            if CACHE in source:
                stats.mixed_steps += 1
        stats.truncated += sum(1 for src, v, length in zip(source, pl.verify_len, sc.length_list)
                               if src == CACHE and v < length)
        if self.metrics is not None:
            self.metrics.step(states, source, list(held))
        contexts = rows.contexts
        cache_drafts = [contexts[r].draft.token_ids if r >= 0 else [] for r in row_of]
        drafts = [d[:c] if c else [] for d, c in zip(cache_drafts, cut)]
        self._report_emitted(snap, now)
        return StepPlan([st.req_id for st in states], pl.source, drafts, sc.predicted, pl.tau, sc.lengths,
                        cache_drafts, pl.model_k)

    def finish(self, req_id: str, last_tokens: Sequence[int] | np.ndarray = ()) -> None:
        """The request ended (after emitting `last_tokens`, if the engine has not reported them):
        label its remaining drafts with what was realised, and forget it."""
        st = self.requests.get(req_id)
        if st is None:
            return
        snap = self._snapshot
        now = self._clock()
        if len(last_tokens):
            rows = _StepDrafts()
            self._observe(RequestInput(req_id, last_tokens, None, st.tenant, st.workload, st.speculate), rows,
                          shadow=self.shadow_drafts and st.speculate)
            x, row_pred, _ = self._predict(snap, rows)
            self._record(snap, rows, x, row_pred, ["shadow"] * len(rows), [float("nan")] * len(rows), now)
            self._report_emitted(snap, now)
        del self.requests[req_id]
        st.verifying = None  # planned after the last token: never verified
        for tracked, label in st.hindsight.finish():
            record = st.records.pop(tracked)
            if record.position < st.hindsight.output_len:  # a draft made after the last token says nothing
                self._emit_cache(st, record, label, now)
        self.drafter.stop(req_id)

    def reset_cache(self) -> None:
        """A fresh suffix cache (a new deployment); only allowed with no request running."""
        if self.requests:
            raise RequestInputError(f"cannot reset the cache with {len(self.requests)} requests running")
        self.drafter = self._drafter_factory(self.drafter.config)

    # ---------------------------------------------------------------- internals
    def _check(self, inp: RequestInput) -> None:
        """Refuse a bad request before the step changes anything."""
        if inp.verified is not None and inp.verified < 0:
            raise RequestInputError(f"request {inp.req_id!r}: verified must be >= 0, got {inp.verified}")
        if inp.room is not None and (isinstance(inp.room, bool) or not isinstance(inp.room, (int, np.integer))
                                     or inp.room < 0):
            raise RequestInputError(f"request {inp.req_id!r}: room must be an int >= 0 or None, got {inp.room!r}")
        if inp.req_id in self.requests:
            return
        if inp.prompt is None:
            raise RequestInputError(f"request {inp.req_id!r} seen for the first time without its prompt")
        if inp.workload not in WORKLOADS:
            raise RequestInputError(f"request {inp.req_id!r}: unknown workload {inp.workload!r}; known: {WORKLOADS}")
        if not isinstance(inp.on_policy, (bool, np.bool_)):  # read, like the prompt, only when first seen
            raise RequestInputError(f"request {inp.req_id!r}: on_policy must be a bool, got {inp.on_policy!r}")

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
                              Hindsight(prompt, WORKLOADS.index(inp.workload), self.classes, bool(inp.on_policy)))
            self.requests[inp.req_id] = st
            self.drafter.start(inp.req_id, prompt)
            self.stats.requests_seen += 1
        st.speculate = inp.speculate
        if len(new):
            tally = self._emitted.setdefault((st.tenant, st.workload), [0, 0])
            tally[0] += len(new)
            tally[1] += 1
        if st.verifying is not None:
            self._settle(st, st.verifying, inp.verified, len(new) if inp.sampled is None else inp.sampled, len(new))
            st.verifying = None
        hindsight = st.hindsight
        if shadow and len(new) > 1:  # a token at a time, drafting after each but the last
            last = len(new) - 1
            for j, token in enumerate(new.tolist()):
                self.drafter.extend(inp.req_id, new[j : j + 1])
                labelled = hindsight.append_token(token)
                if labelled:
                    self._labelled(st, labelled, rows)
                if j < last:
                    self._draft(st, rows)
        else:
            if len(new):
                self.drafter.extend(inp.req_id, new)
            labelled = hindsight.append(new)
            if labelled:
                self._labelled(st, labelled, rows)
        return st

    def _labelled(self, st: RequestState, labelled: list[tuple[TrackedDraft, int]], rows: "_StepDrafts") -> None:
        """Drafts the request's new tokens decided: out as events, or, if this step made them,
        once the step has scored them."""
        records = st.records
        for tracked, label in labelled:
            record = records.pop(tracked, None)
            if record is None:  # drafted in this step: labelled once the step has scored it
                rows.labelled.append((st, tracked, label))
            else:
                self._emit_cache(st, record, label, self._clock())

    def _settle(self, st: RequestState, v: VerifiedDraft, verified: int | None, emitted: int, kept: int) -> None:
        """The engine's verdict on the draft planned for the request last time it ran: `verified`
        of its tokens were verified (None: all that were planned; fewer when the scheduler cut the
        draft to its token budget; 0 when the request was preempted first) and `emitted` - 1 of
        them accepted. Only what was verified counts: the statistics, the model drafter's live
        curve and the cache draft's recorded verified length."""
        n = v.draft_len if verified is None else min(verified, v.draft_len)
        promised = None if v.promised is None or n == 0 else sum(v.promised[:n])
        if n < v.draft_len:  # its record (made with the plan's prefix and promise) says what was verified
            self.stats.engine_cut += 1
            if v.tracked is not None and v.tracked in st.records:
                st.records[v.tracked] = replace(st.records[v.tracked], verified_len=n or None, promised=promised)
        if n == 0:
            return
        accepted = max(0, min(emitted - 1, n))
        self.stats.count_verified(n, accepted)
        if promised is not None:
            self.stats.promised += promised
            self.stats.promised_accepted += accepted
            if self.metrics is not None:
                self.metrics.promised(st.workload, st.tenant, DRAFTER_MODEL if v.model else DRAFTER_CACHE, promised)
        self.stats.accepted_not_output += max(0, accepted - kept)
        if v.model:
            self._emit_model(st, v, n, accepted, promised)
        if self.rival is not None:
            self._rival_seen.append((MODEL if v.model else CACHE, n, accepted, v.token_prob))

    def _draft(self, st: RequestState, rows: "_StepDrafts") -> int:
        """Draft at the request's current position; the draft joins its history at once (later
        positions of this step see it). Returns its row (-1: the cache had nothing)."""
        hindsight = st.hindsight
        d = self.drafter.draft(st.req_id, hindsight.tokens)
        if not d.token_ids:
            return -1
        return rows.add(st, hindsight.draft_context(d), hindsight.add(d))

    def _predict(self, snap: ServingSnapshot, rows: "_StepDrafts",
                 curves: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The feature matrix of the step's drafts and the gate's predictions, one call for all;
        with `curves`, each draft's survival curve too (the prediction is then its sum)."""
        if not len(rows):
            x = np.zeros((0, NUM_FEATURES), dtype=np.float32)
            return x, np.zeros(0, dtype=np.float32), (snap.gate.survival(x) if curves else None)
        x = feature_matrix(rows.contexts, self.classes)
        groups = self._gate_groups(snap, rows)
        calibrating = bool(snap.controls.calibrations) and snap.gate.kind == "survival"
        if curves or calibrating:
            s = snap.gate.survival(x) if not groups else self._by_gate(groups, x, lambda g, xs: g.survival(xs))
            if calibrating:
                s = self._calibrate(snap, rows, s)
            return x, s.sum(axis=1), (s if curves else None)
        return x, (snap.gate.predict(x) if not groups else self._by_gate(groups, x, lambda g, xs: g.predict(xs))), None

    @staticmethod
    def _gate_groups(snap: ServingSnapshot, rows: "_StepDrafts") -> list[tuple[GatePredictor, np.ndarray]] | None:
        """Rows by the gate that decides them (None: all by the champion); notes each row's version."""
        if not snap.workload_gates:
            rows.versions = None
            return None
        rows.versions = [snap.version_for(st.workload) for st, _ in rows.owners]
        groups: dict[int | None, list[int]] = {}
        for r, v in enumerate(rows.versions):
            groups.setdefault(v, []).append(r)
        return [(snap.gate_for_version(v), np.array(idx)) for v, idx in groups.items()]

    @staticmethod
    def _by_gate(groups, x: np.ndarray, score) -> np.ndarray:
        parts = [(idx, score(g, x[idx])) for g, idx in groups]
        out = np.zeros((len(x),) + parts[0][1].shape[1:], dtype=np.float32)
        for idx, values in parts:
            out[idx] = values
        return out

    @staticmethod
    def _calibrate(snap: ServingSnapshot, rows: "_StepDrafts", curves: np.ndarray) -> np.ndarray:
        """The fast per-position correction of each draft's curve: its tenant's for its workload if
        the leader fitted one, else its workload's, else none."""
        table = snap.controls.calibrations
        slope = np.ones(curves.shape)
        bias = np.zeros(curves.shape)
        hit = False
        for r, (st, _) in enumerate(rows.owners):
            c = table.get((st.workload, st.tenant)) or table.get((st.workload, None))
            if c is not None:
                slope[r], bias[r], hit = c.slope[: curves.shape[1]], c.bias[: curves.shape[1]], True
        return apply_calibration(curves, rows.lengths(), slope, bias) if hit else curves

    def _record(self, snap: ServingSnapshot, rows: "_StepDrafts", x: np.ndarray, predicted: np.ndarray,
                decision: list[str], tau: list[float], now: float, verified: list[int | None] | None = None,
                promised: list[float | None] | None = None) -> None:
        """Each draft of the step gets its record, complete, credited to the version that scored
        it; the drafts this step both made and labelled go out now."""
        owners = rows.owners
        if owners:
            # one bytes object for the matrix, cut per row: x[r].tobytes() per row costs more
            blob, width = x.tobytes(), x.shape[1] * x.itemsize  # tobytes: C order, whatever x's layout
            preds = predicted.tolist()
            versions = rows.versions
            version = snap.version_id
            for r, (st, tracked) in enumerate(owners):
                st.records[tracked] = CacheDraftRecord(tracked.position, len(tracked.tokens), decision[r],
                                                       float(preds[r]), tau[r],
                                                       version if versions is None else versions[r],
                                                       blob[r * width : (r + 1) * width],
                                                       None if verified is None else verified[r],
                                                       None if promised is None else promised[r])
        self.stats.cache_drafts += len(rows)
        for st, tracked, label in rows.labelled:
            self._emit_cache(st, st.records.pop(tracked), label, now)

    def _allocate(self, snap: ServingSnapshot, states: list[RequestState], workload: list[int], sc: _Scored,
                  allowed: list[bool], now: float) -> _Planned:
        """The allocator's plan for the step.

        Constraints per request: opted out or backed off -> nothing; the model drafter's curve has
        no columns without a model fallback (or in a cache-only back-off); a fixed tau (the
        configuration's, or an override's), or bounds that move the automatic tau, -> the binary
        decision with that tau; hybrid off -> always the model draft or always the whole cache
        draft. The overrides resolve against the break-even tau of a first plan; if any of them
        changes a request's constraint, the step is planned again with it."""
        n = len(states)
        d = self.decision
        curves, predicted, lengths, has_list = sc.curves, sc.predicted, sc.lengths, [k > 0 for k in sc.length_list]
        if n == 1 and d.fixed_tau is None and not len(snap.controls.overrides):  # batch 1: in plain values
            length = sc.length_list[0]
            model_curve = self.model_curves.curve(workload[0]).tolist() if d.model_drafting(1) else []
            if sc.model_room is not None:
                model_curve = model_curve[: sc.model_room[0]]
            one = allocate_one(curves.tolist()[0], length, model_curve, d.cost, AUTO if allowed[0] else FORCE_NONE)
            tau = one.tau if length > 0 else np.nan
            return _Planned(np.array([one.source], dtype=np.int8), [one.length], one.model_k,
                            np.array([tau], dtype=np.float32), [tau])
        model = self.model_curves.curves(workload) if d.model_drafting(n) else np.zeros((n, 0))
        if sc.model_room is not None and model.shape[1]:  # a model draft token it cannot output is worth nothing
            model = np.where(np.arange(model.shape[1]) < np.array(sc.model_room)[:, None], model, 0.0)
        if d.fixed_tau is None:
            mode_list = [AUTO if a else FORCE_NONE for a in allowed]
            mode = np.array(mode_list, dtype=np.int8)
        else:
            with np.errstate(invalid="ignore"):  # float32 against tau (as numpy compares them), so numpy's
                mode = np.where((lengths > 0) & (predicted > d.fixed_tau), FULL_CACHE, NO_CACHE).astype(np.int8)
            mode[~np.array(allowed, dtype=bool)] = FORCE_NONE
        plan = allocate(curves, lengths, model, d.cost, mode, batch=n)
        if not len(snap.controls.overrides):  # the common case, in lists
            if d.fixed_tau is None:
                taus = plan.tau.tolist()
                tau = [t if h else np.nan for t, h in zip(taus, has_list)]
                return _Planned(plan.source, plan.length.tolist(), plan.model_k, np.array(tau, dtype=np.float32), tau)
            mode_list = mode.tolist()
            taus, fixed = plan.tau.tolist(), np.full(n, d.fixed_tau, dtype=np.float64).tolist()
            tau = [(t if m == AUTO else f) if h else np.nan for t, f, m, h in zip(taus, fixed, mode_list, has_list)]
            return _Planned(plan.source, plan.length.tolist(), plan.model_k, np.array(tau, dtype=np.float32),
                            [f if h else np.nan for f, h in zip(fixed, has_list)])
        has = lengths > 0
        auto = plan.tau if d.fixed_tau is None else np.full(n, d.fixed_tau)
        held = auto.copy()
        changed = False
        for i, eff in _resolve_overrides(snap.controls, states, auto, np.array(allowed, dtype=bool), now):
            if eff.mode == "off_model":
                mode[i] = FORCE_MODEL
            elif eff.mode == "off_cache":
                mode[i] = FULL_CACHE if has[i] else FORCE_NONE
            elif eff.tau is not None and (eff.mode == "fixed" or eff.tau != auto[i]):
                held[i] = eff.tau
                mode[i] = FULL_CACHE if has[i] and predicted[i] > eff.tau else NO_CACHE
            else:
                continue
            changed = True
        if changed:
            plan = allocate(curves, lengths, model, d.cost, mode, batch=n)
        tau = np.where(mode == AUTO, plan.tau, held)
        return _Planned(plan.source, plan.length.tolist(), plan.model_k, np.where(has, tau, np.nan).astype(np.float32),
                        np.where(has, auto, np.nan).tolist())

    def _plan_rival(self, ob: _Observed, sc: _Scored) -> _Planned:
        """A competitor's rule: it first learns from what the engine verified since its last step
        (its own censoring), then plans this one from what its engine would see."""
        seen, self._rival_seen = self._rival_seen, []
        width = max(max(sc.length_list, default=0), 1)
        if seen:
            src, ver, acc, probs = zip(*seen)
            rows = np.zeros((len(seen), width), dtype=np.float64)
            for i, p in enumerate(probs):
                if p is not None:
                    rows[i, : min(len(p), width)] = p[:width]
            self.rival.learn(Outcome(np.array(src, np.int8), np.array(ver, np.int64), np.array(acc, np.int64), rows))
        else:
            self.rival.learn(Outcome(np.zeros(0, np.int8), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                     np.zeros((0, width))))
        contexts, n = ob.rows.contexts, len(ob.states)
        drafts = [contexts[r].draft if r >= 0 else None for r in ob.main_row]
        d = self.decision
        view = StepView(
            cache_len=sc.lengths,
            match_len=np.array([x.match_len if x is not None else 0 for x in drafts], dtype=np.int64),
            score=np.array([x.score if x is not None else 0.0 for x in drafts], dtype=np.float64),
            token_prob=conditional_probs([x.probs if x is not None else [] for x in drafts], width),
            allowed=np.array(ob.allowed, dtype=bool),
            model_survival=self.model_curves.curves(ob.workload) if d.model_drafting(n) else np.zeros((n, 0)),
            batch=n)
        plan = self.rival.plan(view, d.cost)
        nan = [float("nan")] * n
        return _Planned(plan.source, plan.length.tolist(), plan.model_k, np.full(n, np.nan, dtype=np.float32), nan,
                        view.token_prob)

    def _decide(self, snap: ServingSnapshot, states: list[RequestState], predicted: np.ndarray, lengths: np.ndarray,
                allowed: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """The binary rule. tau per request: the goodput rule with its workload's live model-drafter
        estimate, plus the learned correction of that workload, then the tenant's overrides; then
        the decision."""
        n = len(states)
        controls = snap.controls
        mu_e = self.mu_e
        mu = np.array([mu_e[st.workload] for st in states], dtype=np.float64)
        fallback = fallback_sources(mu, self.decision, n)
        tau = rule_thresholds(lengths, mu, fallback, self.decision)
        if controls.corrections and self.decision.fixed_tau is None:
            tau = tau + np.array([controls.corrections.get(st.workload, 0.0) for st in states])
        off = None
        if len(controls.overrides):
            off = np.zeros(n, dtype=np.int8)
            for i, eff in _resolve_overrides(controls, states, tau, np.ones(n, dtype=bool), now):
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

    def _emit_cache(self, st: RequestState, d: CacheDraftRecord, label: int, now: float) -> None:
        self.events.put(LabelledEvent(now, st.tenant, st.workload, st.req_id, d.position, DRAFTER_CACHE,
                                      d.decision, d.draft_len, label, d.predicted, d.tau, d.version_id, d.features,
                                      d.verified_len, d.promised))

    def _report_emitted(self, snap: ServingSnapshot, now: float) -> None:
        if self._emitted and self.stats_sink is not None:
            for (tenant, workload), (tokens, cycles) in self._emitted.items():
                self.stats_sink.add_steps(now, tenant, workload, snap.version_id or 0, tokens, cycles)
        self._emitted = {}

    def _emit_model(self, st: RequestState, m: VerifiedDraft, verified: int, accepted: int,
                    promised: float | None) -> None:
        self.stats.model_drafts += 1
        self.stats.model_accepted += accepted
        w = st.hindsight.workload
        self.model_curves.observe(w, verified, accepted)
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, m.position, DRAFTER_MODEL,
                                      "model", verified, accepted, None, None, m.version_id, None, None, promised))


def _resolve_overrides(controls: Controls, states: Sequence[RequestState], auto_tau: np.ndarray, allowed: np.ndarray,
                       now: float) -> Iterator[tuple[int, EffectiveTau]]:
    """Each allowed request's effective override (precedence tenant+workload > tenant > workload
    auto > default) against its automatic tau, at the runtime's clock: the one resolver both
    rules use."""
    at = datetime.fromtimestamp(now, timezone.utc)
    resolve = controls.overrides.resolve
    taus = auto_tau.tolist()
    for i in np.flatnonzero(allowed).tolist():
        yield i, resolve(states[i].tenant, states[i].workload, float(taus[i]), float(taus[i]), at)


def _request_ends(inputs: Sequence[RequestInput], rows: "_StepDrafts", main_row: list[int],
                  k_max: int) -> tuple[list[int] | None, list[int] | None]:
    """Each request's cache draft's length cut to the tokens it can still output (0: none), and the
    longest model draft it can output; (None, None) when no input says where its request can end
    (then every draft is whole)."""
    if not any(inp.room is not None or len(inp.stops) for inp in inputs):
        return None, None
    contexts = rows.contexts
    useful = [request_end.useful_length(contexts[r].draft.token_ids, inp.room, inp.stops) if r >= 0 else 0
              for inp, r in zip(inputs, main_row)]
    return useful, [request_end.model_room(inp.room, k_max) for inp in inputs]


def _known_lengths(inputs: Sequence[RequestInput], rows: "_StepDrafts", main_row: np.ndarray) -> np.ndarray | None:
    """Each request's cache draft's true accepted length where its input carries the continuation
    (NaN elsewhere); None when no input does (every engine but a replay serving the upper bound)."""
    for inp in inputs:
        if inp.continuation is not None:
            break
    else:
        return None
    out = np.full(len(inputs), np.nan)
    for i, inp in enumerate(inputs):
        if inp.continuation is not None and main_row[i] >= 0:
            draft = rows.contexts[main_row[i]].draft.token_ids
            out[i] = lcp(draft, list(inp.continuation[: len(draft)]))
    return out


class _StepDrafts:
    """The cache drafts of one step (each request's own and the shadow drafts in between), in rows."""

    def __init__(self) -> None:
        self.contexts: list[DraftContext] = []
        self.owners: list[tuple[RequestState, TrackedDraft]] = []
        self.labelled: list[tuple[RequestState, TrackedDraft, int]] = []  # drafts of this step labelled in it
        self.versions: list[int | None] | None = None  # each row's predictor version, when not all the champion's

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


def _versions_of(snap: ServingSnapshot) -> tuple[int | None, dict[str, int]]:
    """Which versions a snapshot serves, by id (a GatePredictor holds arrays: it has no plain ==)."""
    return snap.version_id, {w: v for w, (_, v) in snap.workload_gates.items()}
