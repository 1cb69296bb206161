"""Replayed traces plus the train/test split: what warm start, evaluation and the scenarios work from."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from predictor.data.split import DEFAULT_TEST_FRACTION, test_mask
from predictor.data.streams import source_heads
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import DEFAULT_MAX_RECORD_BYTES, LoadReport, TraceRecord, bundled_traces_path, load_traces
from predictor.drafting.cache_drafter import SuffixConfig
from predictor.replay.trace_replay import ReplayResult
from predictor.replay.trace_replay_cache import DEFAULT_CACHE_DIR, cached_replay, replay_key

Log = Callable[[str], None]


@dataclass
class Dataset:
    """Replayed traces plus the split: what both warm start and evaluation work from."""

    records: list[TraceRecord]
    load_report: LoadReport
    replay: ReplayResult
    test_traces: np.ndarray  # bool per record
    key: str

    def rows(self, test: bool) -> np.ndarray:
        """Row mask of the split's rows that carry a cache draft (the rows the gate decides on)."""
        side = self.test_traces[self.replay.trace] if test else ~self.test_traces[self.replay.trace]
        return side & (self.replay.draft_len > 0)


def build_dataset(paths: Sequence[str | Path] | None = None, skip_bad: bool = False,
                  test_fraction: float = DEFAULT_TEST_FRACTION,
                  seed: int = 0, cache_dir: Path | None = DEFAULT_CACHE_DIR, log: Log = print,
                  max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                  max_tokens_per_source: int | None = None) -> Dataset:
    """`max_tokens_per_source`: only each source's head (predictor.data.streams), for a run that
    takes minutes; the split is then drawn on that head."""
    paths = list(paths) if paths else [bundled_traces_path()]
    records, report = load_traces(paths, skip_bad=skip_bad, max_record_bytes=max_record_bytes)
    if report.skipped:
        log(f"skipped {report.skipped} bad record(s); first: {report.errors[0]}")
    if not records:
        raise ValueError(f"no trace records in {', '.join(map(str, paths))}")
    log(f"loaded {len(records)} records from {', '.join(map(str, paths))}")
    tokenizer = TraceTokenizer()
    if max_tokens_per_source is not None:
        lengths = [len(tokenizer.output_tokens(r)) for r in records]
        records = [records[i] for i in source_heads(records, lengths, max_tokens_per_source)]
        log(f"kept {len(records)} records: each source's first whole sessions up to {max_tokens_per_source} "
            "output tokens")
    step = max(1, len(records) // 20)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            log(f"  replay {done}/{total} traces")

    result = cached_replay(records, tokenizer, SuffixConfig(), cache_dir, progress)
    log(f"replayed {result.rows} output positions ({int((result.draft_len > 0).sum())} cache drafts)")
    return Dataset(records, report, result, test_mask(records, test_fraction, seed),
                   replay_key(records, SuffixConfig()))
