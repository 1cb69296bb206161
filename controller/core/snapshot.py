"""What a step decides with, read once when the step starts: the champion gate and its version,
the per-workload champions, the control plane (corrections, overrides, calibrations) and the rule
the champion serves with.

The control poller builds a new snapshot off the decode path and publishes it with one attribute
assignment; a step holds the one it started with to the end, so every event it writes is credited
to the version that predicted it, however often the poller swaps versions meanwhile."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from predictor.gate.calibration import Calibration
from predictor.gate.mlp import GatePredictor
from storage.overrides import OverrideSnapshot


@dataclass(frozen=True)
class Controls:
    """What the control plane tells a running runtime: per-workload corrections to the rule's tau
    (learned by the leader) and the active overrides. Swapped whole, never mutated."""

    corrections: dict[str, float] = field(default_factory=dict)
    overrides: OverrideSnapshot = field(default_factory=OverrideSnapshot)
    # the fast survival corrections for the champion served: {(workload, tenant or None): Calibration}
    calibrations: dict[tuple[str, str | None], Calibration] = field(default_factory=dict)


@dataclass(frozen=True)
class ServingSnapshot:
    gate: GatePredictor
    version_id: int | None
    rule: str  # the rule this champion serves with (controller.core.decision.effective_rule)
    # workloads served by their own champion (promoted for that workload): {workload: (gate, version)}
    workload_gates: Mapping[str, tuple[GatePredictor, int]] = field(default_factory=dict)
    controls: Controls = field(default_factory=Controls)

    def version_for(self, workload: str) -> int | None:
        """The predictor version deciding `workload`'s drafts."""
        own = self.workload_gates.get(workload)
        return own[1] if own is not None else self.version_id

    def gate_for_version(self, version_id: int | None) -> GatePredictor:
        """The gate of a version this snapshot serves (the champion's for any other)."""
        if version_id != self.version_id:
            for gate, v in self.workload_gates.values():
                if v == version_id:
                    return gate
        return self.gate
