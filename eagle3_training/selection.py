"""Which learning rate and which epoch: chosen on the held-out validation split, by what serving gets.

The trainer keeps the checkpoint with the lowest validation loss, but the loss is a KL over the
whole draft vocabulary and serving only sees whether the greedy draft token matches. The figure that
decides here is the expected accepted length of a k-token draft on the held-out answers,
sum_i P(all of positions 1..i right), which the trainer reports as full_acc_i (`val_epoch` in
`speculators.train.trainer`); the loss breaks ties.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

VALIDATION_FILE = "validation.json"  # written per epoch by eagle3_training.speculators_cpu


@dataclass(frozen=True)
class EpochFigures:
    epoch: int
    accuracy_by_position: tuple[float, ...]  # P(positions 1..i all right), i = 1..k
    conditional_accuracy_by_position: tuple[float, ...]
    loss: float

    @property
    def expected_accepted(self) -> float:
        return float(sum(self.accuracy_by_position))


def figures_of(epoch: int, metrics: dict, positions: int = 3) -> EpochFigures:
    """An epoch's validation metrics as the trainer names them (`full_acc_{i}_epoch`, ...)."""
    missing = [f"full_acc_{i}_epoch" for i in range(positions) if f"full_acc_{i}_epoch" not in metrics]
    if missing or "loss_epoch" not in metrics:
        raise ValueError(f"epoch {epoch}: validation metrics lack {', '.join(missing or ['loss_epoch'])}; "
                         f"have {', '.join(sorted(metrics)) or 'nothing'}")
    return EpochFigures(epoch, tuple(float(metrics[f"full_acc_{i}_epoch"]) for i in range(positions)),
                        tuple(float(metrics.get(f"cond_acc_{i}_epoch", float("nan"))) for i in range(positions)),
                        float(metrics["loss_epoch"]))


def read_epochs(save_path: Path, positions: int = 3) -> list[EpochFigures]:
    """Every validated epoch under a trainer's save path, in epoch order."""
    out = []
    for d in sorted((p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        f = d / VALIDATION_FILE
        if f.is_file():
            out.append(figures_of(int(d.name), json.loads(f.read_text()), positions))
    return out


def best(candidates: list[EpochFigures]) -> EpochFigures:
    """The highest expected accepted length; the lower loss, then the earlier epoch, on a tie."""
    if not candidates:
        raise ValueError("no validated epoch to choose from: training did not finish one")
    return max(candidates, key=lambda f: (round(f.expected_accepted, 6), -f.loss, -f.epoch))
