"""`hvd serve --engine replay` as an operator runs it: progress while serving, Ctrl-C stops it
cleanly, and everything it reported as written is in SQL."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "cycles/1k" in line:  # a progress line: it is serving
            break
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    assert "stopping after the current step" in text and "interrupted" in text
    written = int(re.search(r"events written (\d+)", text).group(1))
    engine = make_engine(db)
    with session_scope(engine) as s:
        assert count_events(s) == written > 0
        assert read_buckets(s)
