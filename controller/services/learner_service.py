"""The learner as a service: on the leader only, off the decode path, from what is in SQL.

Every replica's writer puts its labelled events in `decision_events`; the leader (one per
database: a fenced lease, storage.leader) reads them in commit order (storage.events), lets the
online learner shadow-score and learn, records drift, promotes the challenger when it has earned it
(a new predictor version with parent, metrics and reason, and the `champion` alias moved), and
keeps tau per workload (tau history: the allocator's break-even tau, or the binary rule's).
Replicas pick all of that up through their control pollers. A follower keeps trying for the lock,
so a dead leader is replaced. Each round commits its writes and the fleet's cursor together, inside
the leader's term (storage.learner_log): every committed event is learned in exactly one round.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import NamedTuple

import numpy as np
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from controller.core.decision import DecisionConfig, effective_rule
from controller.core.tau_tuner import TauTuner
from controller.services.lifecycle import BackgroundService
from predictor.decision.binary_rule import model_step_ms
from predictor.drafting.features import NUM_FEATURES
from predictor.gate.batch import Batch
from predictor.gate.calibration import Calibration
from predictor.gate.mlp import SURVIVAL_K, GatePredictor
from predictor.gate.registry import (CHAMPION, check_blob, load_gate, move_alias, version_kind, workload_alias,
                               workload_champions)
from predictor.online.calibrator import Calibrator, Recent, Score
from predictor.online.counterfactual import Paths, gain, replay_paths, served_curves_from, wins
from predictor.online.learner import LearnerConfig, OnlineLearner, batch_from_events
from predictor.online.promotion import ShadowScore
from predictor.online.workload_promotion import Verdict, WorkloadPromoter, replay_drafts
from storage.calibrations import ALL_TENANTS, clear_calibrations, save_calibration
from storage.engine import session_scope
from storage.events import EventCursor, count_cache_drafts_since, events_after, events_end
from storage.learner_log import PRUNE_EVERY, advance_cursor, place_cursor, prune_rounds, read_cursor
from storage.learner_checks import add_learner_check
from storage.learning_room import add_learning_room, prune_learning_room
from storage.limits import MAX_REASON_LEN
from storage.pins import AliasPinnedError, current_pin, list_pins
from storage.tau_history import TauRetention
from storage.versions import (add_drift_event, add_tau_history, create_version, get_alias_version,
                              list_alias_events)
from storage.workloads import WORKLOADS

# A fast calibration is served only where the held-back window's replay says it wins both walked one
# request at a time and walked at the served batch (None): judged at every refit, it needs the
# stricter bar, and the two walks err differently (on the left-out sources the served batch alone
# served a toolbench correction that lost 0.5% ms, batch 1 alone a can-ai-code one that lost 0.3%).
CALIBRATION_JUDGES = (1, None)
# Headroom measurements kept (storage.learning_room): one per 1,000 drafts of a workload, so the
# newest 10 million drafts' worth; the dashboard shows each workload's newest.
KEEP_LEARNING_ROOM = 10_000
MIN_JUDGED = 200  # held-back drafts a scope needs before its calibration is judged (and served)
log = logging.getLogger("hvd.learner")


@dataclass
class LearnerStats:
    events: int = 0
    updates: int = 0
    promotions: list[int] = field(default_factory=list)
    drifts: list[tuple[str, int]] = field(default_factory=list)
    cursor: int = 0
    cursor_at: float | None = None  # unix time of the event at the cursor
    last_update: datetime | None = None
    calibrations: int = 0  # scopes refitted
    rollbacks: list[tuple[str, int, int]] = field(default_factory=list)  # (workload, from version, back to)
    held: list[tuple[str, int]] = field(default_factory=list)  # (alias, version) moves a pin refused
    moved_meanwhile: list[tuple[str, int]] = field(default_factory=list)  # (alias, version) moves a CAS refused


class Judgement(NamedTuple):
    """Workload comparisons judged in a round (WorkloadPromoter.judge), to be acted on in its transaction."""

    challenger: GatePredictor
    verdicts: list[Verdict]
    judged: dict[int, int]  # workload index -> the version serving it when judged


class LearnerService(BackgroundService):
    """`lock` (storage.leader) gates the rounds of the thread: without one this replica always leads."""

    name = "hvd-learner"
    run_at_start = True

    def __init__(self, engine: Engine, decision: DecisionConfig, config: LearnerConfig | None = None,
                 replica: str = "replica-0", lock=None, start_at_end: bool = True, batch_events: int = 2000,
                 interval: float = 0.5, max_backoff: float = 2.0) -> None:
        super().__init__(interval, max_backoff=max_backoff)
        self.engine = engine
        self.decision = decision
        self.config = config or LearnerConfig()
        self.replica = replica
        self.lock = lock
        self.batch_events = batch_events
        self.stats = LearnerStats()
        self._leading = lock is None or lock.is_leader
        self._start_at_end = start_at_end
        self.tau_retention = TauRetention()  # tau_history's age and row bounds, pruned where it is written
        self.cursor = EventCursor()  # after the last event learned, in commit order (storage.events)
        self._cursor_placed = False  # whether the database holds a cursor (a leader places it at take-over)
        self._stale = False  # a round did not commit: rebuild from the database before the next
        self._rounds = 0
        self._fresh()
        self._take_over()

    def _fresh(self) -> None:
        """What the learner knows, from the champions in the database alone."""
        self.tuner = TauTuner(self.decision)
        self.champion_id, champion = load_gate(self.engine)
        self.learner = OnlineLearner(champion, self._goodput, self.config)
        self.calibrator = Calibrator(self.config.calibration)
        self.promoter = WorkloadPromoter(self.config.counterfactual, NUM_FEATURES, len(WORKLOADS))
        self.workload_gates: dict[str, tuple[int, GatePredictor]] = {}  # workloads with their own champion
        self._before: dict[str, int] = {}  # a watched promotion's predecessor, per workload
        self._checks: list[dict] = []  # judgements to record (storage.learner_checks), written with the round's writes
        self._rooms: list[dict] = []  # headroom measurements to record (storage.learning_room), likewise

    @property
    def resumes(self) -> bool:
        """Whether this learner went on from a cursor an earlier learner placed."""
        return self._resumed

    def progress(self) -> dict | None:
        """The learner's cursor, so the Health page can show how far it lags the event log, and its
        capped per-tenant state (calibration tenant scopes held, their cap, how many it evicted)."""
        return {"cursor": self.stats.cursor, "cursor_at": self.stats.cursor_at, "leading": self._leading,
                "epoch": None if self.lock is None else self.lock.epoch,
                "tenant_scopes": self.calibrator.tenant_scopes(),
                "tenant_scope_cap": self.calibrator.config.max_tenant_scopes,
                "tenant_scopes_evicted": self.calibrator.evicted}

    # ---------------------------------------------------------------- one round
    def run_once(self) -> int:
        """Learn from the next batch of settled events, then commit the round in one transaction,
        fenced by the leader's lease: what it concluded, and the cursor moved (compare-and-set) past
        the events it read. A round that does not commit leaves this learner stale: it starts again
        from what the database holds, so no event is learned twice (storage.learner_log)."""
        if self._stale:
            self._rebuild()
        self._follow_external_champion()
        with session_scope(self.engine) as s:
            rows = events_after(s, self.cursor, self.batch_events)
        if not rows:
            return 0
        self._stale = True  # until the round commits
        end = EventCursor(rows[-1].txid, rows[-1].id)
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
        learned = judgement = score = None
        if len(batch.label):
            self.tuner.observe_cache(batch, self.learner.champion.predict(batch.features))
            counterfactual = self._counterfactual()
            released = self.promoter.hold(batch) if counterfactual else None
            refitted = self._calibrate(released) if counterfactual else {}
            result = self.learner.learn_many(batch, released)
            self.stats.updates += result.updates
            self.stats.last_update = now
            for d in result.drifts:
                # what the correction learned is about the traffic before the drift
                self.calibrator.reset(d.workload)
                self.stats.drifts.append((d.workload, d.events_seen))
            rule = effective_rule(self.decision.rule, self.learner.champion.kind)
            changes = self.tuner.changes("drift" if result.drifts else "live estimates", rule)
            learned = (refitted, result.drifts, changes, self.calibrator.take_forgotten())
            if counterfactual:
                judgement = self._judge()
            else:
                score = self.learner.shadow.score()
                if not self.config.promotion.earned(score, self.learner.since_promotion):
                    score = None
        with self._leader_transaction() as s:
            if learned is not None:
                self._write_learned(s, now, *learned)
            if judgement is not None:
                self._act_on(s, judgement)
            if score is not None:
                self._promote(s, score)
            self._write_checks(s, now)
            self._advance(s, end, len(rows))
        self._stale = False
        self.cursor = end
        self.stats.cursor = end.id
        self.stats.cursor_at = rows[-1].at.timestamp()
        self.stats.events += len(rows)
        return len(rows)

    @contextmanager
    def _leader_transaction(self) -> Iterator[Session]:
        """One transaction of the leader's writes, committed only inside its term (storage.leader)."""
        with session_scope(self.engine) if self.lock is None else self.lock.transaction() as s:
            yield s

    def _advance(self, s: Session, end: EventCursor, events: int) -> None:
        """The cursor from where this learner found it to `end`, and the round logged."""
        if not self._cursor_placed:
            self._place(s)
        epoch, holder = (0, self.replica) if self.lock is None else (self.lock.epoch, self.lock.holder)
        advance_cursor(s, self.cursor, end, events, epoch=epoch, holder=holder)
        self._rounds += 1
        if self._rounds % PRUNE_EVERY == 0:
            prune_rounds(s)

    def _write_learned(self, s: Session, now: datetime, refitted: dict, drifts: list, changes: list,
                       forgotten: list[tuple[str, str | None]]) -> None:
        """The round's calibrations (served or cleared, and those of tenant scopes the calibrator
        evicted), drifts and tau changes."""
        for workload, tenant in forgotten:
            if tenant is not None and (workload, tenant) not in refitted:
                clear_calibrations(s, workload, tenant)
        for (workload, tenant), (calibration, pays, verdict) in refitted.items():
            if pays:  # won by the margin, clearly
                save_calibration(s, workload=workload, tenant=tenant,
                                 predictor_version_id=self._serving(workload)[0],
                                 params=calibration.to_json(), events=calibration.events,
                                 reason=(f"fitted on {calibration.events} labelled drafts; counterfactual "
                                         f"goodput {100 * verdict:+.2f}% on the held-back drafts"))
            else:  # a correction that would not have paid is not served
                clear_calibrations(s, workload, ALL_TENANTS if tenant is None else tenant)
        for d in drifts:
            clear_calibrations(s, d.workload)
            add_drift_event(s, at=now, workload=d.workload, detector="adwin",
                            detail={"events_seen": d.events_seen, "error_mean": round(d.error_mean, 4)},
                            predictor_version_id=self.champion_id)
        for c in changes:
            add_tau_history(s, at=now, workload=c.workload, tau=c.tau, rule_tau=c.rule_tau,
                            correction=c.correction, model_mean_accepted=c.mu_e, reason=c.reason,
                            replica=self.replica)
        self.tau_retention.wrote(s, now, len(changes))

    def _serving(self, workload: str) -> tuple[int, GatePredictor]:
        """(version id, gate) deciding `workload`: its own champion, else the champion."""
        return self.workload_gates.get(workload, (self.champion_id, self.learner.champion))

    def _counterfactual(self) -> bool:
        """Survival champions are promoted per workload by counterfactual replay; a point champion
        (no curve to replay) keeps the whole-stream shadow rule."""
        return self.learner.champion.kind == "survival" and self.learner.model.kind == "survival"

    def _judge(self) -> Judgement | None:
        """The comparisons due (predictor.online.workload_promotion), judged; nothing written yet."""
        due = self.promoter.due()
        if not due:
            return None
        challenger = self.learner.challenger()
        verdicts = [self.promoter.judge(w, self._serving(WORKLOADS[w])[1], challenger, self.tuner.model.curves(
            np.array([w])), self.decision.cost) for w in due]
        wins = [v for v in verdicts if v.action == "promote"]
        losses = [v for v in verdicts if v.action == "rollback"]
        told = [v for v in verdicts if v.outcome not in ("lost", "waiting")]
        judged = {v.workload: self._serving(WORKLOADS[v.workload])[0] for v in verdicts}  # before any move
        self._rooms += [self._learning_room(v, judged[v.workload]) for v in verdicts if v.headroom is not None]
        return Judgement(challenger, verdicts, judged)

    def _act_on(self, s: Session, judgement: Judgement) -> None:
        """The judgement acted on: one new version for the challenger if it won anywhere, each winning
        workload's alias moved to it, regressions rolled back."""
        challenger, verdicts, judged = judgement
        wins = [v for v in verdicts if v.action == "promote"]
        losses = [v for v in verdicts if v.action == "rollback"]
        told = [v for v in verdicts if v.outcome not in ("lost", "waiting")]
        if not told:
            return
        actor = f"learner@{self.replica}"
        version = None
        pins, refused = list_pins(s), {}  # workload -> why its move was not made
        for v in wins:  # a pinned workload's win makes no version; the move itself re-checks under its lock
            alias = workload_alias(WORKLOADS[v.workload])
            if alias in pins:
                refused[v.workload] = self._refuse(alias, None, f"held by a pin: {AliasPinnedError(alias, pins[alias])}")
        wins = [v for v in wins if v.workload not in refused]
        if wins:
            names = ", ".join(WORKLOADS[v.workload] for v in wins)
            version = create_version(
                s, blob=challenger.to_bytes(), kind=version_kind(challenger), feature_schema_hash=challenger.schema_hash,
                metrics={"counterfactual": {WORKLOADS[v.workload]: v.to_json() for v in wins}},
                training_summary={"online": {"events_seen": self.learner.events_seen, "updates": self.learner.updates,
                                             "seed": self.config.seed}},
                reason=f"promoted by the online learner for {names} (counterfactual replay on held-back drafts)",
                created_by=actor, parent_id=self.champion_id, check=check_blob)
            self.stats.promotions.append(version.id)
            for v in wins:
                name = WORKLOADS[v.workload]
                before = self._serving(name)[0]
                why = self._move(s, name, version.id, reason=(
                    f"promotion for {name}: counterfactual goodput {100 * v.gain:+.2f}% over v{before} "
                    f"on the {v.candidate.drafts} newest drafts, held back from its training"))
                if why is not None:
                    refused[v.workload] = why
                    continue
                self._before[name] = before
                self._switch(s, name, version.id, challenger)
        for v in losses:
            name = WORKLOADS[v.workload]
            back = self._before.pop(name)
            promoted = self._serving(name)[0]
            why = self._move(s, name, back, reason=(
                f"automatic rollback for {name}: v{promoted} served {100 * -v.gain:.2f}% less goodput than v{back} "
                f"on the {v.candidate.drafts} drafts after its promotion"))
            if why is not None:
                refused[v.workload] = why
                continue
            _, gate = load_gate(self.engine, back) if back != self.champion_id else (back, self.learner.champion)
            self._switch(s, name, back, gate)
            self.stats.rollbacks.append((name, promoted, back))
        for v in told:
            if v.workload in refused:
                self._checks.append(self._refused_check(v, judged[v.workload], refused[v.workload]))
                continue
            self._checks.append(self._promotion_check(v, judged[v.workload],
                                                      None if version is None else version.id))

    def _promotion_check(self, v: Verdict, serving: int, promoted_as: int | None) -> dict:
        """A promotion verdict worth recording (storage.learner_checks), in words; `serving`: the
        version that served the workload when it was judged."""
        name, p = WORKLOADS[v.workload], self.config.counterfactual
        on = f"on the {v.candidate.drafts} newest {name} drafts"
        reason = {
            "won": f"the challenger ({self.learner.events_seen} events learned) won by {100 * v.gain:+.2f}% {on}, "
                   f"held back from its training; it is promoted only if it still gains on a window of later drafts",
            "confirmed": f"the challenger still gains {100 * v.gain:+.2f}% {on}, all after its win; more windows to go",
            "refused": f"the challenger gained {100 * v.gain:+.2f}% {on}, all after its win (it needed "
                       f"{100 * p.rollback_margin:+.2f}%): not promoted",
            "promoted": f"the challenger still gains {100 * v.gain:+.2f}% {on}, all after its win: promoted"
                        + (f" as v{promoted_as}" if promoted_as is not None else ""),
            "kept": f"the promotion still gains {100 * v.gain:+.2f}% over the version it replaced, on the "
                    f"{v.candidate.drafts} drafts since: kept on probation",
            "rolled back": f"the promotion lost {100 * -v.gain:.2f}% against the version it replaced, on the "
                           f"{v.candidate.drafts} drafts since: rolled back",
        }[v.outcome]
        return {"workload": name, "tenant": None, "subject": "promotion", "outcome": v.outcome, "gain": v.gain,
                "drafts": v.candidate.drafts, "predictor_version_id": serving, "reason": reason}

    @staticmethod
    def _learning_room(v: Verdict, serving: int) -> dict:
        """A look's headroom (storage.learning_room), with the challenger's gain where one was tried."""
        probation = v.outcome in ("kept", "rolled back")
        return {"workload": WORKLOADS[v.workload], "predictor_version_id": serving, "drafts": v.window,
                "headroom": v.headroom, "challenger_gain": None if probation else v.gain}

    def _write_checks(self, session, now: datetime) -> None:
        """The round's learner checks and headroom measurements."""
        for check in self._checks:
            add_learner_check(session, at=now, replica=self.replica, **check)
        for room in self._rooms:
            add_learning_room(session, at=now, replica=self.replica, **room)
        if self._rooms:
            prune_learning_room(session, KEEP_LEARNING_ROOM)
        self._checks.clear()
        self._rooms.clear()

    def _switch(self, session, workload: str, version_id: int, gate: GatePredictor) -> None:
        """`workload` is now decided by `version_id`: its corrections were fitted to another model."""
        self.workload_gates[workload] = (version_id, gate)
        self.calibrator.reset(workload)
        clear_calibrations(session, workload)

    def _calibrate(self, released: Batch) -> dict:
        """Feed the fast calibration the raw curves of the gate serving each released draft's
        workload (drafts out of the held-back window, like the challenger's); each scope refitted,
        with its counterfactual gain on the window it has not seen and whether it is served (it pays,
        and its scope is confirmed: Calibrator.admit); and each trial whose window is now all later
        drafts, served from here on if its correction still gained there."""
        curves = np.zeros((len(released.label), SURVIVAL_K), dtype=np.float32)
        for w in np.unique(released.workload).tolist():
            sel = released.workload == w
            curves[sel] = self._serving(WORKLOADS[w])[1].survival(released.features[sel])
        changed = self.calibrator.observe(curves, released.draft_len, released.label, released.workload,
                                          released.tenant, WORKLOADS, released.decided, released.request,
                                          released.position, self._score)
        judged = {}
        for scope, calibration in changed.items():
            outcome = self._judge_calibration(scope, calibration)
            if outcome is not None:
                tried = self.calibrator.on_trial(scope)
                admitted = self.calibrator.admit(scope, calibration, outcome[0], self._seen(scope[0]))
                judged[scope] = (calibration, admitted, outcome[1])
                if not tried and self.calibrator.on_trial(scope):
                    self._checks.append(self._calibration_check(scope, "on trial", *outcome[1:]))
        self.stats.calibrations += len(judged)
        for scope, calibration in self.calibrator.due(self.config.counterfactual.holdout, self._seen).items():
            outcome = self._judge_calibration(scope, calibration, later=True)
            if outcome is not None:
                self.calibrator.settle(scope, outcome[0])
                self._checks.append(self._calibration_check(scope, "confirmed" if outcome[0] else "refused",
                                                            *outcome[1:]))
                if outcome[0]:
                    judged[scope] = (calibration, True, outcome[1])
        return judged

    def _seen(self, workload: str) -> int:
        return self.promoter.seen(WORKLOADS.index(workload))

    def _calibration_check(self, scope: tuple[str, str | None], outcome: str, verdict: float, drafts: int) -> dict:
        """A calibration trial's start or end worth recording (storage.learner_checks), in words."""
        workload, tenant = scope
        on = f"on the {drafts} newest drafts of {workload}" + (f" from tenant {tenant}" if tenant else "")
        reason = {
            "on trial": f"a correction gained {100 * verdict:+.2f}% {on}: on trial, not served until it still "
                        f"gains on a window of later drafts",
            "confirmed": f"the correction on trial still gains {100 * verdict:+.2f}% {on}, all after its fit: served",
            "refused": f"the correction on trial gained {100 * verdict:+.2f}% {on}, all after its fit: not served",
        }[outcome]
        return {"workload": workload, "tenant": tenant, "subject": "calibration", "outcome": outcome, "gain": verdict,
                "drafts": drafts, "predictor_version_id": self._serving(workload)[0], "reason": reason}

    def _judge_calibration(self, scope: tuple[str, str | None], calibration: Calibration,
                           later: bool = False) -> tuple[bool, float, int] | None:
        """Whether `calibration` pays on its scope's held-back window (by the margin, clearly, under
        every one of CALIBRATION_JUDGES), or with `later` (a trial on drafts it was not chosen on)
        still gains there what a probation asks (the rollback margin, 0: at all); the gain, and the
        window's drafts. None: too few drafts to judge yet."""
        workload, tenant = scope
        w = WORKLOADS.index(workload)
        window = self.promoter.drafts(w)
        if tenant is not None:
            window = window.take(window.tenant == tenant)
        if len(window.label) < MIN_JUDGED:
            return None
        raw = self._serving(workload)[1].survival(window.features)
        model = self.tuner.model.curves(np.array([w]))
        corrected = served_curves_from(raw, window.draft_len, calibration)
        for batch in CALIBRATION_JUDGES:
            candidate, incumbent = (replay_drafts(curves, window, model, self.decision.cost, batch)
                                    for curves in (corrected, raw))
            if later:
                verdict = gain(candidate, incumbent)
                pays = verdict >= self.config.counterfactual.rollback_margin  # what a probation asks
            else:
                pays, verdict = wins(candidate, incumbent, self.config.calibration.margin)
            if not pays:
                break
        return pays, verdict, len(window.label)

    def _score(self, workload: str) -> Score:
        """Counterfactual goodput of a workload's drafts along their paths under given curves (the
        fast calibration's shift is chosen by it). Walked one request at a time, which ranks ten
        candidates per refit cheaply; whether the chosen one is served is judged by CALIBRATION_JUDGES."""
        model = self.tuner.model.curves(np.array([WORKLOADS.index(workload)]))[0]
        cost = self.decision.cost

        def score(recent: Recent) -> Callable[[np.ndarray], float]:
            paths = Paths.of(recent.request, recent.position, recent.draft_len, recent.label, recent.decided,
                             batch=1)
            return lambda curves: replay_paths(curves, paths, model, cost).per_ms

        return score

    def _take_over(self) -> None:
        """Just became leader: what earlier leaders learned is in the champions; go on from the
        fleet's cursor (the first learner ever starts at the end, or with start_at_end=False at the
        beginning), and watch the promotions earlier leaders had not seen through."""
        with session_scope(self.engine) as s:
            stored = read_cursor(s)
            self._cursor_placed = self._resumed = stored is not None
            self.cursor = stored or (events_end(s) if self._start_at_end else EventCursor())
        self.stats.cursor = self.cursor.id
        if not self._cursor_placed and (self.lock is None or self.lock.is_leader):
            # placed now, not at the first round: a leader that dies before its first round must
            # not let the next one start at a later end
            try:
                with self._leader_transaction() as s:
                    self._place(s)
            except Exception:  # noqa: BLE001 - e.g. another leader placed it first: start again from it
                self._stale = True
        self._resume_watches()

    def _place(self, s: Session) -> None:
        epoch, holder = (0, self.replica) if self.lock is None else (self.lock.epoch, self.lock.holder)
        place_cursor(s, self.cursor, epoch=epoch, holder=holder)
        self._cursor_placed = True

    def _rebuild(self) -> None:
        """A round that did not commit left this learner ahead of the database: start again from
        the champions and the cursor stored (what was learned since the last promotion is lost)."""
        self._stale = False
        self._fresh()
        self._take_over()

    def _resume_watches(self) -> None:
        """A workload whose alias was last moved by a learner's promotion, still in place and still on
        probation (fewer than `probation` windows of its drafts stored since), is watched for the
        rest of it as if this leader had promoted it (predictor.online.workload_promotion): the watch
        outlives the leader that started it."""
        with session_scope(self.engine) as s:
            pending = []
            for w in WORKLOADS:
                moves = list_alias_events(s, workload_alias(w))
                current = get_alias_version(s, workload_alias(w))
                if not moves or current is None:
                    continue
                last = moves[-1]
                if (last.to_version_id != current.id or not last.actor.startswith("learner@")
                        or not last.reason.startswith("promotion for")):
                    continue
                fresh = count_cache_drafts_since(s, w, last.at)
                if self.promoter.on_probation(fresh):
                    pending.append((w, last.to_version_id, last.from_version_id or self.champion_id, fresh))
        for w, promoted_id, previous_id, fresh in pending:
            promoted, previous = load_gate(self.engine, promoted_id)[1], load_gate(self.engine, previous_id)[1]
            self.workload_gates[w] = (promoted_id, promoted)
            self.promoter.watch(WORKLOADS.index(w), promoted, previous, fresh)
            self._before[w] = previous_id

    def _promote(self, s: Session, score: ShadowScore) -> None:
        pin = current_pin(s, CHAMPION)
        if pin is not None:  # no version made while a pin holds the champion; the move re-checks under its lock
            self._refuse(CHAMPION, None, f"held by a pin: {AliasPinnedError(CHAMPION, pin)}")
            return
        challenger = self.learner.challenger()
        version = create_version(
            s, blob=challenger.to_bytes(), kind=version_kind(challenger), feature_schema_hash=challenger.schema_hash,
            metrics={"shadow": score.to_json()},
            training_summary={"online": {"events_seen": self.learner.events_seen, "updates": self.learner.updates,
                                         "seed": self.config.seed}},
            reason=(f"promoted by the online learner: goodput proxy {100 * score.gain:+.2f}% and MAE "
                    f"{score.challenger_mae:.3f} vs {score.champion_mae:.3f} over {score.events} shadow-scored events"),
            created_by=f"learner@{self.replica}", parent_id=self.champion_id, check=check_blob)
        if self._move(s, None, version.id, reason="promotion") is not None:  # refuses an unloadable blob too
            return
        new_id = version.id
        self.champion_id = new_id
        self.stats.promotions.append(new_id)
        self.learner.adopt(challenger)
        self.calibrator.reset()  # the corrections were fitted to the old champion's outputs

    _refusals_told: set[tuple[str, str]] = set()  # refusals logged already (each logged once, counted always)

    def _move(self, s: Session, workload: str | None, version_id: int, reason: str) -> str | None:
        """Move `champion` (workload None) or `champion/<workload>` through the one checked move
        (registry.move_alias), compare-and-set against the version this learner read at the start of
        its round (_follow_external_champion set its champions from the database then). None if it
        moved; else why not, the move skipped: a pin holds the alias, or someone moved it meanwhile
        (the next round follows the database). Nothing was written then: the round commits the rest."""
        from storage.versions import LEARNER_ACTOR, AliasMovedError

        alias = CHAMPION if workload is None else workload_alias(workload)
        read = self.champion_id if workload is None else self.workload_gates.get(workload, (None, None))[0]
        try:
            move_alias(s, alias, version_id, reason=reason, actor=f"{LEARNER_ACTOR}{self.replica}", expected=read)
        except AliasPinnedError as exc:
            return self._refuse(alias, version_id, f"held by a pin: {exc}")
        except AliasMovedError as exc:
            return self._refuse(alias, version_id, str(exc), pinned=False)
        return None

    def _refuse(self, alias: str, version_id: int | None, why: str, pinned: bool = True) -> str:
        """A move of `alias` refused (to `version_id`; None: not even tried, its alias pinned): counted
        in the stats, logged once per alias and reason, the workload's watch dropped (no promotion of
        this learner's to judge there)."""
        (self.stats.held if pinned else self.stats.moved_meanwhile).append((alias, version_id))
        if (alias, why) not in self._refusals_told:
            self._refusals_told = self._refusals_told | {(alias, why)}
            log.warning("learner@%s: %s not moved%s: %s", self.replica, alias,
                        "" if version_id is None else f" to v{version_id}", why)
        if alias != CHAMPION:
            self.promoter.unwatch(WORKLOADS.index(alias.split("/", 1)[1]))
        return why

    def _refused_check(self, v: Verdict, serving: int, why: str) -> dict:
        """A promotion or rollback that was due but refused (storage.learner_checks: held, moved meanwhile)."""
        name = WORKLOADS[v.workload]
        move = "rollback" if v.action == "rollback" else "promotion"
        reason = (f"the {move} of {name} was due ({100 * v.gain:+.2f}% on the {v.candidate.drafts} newest drafts) "
                  f"but not made: {why}")[:MAX_REASON_LEN]
        return {"workload": name, "tenant": None, "subject": "promotion",
                "outcome": "held" if why.startswith("held by a pin") else "moved meanwhile", "gain": v.gain,
                "drafts": v.candidate.drafts, "predictor_version_id": serving, "reason": reason}

    def _follow_external_champion(self) -> None:
        """An operator moved the alias (rollback), or another leader moved a workload's: learn on
        from what the database says serves each workload."""
        with session_scope(self.engine) as s:
            current = get_alias_version(s, CHAMPION)
            current_id = current.id if current is not None else None
            own = workload_champions(s)
        if current_id is not None and current_id != self.champion_id:
            self.champion_id, champion = load_gate(self.engine, current_id)
            self.learner = OnlineLearner(champion, self._goodput, self.config)
            self.calibrator.reset()
        for workload in set(self.workload_gates) | set(own):
            have = self.workload_gates.get(workload, (None, None))[0]
            if own.get(workload) == have:
                continue
            if workload in own:
                self.workload_gates[workload] = load_gate(self.engine, own[workload])
            else:
                del self.workload_gates[workload]
            self._before.pop(workload, None)  # not this leader's promotion to watch
            self.promoter.unwatch(WORKLOADS.index(workload))
            self.calibrator.reset(workload)

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
