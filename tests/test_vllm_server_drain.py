"""A stopped `hvd serve --engine vllm` drains HVD in vLLM's worker process (its own server: the
other module's stays up until that module ends)."""
from __future__ import annotations

import json

from predictor.data.traces import load_traces

from support.trace_subset import champion_database
from support.vllm_server import post, start, stop


def test_a_stopped_server_drains_hvd_in_its_worker(tmp_path):
    """vLLM's worker, where the hybrid lives, ends with os._exit (a multiprocessing child): HVD's exit
    drain runs there through multiprocessing's exit finalizer. Stopped with SIGTERM after two requests,
    the server has recorded both (the last one finished at exit: no step came after it) and stored its
    shutdown tally, nothing lost."""
    db = champion_database(tmp_path, {"aider-chat-history": 10})
    recorded, spill = tmp_path / "served.jsonl", tmp_path / "spill"
    proc, base = start(tmp_path, db, {"HVD_RECORD": str(recorded), "HVD_SPILL_DIR": str(spill)})
    try:
        for text in ("def add(a, b):", "SELECT name FROM"):
            post(base + "/v1/completions", {"model": "smollm2", "prompt": text, "max_tokens": 12, "temperature": 0,
                                             "vllm_xargs": {"hvd_tenant": "drain", "hvd_workload": "coding"}})
    finally:
        stop(proc, group=False)
    records, report = load_traces([recorded])
    assert report.skipped == 0 and len(records) == 2 and {r.tenant for r in records} == {"drain"}
    tallies = [json.loads(line) for line in (spill / "shutdown.jsonl").read_text().splitlines()]
    assert len(tallies) == 1 and tallies[0]["lost"] == 0 and tallies[0]["written"] == tallies[0]["produced"] > 0
