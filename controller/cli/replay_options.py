"""`ReplayServeOptions`, the settings of `hvd serve --engine replay` (controller.cli.serve_traces,
which re-exports it), in a module of its own that imports neither torch nor the engines: the
`hvd` parser (controller/cli/main.py) reads its defaults at parse time."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from predictor.decision.profiles import DEFAULT_COST_PROFILE

if TYPE_CHECKING:
    from predictor.online.learner import LearnerConfig


def _learner_config() -> LearnerConfig:
    from predictor.online.learner import LearnerConfig  # torch: only when options are made, not at parse time

    return LearnerConfig()


@dataclass
class ReplayServeOptions:
    batch_size: int = 8
    tenants: int = 3
    seed: int = 0
    learn: bool = True
    drafter: str = "eagle3-1.75"
    cost_profile: str = DEFAULT_COST_PROFILE
    rule: str = "allocator"  # controller.core.decision.RULES
    replica: str = "replica-0"
    synchronous: bool = False
    sync_every: int = 50  # steps between synchronous learner rounds
    progress_seconds: float = 5.0
    # decide with the true accepted lengths (controller.engines.trace_engine.ORACLES: the binary
    # oracle "gate", or the allocator fed a perfect "predictor"); learning off
    oracle: str | None = None
    # draft in the shadow at every output position (Runtime.shadow_drafts); off: only where steps land,
    # for measuring what they cost and buy (learning off: the learner's counterfactual walks need them)
    shadow_drafts: bool = True
    drain_seconds: float = 10.0  # at shutdown, how long to keep trying to write what is queued
    learner: LearnerConfig = field(default_factory=_learner_config)
