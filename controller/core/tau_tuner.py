"""tau per workload, as tau history shows it to operators.

Under the allocator (the default rule) the automatic tau of a workload is the break-even expected
accepted length at which the allocator starts to verify a cache draft at the current batch size:
the running mean of the break-even tau the runtime recorded on the workload's decided cache drafts
(every decided draft's event carries it). The allocator has no scalar tau to shift, so no
correction applies to it.

Under the binary rule (configured, or served by a point-estimate predictor) tau is the goodput rule
with live estimates, plus a bounded learned correction. The rule needs the model drafter's mean
accepted length per workload (its live survival curve at the configured draft length, fed the
model-drafter events exactly as the runtime feeds its own) and the cost profile. The correction
absorbs what the rule cannot see: the predictor's bias near the threshold. Among labelled cache
drafts whose prediction fell within one token of tau, the running mean of (prediction - label) is
how much the gate over-promises where it matters; tau moves up by that much (down if it
under-promises), clipped to +-MAX_CORRECTION.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from controller.core.decision import DecisionConfig, fallback_sources, rule_thresholds
from predictor.decision.drafter_survival import DrafterSurvival
from predictor.gate.batch import Batch
from storage.workloads import WORKLOADS

MAX_CORRECTION = 0.5
NEAR = 1.0  # predictions within this distance of tau inform the correction
TYPICAL_DRAFT = 8  # the draft length at which the binary rule's tau is reported in tau history


@dataclass
class WorkloadTau:
    mu_e: float
    correction: float = 0.0
    bias: float = 0.0
    n_near: int = 0
    break_even: float | None = None  # running mean of the allocator's break-even tau (None: none seen)
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
    decay: float = 0.005  # weight of each new observation in the running means (~200-event memory)
    min_near: int = 500  # near-threshold drafts before the correction moves
    report_step: float = 0.05  # a tau change smaller than this is not written to history
    state: dict[str, WorkloadTau] = field(default_factory=dict)
    model: DrafterSurvival = field(init=False)

    def __post_init__(self) -> None:
        self.model = self.decision.model_survival()
        for i, w in enumerate(WORKLOADS):
            self.state.setdefault(w, WorkloadTau(self.model.mean_accepted(i)))

    def observe_model(self, workload: str, draft_len: int, accepted: int) -> None:
        """One verified model draft (its event): the drafter's curve, and mu_e with it."""
        i = WORKLOADS.index(workload)
        self.model.observe(i, draft_len, accepted)
        self.state[workload].mu_e = self.model.mean_accepted(i)

    def observe_break_even(self, workload: np.ndarray, tau: np.ndarray) -> None:
        """The break-even taus of decided cache drafts (workload indices into WORKLOADS), in order."""
        workload = np.asarray(workload, dtype=np.int64)
        tau = np.asarray(tau, dtype=np.float64)
        keep = np.isfinite(tau)
        workload, tau = workload[keep], tau[keep]
        for w in np.unique(workload).tolist():
            x = tau[workload == w]
            s = self.state[WORKLOADS[w]]
            mean = x[0] if s.break_even is None else s.break_even
            # The exponential running mean over x in order, in closed form.
            weights = self.decay * (1.0 - self.decay) ** np.arange(len(x) - 1, -1, -1)
            s.break_even = float((1.0 - self.decay) ** len(x) * mean + weights @ x)

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
        """tau (binary rule + correction) per draft, for drafts that were never held to one."""
        out = np.zeros(len(draft_len))
        for w in np.unique(workload):
            sel = workload == w
            name = WORKLOADS[int(w)]
            out[sel] = self.rule_tau(name, draft_len[sel]) + self.state[name].correction
        return out

    def corrections(self) -> dict[str, float]:
        return {w: s.correction for w, s in self.state.items()}

    def changes(self, reason: str, rule: str = "binary") -> list[TauChange]:
        """Workloads whose reported tau moved by at least report_step since last written. `rule`:
        the rule the runtimes decide with (decision.effective_rule); under the allocator a workload
        is reported once its break-even tau has been seen."""
        out = []
        for w, s in self.state.items():
            if rule == "allocator":
                if s.break_even is None:
                    continue
                tau = rule_tau = s.break_even
                correction = 0.0
            else:
                rule_tau = float(self.rule_tau(w, TYPICAL_DRAFT)[0])
                correction = s.correction
                tau = rule_tau + correction
            if s.reported is None or abs(tau - s.reported) >= self.report_step:
                s.reported = tau
                out.append(TauChange(w, tau, rule_tau, correction, s.mu_e, reason))
        return out
