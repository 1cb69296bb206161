"""The trace replay engine: an inference engine whose "target model" is the recorded continuation.

It drives the same Runtime an engine plugin drives: each step it reports the tokens the previous
step emitted, receives the plan, and "verifies" it greedily against the recorded output: a cache
draft (cut to the length the plan verifies) accepts its longest common prefix with the true
continuation; a model draft of the step's length k accepts what a simulated EAGLE3 drafter would
(seeded, per request and position), at most k; every step emits accepted + 1 tokens. Requests of
one deployment run `batch_size` at a time in arrival order. Each step's simulated time comes from the
runtime's cost profile (its batch, query tokens and model draft length), shared evenly by its requests.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.core.decision import CACHE, MODEL
from controller.core.runtime import RequestInput, Runtime, StepPlan
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import TraceRecord
from predictor.decision.profiles import DrafterProfile, accepted_from_survival
from predictor.drafting.common_prefix import lcp
from predictor.evaluation.simulator import Tally
from predictor.replay.trace_replay import deployments


ORACLES = ("gate", "predictor")


@dataclass
class ReplayRun:
    by_workload: dict[str, Tally] = field(default_factory=dict)
    steps: int = 0

    def total(self) -> Tally:
        out = Tally()
        for t in self.by_workload.values():
            out.add(t)
        return out


@dataclass
class _Live:
    record: TraceRecord
    prompt: np.ndarray
    out: np.ndarray
    emitted: int = 0
    pending_new: np.ndarray | None = None  # emitted by the last step, not yet reported
    started: bool = False
    verified: int | None = None  # draft tokens of the runtime's last plan for it that the step verified


def model_draft_accepted(drafter: DrafterProfile, seed: int, trace_id: str, position: int, workload: str) -> int:
    """The simulated model drafter's accepted length at one position: deterministic per (seed, trace,
    position), drawn from the workload's survival curve (P(accepted >= j) = S(j))."""
    digest = hashlib.blake2b(f"{seed}:{trace_id}:{position}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") + 0.5) / 2.0**64
    return accepted_from_survival(drafter.survival_for(workload), u)


def run_replay(runtime: Runtime, records: Sequence[TraceRecord], tokenizer: TraceTokenizer,
               drafter: DrafterProfile, batch_size: int = 1, seed: int = 0, tenant_of: Callable[[TraceRecord], str] | None = None,
               on_step: Callable[[ReplayRun], None] | None = None, stop: Callable[[], bool] | None = None,
               oracle: str | None = None) -> ReplayRun:
    """Serve `records` through `runtime` deployment by deployment; returns cycles and tokens per workload.

    oracle (ORACLES) serves with perfect knowledge of each cache draft's accepted length: "gate"
    verifies a whole cache draft iff that length beats the plan's tau (see `_oracle_sources`), the
    binary oracle gate of this serving setting; "predictor" hands the runtime each request's
    continuation, so its allocator plans from true lengths instead of the gate's curves (a perfect
    predictor: the most any predictor of the cache drafts could buy in this setting)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if oracle is not None and oracle not in ORACLES:
        raise ValueError(f"oracle must be one of {ORACLES} or None, got {oracle!r}")
    run = ReplayRun()
    tenant_of = tenant_of or (lambda r: "default")
    for group in deployments(records).values():
        runtime.reset_cache()
        queue = list(group)
        live: list[_Live] = []
        while (queue or live) and not (stop is not None and stop()):
            while queue and len(live) < batch_size:
                rec = queue.pop(0)
                out = tokenizer.output_tokens(rec)
                if len(out) == 0:
                    continue
                item = _Live(rec, tokenizer.encode_context(rec), out, emitted=1, pending_new=out[:1])
                tally = run.by_workload.setdefault(rec.workload, Tally())
                tally.tokens += 1  # prefill emits the first token
                tally.cycles += 1
                live.append(item)
            for x in live:
                if x.emitted >= len(x.out):
                    runtime.finish(x.record.trace_id, x.pending_new)
            live = [x for x in live if x.emitted < len(x.out)]
            if not live:
                continue
            inputs = [RequestInput(x.record.trace_id, x.pending_new, None if x.started else x.prompt,
                                   tenant_of(x.record), x.record.workload,
                                   continuation=x.out[x.emitted:] if oracle == "predictor" else None,
                                   verified=x.verified, on_policy=x.record.engine is not None) for x in live]
            for x in live:
                x.started = True
            plan = runtime.step(inputs)
            run.steps += 1
            if oracle == "gate":
                source, drafts = _oracle_sources(plan, live), plan.cache_drafts
                k = plan.model_k or runtime.decision.model_draft_len
            else:
                source, drafts, k = plan.source, plan.drafts, plan.model_k
            verified = [len(drafts[i]) if source[i] == CACHE else k if source[i] == MODEL else 0
                         for i in range(len(live))]
            for i, x in enumerate(live):  # what the runtime planned counts only where it was verified
                x.verified = verified[i] if source[i] == plan.source[i] else 0
            uses_model = any(s == MODEL for s in source)
            # the step's simulated time from the cost profile, shared evenly by the requests in it
            share = runtime.decision.cost.step_ms(len(live), len(live) + sum(verified), k if uses_model else 0) / len(live)
            for i, x in enumerate(live):
                t = x.emitted
                tally = run.by_workload[x.record.workload]
                tally.time_ms += share
                if source[i] == CACHE:
                    draft = drafts[i]
                    accepted = lcp(draft, x.out[t : t + len(draft)].tolist())
                    tally.cache_cycles += 1
                    tally.wasted += len(draft) - accepted
                elif source[i] == MODEL:
                    accepted = min(model_draft_accepted(drafter, seed, x.record.trace_id, t, x.record.workload), k)
                    tally.model_cycles += 1
                    tally.wasted += k - accepted
                else:
                    accepted = 0
                emit = min(accepted + 1, len(x.out) - t)
                x.pending_new = x.out[t : t + emit]
                x.emitted = t + emit
                tally.tokens += emit
                tally.cycles += 1
            if on_step is not None:
                on_step(run)
        for x in live:  # stopped early: end what is running
            runtime.finish(x.record.trace_id)
    return run


def _oracle_sources(plan: StepPlan, live: list[_Live]) -> np.ndarray:
    """What the oracle verifies instead of the plan: a whole cache draft iff its true accepted
    length beats the plan's tau; a cache draft the plan chose but the oracle rejects gives way to
    the model drafter (the step's k, else the configured one); elsewhere the plan's choice stands.

    The runtime is told that a draft it planned and the oracle replaced was not verified (its
    statistics, the model drafter's live curve and the draft's recorded verified length skip it);
    the draft the oracle verified instead is the oracle's, not the runtime's, and is not counted."""
    source = plan.source.copy()
    for i, x in enumerate(live):
        draft = plan.cache_drafts[i]
        if not draft or not np.isfinite(plan.tau[i]):
            continue
        y = lcp(draft, x.out[x.emitted : x.emitted + len(draft)].tolist())
        if y > plan.tau[i]:
            source[i] = CACHE
        elif source[i] == CACHE:
            source[i] = MODEL
    return source
