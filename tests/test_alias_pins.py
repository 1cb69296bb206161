"""Every alias move is checked and compare-and-set, and an operator's pin holds a champion against the
learner until lifted; every move, pin and unpin audited with who and why. On SQLite and PostgreSQL
(conftest's db: a copy of a database migrated to head)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.gate.mlp import MLP, GatePredictor
from predictor.gate.registry import (CHAMPION, move_alias, promote, promote_for_workload, rollback_alias,
                                     workload_alias)
from predictor.online.counterfactual import Goodput
from predictor.online.workload_promotion import Verdict
from storage.engine import session_scope
from storage.models import AliasPinEvent
from storage.pins import AliasPinnedError, PinError, list_pins, unpin_alias
from storage.versions import (AliasMovedError, UnloadableVersionError, create_version, get_alias_version,
                              list_alias_events, list_versions, rollback_target)
from storage.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
SQL = workload_alias("sql")


def gate(seed: int, schema: str | None = None) -> GatePredictor:
    torch.manual_seed(seed)
    return GatePredictor.from_torch(MLP(NUM_FEATURES), schema or schema_hash())


def store(s, g: GatePredictor, parent: int | None = None) -> int:
    return create_version(s, blob=g.to_bytes(), kind="mlp", feature_schema_hash=g.schema_hash, metrics={},
                          training_summary={}, reason="test", created_by="test", parent_id=parent).id


@pytest.fixture()
def versions(db):
    """v1 champion, v2 and v3 loadable children, v4 with a valid checksum but another feature schema."""
    with session_scope(db) as s:
        v1 = store(s, gate(0))
        promote(s, v1, reason="init", actor="test", expected=None)
        v2, v3 = store(s, gate(1), v1), store(s, gate(2), v1)
        v4 = store(s, gate(3, schema="f" * 64), v1)
    return db, (v1, v2, v3, v4)


def alias(engine, name: str) -> int | None:
    with session_scope(engine) as s:
        v = get_alias_version(s, name)
        return None if v is None else v.id


def audit(engine) -> tuple[list[tuple], list[tuple]]:
    """(moves, pin events) as (alias, from, to, actor, reason) and (action, alias, version, actor, reason)."""
    with session_scope(engine) as s:
        moves = [(e.alias_name, e.from_version_id, e.to_version_id, e.actor, e.reason) for e in list_alias_events(s)]
        pins = [(e.action, e.alias_name, e.version_id, e.actor, e.reason)
                for e in s.query(AliasPinEvent).order_by(AliasPinEvent.id)]
    return moves, pins


# ---------------------------------------------------------------- storage and the registry

def test_a_pin_holds_against_every_move_until_lifted_and_everything_is_audited(versions):
    engine, (v1, v2, v3, v4) = versions
    with session_scope(engine) as s:  # pin sql's own champion (none yet) at v2: moved and held
        move_alias(s, SQL, v2, reason="incident 7", actor="ana", expected=None, pin=True)
    assert alias(engine, SQL) == v2
    with pytest.raises(AliasPinnedError, match=r"^champion/sql is pinned to v2 by ana \(incident 7\); nothing "
                                               r"changed \(unpin it, or pin another version\)$"):
        with session_scope(engine) as s:  # the learner, having read v2
            promote_for_workload(s, "sql", v3, reason="promotion for sql", actor="learner@r1", expected=v2)
    with pytest.raises(AliasPinnedError):
        with session_scope(engine) as s:  # an operator's rollback too
            rollback_alias(s, SQL, reason="undo", actor="bob", to=v1)
    with pytest.raises(PinError, match="^champion/sql already is pinned to v2; nothing changed$"):
        with session_scope(engine) as s:
            move_alias(s, SQL, v2, reason="again", actor="ana", expected=v2, pin=True)
    with session_scope(engine) as s:  # an explicit pin to another version moves it
        move_alias(s, SQL, v3, reason="v3 is better", actor="bob", expected=v2, pin=True)
    with session_scope(engine) as s:
        assert {n: (p.version_id, p.actor, p.reason) for n, p in list_pins(s).items()} == \
            {SQL: (v3, "bob", "v3 is better")}
    with pytest.raises(PinError, match=r"pin changed meanwhile: it holds v3, not v2 as read"):
        with session_scope(engine) as s:
            unpin_alias(s, SQL, reason="done", actor="ana", expected=v2)
    with session_scope(engine) as s:
        assert unpin_alias(s, SQL, reason="incident over", actor="ana", expected=v3) == v3
    with pytest.raises(PinError, match="^champion/sql is not pinned; nothing changed$"):
        with session_scope(engine) as s:
            unpin_alias(s, SQL, reason="twice", actor="ana")
    with session_scope(engine) as s:  # lifted: the learner moves it again
        promote_for_workload(s, "sql", v1, reason="promotion for sql", actor="learner@r1", expected=v3)
    assert alias(engine, SQL) == v1 and alias(engine, CHAMPION) == v1
    moves, pins = audit(engine)
    assert moves == [(CHAMPION, None, v1, "test", "init"), (SQL, None, v2, "ana", "pin: incident 7"),
                     (SQL, v2, v3, "bob", "pin: v3 is better"), (SQL, v3, v1, "learner@r1", "promotion for sql")]
    assert pins == [("pin", SQL, v2, "ana", "incident 7"), ("pin", SQL, v3, "bob", "v3 is better"),
                    ("unpin", SQL, v3, "ana", "incident over")]


def test_a_pin_is_checked_and_needs_who_and_why(versions):
    engine, (v1, v2, v3, v4) = versions
    with pytest.raises(UnloadableVersionError, match=f"^predictor version v{v4} is unloadable: predictor blob was "
                                                     "trained on feature schema ffffffffffff"):
        with session_scope(engine) as s:
            move_alias(s, CHAMPION, v4, reason="try", actor="ana", expected=v1, pin=True)
    with pytest.raises(UnloadableVersionError):  # pinning the version it names loads it too
        with session_scope(engine) as s:
            promote_for_workload(s, "chat", v4, reason="t", actor="ana", expected=None)
    for actor, reason, what in (("ana", "  ", "reason"), ("", "why", "actor")):
        with pytest.raises(PinError, match=f"^a pin needs an? {what} of 1..\\d+ characters, got 0$"):
            with session_scope(engine) as s:
                move_alias(s, CHAMPION, v1, reason=reason, actor=actor, expected=v1, pin=True)
    with pytest.raises(ValueError, match="alias 'shadow' is not champion or champion/<workload>"):
        with session_scope(engine) as s:
            move_alias(s, "shadow", v2, reason="t", actor="ana", expected=None)
    with session_scope(engine) as s:  # the global champion, pinned where it is: no move, a pin
        move_alias(s, CHAMPION, v1, reason="freeze", actor="ana", expected=v1, pin=True)
    assert audit(engine) == ([(CHAMPION, None, v1, "test", "init")], [("pin", CHAMPION, v1, "ana", "freeze")])


def test_a_pin_committed_while_a_move_waits_for_the_row_lock_holds(versions):
    """PostgreSQL: the move reads the alias, waits on the row lock the pin's transaction holds, then
    sees the pin once it commits and is refused (SQLite serialises its writers whole)."""
    engine, (v1, v2, v3, v4) = versions
    if engine.dialect.name != "postgresql":
        pytest.skip("row locks: PostgreSQL")
    locked, outcome = threading.Event(), []

    def pinner() -> None:
        with session_scope(engine) as s:
            move_alias(s, CHAMPION, v2, reason="hold", actor="ana", expected=v1, pin=True)
            locked.set()
            time.sleep(0.5)  # the learner's move now waits on the alias's row lock

    t = threading.Thread(target=pinner)
    t.start()
    locked.wait(10)
    try:
        with session_scope(engine) as s:
            move_alias(s, CHAMPION, v3, reason="promotion", actor="learner@r1", expected=v2)
    except AliasPinnedError as exc:
        outcome.append(exc)
    t.join()
    assert len(outcome) == 1 and outcome[0].version_id == v2 and alias(engine, CHAMPION) == v2


def test_a_workload_rolls_back_to_the_version_before_the_learners_last_move(versions):
    engine, (v1, v2, v3, v4) = versions
    with pytest.raises(LookupError, match="champion/sql was never moved by the learner"):
        with session_scope(engine) as s:
            rollback_target(s, SQL)
    with session_scope(engine) as s:  # the learner's first move of sql: from nothing (it followed champion, v1)
        promote_for_workload(s, "sql", v2, reason="promotion for sql", actor="learner@r1", expected=None)
        promote(s, v3, reason="operator", actor="ana", expected=v1)  # champion moves on later
    with session_scope(engine) as s:
        assert rollback_target(s, SQL)[0] == v1  # what served sql then, as the learner's own rollback does
        assert rollback_alias(s, SQL, reason="regressed", actor="ana") == (v2, v1)
    with session_scope(engine) as s:
        promote_for_workload(s, "sql", v2, reason="promotion for sql", actor="learner@r1", expected=v1)
        assert rollback_alias(s, SQL, reason="again", actor="ana") == (v2, v1)
    moves, _ = audit(engine)
    assert moves[-1] == (SQL, v2, v1, "ana", "rollback: again")


# ---------------------------------------------------------------- the learner

def survival_gate(logit: float) -> GatePredictor:
    from predictor.gate.mlp import SURVIVAL_K

    w0 = np.random.default_rng(0).normal(0, 0.1, (NUM_FEATURES, 16)).astype(np.float32)
    return GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32),
                         [w0, np.zeros((16, SURVIVAL_K), np.float32)],
                         [np.zeros(16, np.float32), np.full(SURVIVAL_K, logit, np.float32)], schema_hash())


def verdict(action: str) -> Verdict:
    g = Goodput(100.0, 10.0, 400)
    return Verdict(WORKLOADS.index("sql"), action, 0.05 if action == "promote" else -0.05, g, g,
                   "promoted" if action == "promote" else "rolled back")


@pytest.fixture()
def learner(db):
    from controller.core.decision import DecisionConfig
    from controller.services.learner_service import LearnerService
    from predictor.gate.registry import store_champion
    from predictor.online.learner import LearnerConfig

    with session_scope(db) as s:
        store_champion(s, survival_gate(-6.0), reason="pessimist", actor="test")
    return db, LearnerService(db, DecisionConfig(), LearnerConfig(seed=1), replica="r1", start_at_end=False)


def act(service, action: str) -> None:
    """One round's acting on a verdict for sql, in the leader's transaction, after the round's read."""
    from controller.services.learner_service import Judgement

    with service._leader_transaction() as s:
        service._act_on(s, Judgement(survival_gate(2.0), [verdict(action)], {WORKLOADS.index("sql"): 1}))
        service._write_checks(s, datetime.now(timezone.utc))


def checks(engine) -> list[tuple[str, str]]:
    from storage.learner_checks import list_learner_checks

    with session_scope(engine) as s:
        return [(c.outcome, c.reason) for c in reversed(list_learner_checks(s))]


def test_a_pinned_workload_champion_is_held_against_the_learners_promotion_and_rollback(learner, caplog):
    engine, service = learner
    with session_scope(engine) as s:
        move_alias(s, SQL, 1, reason="hold sql", actor="ana", expected=None, pin=True)
    service._follow_external_champion()  # the start of the round reads the aliases
    with caplog.at_level("WARNING", logger="hvd.learner"):
        act(service, "promote")
    assert alias(engine, SQL) == 1 and service.stats.held == [(SQL, None)] and service.stats.promotions == []
    with session_scope(engine) as s:
        assert [v.id for v in list_versions(s)] == [1]  # no version made for a pinned workload
    outcome, reason = checks(engine)[-1]
    assert outcome == "held" and reason.startswith("the promotion of sql was due (+5.00% on the 400 newest drafts) "
                                                   "but not made: held by a pin: champion/sql is pinned to v1 by ana")
    assert [r.getMessage() for r in caplog.records if r.name == "hvd.learner"] == [
        "learner@r1: champion/sql not moved: held by a pin: champion/sql is pinned to v1 by ana (hold sql); "
        "nothing changed (unpin it, or pin another version)"]

    with session_scope(engine) as s:  # lifted: the next promotion goes through
        unpin_alias(s, SQL, reason="over", actor="ana")
    act(service, "promote")
    promoted = service.stats.promotions[-1]
    assert alias(engine, SQL) == promoted and service.workload_gates["sql"][0] == promoted
    assert checks(engine)[-1][0] == "promoted"

    with session_scope(engine) as s:  # pinned where the learner put it: its rollback is held
        move_alias(s, SQL, promoted, reason="keep it", actor="bob", expected=promoted, pin=True)
    act(service, "rollback")
    assert alias(engine, SQL) == promoted and service.stats.held[-1] == (SQL, 1) and service.stats.rollbacks == []
    outcome, reason = checks(engine)[-1]
    assert outcome == "held" and reason.startswith("the rollback of sql was due (-5.00% ")
    assert "pinned to v%d by bob (keep it)" % promoted in reason
    moves, pins = audit(engine)
    assert [(m[0], m[1], m[2], m[3]) for m in moves[1:]] == [(SQL, None, 1, "ana"), (SQL, 1, promoted, "learner@r1")]
    assert pins == [("pin", SQL, 1, "ana", "hold sql"), ("unpin", SQL, 1, "ana", "over"),
                    ("pin", SQL, promoted, "bob", "keep it")]


def test_a_learner_move_is_refused_when_an_operator_moved_the_alias_in_between(learner):
    engine, service = learner
    service._follow_external_champion()  # read: sql has no champion of its own
    with session_scope(engine) as s:  # an operator gives sql one before the learner acts
        v2 = store(s, survival_gate(1.0), 1)
        promote_for_workload(s, "sql", v2, reason="by hand", actor="ana", expected=None)
    act(service, "promote")
    assert alias(engine, SQL) == v2 and service.stats.moved_meanwhile == [(SQL, service.stats.promotions[-1])]
    outcome, reason = checks(engine)[-1]
    assert outcome == "moved meanwhile" and f"champion/sql moved meanwhile: it names v{v2}, not no version as read" \
        in reason
    assert "sql" not in service.workload_gates
    service._follow_external_champion()  # the next round follows the database
    assert service.workload_gates["sql"][0] == v2
    with session_scope(engine) as s:
        assert [(e.to_version_id, e.actor) for e in list_alias_events(s, SQL)] == [(v2, "ana")]


def test_the_learner_makes_no_version_while_the_global_champion_is_pinned(learner):
    from predictor.online.promotion import ShadowScore

    engine, service = learner
    with session_scope(engine) as s:
        move_alias(s, CHAMPION, 1, reason="freeze", actor="ana", expected=1, pin=True)
    with service._leader_transaction() as s:
        service._promote(s, ShadowScore.__new__(ShadowScore))
    assert service.stats.held == [(CHAMPION, None)] and service.stats.promotions == [] and service.champion_id == 1


# ---------------------------------------------------------------- the CLI

def hvd(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller.cli.main", "--db", url, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_pin_unpin_and_rollback_of_a_workload_champion(versions, db_url):
    engine, (v1, v2, v3, v4) = versions
    with session_scope(engine) as s:
        promote_for_workload(s, "sql", v2, reason="promotion for sql", actor="learner@r1", expected=None)
    who = ("--author", "ana")
    done = hvd(db_url, "pin", "--workload", "sql", "--version", str(v3), *who, "--reason", "incident 7")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"champion/sql: pinned to v{v3} (moved from v{v2}) by ana\n", "")
    refused = hvd(db_url, "rollback", "--workload", "sql", *who, "--reason", "undo")
    assert refused.returncode == 2 and refused.stderr == (
        f"hvd rollback: error: champion/sql is pinned to v{v3} by ana (incident 7); nothing changed (unpin it, or pin "
        "another version)\n")
    again = hvd(db_url, "pin", "--workload", "sql", "--version", str(v3), *who, "--reason", "x")
    assert again.returncode == 2 and again.stderr == f"hvd pin: error: champion/sql already is pinned to v{v3}; nothing changed\n"
    bad = hvd(db_url, "pin", "--workload", "sql", "--version", str(v4), *who, "--reason", "x")
    assert bad.returncode == 2 and bad.stderr.startswith(f"hvd pin: error: predictor version v{v4} is unloadable: "
                                                         "predictor blob was trained on feature schema ffffffffffff")
    listed = hvd(db_url, "versions", "--log")
    assert listed.returncode == 0, listed.stderr
    assert f"pinned: champion/sql at v{v3} by ana since " in listed.stdout and listed.stdout.count("pinned: ") == 1
    assert f" pin champion/sql v{v3} by ana: incident 7\n" in listed.stdout
    done = hvd(db_url, "unpin", "--workload", "sql", *who, "--reason", "over")
    assert (done.returncode, done.stdout) == (0, f"champion/sql: unpinned (it stays at v{v3}; the learner may move it again)\n")
    twice = hvd(db_url, "unpin", "--workload", "sql", *who, "--reason", "over")
    assert twice.returncode == 2 and twice.stderr == "hvd unpin: error: champion/sql is not pinned; nothing changed\n"
    back = hvd(db_url, "rollback", "--workload", "sql", *who, "--reason", "regressed")
    # before the learner's last move sql had no champion of its own: back to what served it then, champion's v1
    assert (back.returncode, back.stdout) == (0, f"champion/sql: v{v3} -> v{v1}\n"), back.stderr
    never = hvd(db_url, "rollback", "--workload", "chat", *who, "--reason", "x")
    assert never.returncode == 2 and never.stderr == ("hvd rollback: error: champion/chat was never moved by the learner: "
                                                      "nothing to roll back (give --to VERSION)\n")
    glob = hvd(db_url, "pin", "--version", str(v1), *who, "--reason", "freeze")
    assert (glob.returncode, glob.stdout) == (0, f"champion: pinned to v{v1} by ana\n")
    held = hvd(db_url, "rollback", "--to", str(v2), *who, "--reason", "x")
    assert held.returncode == 2 and "champion is pinned to v1 by ana (freeze)" in held.stderr
    assert hvd(db_url, "unpin", *who, "--reason", "thaw").returncode == 0
    unknown = hvd(db_url, "pin", "--workload", "poetry", "--version", "1", *who, "--reason", "x")
    assert unknown.returncode == 2 and "invalid choice: 'poetry'" in unknown.stderr
    moves, pins = audit(engine)
    assert [m[0] for m in pins] == ["pin", "unpin", "pin", "unpin"] and all(p[3] == "ana" for p in pins)
    assert moves[-1] == (SQL, v3, v1, "ana", "rollback: regressed")
