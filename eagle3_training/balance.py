"""How often each training answer is seen per epoch, so that every workload weighs about alike.

The answers follow the training split's prompts, and one workload (coding) has three times the
prompts of the next: after every prompt of the smaller workloads is answered, coding fills the rest
of the token budget. A head trained on that mix learned coding and lost agentic, code-edit and chat
acceptance against the head it was to replace. Repeating the smaller workloads' rows (their hidden
states are linked, not copied) gives each workload about the largest one's answer tokens per epoch,
up to `cap` repeats: past that a workload's few answers would be learned by heart.
"""
from __future__ import annotations

from collections.abc import Sequence


def repeats(workloads: Sequence[str], answer_tokens: Sequence[int], cap: int) -> dict[str, int]:
    """Per workload, how many times each of its rows is used in an epoch: the rounded ratio of the
    largest workload's answer tokens to its own, between 1 and `cap` (cap 1: no balancing)."""
    if cap < 1:
        raise ValueError(f"the repeat cap must be >= 1, got {cap}")
    if len(workloads) != len(answer_tokens):
        raise ValueError(f"{len(workloads)} workloads but {len(answer_tokens)} token counts")
    totals: dict[str, int] = {}
    for w, n in zip(workloads, answer_tokens):
        if n < 0:
            raise ValueError(f"negative answer token count {n} for workload {w!r}")
        totals[w] = totals.get(w, 0) + int(n)
    largest = max(totals.values(), default=0)
    return {w: 1 if n == 0 else max(1, min(cap, round(largest / n))) for w, n in totals.items()}


def row_repeats(workloads: Sequence[str], answer_tokens: Sequence[int], cap: int) -> list[int]:
    """`repeats` per row, in the rows' order."""
    per = repeats(workloads, answer_tokens, cap)
    return [per[w] for w in workloads]
