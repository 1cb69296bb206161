"""The one wiring of the self-tuning service next to any engine (vLLM plugin, trace replay): the
runtime the engine calls, and around it the event writer, the statistics writer, the control
poller, the leader-gated learner and the step-cost writer (the engine hands it each step's timing:
`stack.step_costs.add(StepTiming)`).

The services start in dependency order and stop in reverse (the learner and the poller first, then
the event writer, which hands its last events to the statistics writer; the step-cost writer and
the statistics writer stop last), so everything queued is written. `synchronous=True` starts no
threads: the caller runs `sync_round()` between steps, and a run is then a deterministic function
of its inputs.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.core.decision import DecisionConfig
from controller.core.metrics import HvdMetrics
from controller.core.runtime import Runtime
from controller.services.control_poller import ControlPoller
from controller.services.event_writer import EventWriter, Tally
from controller.services.learner_service import LearnerService
from controller.services.lifecycle import Health
from controller.services.live_cost_fitter import LiveCostFitter
from controller.services.stats_writer import StatsWriter
from controller.services.step_cost_writer import StepCostWriter
from predictor.decision.profiles import CostProfile, DrafterProfile
from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.token_classes import TokenClasses
from predictor.gate.registry import load_gate
from predictor.online.learner import LearnerConfig
from storage.engine import session_scope
from storage.events import record_health
from storage.leader import make_leader_lock
from storage.stats import KEEP_STAT_DAYS

_log = logging.getLogger("hvd.services")

KEEP_EVENTS = 2_000_000  # retention limit of the raw decision events


def decision_config(drafter: DrafterProfile, cost: CostProfile, model_draft_len: int | None = None,
                    **options) -> DecisionConfig:
    """The decision rule's configuration, with the one choice of prior for the model drafter: the
    profile's survival curve per workload, up to the longest model draft (`model_draft_len`, else
    the profile's)."""
    return DecisionConfig(model_draft_len=model_draft_len or drafter.draft_len, cost=cost, drafter=drafter, **options)


@dataclass
class ServiceStack:
    runtime: Runtime
    stats: StatsWriter
    writer: EventWriter
    poller: ControlPoller
    learner: LearnerService | None
    step_costs: StepCostWriter | None = None  # what the engine's steps cost, per minute (None: not recorded)
    metrics: HvdMetrics | None = None  # the runtime's Prometheus metrics (the learner's tenant state goes there too)
    live_cost: LiveCostFitter | None = None  # the live cost model's refits (None: the engine does not fit its steps)

    @classmethod
    def build(cls, engine: Engine, decision: DecisionConfig, token_classes: TokenClasses, *, replica: str,
              learn: bool = True, learner_config: LearnerConfig | None = None, leader_lock: bool = True,
              suffix: SuffixConfig | None = None, stats_interval: float = 5.0,
              poll_interval: float = 2.0, metrics: HvdMetrics | None = None,
              step_costs: bool = True, step_cost_interval: float = 10.0, live_cost: bool = False,
              shadow_drafts: bool = True) -> "ServiceStack":
        """Everything around one runtime, on the current champion. `leader_lock=False`: this
        replica learns without asking (one process, synchronous runs). `metrics`: the Prometheus
        metrics the runtime counts into (none without). `step_costs`: a step-cost writer for the
        engine's step timings, written every `step_cost_interval` seconds under `replica`.
        `live_cost`: a thread for the refits of the engine's live cost model (the vLLM plugin's).
        `shadow_drafts`: the runtime's (Runtime.shadow_drafts)."""
        version_id, gate = load_gate(engine)
        stats = StatsWriter(engine, flush_interval=stats_interval, keep_days=KEEP_STAT_DAYS)
        runtime = Runtime(gate, token_classes, decision, version_id=version_id, suffix=suffix, stats_sink=stats,
                          metrics=metrics, shadow_drafts=shadow_drafts)
        writer = EventWriter(engine, runtime.events, stats=stats, keep_events=KEEP_EVENTS, replica=replica)
        if metrics is not None:
            writer.on_dropped = metrics.writer_dropped
        poller = ControlPoller(engine, runtime, interval=poll_interval)
        service = None
        if learn:
            lock = make_leader_lock(engine, "learner", replica) if leader_lock else None
            service = LearnerService(engine, decision, learner_config, replica=replica, lock=lock, start_at_end=True)
        costs = StepCostWriter(engine, replica, flush_interval=step_cost_interval) if step_costs else None
        stack = cls(runtime, stats, writer, poller, service, costs, metrics, LiveCostFitter() if live_cost else None)
        writer.services = stack.health  # the heartbeat row carries every service's state
        return stack

    def services(self) -> list:
        """In start order."""
        return [s for s in (self.stats, self.step_costs, self.writer, self.poller, self.learner, self.live_cost)
                if s is not None]

    def start(self) -> "ServiceStack":
        for s in self.services():
            s.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop every service, last started first; True if everything pending was written."""
        return all([s.stop(timeout) for s in reversed(self.services())])

    def shutdown(self, drain_seconds: float = 10.0, log: Callable[[str], None] | None = None) -> Tally:
        """Stop admitting (the runtime's queue is closed), stop every service, write what is left
        within about `drain_seconds`, and account for every event produced. The tally is logged,
        and stored: in this replica's health row if the database answers, and always as a line of
        `<spill dir>/shutdown.jsonl`. A tally with `lost > 0` should make the process exit non-zero."""
        self.runtime.events.close()
        writers = (self.writer, self.step_costs, self.stats)
        threads = [s for s in self.services() if s not in writers]
        for s in threads:
            s.stop(min(drain_seconds, 5.0))
        self.writer.stop(drain_seconds, drain_seconds=drain_seconds)
        if self.step_costs is not None:
            self.step_costs.stop(min(drain_seconds, 5.0))
        self.stats.stop(drain_seconds)
        tally = self.writer.tally()
        states = [h.to_json() for h in self.health()]
        try:
            with session_scope(self.writer.engine) as session:
                record_health(session, replica=self.writer.replica or "replica-0", queue_depth=tally.lost,
                              events_written=tally.written, events_dropped=tally.dropped,
                              events_dead_lettered=tally.dead_lettered, flush_ms=1000.0 * self.writer.last_flush_seconds,
                              services=json.dumps(states), dead_letters_pruned=self.writer.letters_pruned)
        except SQLAlchemyError:
            pass  # the database is down: the file below has it
        try:
            folder = self.writer.spill_dir
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "shutdown.jsonl", "a", encoding="ascii") as fh:
                fh.write(json.dumps({"at": time.time(), "replica": self.writer.replica, **tally.to_json()},
                                    ensure_ascii=True) + "\n")
        except OSError:
            pass
        if log is not None:
            log(tally.line())
        else:
            (_log.warning if tally.lost else _log.info)(tally.line())
        return tally

    def flush(self) -> bool:
        """Write every queued event and statistic, and every closed minute of step costs, now."""
        costs = self.step_costs.flush() if self.step_costs is not None else True
        return all([self.writer.flush(), self.stats.flush(), costs])

    def sync_round(self) -> None:
        """Without threads: write what is queued, learn from all of it, refresh the controls."""
        self.flush()
        if self.learner is not None:
            while self.learner.run_once():
                pass
        self.poller.poll_once()

    def health(self) -> list[Health]:
        """Every service's state, for the heartbeat row; the learner's tenant scopes go to the metrics
        at the same pace (every heartbeat), so the round itself does nothing more."""
        out = [s.health() for s in self.services()]
        if self.metrics is not None and self.learner is not None:
            cal = self.learner.calibrator
            self.metrics.calibration_scopes(cal.tenant_scopes(), cal.evicted)
        return out

    def tenant_state(self) -> dict[str, int]:
        """How many entries each per-tenant structure of this process holds (each is capped or
        flushed): the learner's calibration tenant scopes (and how many it evicted), the statistics
        writer's pending buckets, the metrics' tenant labels, the runtime's per-(tenant, workload)
        step tally and the fast corrections the control poller handed the runtime."""
        cal = None if self.learner is None else self.learner.calibrator
        return {"calibration_tenant_scopes": 0 if cal is None else cal.tenant_scopes(),
                "calibration_scopes_evicted": 0 if cal is None else cal.evicted,
                "stats_pending_buckets": self.stats.pending_keys(),
                "metric_tenant_labels": 0 if self.metrics is None else self.metrics.tenant_labels(),
                "runtime_step_tally": len(self.runtime._emitted),
                "served_corrections": len(self.runtime.snapshot.controls.calibrations)}
