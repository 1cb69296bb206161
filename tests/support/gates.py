"""Small gates the runtime tests decide with: transparent or seeded, no training."""
from __future__ import annotations

import numpy as np
import torch

from predictor.drafting.features import FEATURE_NAMES, NUM_FEATURES, schema_hash
from predictor.gate.mlp import MLP, SURVIVAL_K, GatePredictor


def random_survival_gate() -> GatePredictor:
    """A survival gate with seeded random weights: the runtime decides with the allocator."""
    torch.manual_seed(0)
    return GatePredictor.from_torch(MLP(NUM_FEATURES, outputs=SURVIVAL_K), schema_hash())


def match_len_gate() -> GatePredictor:
    """A transparent point gate: predicts the draft's match length (so a fixed tau splits decisions)."""
    w = np.zeros((NUM_FEATURES, 1), dtype=np.float32)
    w[FEATURE_NAMES.index("match_len"), 0] = 1.0
    return GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32), [w],
                         [np.zeros(1, np.float32)], schema_hash())
