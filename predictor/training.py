"""Offline training of g_theta on replay labels (mean squared error), deterministic under a seed."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from predictor.mlp import MLP


@dataclass(frozen=True)
class TrainConfig:
    hidden: tuple[int, ...] = (128, 64, 32)
    epochs: int = 12
    batch_size: int = 2048
    learning_rate: float = 3e-3
    weight_decay: float = 1e-5
    seed: int = 0
    # Rows of a workload are weighted by (share of the largest workload / own share) ** balance,
    # so the small agentic sources are not drowned by the coding ones (0 = no reweighting).
    balance: float = 0.5

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def workload_weights(workload: np.ndarray, balance: float) -> np.ndarray:
    counts = np.bincount(workload)
    present = counts > 0
    factor = np.zeros(len(counts))
    factor[present] = (counts[present].max() / counts[present]) ** balance
    w = factor[workload]
    return (w / w.mean()).astype(np.float32)


def train_mlp(features: np.ndarray, labels: np.ndarray, workload: np.ndarray, config: TrainConfig,
              progress: Callable[[int, float], None] | None = None) -> MLP:
    """Fit on rows that carry a cache draft; returns the trained torch module (eval mode)."""
    if len(features) == 0:
        raise ValueError("no training rows with a cache draft: the traces are empty or too short")
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    y = torch.from_numpy(labels.astype(np.float32))
    w = torch.from_numpy(workload_weights(workload, config.balance))
    model = MLP(x.shape[1], config.hidden)
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
            loss = (w[idx] * (model(x[idx]) - y[idx]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        if progress is not None:
            progress(epoch + 1, total / len(x))
    model.eval()
    return model
