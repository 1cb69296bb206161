"""Trace loader properties (hypothesis, derandomized): valid records round-trip, and no input at all
(JSON values, text lines, bytes, compressed containers cut anywhere) raises anything but a
TraceFormatError that names file:line."""
from __future__ import annotations

import gzip
import json
import lzma
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from predictor.data.traces import Message, TraceFormatError, TraceRecord, load_traces

from storage.workloads import WORKLOADS

def fast(max_examples: int) -> settings:
    """Deterministic (derandomized, no example database) and quick: the suite stays well under 20 s."""
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

texts = st.text(min_size=1, max_size=30).filter(lambda s: s.strip() != "")
messages = st.builds(Message, role=st.sampled_from(("system", "user", "assistant", "tool")), content=st.text(max_size=30))
contexts = st.one_of(st.text(max_size=40), st.lists(messages, max_size=4).map(tuple))


@st.composite
def record_sets(draw: st.DrawFn) -> list[TraceRecord]:
    n_sessions = draw(st.integers(1, 4))
    out: list[TraceRecord] = []
    for s in range(n_sessions):
        turns = sorted(draw(st.sets(st.integers(0, 50), min_size=1, max_size=4)))
        sid = draw(texts) + f"#{s}"
        for t in turns:
            model = draw(texts)
            out.append(TraceRecord(
                trace_id=f"{sid}/{t}", session_id=sid, turn=t, source=draw(texts),
                workload=draw(st.sampled_from(WORKLOADS)), model=model, run=draw(texts),
                context=draw(contexts), output=draw(texts),
            ))
    return out


def to_json(rec: TraceRecord) -> dict[str, object]:
    ctx = rec.context if isinstance(rec.context, str) else [{"role": m.role, "content": m.content} for m in rec.context]
    return {**{k: getattr(rec, k) for k in ("trace_id", "session_id", "turn", "source", "workload", "model", "run")},
            "context": ctx, "output": rec.output}


@fast(60)
@given(recs=record_sets(), interleave=st.randoms(use_true_random=False), ascii_only=st.booleans())
def test_valid_records_round_trip(tmp_path: Path, recs: list[TraceRecord], interleave: object,
                                  ascii_only: bool) -> None:
    # interleave sessions while keeping each session's turns in order
    queues: dict[str, list[TraceRecord]] = {}
    for r in recs:
        queues.setdefault(r.session_id, []).append(r)
    written: list[TraceRecord] = []
    while queues:
        sid = interleave.choice(sorted(queues))  # type: ignore[attr-defined]
        written.append(queues[sid].pop(0))
        if not queues[sid]:
            del queues[sid]
    path = tmp_path / "rt.jsonl"
    path.write_text("".join(json.dumps(to_json(r), ensure_ascii=ascii_only) + "\n" for r in written), encoding="utf-8")
    loaded, report = load_traces([path])
    first: dict[str, int] = {}
    for i, r in enumerate(written):
        first.setdefault(r.session_id, i)
    assert loaded == sorted(written, key=lambda r: (first[r.session_id], r.turn))
    assert (report.records, report.skipped) == (len(recs), 0)


# Any JSON value, biased towards the schema's own keys so that validation, not just the
# "must be an object" check, gets exercised; strings include lone surrogates (json.dumps escapes them).
KEYS = ["trace_id", "session_id", "turn", "source", "workload", "model", "run", "context", "output",
        "role", "content", "tool_calls", "function", "name", "arguments", "x"]
surrogates = st.integers(0xD800, 0xDFFF).map(chr)
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF) | surrogates, max_size=10)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text | st.sampled_from(WORKLOADS + ("user",)),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(KEYS) | any_text, kids, max_size=6),
    max_leaves=16,
)
lines = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.text(max_size=60).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=60),
)
LINE_REF = re.compile(r"(?:junk|cut)\.jsonl(?:\.gz|\.xz)?:(\d+): ")


def assert_only_format_errors(path: Path, n_lines: int, max_bytes: int = 1 << 20) -> None:
    """Loading raises nothing but TraceFormatError naming path:line, and --skip-bad counts every line."""
    try:
        load_traces([path], max_record_bytes=max_bytes)
    except TraceFormatError as exc:
        message = str(exc)
        match = LINE_REF.match(message.removeprefix(str(path.parent) + "/"))
        assert match and 1 <= int(match.group(1)) <= n_lines + 1, message
        message.encode("utf-8")  # printable
    recs, report = load_traces([path], skip_bad=True, max_record_bytes=max_bytes)
    assert report.records == len(recs) and report.skipped == len(report.errors)
    assert all(LINE_REF.search(e) for e in report.errors), report.errors


@fast(150)
@given(rows=st.lists(lines, min_size=1, max_size=6), max_bytes=st.sampled_from([8, 64, 1 << 20]))
def test_any_lines_raise_only_format_errors_naming_file_and_line(tmp_path: Path, rows: list[bytes],
                                                                  max_bytes: int) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_bytes(b"\n".join(r.replace(b"\n", b" ") for r in rows) + b"\n")
    assert_only_format_errors(path, len(rows), max_bytes)


@fast(40)
@given(data=st.binary(max_size=400))
def test_any_bytes_in_any_container_raise_only_format_errors(tmp_path: Path, data: bytes) -> None:
    for suffix in ("", ".gz", ".xz"):
        path = tmp_path / f"junk.jsonl{suffix}"
        path.write_bytes(data)
        assert_only_format_errors(path, data.count(b"\n") + 1)


ROW = json.dumps({"workload": "chat", "context": "c", "output": "o"}).encode() + b"\n"


@fast(60)
@given(n=st.integers(1, 200), cut=st.floats(0, 1), suffix=st.sampled_from([".gz", ".xz"]))
def test_containers_cut_anywhere_keep_a_prefix_of_the_records(tmp_path: Path, n: int, cut: float, suffix: str) -> None:
    blob = (gzip.compress if suffix == ".gz" else lzma.compress)(ROW * n)
    path = tmp_path / f"cut.jsonl{suffix}"
    path.write_bytes(blob[: int(len(blob) * cut)])
    assert_only_format_errors(path, n)
    recs, report = load_traces([path], skip_bad=True)
    assert [r.trace_id for r in recs] == [f"cut:{i}" for i in range(1, len(recs) + 1)]
    assert report.skipped <= 1 and (report.skipped == 1 or len(recs) == n)


STRING_FIELDS = ("trace_id", "session_id", "source", "model", "run", "context", "output")


@fast(40)
@given(name=st.sampled_from(STRING_FIELDS + ("message",)), head=st.text(max_size=5), bad=surrogates,
       tail=st.text(max_size=5))
def test_an_escaped_surrogate_anywhere_is_refused_naming_its_field(tmp_path: Path, name: str, head: str, bad: str,
                                                                   tail: str) -> None:
    """Escaped (json.dumps' default) it is valid JSON; raw, its bytes are not UTF-8, a line-level error."""
    value = "x" + head + bad + tail
    record: dict[str, object] = {"workload": "chat", "context": "c", "output": "o"}
    if name == "message":
        record["context"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": value}]
    else:
        record[name] = value
    path = tmp_path / "junk.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="ascii")
    field = "context[1].content" if name == "message" else name
    try:
        load_traces([path])
    except TraceFormatError as exc:
        assert str(exc).startswith(f"{path}:1: field '{field}': character {1 + len(head)} is U+{ord(bad):04X}")
    else:
        raise AssertionError("a lone surrogate was accepted")
