"""tau per workload: the goodput rule with live estimates, plus a bounded learned correction.

The rule needs the model drafter's mean accepted length per workload (estimated here from the
model-drafter events) and the cost profile. The correction absorbs what the rule cannot see: the
predictor's bias near the threshold. Among labelled cache drafts whose prediction fell within one
token of tau, the running mean of (prediction - label) is how much the gate over-promises where it
matters; tau moves up by that much (down if it under-promises), clipped to +-MAX_CORRECTION.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from controller.core.decision import DecisionConfig, fallback_sources, rule_thresholds
from predictor.online import Batch
from predictor.traces import WORKLOADS

MAX_CORRECTION = 0.5
NEAR = 1.0  # predictions within this distance of tau inform the correction
TYPICAL_DRAFT = 8  # the draft length at which tau is reported in tau history


@dataclass
class WorkloadTau:
    mu_e: float
    correction: float = 0.0
    bias: float = 0.0
    n_near: int = 0
    reported: float | None = None  # the last tau written to history


@dataclass
class TauChange:
    workload: str
    tau: float
    rule_tau: float
    correction: float
    mu_e: float
    reason: str


@dataclass
class TauTuner:
    decision: DecisionConfig
    decay: float = 0.005  # weight of each new observation in the bias estimate (~200-event memory)
    min_near: int = 500  # near-threshold drafts before the correction moves
    report_step: float = 0.05  # a tau change smaller than this is not written to history
    state: dict[str, WorkloadTau] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for w in WORKLOADS:
            self.state.setdefault(w, WorkloadTau(self.decision.prior_model_mean(w)))

    def observe_model(self, workload: str, accepted: int) -> None:
        s = self.state[workload]
        s.mu_e = self.decision.update_model_mean(s.mu_e, accepted)

    def observe_cache(self, batch: Batch, predicted: np.ndarray) -> None:
        near = np.abs(predicted - batch.tau) < NEAR
        for w, err in zip(batch.workload[near].tolist(), (predicted - batch.label)[near].tolist()):
            s = self.state[WORKLOADS[w]]
            s.bias = (1.0 - self.decay) * s.bias + self.decay * err
            s.n_near += 1
            if s.n_near >= self.min_near:
                s.correction = float(np.clip(s.bias, -MAX_CORRECTION, MAX_CORRECTION))

    def rule_tau(self, workload: str, draft_len: np.ndarray | float) -> np.ndarray:
        k = np.atleast_1d(np.asarray(draft_len, dtype=np.float64))
        mu = np.full(len(k), self.state[workload].mu_e)
        return rule_thresholds(k, mu, fallback_sources(mu, self.decision, 1), self.decision)

    def thresholds(self, draft_len: np.ndarray, workload: np.ndarray) -> np.ndarray:
        """tau (rule + correction) per draft, for drafts that were never held to one."""
        out = np.zeros(len(draft_len))
        for w in np.unique(workload):
            sel = workload == w
            name = WORKLOADS[int(w)]
            out[sel] = self.rule_tau(name, draft_len[sel]) + self.state[name].correction
        return out

    def corrections(self) -> dict[str, float]:
        return {w: s.correction for w, s in self.state.items()}

    def changes(self, reason: str) -> list[TauChange]:
        """Workloads whose reported tau moved by at least report_step since last written."""
        out = []
        for w, s in self.state.items():
            rule = float(self.rule_tau(w, TYPICAL_DRAFT)[0])
            tau = rule + s.correction
            if s.reported is None or abs(tau - s.reported) >= self.report_step:
                s.reported = tau
                out.append(TauChange(w, tau, rule, s.correction, s.mu_e, reason))
        return out
