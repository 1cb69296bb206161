"""The learner as a service: on the leader only, off the decode path, from what is in SQL.

Every replica's writer puts its labelled events in `decision_events`; the leader (one per
database: a PostgreSQL advisory lock, or a lease row on SQLite) reads them in id order, lets the
online learner shadow-score and learn, records drift, promotes the challenger when it has earned it
(a new predictor version with parent, metrics and reason, and the `champion` alias moved), and
keeps tau per workload (tau history: the allocator's break-even tau, or the binary rule's).
Replicas pick all of that up through their control pollers. A follower keeps trying for the lock,
so a dead leader is replaced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
from sqlalchemy import Engine

from controller.core.decision import DecisionConfig, effective_rule
from controller.core.tau_tuner import TauTuner
from controller.services.lifecycle import BackgroundService
from predictor.champion import CHAMPION, load_gate, promote, version_kind
from predictor.goodput import model_step_ms
from predictor.online import LearnerConfig, OnlineLearner, batch_from_events
from predictor.promotion import ShadowScore
from predictor.traces import WORKLOADS
from storage.engine import session_scope
from storage.events import events_after, last_event_id
from storage.versions import add_drift_event, add_tau_history, create_version, get_alias_version


@dataclass
class LearnerStats:
    events: int = 0
    updates: int = 0
    promotions: list[int] = field(default_factory=list)
    drifts: list[tuple[str, int]] = field(default_factory=list)
    cursor: int = 0
    last_update: datetime | None = None


class LearnerService(BackgroundService):
    """`lock` (storage.leader) gates the rounds of the thread: without one this replica always leads."""

    name = "hvd-learner"
    run_at_start = True

    def __init__(self, engine: Engine, decision: DecisionConfig, config: LearnerConfig | None = None,
                 replica: str = "replica-0", lock=None, start_at_end: bool = True, batch_events: int = 2000,
                 interval: float = 0.5) -> None:
        super().__init__(interval, max_backoff=2.0)
        self.engine = engine
        self.decision = decision
        self.config = config or LearnerConfig()
        self.replica = replica
        self.lock = lock
        self.batch_events = batch_events
        self.tuner = TauTuner(decision)
        self.stats = LearnerStats()
        self._leading = lock is None
        self.champion_id, champion = load_gate(engine)
        self.learner = OnlineLearner(champion, self._goodput, self.config)
        if start_at_end:
            with session_scope(engine) as s:
                self.stats.cursor = last_event_id(s)

    # ---------------------------------------------------------------- one round
    def run_once(self) -> int:
        """Learn from the next batch of stored events; returns how many events were read."""
        self._follow_external_champion()
        with session_scope(self.engine) as s:
            rows = events_after(s, self.stats.cursor, self.batch_events)
        if not rows:
            return 0
        self.stats.cursor = rows[-1].id
        decided_workload, decided_tau = [], []
        for r in rows:
            if r.drafter == "model":
                self.tuner.observe_model(r.workload, r.draft_len, r.accepted)
            elif r.decision != "shadow" and r.tau is not None:
                decided_workload.append(WORKLOADS.index(r.workload))
                decided_tau.append(r.tau)
        self.tuner.observe_break_even(np.array(decided_workload, dtype=np.int64), np.array(decided_tau))
        batch = batch_from_events(rows, self.tuner.thresholds)
        now = datetime.now(timezone.utc)
        if len(batch.label):
            self.tuner.observe_cache(batch, self.learner.champion.predict(batch.features))
            result = self.learner.learn_many(batch)
            self.stats.updates += result.updates
            self.stats.last_update = now
            with session_scope(self.engine) as s:
                for d in result.drifts:
                    self.stats.drifts.append((d.workload, d.events_seen))
                    add_drift_event(s, at=now, workload=d.workload, detector="adwin",
                                    detail={"events_seen": d.events_seen, "error_mean": round(d.error_mean, 4)},
                                    predictor_version_id=self.champion_id)
                rule = effective_rule(self.decision.rule, self.learner.champion.kind)
                for c in self.tuner.changes("drift" if result.drifts else "live estimates", rule):
                    add_tau_history(s, at=now, workload=c.workload, tau=c.tau, rule_tau=c.rule_tau,
                                    correction=c.correction, model_mean_accepted=c.mu_e, reason=c.reason,
                                    replica=self.replica)
            score = self.learner.shadow.score()
            if self.config.promotion.earned(score, self.learner.since_promotion):
                self._promote(score)
        self.stats.events += len(rows)
        return len(rows)

    def _take_over(self) -> None:
        """Just became leader: what earlier leaders learned is in the champion; start at the end."""
        with session_scope(self.engine) as s:
            self.stats.cursor = last_event_id(s)

    def _promote(self, score: ShadowScore) -> None:
        challenger = self.learner.challenger()
        with session_scope(self.engine) as s:
            version = create_version(
                s, blob=challenger.to_bytes(), kind=version_kind(challenger), feature_schema_hash=challenger.schema_hash,
                metrics={"shadow": score.to_json()},
                training_summary={"online": {"events_seen": self.learner.events_seen, "updates": self.learner.updates,
                                             "seed": self.config.seed}},
                reason=(f"promoted by the online learner: goodput proxy {100 * score.gain:+.2f}% and MAE "
                        f"{score.challenger_mae:.3f} vs {score.champion_mae:.3f} over {score.events} shadow-scored events"),
                created_by=f"learner@{self.replica}", parent_id=self.champion_id)
            promote(s, version.id, reason="promotion", actor=f"learner@{self.replica}")  # refuses an unloadable blob
            new_id = version.id
        self.champion_id = new_id
        self.stats.promotions.append(new_id)
        self.learner.adopt(challenger)

    def _follow_external_champion(self) -> None:
        """An operator moved the alias (rollback): learn on from that version instead."""
        with session_scope(self.engine) as s:
            current = get_alias_version(s, CHAMPION)
            current_id = current.id if current is not None else None
        if current_id is not None and current_id != self.champion_id:
            self.champion_id, champion = load_gate(self.engine, current_id)
            self.learner = OnlineLearner(champion, self._goodput, self.config)

    def _goodput(self, label: np.ndarray, draft_len: np.ndarray, cache: np.ndarray,
                 workload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and milliseconds of the step each decision implies: the cache draft's label + 1
        when verified, else the model drafter's expected tokens (its live mean) at its step cost."""
        cost = self.decision.cost
        mu = np.array([self.tuner.state[WORKLOADS[w]].mu_e for w in workload.tolist()])
        tokens = np.where(cache, label + 1.0, mu + 1.0)
        ms = np.where(cache, cost.target_ms(1 + draft_len.astype(np.float64)),
                      model_step_ms(cost, self.decision.model_draft_len))
        return tokens, ms

    # ---------------------------------------------------------------- the thread
    def round(self) -> float:
        """Lead if the lock allows (a new leader starts at the end of the events), then learn; no
        pause while a full batch of events is waiting."""
        if self.lock is None:
            leading = True
        else:  # a leader whose lock went with its connection (an outage) is a follower again
            leading = self.lock.renew() if self.lock.is_leader else self.lock.try_acquire()
        if leading and not self._leading:
            self._take_over()
        self._leading = leading
        read = self.run_once() if leading else 0
        self.succeeded()
        return 0.0 if read >= self.batch_events else self.interval

    def stop(self, timeout: float = 30.0) -> bool:
        ok = super().stop(timeout)
        if self.lock is not None:
            self.lock.release()
        return ok
