"""Which prompts the drafter learns from and which it is judged on.

The split is the evaluation's own (predictor/data/split.py): sessions the replay evaluation holds out
never reach the drafter's training data, so acceptance measured on them is out of sample.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictor.data.split import test_mask
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import TraceRecord

DRAFTER_WORKLOADS = ("agentic", "code_edit", "coding", "sql", "chat")


@dataclass(frozen=True)
class Prompt:
    trace_id: str
    workload: str
    token_ids: tuple[int, ...]


def render(record: TraceRecord, tokenizer: TraceTokenizer, max_tokens: int) -> tuple[int, ...]:
    """Chat-templated prompt ids, cut to the last `max_tokens` (a plain prompt becomes one user
    turn: SmolLM2-Instruct answers chat, and serving sends it chat)."""
    if isinstance(record.context, str):
        ids = np.concatenate([tokenizer.encode_output(f"<|im_start|>user\n{record.context}<|im_end|>\n"),
                              tokenizer.encode_output("<|im_start|>assistant\n")])
    else:
        ids = tokenizer.encode_context(record)
    return tuple(int(i) for i in ids[-max_tokens:])


def select(records: Sequence[TraceRecord], held_out: bool, seed: int = 0,
           workloads: Sequence[str] = DRAFTER_WORKLOADS) -> list[TraceRecord]:
    """Training (held_out=False) or held-out records, interleaved across workloads in a seeded
    order, so any prefix of the list is workload-balanced (a token budget cuts a prefix)."""
    mask = test_mask(records)
    by_workload: dict[str, list[TraceRecord]] = {w: [] for w in workloads}
    for record, is_test in zip(records, mask):
        if bool(is_test) == held_out and record.workload in by_workload:
            by_workload[record.workload].append(record)
    for w, rs in by_workload.items():
        rs.sort(key=lambda r: hashlib.sha256(f"{seed}:{r.trace_id}".encode()).hexdigest())
    out: list[TraceRecord] = []
    longest = max((len(rs) for rs in by_workload.values()), default=0)
    for i in range(longest):
        out.extend(rs[i] for rs in by_workload.values() if i < len(rs))
    return out


def prompts(records: Sequence[TraceRecord], held_out: bool, max_prompt_tokens: int, seed: int = 0,
            workloads: Sequence[str] = DRAFTER_WORKLOADS, limit: int | None = None,
            tokenizer: TraceTokenizer | None = None) -> list[Prompt]:
    """The first `limit` (all by default) prompts of `select`, rendered."""
    tokenizer = tokenizer or TraceTokenizer()
    chosen = select(records, held_out, seed, workloads)[:limit]
    return [Prompt(r.trace_id, r.workload, render(r, tokenizer, max_prompt_tokens)) for r in chosen]


def bench_prompts(workloads: Sequence[str], per_workload: int, max_tokens: int = 1000,
                  held_out: bool = True) -> list[tuple[str, list[int]]]:
    """Bundled prompts for the benches and the real-vLLM tests, interleaved across `workloads`:
    (workload, token ids). By default those of the sessions the evaluation holds out (neither the
    gate nor the EAGLE3 head trained on them: what is measured); held_out=False, the training split's
    (a bench's warm-up, which must not be the measured prompts)."""
    from predictor.data.traces import bundled_traces_path, load_traces

    records, _ = load_traces([bundled_traces_path()])
    chosen = prompts(records, held_out=held_out, max_prompt_tokens=max_tokens, workloads=workloads,
                     limit=per_workload * len(workloads))
    return [(p.workload, list(p.token_ids)) for p in chosen]
