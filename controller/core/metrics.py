"""HVD's Prometheus metrics, in the registry vLLM serves at /metrics (or any other): what the
runtime decided and what it cost, as it happens, for dashboards and alerts that already scrape vLLM.

Counted from the two places the facts are made: the runtime's step (one decision per request and
step: cache | model | none; the tau it held each workload to) and its event queue (every labelled
draft the runtime offers, through the queue's observer hook: tokens verified and accepted, the
gate's confusion matrix; the queue's depth and drops). The token and gate counts use the very
functions the stored statistics do (storage.stats), so a scrape and `stat_buckets` agree; they count
every labelled draft, stored or dropped (hvd_events_dropped_total says how many were dropped).

Labels are bounded: workload is one of storage.workloads.WORKLOADS (the runtime refuses others);
tenant keeps its name for the first `max_tenants` distinct tenants this process sees and is
"other" after that, so a flood of tenant names cannot blow up the series count.

Step costs (hvd_step_seconds): the engine times each step and hands the parts to `step_seconds`
(controller.core.step_costs.StepTiming); every step observes every part, zero included, so each
part's count is the number of steps and sum / count is what the part costs an average step (the
drafter's too, in steps that did not run it); a part's share of the step is its sum over the total's.

Observing never raises into the decode path: a failure is logged once and the metrics go on.
vLLM runs the model runner (and so the runtime) in a worker process while its API server answers
/metrics; `hvd serve --engine vllm` points PROMETHEUS_MULTIPROC_DIR at a fresh folder, where every
process's values meet (controller/cli/serve_vllm.py). Gauges say how they combine across processes.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from controller.core.decision import SOURCE_NAMES
from controller.core.events import DRAFTER_CACHE, DRAFTER_MODEL, LabelledEvent
from controller.core.step_costs import SUMMARY_PARTS, StepTiming
from storage.stats import GATE_OUTCOMES, LONG, gate_outcome, verified_tokens
from storage.workloads import WORKLOADS

_log = logging.getLogger("hvd.metrics")

DEFAULT_MAX_TENANTS = 20
OTHER_TENANT = "other"
DRAFTERS = (DRAFTER_CACHE, DRAFTER_MODEL)
STEP_PHASES = ("decode", "prefill")  # hvd_step_seconds' phase label
# hvd_live_cost_ms' term label: predictor.decision.live_cost's coefficients (a, b, c, d, e), then its floor
LIVE_COST_TERMS = ("base", "batch", "query_token", "drafter_call", "drafter_token", "floor_per_query_token")
# hvd_step_seconds' buckets, 0.1 ms .. 2 s: HVD's part (0.1-1 ms), GPU steps (5-10 ms) and CPU steps
# (20-200 ms) each fall across several buckets.
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)

_SHARED: "weakref.WeakKeyDictionary[CollectorRegistry, HvdMetrics]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


class Requester(Protocol):
    tenant: str
    workload: str


class _Series:
    """The labelled children of one (workload, tenant label), looked up once."""

    __slots__ = ("decisions", "draft", "accepted", "rejected", "promised", "gate")

    def __init__(self, m: "HvdMetrics", workload: str, tenant: str) -> None:
        self.decisions = {code: m.decisions.labels(workload, tenant, name) for code, name in SOURCE_NAMES.items()}
        self.draft = {d: m.draft_tokens.labels(workload, tenant, d) for d in DRAFTERS}
        self.accepted = {d: m.accepted_tokens.labels(workload, tenant, d) for d in DRAFTERS}
        self.rejected = {d: m.rejected_tokens.labels(workload, tenant, d) for d in DRAFTERS}
        self.promised = {d: m.promised_tokens.labels(workload, tenant, d) for d in DRAFTERS}
        self.gate = {o: m.gate_outcomes.labels(workload, tenant, o) for o in GATE_OUTCOMES}


class HvdMetrics:
    """The hvd_* metrics of one registry. Use `HvdMetrics.shared(registry)`: a registry refuses a
    second set of the same names, and every runtime of a process counts into one set."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.registry = registry
        self.max_tenants = max_tenants
        tenant_doc = (f"tenant: its own name for the first {max_tenants} distinct tenants this process saw, "
                      f"'{OTHER_TENANT}' for any later one")
        wt = ("workload", "tenant")
        self.decisions = Counter(
            "hvd_decisions", "Decode steps per request by what the step verified (source: cache = a cache "
            f"draft, model = the model drafter's, none = no draft); {tenant_doc}", wt + ("source",), registry=registry)
        self.draft_tokens = Counter(
            "hvd_draft_tokens", "Draft tokens verified (a cache draft's verified prefix, a model draft), by "
            f"drafter; counted when the draft is labelled; {tenant_doc}", wt + ("drafter",), registry=registry)
        self.accepted_tokens = Counter(
            "hvd_accepted_tokens", f"Verified draft tokens the target model accepted, by drafter; {tenant_doc}",
            wt + ("drafter",), registry=registry)
        self.rejected_tokens = Counter(
            "hvd_rejected_tokens", "Verified draft tokens the target model rejected (draft - accepted), by "
            f"drafter; {tenant_doc}", wt + ("drafter",), registry=registry)
        self.promised_tokens = Counter(
            "hvd_promised_tokens", "Draft tokens the allocator's plan expected the target to accept from the drafts "
            "it verified (the survival curve summed over the verified prefix; the model drafter's live curve over "
            "k), counted when the engine reports the verdict, by drafter. hvd_accepted_tokens over it below 1: the "
            "predictor over-promises on the drafts it acts on, though it may be calibrated over all of them; "
            f"{tenant_doc}", wt + ("drafter",), registry=registry)
        self.oracle_requests = Counter(
            "hvd_oracle_requests", "Requests a server measuring the served upper bound (HVD_ORACLE) saw, by "
            "outcome: matched (found in the recording), missing (not in it: served as usual), diverged (its "
            "output parted from the recording: the oracle stopped for it)", ("outcome",), registry=registry)
        self.gate_outcomes = Counter(
            "hvd_gate_outcomes", f"The gate's confusion matrix at >= {LONG} accepted tokens over every labelled "
            "cache draft it scored, shadow drafts included (outcome: tp | fp | fn | tn, as stat_buckets counts "
            f"them); {tenant_doc}", wt + ("outcome",), registry=registry)
        self.tau = Gauge(
            "hvd_tau", "tau of the workload's requests with a cache draft (the tau their events carry), averaged "
            "over them, in the runtime's latest step that had any (allocator: the automatic break-even expected "
            "accepted length, before tenant overrides; binary rule: the rule's tau with its learned correction "
            "and overrides)", ("workload",),
            registry=registry, multiprocess_mode="mostrecent")
        self.queue_depth = Gauge(
            "hvd_event_queue_depth", "Labelled events waiting for the event writer (summed over this "
            "process's runtimes and the live processes)", registry=registry, multiprocess_mode="livesum")
        self.events_dropped = Counter(
            "hvd_events_dropped", "Labelled events dropped before storage: by the decode path (queue full, "
            "or closed at shutdown) instead of waiting, or by the event writer when its buffer overflowed during "
            "a database outage", registry=registry)
        self.predictor_version = Gauge(
            "hvd_predictor_version", "Id of the predictor version deciding the workload's drafts (its own "
            "champion, else the whole stream's; 0: none)", ("workload",), registry=registry,
            multiprocess_mode="mostrecent")
        self.champion_version = Gauge(
            "hvd_champion_version", "Id of the whole stream's champion predictor version the runtime serves "
            "(0: none)", registry=registry, multiprocess_mode="mostrecent")
        self.step_time = Histogram(
            "hvd_step_seconds", "Seconds of each engine step by part (part: target = the target model's forward "
            "and sampling, hvd = HVD's runtime, drafter = the model drafter's proposer, rest = everything else, "
            "total = the whole step) and phase (decode: every request in the step decoded; prefill: the step "
            "held a prompt chunk); every step observes every part, zero included, so sum / count is the "
            "part's cost per step", ("part", "phase"), buckets=STEP_BUCKETS, registry=registry)
        self.live_cost = Gauge(
            "hvd_live_cost_ms", "The line the allocator prices this engine's steps with once it has fitted "
            "its own step times (HVD_LIVE_COST), in ms per term: t = base + batch * running requests + "
            "query_token * query tokens + drafter_call [model drafter called] + drafter_token * its draft "
            "length, and floor_per_query_token, the compute floor (0: none); absent before the first fit",
            ("term",), registry=registry, multiprocess_mode="mostrecent")
        self.live_cost_steps = Gauge(
            "hvd_live_cost_steps", "Decode steps the latest live cost fit used", registry=registry,
            multiprocess_mode="mostrecent")
        # PARTS, then "total", per phase
        self._step_parts = {phase: tuple(self.step_time.labels(p, phase) for p in SUMMARY_PARTS)
                            for phase in STEP_PHASES}
        # Per-tenant state is capped everywhere; what the caps hold and forget is visible here.
        self.metric_tenants = Gauge(
            "hvd_metric_tenants", f"Tenant names with their own label in this process's hvd_* series (at most "
            f"{max_tenants}; later tenants are counted under \"{OTHER_TENANT}\")", registry=registry,
            multiprocess_mode="max")
        self.calibration_tenant_scopes = Gauge(
            "hvd_calibration_tenant_scopes", "Tenant scopes the leading learner's fast calibration holds (at most "
            "its cap, CalibrationConfig.max_tenant_scopes; the whole-workload scopes are not counted)",
            registry=registry, multiprocess_mode="max")
        self.calibration_tenant_scopes_evicted = Counter(
            "hvd_calibration_tenant_scopes_evicted", "Tenant scopes the learner's fast calibration forgot (the "
            "longest unseen, with their window of drafts) to stay within its cap", registry=registry)
        self._evicted_seen = 0
        self._tenants: set[str] = set()
        self._series: dict[tuple[str, str], _Series] = {}
        self._tau: dict[str, Gauge] = {}  # a workload's series from its first tau on (none: not 0)
        self._lock = threading.Lock()
        self._failed = False

    @classmethod
    def shared(cls, registry: CollectorRegistry = REGISTRY, max_tenants: int = DEFAULT_MAX_TENANTS) -> "HvdMetrics":
        """The one HvdMetrics of `registry`, made on first use (its tenant cap is the first caller's)."""
        with _SHARED_LOCK:
            metrics = _SHARED.get(registry)
            if metrics is None:
                metrics = _SHARED[registry] = cls(registry, max_tenants)
            return metrics

    # ---------------------------------------------------------------- labels
    def tenant_label(self, tenant: str) -> str:
        """The tenant's own name while fewer than max_tenants names are in use, else "other"."""
        if tenant in self._tenants:
            return tenant
        with self._lock:
            if tenant in self._tenants or len(self._tenants) < self.max_tenants:
                self._tenants.add(tenant)
                self.metric_tenants.set(len(self._tenants))
                return tenant
        return OTHER_TENANT

    def calibration_scopes(self, scopes: int, evicted: int) -> None:
        """The learner's Calibrator: tenant scopes held now, and evicted since it started (its
        `evicted`, a running total: the counter adds what is new since the last call)."""
        with self._lock:
            self.calibration_tenant_scopes.set(scopes)
            if evicted > self._evicted_seen:
                self.calibration_tenant_scopes_evicted.inc(evicted - self._evicted_seen)
            self._evicted_seen = evicted

    def tenant_labels(self) -> int:
        """Tenant names with their own label (at most max_tenants)."""
        return len(self._tenants)

    def _of(self, workload: str, tenant: str) -> _Series:
        key = (workload, self.tenant_label(tenant))
        series = self._series.get(key)
        if series is None:
            with self._lock:
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = _Series(self, *key)
        return series

    def _failure(self, what: str) -> None:
        if not self._failed:
            self._failed = True
            _log.exception("HVD metrics: %s failed; serving goes on (logged once)", what)

    # ---------------------------------------------------------------- the event queue's observer
    def offered(self, event: LabelledEvent, admitted: bool) -> None:
        """A labelled draft the runtime put on its queue: its tokens and gate outcome, whether the
        queue took it (then it waits: depth + 1) or dropped it."""
        try:
            series = self._of(event.workload, event.tenant)
            draft, accepted = verified_tokens(event)
            if draft:
                series.draft[event.drafter].inc(draft)
                series.accepted[event.drafter].inc(accepted)
                if draft > accepted:
                    series.rejected[event.drafter].inc(draft - accepted)
            outcome = gate_outcome(event)
            if outcome is not None:
                series.gate[outcome].inc()
            if admitted:
                self.queue_depth.inc()
            else:
                self.events_dropped.inc()
        except Exception:
            self._failure("counting an event")

    def promised(self, workload: str, tenant: str, drafter: str, tokens: float) -> None:
        """A verified draft's promise: the tokens the plan expected of what the engine verified."""
        try:
            self._of(workload, tenant).promised[drafter].inc(tokens)
        except Exception:
            self._failure("counting a promise")

    def writer_dropped(self, count: int) -> None:
        """The event writer dropped `count` buffered events (its buffer overflowed)."""
        try:
            self.events_dropped.inc(count)
        except Exception:
            self._failure("counting the writer's drops")

    def taken(self, count: int) -> None:
        """The writer took `count` events off a queue."""
        try:
            self.queue_depth.dec(count)
        except Exception:
            self._failure("counting the queue")

    # ---------------------------------------------------------------- the runtime
    def step(self, requests: Sequence[Requester], source: Sequence[int], tau: Sequence[float]) -> None:
        """One step's decisions (`source`: a decision.SOURCE code per request) and, per workload, the
        mean of its requests' finite taus. One pass in plain Python: a step is a few requests."""
        try:
            sums: dict[str, list[float]] = {}
            for r, s, t in zip(requests, source, tau):
                self._of(r.workload, r.tenant).decisions[s].inc()
                if math.isfinite(t):
                    acc = sums.get(r.workload)
                    if acc is None:
                        sums[r.workload] = [t, 1.0]
                    else:
                        acc[0] += t
                        acc[1] += 1.0
            for workload, (total, count) in sums.items():
                gauge = self._tau.get(workload)
                if gauge is None:
                    gauge = self._tau[workload] = self.tau.labels(workload)
                gauge.set(total / count)
        except Exception:
            self._failure("counting a step")

    def step_seconds(self, timing: StepTiming, decode: bool) -> None:
        """One engine step's parts and total into hvd_step_seconds, under its phase: a step with a prompt
        chunk costs what the prompt does, so decode steps are kept apart from it."""
        try:
            for child, seconds in zip(self._step_parts[STEP_PHASES[0] if decode else STEP_PHASES[1]],
                                      timing.parts + (timing.total,)):
                child.observe(seconds)
        except Exception:
            self._failure("timing a step")

    def live_cost_fit(self, coefficients: Sequence[float], floor_ms_per_token: float, steps: int) -> None:
        """The live cost fit the allocator now prices with (LiveFit's coefficients, in LIVE_COST_TERMS'
        order, and its floor)."""
        try:
            for term, value in zip(LIVE_COST_TERMS, (*coefficients, floor_ms_per_token), strict=True):
                self.live_cost.labels(term).set(value)
            self.live_cost_steps.set(steps)
        except Exception:
            self._failure("publishing the live cost fit")

    def versions(self, champion: int | None, by_workload: Mapping[str, int | None]) -> None:
        """The predictor versions now serving: the champion and each workload's (0 for none)."""
        try:
            self.champion_version.set(champion or 0)
            for w in WORKLOADS:
                self.predictor_version.labels(w).set(by_workload.get(w) or 0)
        except Exception:
            self._failure("setting the versions")


def mark_process_dead() -> None:
    """At a process's exit, with PROMETHEUS_MULTIPROC_DIR set: drop its share of the live gauges
    (hvd_event_queue_depth), so the API server stops summing a queue that is gone."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        try:
            multiprocess.mark_process_dead(os.getpid())
        except OSError:
            pass
