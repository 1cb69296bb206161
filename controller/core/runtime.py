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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from controller.core.decision import (CACHE, MODEL, NONE, OFF_CACHE, OFF_MODEL, SOURCE_NAMES, DecisionConfig, decide,
                                      effective_rule, fallback_sources, rule_thresholds)
from controller.core.events import DRAFTER_CACHE, DRAFTER_MODEL, EventQueue, LabelledEvent
from controller.core.request_state import CacheDraftRecord, RequestState, VerifiedDraft
from predictor.decision.allocator import AUTO, FORCE_MODEL, FORCE_NONE, FULL_CACHE, NO_CACHE, allocate
from predictor.decision.profiles import known_survival
from predictor.drafting.cache_drafter import CacheDrafter, SuffixConfig
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import NUM_FEATURES, DraftContext, feature_matrix
from predictor.drafting.hindsight import Hindsight, TrackedDraft
from predictor.drafting.token_classes import TokenClasses
from predictor.gate.calibration import Calibration
from predictor.gate.calibration import apply as apply_calibration
from predictor.gate.mlp import GatePredictor
from storage.overrides import OverrideSnapshot
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
    accepted_count: dict[int, int] = field(default_factory=dict)  # verified drafts per number of tokens accepted
    truncated: int = 0  # cache drafts verified shorter than the cache made them
    model_k_steps: dict[int, int] = field(default_factory=dict)  # steps per model draft length
    mixed_steps: int = 0  # steps verifying cache and model drafts side by side

    def count_verified(self, draft_len: int, accepted: int) -> None:
        self.verified_drafts += 1
        self.verified_tokens += draft_len
        self.verified_accepted += accepted
        self.accepted_count[accepted] = self.accepted_count.get(accepted, 0) + 1


class Runtime:
    def __init__(self, gate: GatePredictor, classes: TokenClasses, decision: DecisionConfig | None = None,
                 events: EventQueue | None = None, version_id: int | None = None,
                 suffix: SuffixConfig | None = None, clock=time.time,
                 drafter_factory: Callable[[SuffixConfig | None], CacheDrafter] = CacheDrafter,
                 shadow_drafts: bool = True, stats_sink=None, metrics: "HvdMetrics | None" = None) -> None:
        self.gate = gate
        self.version_id = version_id
        # workloads served by their own champion (promoted for that workload): {workload: (gate, version)}
        self.workload_gates: dict[str, tuple[GatePredictor, int]] = {}
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
        self.mu_e = {w: self.model_curves.mean_accepted(i) for i, w in enumerate(WORKLOADS)}
        self.controls = Controls()
        self._clock = clock
        self._told_binary = False
        self._choose_rule()
        self._report_versions()

    def set_controls(self, controls: "Controls") -> None:
        """New learned corrections and overrides (from the control poller), used from the next step."""
        self.controls = controls

    def set_gate(self, gate: GatePredictor, version_id: int | None) -> None:
        """Swap the predictor between steps (a new champion); in-flight drafts keep their version."""
        self.gate, self.version_id = gate, version_id
        self._choose_rule()
        self._report_versions()

    def set_workload_gates(self, gates: dict[str, tuple[GatePredictor, int]]) -> None:
        """The per-workload champions (from the control poller); workloads not in it use `gate`."""
        self.workload_gates = dict(gates)
        self._report_versions()

    def version_for(self, workload: str) -> int | None:
        """The predictor version deciding `workload`'s drafts."""
        own = self.workload_gates.get(workload)
        return own[1] if own is not None else self.version_id

    def _report_versions(self) -> None:
        if self.metrics is not None:
            self.metrics.versions(self.version_id, {w: self.version_for(w) for w in WORKLOADS})

    def _choose_rule(self) -> None:
        """The rule this predictor serves with: a point-estimate version keeps the binary rule."""
        self.rule = effective_rule(self.decision.rule, self.gate.kind)
        if self.rule != self.decision.rule and not self._told_binary:
            self._told_binary = True
            _log.warning("predictor v%s is a point estimate (no survival curve): deciding with the binary rule "
                         "instead of the %s; a survival predictor (hvd warmstart) brings it back",
                         self.version_id, self.decision.rule)

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
        workload = np.zeros(n, dtype=np.int64)
        states = []
        for i, inp in enumerate(inputs):
            drafting = inp.speculate and speculating
            st = self._observe(inp, rows, shadow=drafting and self.shadow_drafts)
            states.append(st)
            workload[i] = st.hindsight.workload
            if drafting:
                main_row[i] = self._draft(st, rows)
        has_row = main_row >= 0
        main = main_row[has_row]
        lengths = np.zeros(n, dtype=np.int64)
        predicted = np.full(n, np.nan, dtype=np.float32)
        allocating = self.rule == "allocator"
        x, row_pred, row_curves = self._predict(rows, curves=allocating)
        lengths[has_row] = rows.lengths()[main]
        predicted[has_row] = row_pred[main]
        known = _known_lengths(inputs, rows, main_row)  # None unless a replay engine serves a perfect predictor
        if known is not None:
            predicted = np.where(np.isnan(known), predicted, known).astype(np.float32)
        allowed = np.array([st.speculate for st in states], dtype=bool) & speculating
        k = self.decision.model_draft_len
        if allocating:
            curves = np.zeros((n, row_curves.shape[1]), dtype=np.float32)
            curves[has_row] = row_curves[main]
            if known is not None:
                sure = ~np.isnan(known)
                curves[sure] = known_survival(known[sure], curves.shape[1])
            plan_source, verify_len, model_k, tau, auto_tau = self._allocate(states, workload, curves, predicted,
                                                                             lengths, allowed)
        else:
            if self.rule == "arctic":
                plan_source, tau = self._decide_arctic(rows, main_row, lengths, allowed)
            else:
                plan_source, tau = self._decide(states, predicted, lengths, allowed)
            model_k = k if (plan_source == MODEL).any() else 0
            verify_len = np.where(plan_source == CACHE, lengths, np.where(plan_source == MODEL, k, 0))
            auto_tau = tau
        is_cache = plan_source == CACHE
        source = plan_source.tolist()
        cut = np.where(is_cache, verify_len, 0).tolist()  # cache tokens verified per request
        row_of, held = main_row.tolist(), auto_tau.tolist()
        decision = ["shadow"] * len(rows)
        row_tau = [float("nan")] * len(rows)
        row_verified: list[int | None] = [None] * len(rows)
        for i in np.flatnonzero(has_row).tolist():
            decision[row_of[i]], row_tau[row_of[i]] = SOURCE_NAMES[source[i]], held[i]
            if source[i] == CACHE:
                row_verified[row_of[i]] = cut[i]
        self._record(rows, x, row_pred, decision, row_tau, row_verified)
        stats = self.stats
        for st, src, c in zip(states, source, cut):
            stats.decisions[SOURCE_NAMES[src]] += 1
            if src == MODEL:
                st.verifying = VerifiedDraft(st.hindsight.output_len, model_k, True)
            elif src == CACHE:
                st.verifying = VerifiedDraft(st.hindsight.output_len, c, False)
        if model_k:
            stats.model_k_steps[model_k] = stats.model_k_steps.get(model_k, 0) + 1
            if is_cache.any():
                stats.mixed_steps += 1
        stats.truncated += int(np.count_nonzero(is_cache & (verify_len < lengths)))
        if self.metrics is not None:
            self.metrics.step(states, source, held)
        cache_drafts = [rows.contexts[r].draft.token_ids if r >= 0 else [] for r in row_of]
        drafts = [d[:c] if c else [] for d, c in zip(cache_drafts, cut)]
        self._report_emitted()
        return StepPlan([st.req_id for st in states], plan_source, drafts, predicted, tau, lengths, cache_drafts,
                        model_k)

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
            x, row_pred, _ = self._predict(rows)
            self._record(rows, x, row_pred, ["shadow"] * len(rows), [float("nan")] * len(rows))
            self._report_emitted()
        del self.requests[req_id]
        st.verifying = None  # planned after the last token: never verified
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
        if st.verifying is not None:
            v = st.verifying
            accepted = max(0, min(len(new) - 1, v.draft_len))
            self.stats.count_verified(v.draft_len, accepted)
            if v.model:
                self._emit_model(st, v, accepted)
            st.verifying = None
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

    def _predict(self, rows: "_StepDrafts", curves: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The feature matrix of the step's drafts and the gate's predictions, one call for all;
        with `curves`, each draft's survival curve too (the prediction is then its sum)."""
        if not len(rows):
            x = np.zeros((0, NUM_FEATURES), dtype=np.float32)
            return x, np.zeros(0, dtype=np.float32), (self.gate.survival(x) if curves else None)
        x = feature_matrix(rows.contexts, self.classes)
        groups = self._gate_groups(rows)
        calibrating = bool(self.controls.calibrations) and self.gate.kind == "survival"
        if curves or calibrating:
            s = self.gate.survival(x) if not groups else self._by_gate(groups, x, lambda g, xs: g.survival(xs))
            if calibrating:
                s = self._calibrate(rows, s)
            return x, s.sum(axis=1), (s if curves else None)
        return x, (self.gate.predict(x) if not groups else self._by_gate(groups, x, lambda g, xs: g.predict(xs))), None

    def _gate_groups(self, rows: "_StepDrafts") -> list[tuple[GatePredictor, np.ndarray]] | None:
        """Rows by the gate that decides them (None: all by the champion); notes each row's version."""
        if not self.workload_gates:
            rows.versions = None
            return None
        names = [st.workload for st, _ in rows.owners]
        rows.versions = [self.version_for(w) for w in names]
        groups: dict[int | None, list[int]] = {}
        for r, v in enumerate(rows.versions):
            groups.setdefault(v, []).append(r)
        gates = {v: g for g, v in self.workload_gates.values()}
        return [(gates.get(v, self.gate) if v != self.version_id else self.gate, np.array(idx)) for v, idx in groups.items()]

    @staticmethod
    def _by_gate(groups, x: np.ndarray, score) -> np.ndarray:
        parts = [(idx, score(g, x[idx])) for g, idx in groups]
        out = np.zeros((len(x),) + parts[0][1].shape[1:], dtype=np.float32)
        for idx, values in parts:
            out[idx] = values
        return out

    def _calibrate(self, rows: "_StepDrafts", curves: np.ndarray) -> np.ndarray:
        """The fast per-position correction of each draft's curve: its tenant's for its workload if
        the leader fitted one, else its workload's, else none."""
        table = self.controls.calibrations
        slope = np.ones(curves.shape)
        bias = np.zeros(curves.shape)
        hit = False
        for r, (st, _) in enumerate(rows.owners):
            c = table.get((st.workload, st.tenant)) or table.get((st.workload, None))
            if c is not None:
                slope[r], bias[r], hit = c.slope[: curves.shape[1]], c.bias[: curves.shape[1]], True
        return apply_calibration(curves, rows.lengths(), slope, bias) if hit else curves

    def _record(self, rows: "_StepDrafts", x: np.ndarray, predicted: np.ndarray, decision: list[str],
                tau: list[float], verified: list[int | None] | None = None) -> None:
        """Each draft of the step gets its record, complete; the drafts this step both made and
        labelled go out now."""
        for r, (st, tracked) in enumerate(rows.owners):
            st.records[tracked] = CacheDraftRecord(tracked.position, len(tracked.tokens), decision[r],
                                                   float(predicted[r]), tau[r],
                                                   self.version_id if rows.versions is None else rows.versions[r],
                                                   x[r].tobytes(),
                                                   None if verified is None else verified[r])
        self.stats.cache_drafts += len(rows)
        for st, tracked, label in rows.labelled:
            self._emit_cache(st, st.records.pop(tracked), label)

    def _allocate(self, states: list[RequestState], workload: np.ndarray, curves: np.ndarray, predicted: np.ndarray,
                  lengths: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
        """The allocator's plan for the step: (source, tokens verified per request, the model draft
        length k, the tau each request was held to, its automatic tau).

        Constraints per request: opted out or backed off -> nothing; the model drafter's curve has
        no columns without a model fallback (or in a cache-only back-off); a fixed tau (the
        configuration's, or an override's), or bounds that move the automatic tau, -> the binary
        decision with that tau; hybrid off -> always the model draft or always the whole cache
        draft. The overrides resolve against the break-even tau of a first plan; if any of them
        changes a request's constraint, the step is planned again with it."""
        n = len(states)
        d = self.decision
        has = lengths > 0
        model = self.model_curves.curves(workload) if d.model_drafting(n) else np.zeros((n, 0))
        if d.fixed_tau is None:
            mode = np.full(n, AUTO, dtype=np.int8)
        else:
            with np.errstate(invalid="ignore"):
                mode = np.where(has & (predicted > d.fixed_tau), FULL_CACHE, NO_CACHE).astype(np.int8)
        mode[~allowed] = FORCE_NONE
        plan = allocate(curves, lengths, model, d.cost, mode, batch=n)
        auto = plan.tau if d.fixed_tau is None else np.full(n, d.fixed_tau)
        held = auto.copy()
        if len(self.controls.overrides) and self._apply_overrides(states, auto, predicted, has, allowed, mode, held):
            plan = allocate(curves, lengths, model, d.cost, mode, batch=n)
        tau = np.where(mode == AUTO, plan.tau, held)
        return (plan.source, plan.length, plan.model_k, np.where(has, tau, np.nan).astype(np.float32),
                np.where(has, auto, np.nan))

    def _apply_overrides(self, states: list[RequestState], auto: np.ndarray, predicted: np.ndarray, has: np.ndarray,
                         allowed: np.ndarray, mode: np.ndarray, held: np.ndarray) -> bool:
        """Each allowed request's overrides (precedence tenant+workload > tenant > workload auto >
        default) turned into its allocator constraint, in place; True if any changed."""
        now = datetime.now(timezone.utc)
        resolve = self.controls.overrides.resolve
        auto_taus = auto.tolist()
        changed = False
        for i in np.flatnonzero(allowed).tolist():
            st = states[i]
            eff = resolve(st.tenant, st.workload, auto_taus[i], auto_taus[i], now)
            if eff.mode == "off_model":
                mode[i] = FORCE_MODEL
            elif eff.mode == "off_cache":
                mode[i] = FULL_CACHE if has[i] else FORCE_NONE
            elif eff.tau is not None and (eff.mode == "fixed" or eff.tau != auto_taus[i]):
                held[i] = eff.tau
                mode[i] = FULL_CACHE if has[i] and predicted[i] > eff.tau else NO_CACHE
            else:
                continue
            changed = True
        return changed

    def _decide(self, states: list[RequestState], predicted: np.ndarray, lengths: np.ndarray,
                allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The binary rule. tau per request: the goodput rule with its workload's live model-drafter
        estimate, plus the learned correction of that workload, then the tenant's overrides
        (precedence tenant+workload > tenant > workload auto > default); then the decision."""
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
                                      d.decision, d.draft_len, label, d.predicted, d.tau, d.version_id, d.features,
                                      d.verified_len))

    def _report_emitted(self) -> None:
        if self._emitted and self.stats_sink is not None:
            now = self._clock()
            for (tenant, workload), (tokens, cycles) in self._emitted.items():
                self.stats_sink.add_steps(now, tenant, workload, self.version_id or 0, tokens, cycles)
        self._emitted = {}

    def _emit_model(self, st: RequestState, m: VerifiedDraft, accepted: int) -> None:
        self.stats.model_drafts += 1
        self.stats.model_accepted += accepted
        w = st.hindsight.workload
        self.model_curves.observe(w, m.draft_len, accepted)
        self.mu_e[st.workload] = self.model_curves.mean_accepted(w)
        self.events.put(LabelledEvent(self._clock(), st.tenant, st.workload, st.req_id, m.position, DRAFTER_MODEL,
                                      "model", m.draft_len, accepted, None, None, self.version_id, None))


@dataclass(frozen=True)
class Controls:
    """What the control plane tells a running runtime: per-workload corrections to the rule's tau
    (learned by the leader) and the active overrides. Swapped whole, never mutated."""

    corrections: dict[str, float] = field(default_factory=dict)
    overrides: OverrideSnapshot = field(default_factory=OverrideSnapshot)
    # the fast survival corrections for the champion served: {(workload, tenant or None): Calibration}
    calibrations: dict[tuple[str, str | None], Calibration] = field(default_factory=dict)


def _known_lengths(inputs: Sequence[RequestInput], rows: "_StepDrafts", main_row: np.ndarray) -> np.ndarray | None:
    """Each request's cache draft's true accepted length where its input carries the continuation
    (NaN elsewhere); None when no input does (every engine but a replay serving the upper bound)."""
    if all(inp.continuation is None for inp in inputs):
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
