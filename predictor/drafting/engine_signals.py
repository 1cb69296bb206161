"""What the serving engine knows about a position that text-only traces do not: the target's
confidence in the token it emitted there.

At every step vLLM has computed the target's distribution at each position it emitted; three
numbers summarise it: the top-1 probability, the log-odds gap between the top-1 and top-2 tokens
(top1 logit - top2 logit) and the entropy (nats). They are what `controller.engines.vllm_signals`
reads from the step's logits, what the trace recorder stores per output position (the `engine`
field of a trace line, docs/guides/traces.md) and what `Hindsight` keeps per position, so the gate
sees the same numbers live and in replay. A position without them (a text-only trace, an engine
that did not compute them) holds NaN: the features mark it missing rather than guess.
"""
from __future__ import annotations

import numpy as np

SIGNAL_NAMES: tuple[str, ...] = ("top1_prob", "logit_gap", "entropy")
NUM_SIGNALS = len(SIGNAL_NAMES)
# What a trace line keeps of each signal: three decimals are far below what the gate can tell apart,
# and the recorded corpus stays small.
DECIMALS = 3


def missing(n: int) -> np.ndarray:
    """`n` positions without signals (float32, n x NUM_SIGNALS of NaN)."""
    return np.full((n, NUM_SIGNALS), np.nan, dtype=np.float32)


def rounded(values: np.ndarray) -> list[list[float | None]]:
    """Per-signal lists as a trace line stores them (None where missing)."""
    columns = np.round(np.asarray(values, dtype=np.float64), DECIMALS).T
    return [[None if v != v else v for v in column.tolist()] for column in columns]
