"""The engine's signals (predictor.drafting.engine_signals) read from a vLLM step's logits.

After the sampler has run, the step's logits hold, for every request, one row per position it
verified: with a draft of d tokens, rows start..start+d (the d draft positions and the bonus one),
without, one row. The j-th token the step emitted for a request was sampled from its row start + j,
so the emitted tokens' distributions are there with no extra forward pass. Per emitted token:

- top1_prob: the emitted token's probability (under greedy decoding, the top-1 probability);
- logit_gap: its logit minus the best other token's (the top-1/top-2 log-odds gap; negative where
  a sampled token was not the top one);
- entropy: of the row's distribution, in nats.

What it costs (bench/engine_signals_cost.py, `make bench`) is one gather of the rows, two max
reductions and one pass of exp over the vocabulary per row: only the rows the gate or the recorder
needs are read (`every_token`).
"""
from __future__ import annotations

import numpy as np
import torch

from predictor.drafting.engine_signals import NUM_SIGNALS


def row_signals(logits: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
    """Signals of rows `logits` (m x vocab, a copy this may write to) for the tokens emitted from
    them (m): float32, m x NUM_SIGNALS. One pass of exp over the rows: with y = logit - max logit,
    e = exp(y), s = sum(e): p(token) = exp(y_token) / s and entropy = log s - (e . y) / s."""
    if logits.shape[0] == 0:
        return np.zeros((0, NUM_SIGNALS), dtype=np.float32)
    x = logits.float()
    r = torch.arange(x.shape[0])
    chosen = x[r, tokens].clone()
    x[r, tokens] = float("-inf")
    other = x.amax(-1)
    x[r, tokens] = chosen
    top = torch.maximum(chosen, other)
    x.sub_(top[:, None]).clamp_(min=-1e4)  # masked (-inf) logits: exp 0, and 0 * -1e4 adds nothing
    e = torch.exp(x)
    s = e.sum(-1)
    entropy = torch.log(s) - torch.bmm(e.unsqueeze(1), x.unsqueeze(2)).view(-1) / s
    return torch.stack([torch.exp(chosen - top) / s, chosen - other, entropy.clamp_(min=0.0)], 1).numpy()


def step_signals(logits: torch.Tensor, sampled: torch.Tensor, num_draft_tokens: list[int] | None,
                 every_token: bool) -> list[np.ndarray]:
    """Per request of the step (the rows of `sampled`, -1 padded), the signals of the tokens it
    emitted (n_i x NUM_SIGNALS), or only of its last one (every_token False: rows of NaN before it)."""
    ids = sampled.to("cpu")
    counts = (ids >= 0).sum(1).tolist()
    widths = [1] * len(counts) if num_draft_tokens is None else [d + 1 for d in num_draft_tokens]
    rows, emitted, starts, at = [], [], [], 0
    for i, (n, w) in enumerate(zip(counts, widths)):
        starts.append(len(rows))
        first = 0 if every_token else max(n - 1, 0)
        rows.extend(range(at + first, at + n))
        emitted.extend(ids[i, first:n].tolist())
        at += w
    values = row_signals(logits[torch.tensor(rows, dtype=torch.long)], torch.tensor(emitted, dtype=torch.long))
    out = []
    for i, n in enumerate(counts):
        got = values[starts[i]: starts[i] + (n if every_token else min(n, 1))]
        if not every_token and n > 1:
            got = np.concatenate([np.full((n - 1, NUM_SIGNALS), np.nan, dtype=np.float32), got])
        out.append(got)
    return out
