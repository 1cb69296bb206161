"""The served upper bound's recording (controller/engines/served_oracle.py): a file HVD_RECORD wrote,
read back as each prompt's output, and followed request by request while the engine's output matches
it; a bad file is refused naming what is wrong."""
from __future__ import annotations

import json

import numpy as np
import pytest

from controller.engines.served_oracle import OracleFileError, ServedOracle, recorded_outputs
from controller.services.trace_recorder import ServedRequest, TraceRecorder


def _prompt(tokenizer, i: int) -> np.ndarray:
    return tokenizer._encode(f"<|im_start|>user\\nquestion {i}: how many rows?<|im_end|>\\n<|im_start|>assistant\\n")


def _recording(tmp_path, tokenizer, outputs: dict[int, list[int]], name: str = "served"):
    path = tmp_path / f"{name}.jsonl"
    rec = TraceRecorder(path, tokenizer, replica="r1", model="smollm2")
    for i, out in outputs.items():
        rec.add(ServedRequest(f"req-{i}", "acme", "sql", _prompt(tokenizer, i), np.array(out, dtype=np.int32)))
    assert rec.flush()
    return path


def test_a_request_is_followed_while_its_output_matches_the_recording(tmp_path, tokenizer):
    path = _recording(tmp_path, tokenizer, {0: [5, 6, 7, 8, 9, 10], 1: [20, 21, 22]})
    seen = []
    oracle = ServedOracle(recorded_outputs(path), tokenizer.decode, seen.append)
    first = oracle.continuation("a", _prompt(tokenizer, 0), [5], 0)
    assert first.tolist() == [6, 7, 8, 9, 10]
    assert oracle.continuation("a", None, [6, 7, 8], 1).tolist() == [9, 10]  # a step that accepted two drafts
    assert oracle.continuation("a", None, [9, 10], 4).tolist() == []  # the end: nothing more to promise
    assert oracle.continuation("b", _prompt(tokenizer, 1), [20], 0).tolist() == [21, 22]
    assert oracle.continuation("b", None, [21, 99], 1) is None  # parted from the recording
    assert oracle.continuation("b", None, [22], 3) is None  # and stays off for that request
    assert oracle.continuation("c", _prompt(tokenizer, 7), [1], 0) is None  # not recorded
    assert oracle.continuation("c", None, [2], 1) is None
    assert (oracle.counts.matched, oracle.counts.missing, oracle.counts.diverged) == (2, 1, 1)
    assert seen == ["matched", "matched", "diverged", "missing"]
    oracle.forget("a")  # a finished request's id may come again: looked up afresh
    assert oracle.continuation("a", _prompt(tokenizer, 1), [20], 0).tolist() == [21, 22]


def test_a_prompt_recorded_twice_keeps_its_longer_output(tmp_path, tokenizer):
    path = _recording(tmp_path, tokenizer, {0: [5, 6]})
    more = _recording(tmp_path, tokenizer, {0: [5, 6, 7]}, "more")
    path.write_text(path.read_text() + more.read_text().replace("r1:req-0", "r1:req-0b"))
    (out,) = recorded_outputs(path).values()
    assert out.tolist() == [5, 6, 7]


def test_bad_recordings_are_refused_by_name(tmp_path, tokenizer):
    with pytest.raises(OracleFileError, match="does not exist.*HVD_RECORD"):
        recorded_outputs(tmp_path / "none.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(OracleFileError, match="holds no recorded request"):
        recorded_outputs(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(OracleFileError, match="broken.jsonl"):
        recorded_outputs(broken)
    text = tmp_path / "text.jsonl"  # a trace another model wrote: no engine token ids
    line = json.loads(_recording(tmp_path, tokenizer, {0: [5, 6]}, "one").read_text())
    del line["engine"]
    text.write_text(json.dumps(line) + "\n")
    with pytest.raises(OracleFileError, match="was not recorded by the engine"):
        recorded_outputs(text)
    other = tmp_path / "other.jsonl"
    a = json.loads(_recording(tmp_path, tokenizer, {0: [5, 6]}, "two").read_text())
    b = dict(a, trace_id="r1:req-9", session_id="r1:req-9", engine={"output_ids": [5, 8]})
    other.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    with pytest.raises(OracleFileError, match="another output for a prompt"):
        recorded_outputs(other)
