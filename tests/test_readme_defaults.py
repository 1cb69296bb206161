"""The defaults table (docs/reference/defaults.md) against the code.

Each row names a default, its value as the docs write it (`0.5`, `20,000`, `1%`, `10 s`, `1 MiB`,
`ten`...), one or more code locations (`module:path`) and, optionally, a short quote of the prose
that states it. The test imports every location and compares; it also finds each quote in the
prose of README.md and the other pages under docs/ (whitespace-insensitive, so re-wrapping is
harmless) and checks that it states the same value. Change a default in the code and this fails
until the table and the prose say so too.

A location's path is resolved step by step from the module: `Name` is an attribute, except that
on a dataclass it is a field's default and on a function or class a parameter's default;
`name()` calls; `[key]` indexes (a string key, unquoted).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ROOT / "docs" / "reference" / "defaults.md"  # the table
TABLE_NAME = str(DEFAULTS.relative_to(ROOT))
# Where the quoted prose must be: the README and every page of the docs but the table's own.
PROSE_FILES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != DEFAULTS)]
PROSE_NAMES = "README.md and docs/**/*.md"
NO_QUOTE = {"", "—", "-"}

WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
UNITS = {
    "%": Decimal("0.01"), "k": Decimal(1000), "M": Decimal(1000) ** 2,
    "KiB": Decimal(1024), "MiB": Decimal(1024) ** 2, "GiB": Decimal(1024) ** 3,
    "ms": Decimal("0.001"), "s": Decimal(1), "seconds": Decimal(1),
    "min": Decimal(60), "minute": Decimal(60), "minutes": Decimal(60),
    "h": Decimal(3600), "hour": Decimal(3600), "hours": Decimal(3600),
}
_UNIT = "|".join(sorted(map(re.escape, UNITS), key=len, reverse=True))
# A number: optional sign ("+-x" is a symmetric bound, its value is x), digits grouped by commas in
# threes or not at all, an optional fraction and exponent.
_NUMBER = r"(?:\+-|±)?-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?"
_VALUE = re.compile(rf"(?P<num>{_NUMBER})\s?(?P<unit>{_UNIT})?")
_TUPLE = re.compile(r"\d+(?:-\d+)+")
# The same inside prose: a minus counts only after a space or an opening bracket ("[-1, 24]", not the
# range "1-2 s"), a unit only when a word does not go on ("19.7 MB" is 19.7, not 19.7 million).
_IN_TEXT = re.compile(
    rf"(?<![\w.,])(?P<num>(?:\+-|±|(?<![^\s\[(])-)?(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    rf"(?!\d|,\d)(?:\s?(?P<unit>{_UNIT})(?![\w%]))?(?![A-Za-z_])"
    rf"|\b(?P<word>(?i:{'|'.join(WORDS)}))\b")


def _number(num: str, unit: str | None) -> Decimal:
    num = num.removeprefix("+-").removeprefix("±").replace(",", "")
    return Decimal(num) * (UNITS[unit] if unit else 1)


def parse_value(text: str) -> Decimal | tuple[int, ...] | str:
    """A value as the docs write it, as a number (units applied: `1%` is 0.01, `10 min` 600, `1 MiB` 1048576,
    `500k` 500000, `ten` 10), a tuple (`256-128-64`), or else the text itself."""
    text = text.strip().strip("`").strip()
    if text.lower() in WORDS:
        return Decimal(WORDS[text.lower()])
    if _TUPLE.fullmatch(text):
        return tuple(int(x) for x in text.split("-"))
    m = _VALUE.fullmatch(text)
    if m:
        return _number(m["num"], m["unit"])
    return text


def values_in(prose: str) -> list[Decimal]:
    """Every number the prose states, units applied."""
    out = []
    for m in _IN_TEXT.finditer(prose):
        out.append(Decimal(WORDS[m["word"].lower()]) if m["word"] else _number(m["num"], m["unit"]))
    return out


def same(readme: Decimal | tuple | str, code: Any) -> bool:
    if isinstance(code, timedelta):  # durations in the docs are read as seconds
        code = code.total_seconds()
    if isinstance(readme, Decimal):
        return (isinstance(code, (int, float, Decimal)) and not isinstance(code, bool)
                and math.isclose(float(readme), float(code), rel_tol=1e-9, abs_tol=1e-12))
    if isinstance(readme, tuple):
        return tuple(code) == readme if isinstance(code, (tuple, list)) else False
    return str(code) == readme


# ------------------------------------------------------------------ the table
class Row(NamedTuple):
    line: int
    name: str
    value: str
    locations: tuple[str, ...]
    quote: str | None


def table_rows(section: str, first_line: int = 1) -> list[Row]:
    rows = []
    lines = section.splitlines()
    table = [(i, ln) for i, ln in enumerate(lines) if ln.startswith("|")]
    assert len(table) > 2, f"no table in {TABLE_NAME}"
    for i, ln in table[2:]:  # after the header and its separator
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == 4, f"{TABLE_NAME}:{first_line + i}: expected 4 cells, got {len(cells)}: {ln}"
        name, value, code, quote = cells
        locations = tuple(re.findall(r"`([^`]+)`", code))
        assert locations, f"{TABLE_NAME}:{first_line + i}: no `module:path` in the code cell: {code!r}"
        rows.append(Row(first_line + i, name, value, locations, None if quote in NO_QUOTE else quote))
    return rows


_STEP = re.compile(r"\.?(?P<name>[A-Za-z_]\w*)(?P<call>\(\))?|\[(?P<key>[^\]]+)\]")


def _attribute(obj: Any, name: str) -> Any:
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name == name:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                raise LookupError(f"dataclass field {obj.__name__}.{name} has no default")
    if callable(obj) and not isinstance(obj, ModuleType):
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            params = {}
        if name in params and params[name].default is not inspect.Parameter.empty:
            return params[name].default
    return getattr(obj, name)


def resolve(location: str) -> Any:
    """The value at `module:path` (see the module docstring)."""
    module, sep, path = location.partition(":")
    if not sep or not path:
        raise ValueError(f"{location!r} is not module:path")
    obj: Any = importlib.import_module(module)
    pos = 0
    while pos < len(path):
        m = _STEP.match(path, pos)
        if not m or m.end() == pos:
            raise ValueError(f"{location!r}: cannot read the path from {path[pos:]!r}")
        if m["key"] is not None:
            obj = obj[m["key"]]
        elif m["call"]:
            obj = getattr(obj, m["name"])()
        else:
            obj = _attribute(obj, m["name"])
        pos = m.end()
    return obj


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


SECTION = DEFAULTS.read_text(encoding="utf-8")
PROSE = "\n".join(p.read_text(encoding="utf-8") for p in PROSE_FILES)
ROWS = table_rows(SECTION)


def test_table_is_there_and_names_are_unique():
    assert len(ROWS) >= 40, f"only {len(ROWS)} rows in {TABLE_NAME}"
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names)), f"repeated names: {sorted({n for n in names if names.count(n) > 1})}"


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_readme_default_is_the_codes(row: Row):
    readme = parse_value(row.value)
    for location in row.locations:
        code = resolve(location)
        assert same(readme, code), (
            f"{TABLE_NAME}:{row.line} {row.name!r}: the table says {row.value} ({readme}), "
            f"but {location} is {code!r}: update the docs (table and prose) or the code")


@pytest.mark.parametrize("row", [r for r in ROWS if r.quote], ids=[r.name for r in ROWS if r.quote])
def test_prose_states_the_same_value(row: Row):
    assert _flat(row.quote) in _flat(PROSE), (
        f"{TABLE_NAME}:{row.line} {row.name!r}: the quoted prose {row.quote!r} is no longer in "
        f"{PROSE_NAMES} (outside {TABLE_NAME}): the prose changed (quote it again, with the value in the "
        f"table) or the quote did")
    readme = parse_value(row.value)
    if isinstance(readme, str):
        assert readme in row.quote, f"{TABLE_NAME}:{row.line} {row.name!r}: {row.quote!r} does not say {readme!r}"
        return
    found = values_in(row.quote)
    assert any(same(readme, v) for v in found), (
        f"{TABLE_NAME}:{row.line} {row.name!r}: the table says {row.value} but its prose {row.quote!r} "
        f"states {[str(v) for v in found]}")


# ------------------------------------------------------------------ the parsers
def test_parse_value_examples():
    assert parse_value("`0.5`") == Decimal("0.5")
    assert parse_value("20,000") == 20000
    assert parse_value("1%") == Decimal("0.01")
    assert parse_value("0.2%") == Decimal("0.002")
    assert parse_value("10 s") == 10
    assert parse_value("10 minutes") == 600
    assert parse_value("1 min") == 60
    assert parse_value("500k") == 500_000
    assert parse_value("1.5M") == 1_500_000
    assert parse_value("1 MiB") == 1 << 20
    assert parse_value("3e-4") == Decimal("0.0003")
    assert parse_value("-1") == -1
    assert parse_value("+-0.5") == Decimal("0.5")
    assert parse_value("ten") == 10
    assert parse_value("256-128-64") == (256, 128, 64)
    assert parse_value("gpu-8b") == "gpu-8b"
    assert parse_value("1,00") == "1,00"  # not a grouped number: left as text, so it cannot match a number


def test_values_in_prose():
    assert values_in("tau outside [-1, 24], bounds") == [-1, 24]
    assert values_in("every 1-2 s and") == [1, 2]
    assert values_in("19.7 MB, 9.87 M parameters") == [Decimal("19.7"), Decimal("9.87") * 10**6]
    assert values_in("clipped to +-0.5 (the gate's bias within one token") == [Decimal("0.5"), 1]
    assert values_in("in every 2,000-token window, 8192-token vocabulary, lr 3e-4") == [2000, 8192, Decimal("3e-4")]
    assert values_in("5 wrong tries within 10 minutes lock") == [5, 600]
    assert values_in("vLLM 0.32 (1,624 answers, 325 per workload), v2") == [Decimal("0.32"), 1624, 325]
    assert values_in("One more round, 1,0000 is no number") == [1]
    assert values_in("gpu-8b at b64, 30k tokens, 1.5M more") == [30_000, 1_500_000]


@given(st.integers(min_value=0, max_value=10**12))
def test_grouped_and_plain_integers_parse_back(n: int):
    assert parse_value(f"{n:,}") == n
    assert parse_value(f"`{n}`") == n
    assert values_in(f"at least {n:,} events, then {n} more.") == [n, n]


@given(st.integers(min_value=-10**6, max_value=10**6), st.integers(min_value=0, max_value=4))
def test_percent_and_units_parse_back(n: int, places: int):
    x = Decimal(n).scaleb(-places)  # n / 10**places, written with `places` decimals
    assert parse_value(f"{x}%") == x / 100
    assert parse_value(f"{x} s") == x
    assert parse_value(f"{x} min") == x * 60
    assert parse_value(f"{x}k") == x * 1000
    assert same(parse_value(f"{x}%"), float(x) / 100)


@given(st.integers(min_value=0, max_value=10**9))
def test_a_number_in_prose_is_found_whatever_follows(n: int):
    for tail in ("", ".", ",", ")", " tokens", "-token window", "; then"):
        assert values_in(f"({n:,}{tail}") == [n]
