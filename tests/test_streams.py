"""Each source's head (predictor.data.streams): what `make run` and the unseen scenario serve."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from predictor.data.streams import source_heads
from predictor.data.traces import TraceRecord


def record(source: str, session: str, turn: int) -> TraceRecord:
    return TraceRecord(trace_id=f"{source}-{session}-{turn}", session_id=session, turn=turn, source=source,
                       workload="chat", model="m", run="r", context="c", output="o")


def test_whole_sessions_until_the_budget_per_source() -> None:
    records = [record("a", "s1", 0), record("b", "t1", 0), record("a", "s1", 1), record("a", "s2", 0),
               record("b", "t2", 0), record("a", "s3", 0), record("b", "t3", 0)]
    tokens = [4, 10, 4, 1, 1, 5, 1]
    # a: s1 (8 tokens) reaches 5, so s2 is not started; b: t1 (10) reaches it at once
    assert source_heads(records, tokens, 5) == [0, 1, 2]
    # a: s1 + s2 = 9 < 10, s3 starts below the budget and is kept whole; b: t1 = 10 stops b
    assert source_heads(records, tokens, 10) == [0, 1, 2, 3, 5]
    assert source_heads(records, tokens, None) == list(range(7))


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        source_heads([record("a", "s", 0)], [1], 0)
    with pytest.raises(ValueError, match="output_tokens has 2 lengths for 1 records"):
        source_heads([record("a", "s", 0)], [1, 2], 5)


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[TraceRecord], list[int]]:
    """Sources with sessions of consecutive turns (the order load_traces keeps), interleaved."""
    per_source = []
    for s in range(draw(st.integers(1, 3))):
        rows = []
        for k in range(draw(st.integers(0, 4))):
            rows += [record(f"src{s}", f"src{s}-s{k}", t) for t in range(draw(st.integers(1, 3)))]
        per_source.append(rows)
    merged = []
    while any(per_source):
        i = draw(st.sampled_from([i for i, rows in enumerate(per_source) if rows]))
        merged.append(per_source[i].pop(0))
    return merged, [draw(st.integers(0, 20)) for _ in merged]


@given(streams(), st.integers(1, 60))
def test_every_source_keeps_a_prefix_of_whole_sessions_that_just_reaches_the_budget(
        stream: tuple[list[TraceRecord], list[int]], budget: int) -> None:
    records, tokens = stream
    kept = source_heads(records, tokens, budget)
    assert kept == sorted(kept)
    for source in {r.source for r in records}:
        mine = [i for i, r in enumerate(records) if r.source == source]
        head = [i for i in kept if records[i].source == source]
        assert head == mine[: len(head)], "a source's head is a prefix of its records"
        sessions = [records[i].session_id for i in head]
        whole = {s: sum(1 for i in mine if records[i].session_id == s) for s in sessions}
        assert all(sessions.count(s) == n for s, n in whole.items()), "no session is cut short"
        if len(head) < len(mine):  # stopped: the budget is reached, and it was not yet before the last session
            assert sum(tokens[i] for i in head) >= budget
            last = sessions[-1]
            assert sum(tokens[i] for i in head if records[i].session_id != last) < budget
