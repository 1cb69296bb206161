"""Each source's traffic as it arrived, cut after whole sessions: a bounded slice of a trace set
that still looks like its stream (every source, earliest sessions first, no session cut short).

The unseen-source scenario serves one source's head; `hvd warmstart|eval --max-tokens-per-source`
and `make run` work on every source's head, so a first run takes minutes, not the whole bundle.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from predictor.data.traces import TraceRecord


def source_heads(records: Sequence[TraceRecord], output_tokens: Sequence[int] | np.ndarray,
                 max_tokens: int | None) -> list[int]:
    """Indices into `records` (kept in their order) of each source's head: its records in order,
    whole sessions, until the source has `max_tokens` output tokens (the session that crosses the
    budget is kept whole). `output_tokens[i]` is record i's output length; None: everything."""
    if len(output_tokens) != len(records):
        raise ValueError(f"output_tokens has {len(output_tokens)} lengths for {len(records)} records")
    if max_tokens is None:
        return list(range(len(records)))
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (None: no limit), got {max_tokens}")
    tokens: dict[str, int] = {}
    last: dict[str, str] = {}
    full: set[str] = set()
    keep = []
    for i, r in enumerate(records):
        if r.source in full:
            continue
        if tokens.get(r.source, 0) >= max_tokens and r.session_id != last.get(r.source):
            full.add(r.source)
            continue
        keep.append(i)
        tokens[r.source] = tokens.get(r.source, 0) + int(output_tokens[i])
        last[r.source] = r.session_id
    return keep
