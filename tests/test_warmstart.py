"""Warm start into a temporary SQLite database, and the champion round trip."""
from __future__ import annotations


import numpy as np
import pytest
from sqlalchemy import update

from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.evaluation.gate_quality import survival_reliability
from predictor.gate.mlp import BlobError, GatePredictor
from predictor.gate.registry import CHAMPION, NoChampionError, load_gate
from predictor.gate.training import TrainConfig, train_mlp
from predictor.replay.dataset import build_dataset
from predictor.warmstart import warmstart
from support.trace_subset import write_subset
from storage.engine import make_engine, session_scope
from storage.migrate import upgrade
from storage.models import PredictorVersion
from storage.versions import get_alias_version, get_version, list_alias_events



@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = write_subset(tmp_path_factory.mktemp("traces") / "subset.jsonl")
    return build_dataset([path], cache_dir=None, log=lambda _: None)


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path}/x.db")
    upgrade(eng)
    yield eng
    eng.dispose()


def test_dataset_covers_several_workloads_and_both_split_sides(dataset):
    assert len(dataset.records) == 32
    assert {r.workload for r in dataset.records} == {"coding", "sql", "agentic", "chat"}
    assert dataset.test_traces.any() and not dataset.test_traces.all()
    assert dataset.rows(test=True).sum() > 0 and dataset.rows(test=False).sum() > 0
    assert not (dataset.rows(test=True) & dataset.rows(test=False)).any()
    assert dataset.replay.features.shape[1] == NUM_FEATURES


def test_warmstart_round_trips_through_sqlite(dataset, engine):
    config = TrainConfig(epochs=1)
    version_id = warmstart(engine, dataset, config, log=lambda _: None)
    assert isinstance(version_id, int)

    loaded_id, gate = load_gate(engine)
    assert loaded_id == version_id
    assert gate.schema_hash == schema_hash()

    # training is deterministic under the seed: retrain and compare bit for bit
    rp = dataset.replay
    train = dataset.rows(test=False)
    model = train_mlp(rp.features[train], rp.label[train], rp.row_workload()[train], config)
    trained = GatePredictor.from_torch(model, schema_hash())
    x = rp.features[dataset.rows(test=True)]
    assert np.array_equal(gate.predict(x), trained.predict(x))
    assert np.array_equal(load_gate(engine, version_id)[1].predict(x), trained.predict(x))

    with session_scope(engine) as session:
        champion = get_alias_version(session, CHAMPION)
        assert champion is not None and champion.id == version_id
        assert champion.parent_id is None
        assert champion.kind == "survival" and gate.kind == "survival"
        assert champion.feature_schema_hash == schema_hash()
        assert champion.metrics["kind"] == "survival"
        overall = champion.metrics["test"]["overall"]
        assert {"precision_ge6", "recall_ge6", "mae"} <= set(overall)
        assert 0.0 <= overall["precision_ge6"] <= 1.0 and overall["mae"] >= 0.0
        test = dataset.rows(test=True)
        assert champion.metrics["test"]["reliability"] == survival_reliability(
            trained.survival(x), rp.draft_len[test], rp.label[test])
        assert champion.metrics["test"]["reliability"][0]["count"] == int(test.sum())  # every draft reaches position 1
        summary = champion.training_summary
        assert summary["kind"] == "survival" and summary["config"]["kind"] == "survival"
        assert summary["config"]["epochs"] == 1
        assert summary["train"]["records"] + summary["test"]["records"] == 32
        assert summary["replay_key"] == dataset.key


def test_point_warmstart_stores_an_mlp_version_without_a_curve(dataset, engine):
    version_id = warmstart(engine, dataset, TrainConfig(epochs=1, kind="point"), log=lambda _: None)
    assert load_gate(engine)[1].kind == "point"
    with session_scope(engine) as session:
        version = get_version(session, version_id)
        assert version.kind == "mlp" and version.metrics["kind"] == "point"
        assert "reliability" not in version.metrics["test"] and version.training_summary["kind"] == "point"


def test_second_warmstart_is_a_child_of_the_first(dataset, engine):
    first = warmstart(engine, dataset, TrainConfig(epochs=1), log=lambda _: None)
    second = warmstart(engine, dataset, TrainConfig(epochs=1, seed=1), log=lambda _: None)
    assert second != first
    with session_scope(engine) as session:
        assert get_version(session, second).parent_id == first
        assert get_alias_version(session, CHAMPION).id == second
        moves = [(e.from_version_id, e.to_version_id) for e in list_alias_events(session, CHAMPION)]
    assert moves == [(None, first), (first, second)]
    assert load_gate(engine)[0] == second


def test_corrupt_blob_is_refused_naming_the_version(dataset, engine):
    version_id = warmstart(engine, dataset, TrainConfig(epochs=1), log=lambda _: None)
    with session_scope(engine) as session:
        blob = bytearray(session.get(PredictorVersion, version_id).blob)
        blob[len(blob) // 2] ^= 0xFF
        session.execute(update(PredictorVersion).where(PredictorVersion.id == version_id).values(blob=bytes(blob)))
    with pytest.raises(BlobError, match=f"predictor version {version_id}: blob sha256 mismatch"):
        load_gate(engine)


def test_no_champion_in_an_empty_database(engine):
    with pytest.raises(NoChampionError, match="hvd warmstart"):
        load_gate(engine)


def test_build_dataset_with_no_records_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no trace records"):
        build_dataset([empty], cache_dir=None, log=lambda _: None)
