"""Load and validate LLM traces (the bundled ones or a user's own logs) for replay.

Users bring their own logs in this JSONL schema, so validation is strict and every error
names file:line and the offending field: a silently mis-read trace would skew every
replay measurement built on it.

Every string must be encodable as UTF-8 (JSON's escaped lone surrogates such as "\\ud800" are
refused: tokenizers, hashes and databases downstream cannot hold them), and a line may be at most
`max_record_bytes` long (DEFAULT_MAX_RECORD_BYTES): files are read line by line with that bound, so
one huge record costs neither the memory nor the replay time it would take to process it.

Record schema (one JSON object per line; `.jsonl`, `.jsonl.gz` or `.jsonl.xz`)::

    workload  (required) one of WORKLOADS
    context   (required) a prompt string, or a list of {"role", "content"} messages
    output    (required) non-empty text the model produced
    trace_id, session_id, turn, source, model, run, tenant   (optional, see parse_record)
    engine    (optional) present where the serving engine itself recorded the line (HVD_RECORD):
              {"output_ids": [...]}, the token ids it emitted (replay uses them rather than tokenizing
              `output` again; the output is the verifying model's own: DraftContext.on_policy).
              Lines recorded before schema 5 also carry per-token "top1_prob", "logit_gap" and
              "entropy" lists: read past, as no feature uses them any more
"""
from __future__ import annotations

import gzip
import json
import lzma
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

from storage.workloads import WORKLOADS

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".jsonl.xz")
FIELDS: tuple[str, ...] = ("trace_id", "session_id", "turn", "source", "workload", "model", "run", "context", "output",
                           "tenant", "engine")
MAX_TOKEN_ID = 2**31 - 1
# The bundled traces' longest line is 0.3 MiB; a record several times that is a log gone wrong more
# often than a real prompt, and replaying it is super-linear in its length (20 MB: > 240 s, 4.4 GB).
DEFAULT_MAX_RECORD_BYTES = 1 << 20
_SKIP_CHUNK = 1 << 16  # how much of an over-long line is held at once while skipping it


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class EngineRecord:
    """The engine's own view of an output it served: the token ids it emitted."""

    output_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceRecord:
    trace_id: str
    session_id: str
    turn: int
    source: str
    workload: str
    model: str
    run: str
    context: tuple[Message, ...] | str
    output: str
    tenant: str = "default"  # who was served (recorded traffic says; replay may serve each tenant's overrides)
    engine: EngineRecord | None = None  # recorded by the serving engine: its tokens


class TraceFormatError(ValueError):
    """A trace line is not in the schema; the message says where (file:line) and which field.

    The message is made printable (lone surrogates and other unencodable characters escaped as
    backslash sequences) so that reporting a bad string can never fail in its turn."""

    def __init__(self, message: str) -> None:
        super().__init__(message.encode("utf-8", "backslashreplace").decode("utf-8"))


@dataclass
class LoadReport:
    records: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)


def bundled_traces_path() -> Path:
    """The committed traces, found relative to this file so it works from any CWD."""
    return Path(__file__).resolve().parents[2] / "data" / "traces.jsonl.xz"


ONPOLICY_SPLITS = ("train", "held-out")


def onpolicy_traces_path(split: str) -> Path:
    """The recorded on-policy corpus (SmolLM2's own answers as the engine emitted them,
    tools/record_onpolicy.py): the training prompts' ("train") or the held-out ones' ("held-out")."""
    if split not in ONPOLICY_SPLITS:
        raise ValueError(f"on-policy split must be one of {ONPOLICY_SPLITS}, got {split!r}")
    return bundled_traces_path().parent / f"onpolicy-{split}.jsonl.xz"


# ---------------------------------------------------------------- one record


def _fail(where: str, name: str, problem: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: field '{name}': {problem}")


def _utf8(value: str, where: str, name: str) -> str:
    """`value` unchanged if it can be stored and tokenized, i.e. encoded as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise _fail(where, name, f"character {exc.start} is U+{ord(bad):04X}, which is not valid in UTF-8 "
                                 "(a lone surrogate escape such as \\ud800?)") from None
    return value


def _text(obj: dict[str, Any], name: str, where: str, default: str | None) -> str:
    """A non-empty string field; `default` None means the field is required."""
    if name not in obj:
        if default is None:
            raise _fail(where, name, "missing (required)")
        return default
    value = obj[name]
    if not isinstance(value, str):
        raise _fail(where, name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _fail(where, name, "must not be empty")
    return _utf8(value, where, name)


def _turn(obj: dict[str, Any], where: str) -> int:
    value = obj.get("turn", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, "turn", f"must be an integer, got {type(value).__name__}")
    if value < 0:
        raise _fail(where, "turn", f"must be >= 0, got {value}")
    return value


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _message(item: object, where: str, index: int) -> Message:
    """An OpenAI-style chat message. `name` and `tool_call_id` are accepted and ignored; `tool_calls`
    are rendered as one JSON line {"name", "arguments"} per call after the content, which is how
    the bundled agent traces show them to later turns."""
    name = f"context[{index}]"
    if not isinstance(item, dict):
        raise _fail(where, name, f"must be an object with 'role' and 'content', got {type(item).__name__}")
    extra = sorted(set(item) - _MESSAGE_KEYS)
    if extra:
        raise _fail(where, f"{name}.{extra[0]}", f"unknown key (allowed: {', '.join(sorted(_MESSAGE_KEYS))})")
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise _fail(where, f"{name}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    calls = item.get("tool_calls") or []
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise _fail(where, f"{name}.content", f"must be a string, got {type(content).__name__}")
    if not isinstance(calls, list):
        raise _fail(where, f"{name}.tool_calls", f"must be a list, got {type(calls).__name__}")
    lines = [_utf8(content, where, f"{name}.content")] if content else []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        where_call = f"{name}.tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _fail(where, where_call, "must be {'function': {'name': str, 'arguments': ...}}")
        try:
            line = json.dumps({"name": fn["name"], "arguments": fn.get("arguments", "")}, ensure_ascii=False)
        except RecursionError:
            raise _fail(where, f"{where_call}.function.arguments", "nested too deeply") from None
        lines.append(_utf8(line, where, f"{where_call}.function"))
    return Message(role, "\n".join(lines))


def _context(obj: dict[str, Any], where: str) -> tuple[Message, ...] | str:
    if "context" not in obj:
        raise _fail(where, "context", "missing (required)")
    value = obj["context"]
    if isinstance(value, str):
        return _utf8(value, where, "context")
    if not isinstance(value, list):
        raise _fail(where, "context", f"must be a string or a list of messages, got {type(value).__name__}")
    return tuple(_message(item, where, i) for i, item in enumerate(value))


def _workload(obj: dict[str, Any], where: str) -> str:
    value = _text(obj, "workload", where, None)
    if value not in WORKLOADS:
        raise _fail(where, "workload", f"{value!r} is not one of {', '.join(WORKLOADS)}")
    return value


def parse_record(
    obj: object, where: str, *, default_trace_id: str | None = None, default_source: str = "unknown"
) -> TraceRecord:
    """Validate one decoded JSON value; pure, so callers decide how to report failures.

    Optional fields default so that a bare {workload, context, output} log is usable:
    trace_id -> `default_trace_id` (else `where`), session_id -> trace_id (one turn per
    session), turn -> 0, model -> "unknown", run -> model, source -> `default_source`, tenant ->
    "default".
    """
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: record must be a JSON object, got {type(obj).__name__}")
    extra = sorted(set(obj) - set(FIELDS))
    if extra:
        raise _fail(where, extra[0], f"unknown field (allowed: {', '.join(FIELDS)})")
    trace_id = _text(obj, "trace_id", where, default_trace_id or where)
    model = _text(obj, "model", where, "unknown")
    return TraceRecord(
        trace_id=trace_id,
        session_id=_text(obj, "session_id", where, trace_id),
        turn=_turn(obj, where),
        source=_text(obj, "source", where, default_source),
        workload=_workload(obj, where),
        model=model,
        run=_text(obj, "run", where, model),
        context=_context(obj, where),
        output=_text(obj, "output", where, None),
        tenant=_text(obj, "tenant", where, "default"),
        engine=_engine(obj, where),
    )


_LEGACY_ENGINE_KEYS = frozenset({"top1_prob", "logit_gap", "entropy"})  # recorded before schema 5, read past


def _engine(obj: dict[str, Any], where: str) -> EngineRecord | None:
    """The optional `engine` object: the token ids the engine emitted."""
    if "engine" not in obj:
        return None
    value = obj["engine"]
    if not isinstance(value, dict):
        raise _fail(where, "engine", f"must be an object, got {type(value).__name__}")
    wrong = sorted((set(value) - _LEGACY_ENGINE_KEYS) ^ {"output_ids"})
    if wrong:
        raise _fail(where, "engine", f"has keys {sorted(value)}; expected exactly ['output_ids'] ({wrong[0]!r})")
    ids = value["output_ids"]
    if not isinstance(ids, list) or not ids:
        raise _fail(where, "engine.output_ids", "must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise _fail(where, f"engine.output_ids[{i}]", f"must be a token id (an integer 0..{MAX_TOKEN_ID}), got {t!r}")
    return EngineRecord(tuple(ids))


# ---------------------------------------------------------------- files


def _is_trace_file(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    """Explicit files keep their order; a directory contributes its trace files sorted by name."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(c for c in p.iterdir() if c.is_file() and _is_trace_file(c))
        elif not p.exists():
            raise FileNotFoundError(f"{p}: no such trace file or directory")
        elif _is_trace_file(p):
            files.append(p)
        else:
            raise TraceFormatError(f"{p}: unsupported file type (expected {', '.join(SUFFIXES)})")
    return files


def _open(path: Path) -> BinaryIO:
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rb")  # type: ignore[return-value]


_READ_ERRORS = (OSError, EOFError, lzma.LZMAError)


def _read_problem(path: Path, exc: BaseException) -> str:
    if path.suffix in (".gz", ".xz"):
        return f"cannot read compressed data, truncated or corrupt ({exc})"
    return f"cannot read the file ({exc})"


def _lines(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes | TraceFormatError]]:
    """(line number, the line) for each line, or (line number, an error) for a line over `max_bytes`
    (skipped without ever holding more than `max_bytes` of it) and, last, for a read error: a
    truncated .gz/.xz yields every complete line before the cut, then one error naming where it was
    cut (a partial last line is part of that error, not a second, misleading "invalid JSON")."""
    lineno = 1
    try:
        if path.suffix in (".gz", ".xz") and path.stat().st_size == 0:  # gzip would read it as no lines
            raise EOFError("the file is empty")
        with _open(path) as fh:
            while line := fh.readline(max_bytes + 1):
                if len(line) > max_bytes and not line.endswith(b"\n"):
                    size = len(line)
                    while not line.endswith(b"\n") and (line := fh.readline(_SKIP_CHUNK)):
                        size += len(line) - line.endswith(b"\n")
                    yield lineno, TraceFormatError(
                        f"{path}:{lineno}: record is {size:,} bytes, over the limit of {max_bytes:,} bytes "
                        "(raise it with --max-record-bytes, or load_traces(max_record_bytes=...))")
                else:
                    if not line.endswith(b"\n"):
                        fh.read(1)  # the data's end: a truncated container raises here, not yield a cut line
                    yield lineno, line
                lineno += 1
    except _READ_ERRORS as exc:
        yield lineno, TraceFormatError(f"{path}:{lineno}: {_read_problem(path, exc)}")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _decode(raw: bytes, where: str) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    except (ValueError, RecursionError) as exc:  # e.g. integers beyond int_max_str_digits, deep nesting
        raise TraceFormatError(f"{where}: invalid JSON ({exc})") from exc


def _file_records(path: Path, max_bytes: int) -> Iterator[tuple[str, TraceRecord | TraceFormatError]]:
    """Each non-blank line parsed, or the error that line produced (so the caller may skip it)."""
    for lineno, raw in _lines(path, max_bytes):
        where = f"{path}:{lineno}"
        if isinstance(raw, TraceFormatError):
            yield where, raw
            continue
        if not raw.strip():
            continue
        try:
            obj = _decode(raw, where)
            yield where, parse_record(obj, where, default_trace_id=f"{_stem(path)}:{lineno}", default_source=path.name)
        except TraceFormatError as exc:
            yield where, exc


class _Sequencer:
    """Cross-line checks: unique trace_ids and strictly increasing turns per session."""

    def __init__(self) -> None:
        self.seen_ids: dict[str, str] = {}
        self.last_turn: dict[str, tuple[int, str]] = {}

    def check(self, rec: TraceRecord, where: str) -> None:
        if rec.trace_id in self.seen_ids:
            raise _fail(where, "trace_id", f"duplicate {rec.trace_id!r} (first at {self.seen_ids[rec.trace_id]})")
        prev = self.last_turn.get(rec.session_id)
        if prev is not None and rec.turn <= prev[0]:
            kind = "duplicated" if rec.turn == prev[0] else "out of order"
            raise _fail(
                where, "turn", f"{kind}: turn {rec.turn} of session {rec.session_id!r} after turn {prev[0]} at {prev[1]}"
            )

    def accept(self, rec: TraceRecord, where: str) -> None:
        self.seen_ids[rec.trace_id] = where
        self.last_turn[rec.session_id] = (rec.turn, where)


def _arrival_order(records: list[TraceRecord]) -> list[TraceRecord]:
    """Sessions in order of first appearance, turns ascending inside each (a stable sort)."""
    first: dict[str, int] = {}
    for i, rec in enumerate(records):
        first.setdefault(rec.session_id, i)
    return sorted(records, key=lambda r: (first[r.session_id], r.turn))


def load_traces(
    paths: Sequence[str | Path], skip_bad: bool = False, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> tuple[list[TraceRecord], LoadReport]:
    """Read and validate trace files; raise on the first bad line unless `skip_bad`.

    With `skip_bad` a bad line is dropped and its error kept in the report, so one broken
    line in a large user log does not block a replay but is never silently lost either; a
    truncated compressed file keeps the lines before the cut and counts the cut as one error.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if max_record_bytes < 1:
        raise ValueError(f"max_record_bytes must be >= 1, got {max_record_bytes}")
    report = LoadReport()
    seq = _Sequencer()
    records: list[TraceRecord] = []
    for path in _expand(paths):
        for where, item in _file_records(path, max_record_bytes):
            try:
                if isinstance(item, TraceFormatError):
                    raise item
                seq.check(item, where)
            except TraceFormatError as exc:
                if not skip_bad:
                    raise
                report.skipped += 1
                report.errors.append(str(exc))
                continue
            seq.accept(item, where)
            records.append(item)
    report.records = len(records)
    return _arrival_order(records), report
