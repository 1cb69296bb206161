"""The training configuration of g_theta (`TrainConfig`) and its kinds, in a module of its own that
imports neither torch nor numpy: `hvd --help` reads its defaults (controller/cli/main.py) and
predictor.gate.training, which trains with it, re-exports it."""
from __future__ import annotations

from dataclasses import asdict, dataclass

KINDS = ("survival", "point")
# The survival head is wider: at (128, 64, 32) it is a shade below the point gate at precision@6 on
# the held-out sessions; at (256, 128, 64) it is above it on precision, recall and MAE (3 seeds).
DEFAULT_HIDDEN = {"survival": (256, 128, 64), "point": (128, 64, 32)}


@dataclass(frozen=True)
class TrainConfig:
    hidden: tuple[int, ...] | None = None  # None: DEFAULT_HIDDEN of the kind
    epochs: int = 12
    batch_size: int = 2048
    learning_rate: float = 3e-3
    weight_decay: float = 1e-5
    seed: int = 0
    # Rows of a workload are weighted by (share of the largest workload / own share) ** balance,
    # so the small agentic sources are not drowned by the coding ones (0 = no reweighting).
    balance: float = 0.5
    kind: str = "survival"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TrainConfig.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.hidden is None:
            object.__setattr__(self, "hidden", DEFAULT_HIDDEN[self.kind])
        if not self.hidden or any(not isinstance(h, int) or h < 1 for h in self.hidden):
            raise ValueError(f"TrainConfig.hidden must be a non-empty tuple of positive layer widths, "
                             f"got {self.hidden!r}")

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

