"""Every engine step HVD timed, one JSON line each (HVD_STEP_LOG): when it ran, its phase, the
running requests, the tokens the target processed, the model draft length and each part's ms.

Why: the allocator prices a step with a line fitted to these same timings (the live cost fit), and a
line can only be as right as its terms; the per-minute summaries (`step_cost_minutes`) and the
Prometheus histogram keep means and quantiles, not which steps were dear. The log keeps the steps
themselves, so that what a step cost can be read against what it verified and ran.

Opt-in and bounded (controller.services.jsonl_log): the decode path appends the timing to a queue;
the lines are made and written in the service's thread."""
from __future__ import annotations

from pathlib import Path

from controller.core.step_costs import PARTS, StepTiming
from controller.services.jsonl_log import JsonlLog


def step_line(timing: StepTiming, decode: bool) -> dict:
    """One step's JSON line."""
    line = {"at": round(timing.at, 6), "phase": "decode" if decode else "prefill", "batch": timing.batch,
            "query_tokens": timing.query_tokens, "model_k": timing.model_k}
    line.update({f"{p}_ms": round(1000.0 * s, 4) for p, s in zip(PARTS, timing.parts)})
    line["total_ms"] = round(1000.0 * timing.total, 4)
    return line


class StepLog(JsonlLog[tuple[StepTiming, bool]]):
    name = "hvd-step-log"
    setting, what = "HVD_STEP_LOG", "steps"

    def __init__(self, path: str | Path, *, max_steps: int = 1_000_000, max_pending: int = 100_000,
                 interval: float = 2.0) -> None:
        super().__init__(path, max_steps, max_pending, interval)

    def line(self, item: tuple[StepTiming, bool]) -> dict:
        return step_line(*item)
