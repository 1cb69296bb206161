"""Chart conventions shared by the pages: one colour per workload everywhere, gaps drawn as gaps,
rounded tooltips."""
from __future__ import annotations

from datetime import timedelta

import altair as alt
import pandas as pd

from storage.workloads import WORKLOADS

# Tableau 10, in WORKLOADS order: a workload keeps its colour on every chart and page.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")


def workload_color(title: str = "Workload", field: str = "workload") -> alt.Color:
    domain = list(WORKLOADS)
    return alt.Color(f"{field}:N", title=title, scale=alt.Scale(domain=domain, range=list(PALETTE[: len(domain)])))


def segments(df: pd.DataFrame, at: str, max_gap: timedelta, by: str | None = None) -> pd.DataFrame:
    """`df` with a "segment" column that changes wherever consecutive times (per `by` group) are more
    than `max_gap` apart: drawn with detail="segment", a line stops at idle time instead of
    bridging it with a straight line."""
    out = df.sort_values([by, at] if by else [at]).copy()
    groups = out.groupby(by, sort=False)[at] if by else out[at]
    gap = groups.diff() > pd.Timedelta(max_gap)
    counter = gap.groupby(out[by]).cumsum() if by else gap.cumsum()
    out["segment"] = (out[by].astype(str) + "#" if by else "") + counter.astype(int).astype(str)
    return out


def bin_words(resolution: timedelta) -> str:
    """A time bin as axis titles say it: "1-minute", "15-minute", "4-hour", "1-day"."""
    m = int(resolution.total_seconds() // 60)
    return f"{m}-minute" if m < 60 else f"{m // 60}-hour" if m < 1440 else f"{m // 1440}-day"


def tooltip(field: str, title: str, fmt: str | None = None) -> alt.Tooltip:
    """A tooltip entry with a human title and, for numbers, a rounded format (e.g. ".3f", ",d")."""
    return alt.Tooltip(field, title=title, format=fmt) if fmt else alt.Tooltip(field, title=title)
