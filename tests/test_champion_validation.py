"""A corrupt or unscoreable predictor version never becomes champion, and a replica whose champion
will not load keeps its last good gate, says so, and still applies overrides. Both databases; the
corruption is made in SQL, as a disk or an operator would make it."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import text

from controller.core.decision import DecisionConfig
from controller.core.runtime import Runtime
from controller.services.control_poller import ControlPoller
from predictor.data.tokens import TraceTokenizer
from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import MLP, BlobError, GatePredictor
from predictor.gate.registry import CHAMPION, load_gate, promote, promote_for_workload, unloadable_reason
from storage import dashboard_queries as q
from storage.engine import make_engine, session_scope
from storage.migrate import upgrade
from storage.overrides import OverrideSpec, set_override
from storage.versions import UnloadableVersionError, create_version, get_alias_version, get_version, set_alias

ROOT = Path(__file__).resolve().parents[1]


def _gate(seed: int, schema: str | None = None, scale: float = 1.0) -> GatePredictor:
    torch.manual_seed(seed)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema or schema_hash())
    if scale != 1.0:
        gate = GatePredictor(gate.mean, gate.scale, [w * scale for w in gate.weights],
                             [b * scale for b in gate.biases], gate.schema_hash)
    return gate


def _store(s, gate: GatePredictor, parent: int | None = None) -> int:
    return create_version(s, blob=gate.to_bytes(), kind="mlp", feature_schema_hash=gate.schema_hash, metrics={},
                          training_summary={}, reason="test", created_by="test", parent_id=parent).id


@pytest.fixture()
def world(db_url):
    """v1 champion, v2 good child, v3 corrupted in SQL, v4 overflowing to inf, v5 another schema."""
    engine = make_engine(db_url)
    upgrade(engine)
    with session_scope(engine) as s:
        v1 = _store(s, _gate(0))
        promote(s, v1, reason="init", actor="test")
        v2 = _store(s, _gate(1), parent=v1)
        v3 = _store(s, _gate(2), parent=v1)
        v4 = _store(s, _gate(3, scale=1e12), parent=v1)
        v5 = _store(s, _gate(4, schema="f" * 64), parent=v1)
    with engine.begin() as conn:  # flip bytes in the middle of v3's weights
        blob = bytearray(conn.execute(text("SELECT blob FROM predictor_versions WHERE id = :i"), {"i": v3}).scalar_one())
        blob[len(blob) // 2: len(blob) // 2 + 8] = b"\xff" * 8
        conn.execute(text("UPDATE predictor_versions SET blob = :b WHERE id = :i"), {"b": bytes(blob), "i": v3})
    yield engine, db_url, (v1, v2, v3, v4, v5)
    engine.dispose()


def _champion(engine) -> int:
    with session_scope(engine) as s:
        return get_alias_version(s, CHAMPION).id


def _hvd(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller.cli.main", "--db", url, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_unloadable_versions_are_named_with_their_reason(world):
    engine, _, (v1, v2, v3, v4, v5) = world
    with session_scope(engine) as s:
        reasons = {v: unloadable_reason(get_version(s, v)) for v in (v1, v2, v3, v4, v5)}
    assert reasons[v1] is None and reasons[v2] is None
    assert reasons[v3].startswith("blob sha256 mismatch")
    assert reasons[v4] == "predictor blob scores a fixed probe input to non-finite values"
    assert "feature schema ffffffffffff" in reasons[v5]
    with pytest.raises(BlobError, match=f"predictor version {v3}: blob sha256 mismatch"):
        load_gate(engine, v3)


@pytest.mark.parametrize("which", [2, 3, 4])
def test_promote_refuses_an_unloadable_version_and_leaves_the_champion(world, which):
    engine, _, versions = world
    bad = versions[which]
    with pytest.raises(UnloadableVersionError, match=f"predictor version v{bad} is unloadable: ") as info:
        with session_scope(engine) as s:
            promote(s, bad, reason="test", actor="test")
    assert info.value.version_id == bad
    assert _champion(engine) == versions[0]
    with session_scope(engine) as s:  # storage alone (as the dashboard moves it) still refuses a corrupt blob
        if which == 2:
            with pytest.raises(UnloadableVersionError, match="blob sha256 mismatch"):
                set_alias(s, CHAMPION, bad, reason="dashboard", actor="test")
        promote(s, versions[1], reason="good", actor="test")
    assert _champion(engine) == versions[1]


def test_cli_rollback_refuses_with_exit_2_and_versions_marks_it(world):
    engine, url, (v1, v2, v3, v4, v5) = world
    done = _hvd(url, "rollback", "--to", str(v3), "--author", "ops", "--reason", "test")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"hvd rollback: error: predictor version v{v3} is unloadable: blob sha256 mismatch")
    assert _champion(engine) == v1
    listed = _hvd(url, "versions")
    assert listed.returncode == 0, listed.stderr
    lines = {line[2:].split()[0]: line for line in listed.stdout.splitlines()}
    assert lines["v1"].startswith("* v1") and "UNLOADABLE" not in lines["v1"] and "UNLOADABLE" not in lines["v2"]
    assert "UNLOADABLE: blob sha256 mismatch" in lines[f"v{v3}"]
    assert lines[f"v{v4}"].endswith("UNLOADABLE: predictor blob scores a fixed probe input to non-finite values")
    assert "UNLOADABLE: predictor blob was trained on feature schema ffffffffffff" in lines[f"v{v5}"]
    good = _hvd(url, "rollback", "--to", str(v2), "--author", "ops", "--reason", "test")
    assert good.returncode == 0 and good.stdout == f"champion: v{v1} -> v{v2}\n"


def test_poller_keeps_the_last_good_gate_and_still_applies_overrides(world, caplog):
    engine, _, (v1, v2, v3, v4, v5) = world
    runtime = Runtime(_gate(0), token_classes(TraceTokenizer()), DecisionConfig(), version_id=v1)
    poller = ControlPoller(engine, runtime)
    assert poller.poll_once() and runtime.version_id == v1 and poller.champion_problem is None
    old_gate = runtime.gate
    with engine.begin() as conn:  # the alias moved to the corrupt version behind the checks' back
        conn.execute(text("UPDATE aliases SET version_id = :v WHERE name = 'champion'"), {"v": v3})
    with session_scope(engine) as s:
        set_override(s, OverrideSpec("acme", None, "off_model", author="ops", reason="test"),
                     ["agentic", "code_edit", "coding", "sql", "chat"])
    with caplog.at_level(logging.ERROR, logger="hvd.controls"):
        assert poller.poll_once() and poller.poll_once()
    assert runtime.gate is old_gate and runtime.version_id == v1
    assert [o.tenant for o in runtime.controls.overrides.overrides] == ["acme"]  # applied despite the champion
    assert poller.champion_problem.startswith(f"v{v3}: predictor version {v3}: blob sha256 mismatch")
    assert poller.health().last_error == f"champion not loaded: {poller.champion_problem}"
    assert len([r for r in caplog.records if r.name == "hvd.controls"]) == 1  # once per new failure
    with engine.begin() as conn:  # another bad champion: a new failure, logged again
        conn.execute(text("UPDATE aliases SET version_id = :v WHERE name = 'champion'"), {"v": v4})
    with caplog.at_level(logging.ERROR, logger="hvd.controls"):
        assert poller.poll_once()
    assert len([r for r in caplog.records if r.name == "hvd.controls"]) == 2
    with session_scope(engine) as s:
        promote(s, v2, reason="fixed", actor="ops")
    assert poller.poll_once() and runtime.version_id == v2 and poller.champion_problem is None
    x = np.zeros((1, NUM_FEATURES), dtype=np.float32)
    assert np.array_equal(runtime.gate.predict(x), _gate(1).predict(x))


def test_dashboard_queries_mark_the_corrupt_version_and_stale_replicas(world):
    engine, _, (v1, v2, v3, v4, v5) = world
    with session_scope(engine) as s:
        rows = {r["id"]: r["unloadable"] for r in q.versions(s)}
        status = q.champion_status(s)
    assert rows[v3].startswith("blob sha256 mismatch") and rows[v1] == rows[v2] == rows[v4] == ""
    assert rows[v5] == (f"predictor blob was trained on feature schema ffffffffffff, the champion v{v1} on "
                        f"{schema_hash()[:12]}: the replicas that serve the champion could not load it")
    assert status["version"] == v1 and status["problem"] is None and status["stale"] == {}


def test_an_override_row_this_version_cannot_apply_is_skipped_and_named(world, caplog):
    engine, _, (v1, *_) = world
    runtime = Runtime(_gate(0), token_classes(TraceTokenizer()), DecisionConfig(), version_id=v1)
    poller = ControlPoller(engine, runtime)
    workloads = ["agentic", "code_edit", "coding", "sql", "chat"]
    with session_scope(engine) as s:
        set_override(s, OverrideSpec("acme", None, "off_model", author="ops", reason="test"), workloads)
        set_override(s, OverrideSpec("beta", None, "fixed", tau=3.0, author="ops", reason="test"), workloads)
    with engine.begin() as conn:  # as a newer HVD might write it during a rolling upgrade
        conn.execute(text("UPDATE tau_overrides SET mode = 'sometimes' WHERE tenant = 'beta'"))
        beta = conn.execute(text("SELECT id FROM tau_overrides WHERE tenant = 'beta'")).scalar_one()
    with caplog.at_level(logging.ERROR, logger="hvd.controls"):
        assert poller.poll_once() and poller.poll_once()
    assert [o.tenant for o in runtime.controls.overrides.overrides] == ["acme"]  # the readable one applies
    assert poller.unreadable_overrides == ((beta, "mode 'sometimes' is unknown here (known: fixed, bounds, "
                                                  "off_model, off_cache)"),)
    said = [r.getMessage() for r in caplog.records if r.name == "hvd.controls"]
    assert len(said) == 1 and f"override #{beta} cannot be applied" in said[0]  # once, by id
    assert poller.health().failing == 0


def test_without_the_predictor_a_move_checks_the_checksum_and_the_served_schema(world):
    """The dashboard's move (storage alone): a corrupt blob and another feature schema are refused,
    naming why; a version of the champion's schema moves, compare-and-set as every move."""
    engine, _, (v1, v2, v3, v4, v5) = world
    for bad, why in ((v3, "blob sha256 mismatch"), (v5, "predictor blob was trained on feature schema ffffffffffff, "
                                                         f"the champion v{v1} on {schema_hash()[:12]}")):
        with pytest.raises(UnloadableVersionError, match=f"predictor version v{bad} is unloadable: {why}"):
            with session_scope(engine) as s:
                set_alias(s, "champion/sql", bad, reason="dashboard", actor="ops", expected=None, serving_schema=True)
    with session_scope(engine) as s:
        set_alias(s, "champion/sql", v2, reason="dashboard", actor="ops", expected=None, serving_schema=True)
        assert get_alias_version(s, "champion/sql").id == v2 and get_alias_version(s, CHAMPION).id == v1


def test_a_blob_that_does_not_load_or_score_is_never_stored(world):
    """Every version the product stores passes check_blob first (what lets the dashboard move on the
    checksum and schema alone): an overflowing blob and another schema's are refused, nothing stored."""
    from sqlalchemy import func, select

    from predictor.gate.registry import check_blob
    from storage.models import PredictorVersion
    from storage.versions import UnloadableBlobError

    engine, *_ = world
    with session_scope(engine) as s:
        before = s.scalar(select(func.count()).select_from(PredictorVersion))
    for gate, why in ((_gate(3, scale=1e12), "scores a fixed probe input to non-finite values"),
                      (_gate(4, schema="e" * 64), "was trained on feature schema eeeeeeeeeeee")):
        with pytest.raises(UnloadableBlobError, match=f"predictor blob refused, nothing stored: predictor blob {why}"):
            with session_scope(engine) as s:
                create_version(s, blob=gate.to_bytes(), kind="mlp", feature_schema_hash=gate.schema_hash, metrics={},
                               training_summary={}, reason="test", created_by="test", check=check_blob)
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(PredictorVersion)) == before
        good = create_version(s, blob=_gate(5).to_bytes(), kind="mlp", feature_schema_hash=schema_hash(), metrics={},
                              training_summary={}, reason="test", created_by="test", check=check_blob)
        assert good.id > before


def test_rollback_destination_names_where_each_alias_goes_back_to(world):
    from storage.versions import rollback_destination

    engine, _, (v1, v2, *_) = world
    with session_scope(engine) as s:
        with pytest.raises(LookupError, match=f"champion v{v1} has no parent: give --to VERSION"):
            rollback_destination(s, CHAMPION)
        promote(s, v2, reason="child", actor="ops")
        assert rollback_destination(s, CHAMPION) == (v2, v1)
        with pytest.raises(LookupError, match="champion/sql was never moved by the learner"):
            rollback_destination(s, "champion/sql")
        promote_for_workload(s, "sql", v1, reason="promotion for sql", actor="learner@r1", expected=None)
        assert rollback_destination(s, "champion/sql") == (v1, v2)  # champion named v2 when the learner moved it


def test_a_move_from_a_stale_read_is_refused_and_changes_nothing(world):
    from sqlalchemy import func, select

    from storage.models import AliasEvent
    from storage.versions import AliasMovedError

    engine, _, (v1, v2, *_) = world
    with session_scope(engine) as s:
        events = s.scalar(select(func.count()).select_from(AliasEvent))
        promote(s, v2, reason="read v1, still v1", actor="ops", expected=v1)
    with pytest.raises(AliasMovedError, match=f"champion moved meanwhile: it names v{v2}, not v{v1} as read"):
        with session_scope(engine) as s:
            promote(s, v1, reason="read v1 before the move", actor="ops", expected=v1)
    with pytest.raises(AliasMovedError, match="names no version, not v7 as read"):
        with session_scope(engine) as s:
            promote_for_workload(s, "sql", v1, reason="stale", actor="ops", expected=7)
    with session_scope(engine) as s:
        assert get_alias_version(s, CHAMPION).id == v2
        assert s.scalar(select(func.count()).select_from(AliasEvent)) == events + 1
