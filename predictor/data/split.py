"""Train/test split by session, and by producing model where a source has several.

Whole groups go to one side: a session's turns share context, and one producing model's habits
(formatting, phrasing) would otherwise leak from training into the test set. Quantisations of one
base model count as one model.
"""
from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from predictor.data.traces import TraceRecord

DEFAULT_TEST_FRACTION = 0.25  # share of each source's output text held out (build_dataset, `hvd warmstart|eval`)
_QUANT_SUFFIX = re.compile(r"[-_.](awq|gptq|gguf|ggml|exl2|fp16|bf16|int4|int8|q\d(_\w+)?|\d+bpw|hqq|aqlm)\b.*$")


def base_model(model: str) -> str:
    """'TheBloke/Mistral-7B-Code-16K-qlora-AWQ' and 'Nondzu/Mistral-7B-code-16k-qlora' -> one key."""
    name = model.lower().rsplit("/", 1)[-1].split(":", 1)[0]
    return _QUANT_SUFFIX.sub("", name)


def split_key(record: TraceRecord, multi_model_sources: set[str]) -> str:
    if record.source in multi_model_sources:
        return f"model:{base_model(record.model)}"
    return f"session:{record.session_id}"


def test_mask(records: Sequence[TraceRecord], test_fraction: float = DEFAULT_TEST_FRACTION,
              seed: int = 0) -> np.ndarray:
    """True for records in the test set: per source, groups in a seeded hash order are taken into
    the test set until it holds about `test_fraction` of the source's output text; a group that
    would overshoot by half again is skipped (one dominant model stays in training)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    models: dict[str, set[str]] = defaultdict(set)
    for r in records:
        models[r.source].add(base_model(r.model))
    multi = {s for s, m in models.items() if len(m) > 1}
    size: dict[tuple[str, str], int] = defaultdict(int)
    for r in records:
        size[(r.source, split_key(r, multi))] += len(r.output)
    by_source: dict[str, list[str]] = defaultdict(list)
    for source, key in size:
        by_source[source].append(key)
    chosen: set[tuple[str, str]] = set()
    for source, keys in by_source.items():
        total = sum(size[(source, k)] for k in keys)
        target, taken = test_fraction * total, 0
        for key in sorted(keys, key=lambda k: hashlib.sha256(f"{seed}:{source}:{k}".encode()).hexdigest()):
            if taken >= target:
                break
            if taken + size[(source, key)] <= 1.5 * target:
                chosen.add((source, key))
                taken += size[(source, key)]
    return np.array([(r.source, split_key(r, multi)) in chosen for r in records], dtype=bool)
