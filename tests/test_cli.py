"""The `hvd` console script end to end (subprocesses), and `make warmstart` on a small subset."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from support.trace_subset import write_subset

ROOT = Path(__file__).resolve().parents[1]
HVD = Path(sys.executable).with_name("hvd")
if not HVD.exists():
    HVD = ROOT / ".venv" / "bin" / "hvd"
POLICY_KEYS = {"none", "suffix", "model", "arctic", "vllm-adaptive", "sglang-hybrid", "trtllm", "hvd", "hvd-binary", "oracle",
               "oracle-length"}
FIGURE_KEYS = {"cycles_per_1k", "tokens_per_cycle", "wasted_per_1k", "speedup"}


def hvd(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HVD_DATABASE_URL"}
    return subprocess.run([str(HVD), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    return tmp, write_subset(tmp / "subset.jsonl")


@pytest.fixture(scope="module")
def warm_db(work):
    tmp, subset = work
    db = f"sqlite:///{tmp}/h.db"
    run = hvd("--db", db, "warmstart", "--traces", str(subset), "--epochs", "1", "--no-cache", cwd=tmp)
    assert run.returncode == 0, run.stderr
    return db, run


def test_warmstart_exits_0_and_reports_the_version(warm_db):
    _, run = warm_db
    assert "loaded 32 records" in run.stdout
    assert "stored predictor version 1 as champion" in run.stdout


def test_eval_writes_the_report(work, warm_db):
    tmp, subset = work
    db, _ = warm_db
    out = tmp / "reports" / "out.json"
    run = hvd("--db", db, "eval", "--traces", str(subset), "--json", str(out), "--no-cache", cwd=tmp)
    assert run.returncode == 0, run.stderr
    assert "SIMULATED" in run.stdout and f"report written to {out}" in run.stdout
    report = json.loads(out.read_text())
    assert report["predictor_version"] == 1
    with open(ROOT / "predictor" / "decision" / "profiles.toml", "rb") as fh:
        import tomllib

        profiles = set(tomllib.load(fh)["drafter"])
    assert set(report["drafters"]) == profiles
    workloads = None
    for name, drafter in report["drafters"].items():
        assert drafter["simulated"] is True
        policies = drafter["policies"]
        assert set(policies) == POLICY_KEYS
        for policy, fig in policies.items():
            assert FIGURE_KEYS <= set(fig["overall"]), (name, policy)
            assert fig["by_workload"], (name, policy)
            for w, f in fig["by_workload"].items():
                assert FIGURE_KEYS <= set(f), (name, policy, w)
            workloads = workloads or set(fig["by_workload"])
            assert set(fig["by_workload"]) == workloads
        assert policies["none"]["overall"]["cycles_per_1k"] == 1000.0
        assert policies["none"]["overall"]["tokens_per_cycle"] == 1.0
        assert policies["none"]["overall"]["speedup"] == 1.0
        assert policies["none"]["overall"]["wasted_per_1k"] == 0.0
        for w, f in policies["none"]["by_workload"].items():
            assert f["cycles_per_1k"] == 1000.0, w
        # an oracle gate can never need more cycles than never speculating
        assert policies["oracle"]["overall"]["cycles_per_1k"] < 1000.0
    assert workloads <= {"agentic", "code_edit", "coding", "sql", "chat"} and len(workloads) >= 3
    predictor = report["predictor"]
    assert {"precision_ge6", "recall_ge6", "mae", "by_workload"} <= set(predictor)
    assert 0.0 <= predictor["precision_ge6"] <= 1.0 and 0.0 <= predictor["recall_ge6"] <= 1.0
    assert predictor["mae"] >= 0.0
    assert set(predictor["by_workload"]) <= {"agentic", "code_edit", "coding", "sql", "chat"}


def test_versions_lists_v1_as_champion(work, warm_db):
    tmp, _ = work
    db, _ = warm_db
    run = hvd("--db", db, "versions", cwd=tmp)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("* v1 parent=- ")
    assert "precision@6=" in lines[0] and "reason='warm start from replayed traces'" in lines[0]


def test_bad_trace_line_is_exit_2_naming_file_and_line(work):
    tmp, _ = work
    lines = write_subset(tmp / "lines.jsonl").read_bytes().splitlines(keepends=True)
    bad = tmp / "bad.jsonl"
    bad.write_bytes(lines[0] + b'{"workload": "chat", oops\n' + b"".join(lines[1:]))
    db = f"sqlite:///{tmp}/bad.db"
    run = hvd("--db", db, "warmstart", "--traces", str(bad), "--epochs", "1", "--no-cache", cwd=tmp)
    assert run.returncode == 2
    assert f"{bad}:2" in run.stderr and "invalid JSON" in run.stderr
    assert "Traceback" not in run.stderr

    ok = hvd("--db", db, "warmstart", "--traces", str(bad), "--epochs", "1", "--no-cache", "--skip-bad", cwd=tmp)
    assert ok.returncode == 0, ok.stderr
    assert "skipped 1 bad record(s)" in ok.stdout and f"{bad}:2" in ok.stdout
    assert "loaded 32 records" in ok.stdout


def test_missing_trace_file_is_exit_2(work):
    tmp, _ = work
    run = hvd("--db", f"sqlite:///{tmp}/missing.db", "warmstart", "--traces", str(tmp / "nope.jsonl"),
              "--no-cache", cwd=tmp)
    assert run.returncode == 2
    assert "nope.jsonl: no such trace file" in run.stderr


def test_eval_on_empty_database_points_to_warmstart(work):
    tmp, subset = work
    run = hvd("--db", f"sqlite:///{tmp}/empty.db", "eval", "--traces", str(subset), "--no-cache", cwd=tmp)
    assert run.returncode == 2
    assert "hvd warmstart" in run.stderr
    assert "Traceback" not in run.stderr


def test_help(work):
    tmp, _ = work
    top = hvd("--help", cwd=tmp)
    assert top.returncode == 0
    for command in ("warmstart", "eval", "versions", "migrate"):
        assert command in top.stdout
    assert "--db" in top.stdout and "Hybrid Verified Decoding" in top.stdout
    sub = hvd("warmstart", "--help", cwd=tmp)
    assert sub.returncode == 0
    for option in ("--traces", "--epochs", "--skip-bad", "--no-cache", "--seed", "--test-fraction"):
        assert option in sub.stdout
    assert "champion" in sub.stdout


def test_no_subcommand_is_a_usage_error(work):
    tmp, _ = work
    run = hvd(cwd=tmp)
    assert run.returncode == 2 and "usage: hvd" in run.stderr


@pytest.mark.slow
def test_make_warmstart_on_a_subset(work):
    tmp, subset = work
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    db = f"sqlite:///{tmp}/m.db"
    run = subprocess.run(
        ["make", "-C", str(ROOT), "warmstart", f"DB={db}", f"ARGS=--traces {subset} --epochs 1 --no-cache"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "loaded 32 records" in run.stdout

    from storage.engine import make_engine, session_scope
    from storage.models import Alias

    engine = make_engine(db)
    try:
        with session_scope(engine) as session:
            champion = session.scalars(select(Alias).where(Alias.name == "champion")).one_or_none()
            assert champion is not None and champion.version_id == 1
    finally:
        engine.dispose()


def test_database_failing_mid_command_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A database that answers but then fails the command (here: locked by another writer past the
    busy timeout) is one line naming the database, not a traceback."""
    import sqlite3

    from controller.cli.main import main
    from storage.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'hvd.db'}"
    upgrade(url)
    holder = sqlite3.connect(tmp_path / "hvd.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # holds the write lock
    try:
        code = main(["--db", url, "override", "set", "--tenant", "acme", "--tau", "2", "--expires", "1h",
                     "--author", "ana", "--reason", "test"])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"hvd override: error: database {url}: database is locked") and err.count("\n") == 1


def test_scenario_unseen_names_an_unknown_source_before_any_work(work):
    tmp, _ = work
    run = hvd("--db", f"sqlite:///{tmp}/sc.db", "scenario", "unseen", "--source", "no-such-source", cwd=tmp)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "unknown source 'no-such-source'; bundled sources: aider-chat-history, can-ai-code-results" in run.stderr
    assert not (tmp / "var" / "scenario-unseen").exists()


@pytest.mark.parametrize("argv, oracle", [([], None), (["--oracle"], "gate"), (["--oracle", "predictor"], "predictor")])
def test_the_replay_engines_oracles_by_name(argv, oracle):
    """`--oracle` alone is the binary oracle gate; `--oracle predictor` the perfect predictor; the
    names the CLI offers are the engine's, and the engine refuses any other by name."""
    from controller.cli.main import ORACLE_NAMES, _parser
    from controller.engines.trace_engine import ORACLES, run_replay

    assert _parser().parse_args(["serve", "--engine", "replay", *argv]).oracle == oracle
    assert set(ORACLE_NAMES) == set(ORACLES)
    with pytest.raises(ValueError, match="oracle must be one of \\('gate', 'predictor'\\) or None, got 'length'"):
        run_replay(None, [], None, None, oracle="length")


def test_eval_on_each_sources_head(work, warm_db):
    """--max-tokens-per-source (what `make run` uses): fewer records, whole sessions, and a bad
    value refused by name before anything is replayed."""
    tmp, subset = work
    db, _ = warm_db
    out = tmp / "head.json"
    run = hvd("--db", db, "eval", "--traces", str(subset), "--max-tokens-per-source", "200", "--json", str(out),
              "--no-cache", cwd=tmp)
    assert run.returncode == 0, run.stderr
    kept = int(run.stdout.split("kept ")[1].split(" records")[0])
    assert 0 < kept < 32
    assert json.loads(out.read_text())["data"]["traces"] <= kept
    bad = hvd("--db", db, "eval", "--traces", str(subset), "--max-tokens-per-source", "0", cwd=tmp)
    assert bad.returncode == 2
    assert "--max-tokens-per-source must be >= 1, got 0" in bad.stderr


def test_eval_left_out_evaluates_each_sources_stream_under_a_gate_that_never_saw_it(work):
    tmp, subset = work
    out = tmp / "left-out.json"
    run = hvd("--db", f"sqlite:///{tmp}/left-out.db", "eval", "--traces", str(subset), "--left-out", "fastchat-chat",
              "--drafter", "eagle3-smollm2", "--settings", "cpu-smollm2/b1", "gpu-8b/b8", "--no-cache",
              "--json", str(out), cwd=tmp)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())["left_out"]["fastchat-chat"]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, json.loads((ROOT / "docs" / "reference" / "eval-report.schema.json").read_text()))
    assert report["split"].startswith("left-out source fastchat-chat: its scenario stream")
    assert report["data"]["traces"] == 8  # the subset's fastchat sessions, nothing of the others
    assert set(report["predictor"]["by_workload"]) == {"chat"}
    vs = report["checks"]["eagle3-smollm2"]["ms_vs_rivals"]
    assert set(vs) == {"cpu-smollm2/b1", "gpu-8b/b8"}
    assert set(vs["gpu-8b/b8"]["overall"]) == {"vllm-adaptive", "sglang-hybrid", "trtllm"}
    assert "hvd against the competitors' rules on left-out sources" in run.stdout
    assert "hvd below every rule on every workload in every setting:" in run.stdout

    refused = hvd("--db", f"sqlite:///{tmp}/left-out.db", "eval", "--traces", str(subset), "--left-out", "nope",
                  "--no-cache", cwd=tmp)
    assert refused.returncode == 2 and "--left-out: unknown source 'nope'" in refused.stderr
    refused = hvd("--db", f"sqlite:///{tmp}/left-out.db", "eval", "--traces", str(subset), "--left-out",
                  "--version", "1", "--no-cache", cwd=tmp)
    assert refused.returncode == 2 and "drop --version" in refused.stderr
