"""EAGLE3 training attention computed one packed document at a time, for the CPU trainer.

The trainer packs several answers into one 2048-token row and, on its SDPA path, builds a dense
[2048, 2048 x (step + 1)] mask per test-time-training step: a query attends causally within its own
document in the first block, and only to its own position in each later block (the draft tokens).
Dense attention over that mask spends most of its work on pairs the mask discards, about 30% of a
step on these CPUs. Here the same attention runs per document (L x L causal plus the diagonals),
and padding attends only to itself: the same result, a fraction of the work.

Installed by `eagle3_training.speculators_cpu` (`install`); the trainer's own code is unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DocumentMask:
    """What the trainer's dense mask encodes, kept as document runs: `blocks` is how many copies of
    the sequence the keys hold (1, then one more per test-time-training step)."""
    runs: tuple[tuple[int, int, bool], ...]  # (start, end, real document) in sequence order
    length: int
    blocks: int = 1

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> DocumentMask:
        """From the collated document ids ([S], -1 for padding), as the trainer packs them."""
        ids = document_ids.reshape(-1).cpu()
        values, counts = torch.unique_consecutive(ids, return_counts=True)
        runs, at = [], 0
        for value, count in zip(values.tolist(), counts.tolist()):
            runs.append((at, at + count, value != -1))
            at += count
        return cls(tuple(runs), at)

    def extended(self) -> DocumentMask:
        return replace(self, blocks=self.blocks + 1)


def _run_mask(length: int, blocks: int, device: torch.device) -> torch.Tensor:
    eye = torch.eye(length, dtype=torch.bool, device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.cat([causal] + [eye] * (blocks - 1), dim=1)


def _blocks_of(x: torch.Tensor, a: int, b: int, length: int, blocks: int) -> torch.Tensor:
    return torch.cat([x[:, :, j * length + a : j * length + b] for j in range(blocks)], dim=2)


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: DocumentMask,
                       scaling: float | None) -> torch.Tensor:
    """query [1, H, S, D], key/value [1, H_kv, blocks x S, D] -> [1, S, H, D], as SDPA with the dense mask."""
    s, blocks = mask.length, mask.blocks
    if query.shape[2] != s or key.shape[2] != blocks * s:
        raise ValueError(f"attention over {query.shape[2]} queries and {key.shape[2]} keys does not match a "
                         f"mask of {s} positions in {blocks} blocks")
    groups = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    parts = []
    for a, b, real in mask.runs:
        q = query[:, :, a:b]
        k = _blocks_of(key, a, b, s, blocks)
        v = _blocks_of(value, a, b, s, blocks)
        if real:
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=_run_mask(b - a, blocks, q.device),
                                                        scale=scale, enable_gqa=groups > 1))
            continue
        # Padding attends to its own position in each block only: a softmax over `blocks` scores.
        k = k.repeat_interleave(groups, dim=1).unflatten(2, (blocks, b - a))
        v = v.repeat_interleave(groups, dim=1).unflatten(2, (blocks, b - a))
        scores = (q.unsqueeze(2) * k).sum(-1) * scale
        weights = torch.softmax(scores, dim=2, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
        parts.append((weights.unsqueeze(-1) * v).sum(2))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def install() -> None:
    """Route the trainer's SDPA draft attention through `document_attention` (idempotent)."""
    import speculators.models.eagle3.core as core
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if getattr(core.Eagle3DraftModel._build_attn_mask, "_hvd", False):
        return
    sdpa: Callable = ALL_ATTENTION_FUNCTIONS["sdpa"]
    build, extend = core.Eagle3DraftModel._build_attn_mask, core.extend_dense_mask_for_draft_tokens

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if isinstance(attention_mask, DocumentMask):
            if dropout:
                raise ValueError("document attention has no dropout; the EAGLE3 trainer uses none")
            return document_attention(query, key, value, attention_mask, scaling), None
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def build_attn_mask(self, doc_ids_1d, seq_len, device, sliding_window=None):
        if self._attn_impl != "sdpa" or sliding_window is not None:
            return build(self, doc_ids_1d, seq_len, device, sliding_window)
        return DocumentMask.of(doc_ids_1d)

    def extend_mask(mask, total_seq_len):
        return mask.extended() if isinstance(mask, DocumentMask) else extend(mask, total_seq_len)

    build_attn_mask._hvd = True
    AttentionInterface.register("sdpa", attention)
    core.Eagle3DraftModel._build_attn_mask = build_attn_mask
    core.extend_dense_mask_for_draft_tokens = extend_mask
