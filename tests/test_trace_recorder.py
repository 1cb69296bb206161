"""HVD_RECORD: served requests written as traces that `hvd eval --traces` reads back, bounded, and
never lost to a file that cannot be written for a while."""
from __future__ import annotations

import numpy as np

from controller.services.trace_recorder import ServedRequest, TraceRecorder
from predictor.data.traces import load_traces


def _served(tokenizer, i: int, tenant: str = "acme", workload: str = "sql") -> ServedRequest:
    prompt = tokenizer._encode(f"<|im_start|>user\nquestion {i}: how many rows?<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode_output(f"SELECT count(*) FROM t{i};")
    return ServedRequest(f"req-{i}", tenant, workload, prompt, output)


def test_recorded_requests_read_back_as_traces(tmp_path, tokenizer):
    path = tmp_path / "served.jsonl"
    rec = TraceRecorder(path, tokenizer, replica="r1", model="smollm2")
    served = [_served(tokenizer, i) for i in range(3)]
    for r in served:
        rec.add(r)
    assert rec.flush() and rec.written == 3
    records, report = load_traces([path])
    assert report.skipped == 0 and [r.trace_id for r in records] == ["r1:req-0", "r1:req-1", "r1:req-2"]
    assert {(r.tenant, r.workload, r.model, r.run, r.source) for r in records} == {("acme", "sql", "smollm2", "r1", "recorded")}
    for r, s in zip(records, served):
        np.testing.assert_array_equal(tokenizer.encode_context(r), s.prompt)  # the same ids replayed
        np.testing.assert_array_equal(tokenizer.encode_output(r.output), s.output)


def test_recording_is_bounded(tmp_path, tokenizer):
    rec = TraceRecorder(tmp_path / "served.jsonl", tokenizer, replica="r1", model="m", max_requests=2)
    for i in range(5):
        rec.add(_served(tokenizer, i))
    assert rec.flush() and (rec.accepted, rec.written) == (2, 2)
    queued = TraceRecorder(tmp_path / "q.jsonl", tokenizer, replica="r1", model="m", max_pending=2)
    for i in range(3):
        queued.add(_served(tokenizer, i))
    assert queued.flush() and (queued.written, queued.dropped) == (2, 1)


def test_an_unwritable_file_keeps_the_requests_until_it_can_be_written(tmp_path, tokenizer):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    rec = TraceRecorder(blocker / "served.jsonl", tokenizer, replica="r1", model="m")
    rec.add(_served(tokenizer, 0))
    assert not rec.flush() and rec.failures == 1 and rec.written == 0
    blocker.unlink()
    rec.add(_served(tokenizer, 1))
    assert rec.flush() and rec.written == 2
    assert [r.trace_id for r in load_traces([blocker / "served.jsonl"])[0]] == ["r1:req-0", "r1:req-1"]
