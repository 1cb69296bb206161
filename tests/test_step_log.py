"""HVD_STEP_LOG: every step HVD timed, one JSON line each, bounded, and never lost to a file that
cannot be written for a while (controller.services.step_log on controller.services.jsonl_log)."""
from __future__ import annotations

import json

import pytest

from controller.core.step_costs import StepTiming
from controller.services.step_log import StepLog

DECODE = StepTiming.of(1_700_000_000.25, 2, 9, 3, target=0.040, hvd=0.0012, drafter=0.003, rest=0.0008)
PREFILL = StepTiming.of(1_700_000_000.5, 1, 700, 0, target=0.2, hvd=0.0004, drafter=0.0, rest=0.001)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_is_one_line_with_its_parts(tmp_path):
    log = StepLog(tmp_path / "steps.jsonl")
    log.add((DECODE, True))
    log.add((PREFILL, False))
    assert log.flush() and log.written == 2
    decode, prefill = _lines(tmp_path / "steps.jsonl")
    assert decode == {"at": 1_700_000_000.25, "phase": "decode", "batch": 2, "query_tokens": 9, "model_k": 3,
                      "target_ms": 40.0, "hvd_ms": 1.2, "drafter_ms": 3.0, "rest_ms": 0.8, "total_ms": 45.0}
    assert (prefill["phase"], prefill["query_tokens"], prefill["total_ms"]) == ("prefill", 700, 201.4)
    log.add((DECODE, True))
    assert log.flush() and len(_lines(tmp_path / "steps.jsonl")) == 3  # appended


def test_the_log_is_bounded_and_says_so_once(tmp_path, caplog):
    log = StepLog(tmp_path / "steps.jsonl", max_steps=2)
    for _ in range(5):
        log.add((DECODE, True))
    assert log.flush() and (log.accepted, log.written) == (2, 2)
    assert sum("HVD_STEP_LOG: 2 steps written" in r.getMessage() for r in caplog.records) == 1
    queued = StepLog(tmp_path / "q.jsonl", max_pending=2)
    for _ in range(3):
        queued.add((DECODE, True))
    assert queued.flush() and (queued.written, queued.dropped) == (2, 1)
    with pytest.raises(ValueError, match="HVD_STEP_LOG: its bounds must be >= 1, got at most 0 steps"):
        StepLog(tmp_path / "x.jsonl", max_steps=0)


def test_an_unwritable_file_keeps_the_steps_until_it_can_be_written(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    log = StepLog(blocker / "steps.jsonl")
    log.add((DECODE, True))
    assert not log.flush() and log.failures == 1 and log.written == 0
    blocker.unlink()
    log.add((PREFILL, False))
    assert log.flush() and log.written == 2
    assert [line["phase"] for line in _lines(blocker / "steps.jsonl")] == ["decode", "prefill"]
