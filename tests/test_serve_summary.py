"""The serve summary prints the allocator's objective (simulated ms/1k) beside cycles/1k, with the
counts both are made of."""
from __future__ import annotations

from controller.cli.serve_traces import ServeResult
from controller.cli.summary import format_serve_summary
from controller.engines.trace_engine import ReplayRun
from controller.services.event_writer import Tally as EventTally
from predictor.evaluation.simulator import Tally


def _row(text: str, name: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.split() and line.split()[0] == name]
    return line.split()


def test_rows_carry_ms_per_1k_and_exact_counts() -> None:
    run = ReplayRun({"sql": Tally(tokens=2000, cycles=500, wasted=7, cache_cycles=300, model_cycles=200, time_ms=1234.0),
                     "chat": Tally(tokens=1000, cycles=400, wasted=3, cache_cycles=100, model_cycles=300, time_ms=766.0)},
                    steps=480)
    text = format_serve_summary(ServeResult(run, [], [], EventTally(900, 900, 0, 0, 0), False, 1.5))
    assert _row(text, "workload") == ["workload", "tokens", "cycles/1k", "ms/1k", "cache", "cycles", "model", "cycles",
                                      "rejected"]
    assert _row(text, "sql") == ["sql", "2000", "250.0", "617.0", "300", "200", "7"]
    assert _row(text, "overall") == ["overall", "3000", "300.0", "666.7", "400", "500", "10"]
    assert text.splitlines()[4].startswith("480 engine steps; 1.5 s; promotions none")


def test_the_summary_says_how_far_the_plans_promises_were_kept() -> None:
    run = ReplayRun({"sql": Tally(tokens=100, cycles=50, wasted=0, cache_cycles=50, model_cycles=0, time_ms=10.0)},
                    steps=50)
    text = format_serve_summary(ServeResult(run, [], [], EventTally(9, 9, 0, 0, 0), False, 1.0, [], (250.0, 220)))
    assert "the plan's promises kept: 220 of 250.0 accepted tokens expected of the verified drafts (0.880)" in text
    quiet = format_serve_summary(ServeResult(run, [], [], EventTally(9, 9, 0, 0, 0), False, 1.0))
    assert "promises" not in quiet  # no plan promised (a fixed tau, a competitor's rule)
