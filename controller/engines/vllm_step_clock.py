"""Times one vLLM engine step across the runner calls it is made of, and says where the time went.

vLLM 0.32's model runner makes a step in two calls: `execute_model` (input preparation and the
target model's forward pass, up to the logits) and `sample_tokens` (sampling, verification of the
drafts, bookkeeping, and the drafter for the next step, `propose_draft_token_ids`, which HVD
wraps). The plugin wraps both and the sampler call (`_sample`) and tells this clock what happened;
a step's parts are then:

- target: `execute_model` plus `_sample` (the forward pass, sampling and verification);
- hvd: HVD's work inside `propose_draft_token_ids` (the runtime's step and the plan's glue);
- drafter: vLLM's EAGLE proposer when HVD called it;
- rest: what the wall time of the two calls leaves (input preparation outside the forward pass is
  in `target`; bookkeeping, output copies and the drafter's input preparation are here).

Only steps in which every scheduled request decodes (no prefill chunk) are `decode` steps: those
are what the live cost model fits, as the allocator prices decode steps only."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controller.core.step_costs import StepTiming


@dataclass(frozen=True, slots=True)
class TimedStep:
    timing: StepTiming
    decode: bool  # every request in the step decoded (1 + its verified draft tokens)


class StepClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self._open = False

    def begin(self, num_scheduled_tokens: Mapping[str, int], spec_tokens: Mapping[str, Sequence[int]]) -> None:
        """`execute_model` starts: the scheduler's view of the step."""
        self._t0 = self._clock()
        self._at = self._wall()
        self._batch = len(num_scheduled_tokens)
        self._query = int(sum(num_scheduled_tokens.values()))
        self._decode = all(n == 1 + len(spec_tokens.get(r, ())) for r, n in num_scheduled_tokens.items())
        self._target = self._hvd = self._drafter = 0.0
        self._model_k = 0
        self._open = self._batch > 0

    def add(self, part: str, seconds: float, model_k: int = 0) -> None:
        """Seconds spent in `part` (target, hvd or drafter) of the open step."""
        if not self._open:
            return
        if part == "target":
            self._target += seconds
        elif part == "hvd":
            self._hvd += seconds
        elif part == "drafter":
            self._drafter += seconds
            self._model_k = max(self._model_k, model_k)
        else:
            raise ValueError(f"step part {part!r}: expected target, hvd or drafter")

    def end(self) -> TimedStep | None:
        """`sample_tokens` returned: the step, or None if no step was open (an empty step)."""
        if not self._open:
            return None
        self._open = False
        wall = self._clock() - self._t0
        timing = StepTiming.from_wall(self._at, self._batch, self._query, self._model_k, wall=wall,
                                      target=self._target, hvd=self._hvd, drafter=self._drafter)
        return TimedStep(timing, self._decode)
