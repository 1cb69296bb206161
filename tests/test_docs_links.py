"""The README stays a newcomer's page (at most 200 lines; the rest lives under docs/), and every
relative link in README.md and docs/**/*.md points to a file that exists, and its #anchor, if any, to
a heading of that file (GitHub's heading ids)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 200

_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced and indented code blocks, inline code spans blanked."""
    out, fenced, prev_blank = [], False, True
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        indented_code = prev_blank and line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|"))
        if not fenced and not indented_code:
            out.append((n, _CODE_SPAN.sub("``", line)))
        if not (indented_code and line.strip()):
            prev_blank = not line.strip()
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading ids of a page (outside fenced code; a repeated heading gets -1, -2...)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    return [(n, m[1]) for n, line in prose_lines(path.read_text(encoding="utf-8")) for m in _LINK.finditer(line)]


def test_slug_examples():
    assert slug("Serving on the replay engine: allocator against the binary rule") == \
        "serving-on-the-replay-engine-allocator-against-the-binary-rule"
    assert slug("`hvd serve --engine replay`") == "hvd-serve---engine-replay"
    assert slug("Benchmarks (`make bench`)") == "benchmarks-make-bench"
    assert slug("How much could any predictor win?") == "how-much-could-any-predictor-win"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail "
                                       "to a page under docs/ and link it")


def test_the_pages_have_links():
    assert links(README), "README.md links to no page"
    assert (ROOT / "docs" / "README.md").is_file(), "docs/README.md (the index of the docs) is missing"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    bad = []
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, "broken links:\n" + "\n".join(bad)
