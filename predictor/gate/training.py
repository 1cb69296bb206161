"""Offline training of g_theta on replay labels, deterministic under a seed.

A survival gate (the default) learns the per-position conditional acceptance with a censored
binary cross-entropy: a draft of length L that got a tokens accepted shows positions 1..a accepted,
position a+1 rejected (when a < L), and says nothing about positions past min(a+1, L), which are
censored rather than counted as rejections (the draft simply ended). A point gate keeps the seed's
weighted mean squared error on the accepted length.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from predictor.gate.config import TrainConfig  # in a light module for `hvd --help`; imported from here too
from predictor.gate.mlp import DRAFT_LEN_COLUMN, MLP, SURVIVAL_K

LOSS_NAMES = {"survival": "censored BCE", "point": "weighted MSE"}


def workload_weights(workload: np.ndarray, balance: float) -> np.ndarray:
    counts = np.bincount(workload)
    present = counts > 0
    factor = np.zeros(len(counts))
    factor[present] = (counts[present].max() / counts[present]) ** balance
    w = factor[workload]
    return (w / w.mean()).astype(np.float32)


def censored_bce(logits: torch.Tensor, draft_len: torch.Tensor, label: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over rows of the (weighted) negative log-likelihood of each draft's accepted length
    under the conditional logits (n x K); censored positions carry no loss and no gradient."""
    positions = torch.arange(1, logits.shape[1] + 1, device=logits.device, dtype=logits.dtype)[None, :]
    label = label.to(logits.dtype)[:, None]
    observed = positions <= torch.minimum(label + 1, draft_len.to(logits.dtype)[:, None])
    target = (positions <= label).to(logits.dtype)
    per = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    per = torch.where(observed, per, torch.zeros_like(per))
    rows = per.sum(dim=1)
    if weight is not None:
        rows = rows * weight
    return rows.mean()


def check_labels(draft_len: np.ndarray, labels: np.ndarray) -> None:
    """A label outside 0..draft length is a replay or event bug; training on it would be silent noise."""
    bad = (labels < 0) | (labels > draft_len)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{int(bad.sum())} row(s) have an accepted length outside 0..draft length "
                         f"(first: row {i}, label {labels[i]:g}, draft length {draft_len[i]:g})")


def train_gate(features: np.ndarray, labels: np.ndarray, workload: np.ndarray, config: TrainConfig,
               progress: Callable[[int, float], None] | None = None) -> MLP:
    """Fit a gate of ``config.kind`` on rows that carry a cache draft (draft lengths are read from
    the features' draft_len column); returns the trained torch module (eval mode).

    A column constant over the rows (`on_policy`, when every trace is text-only; a workload
    absent from the traces) gets first-layer weights of 0: training never moved them (its
    standardised value is 0 in every row), and a value served later must not meet random weights.
    The online learner then learns them from live labels."""
    if len(features) == 0:
        raise ValueError("no training rows with a cache draft: the traces are empty or too short")
    survival = config.kind == "survival"
    if survival:
        check_labels(features[:, DRAFT_LEN_COLUMN], labels)
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    y = torch.from_numpy(labels.astype(np.float32))
    w = torch.from_numpy(workload_weights(workload, config.balance))
    lengths = x[:, DRAFT_LEN_COLUMN]
    model = MLP(x.shape[1], config.hidden, SURVIVAL_K if survival else 1)
    model.mean.copy_(x.mean(0))
    std = x.std(0)
    model.scale.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))
    opt = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    steps_per_epoch = max(1, (len(x) + config.batch_size - 1) // config.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=config.learning_rate,
                                                total_steps=config.epochs * steps_per_epoch)
    model.train()
    for epoch in range(config.epochs):
        order = torch.randperm(len(x), generator=gen)
        total = 0.0
        for start in range(0, len(x), config.batch_size):
            idx = order[start : start + config.batch_size]
            if survival:
                loss = censored_bce(model(x[idx]), lengths[idx], y[idx], w[idx])
            else:
                loss = (w[idx] * (model(x[idx]) - y[idx]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        if progress is not None:
            progress(epoch + 1, total / len(x))
    with torch.no_grad():  # a column constant in training (standardised to 0 there) is ignored until learned
        model.net[0].weight[:, std <= 1e-6] = 0.0
    model.eval()
    return model


train_mlp = train_gate  # the seed's name, kept for its callers (scenario shift, benchmarks)
