"""The runtime at the engine's boundary: only what the engine verified counts (a draft the
scheduler cut, one a preemption dropped), a request absent from some steps keeps its state, and a
step decides on the one snapshot of the control plane it started with, however often it is
swapped meanwhile."""
from __future__ import annotations

from functools import partial

import numpy as np

from controller.core.decision import CACHE, MODEL, DecisionConfig
from controller.core.events import EventQueue, LabelledEvent
from controller.core.runtime import RequestInput
from controller.core.runtime import Runtime as _Runtime
from predictor.decision.profiles import cost_profiles
from predictor.drafting.cache_drafter import VLLM_SUFFIX
from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import SURVIVAL_K, GatePredictor
from storage.workloads import WORKLOADS

GPU = cost_profiles()["gpu-8b"]
PROMPT = list(range(100, 140)) * 3  # after token 100 the cache drafts 101.. (12 tokens)

# These cases hand-build drafts as long as their match (vLLM's shape); HVD's wider drafts are the
# cache drafter's and the runtime's own tests' (test_cache_drafter.py, test_runtime.py)
Runtime = partial(_Runtime, suffix=VLLM_SUFFIX)


def survival_gate(certain: int) -> GatePredictor:
    z = np.full(SURVIVAL_K, -30.0, dtype=np.float32)
    z[:certain] = 30.0
    return GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32),
                         [np.zeros((NUM_FEATURES, SURVIVAL_K), np.float32)], [z], schema_hash())


def drain(queue: EventQueue) -> list[LabelledEvent]:
    out = []
    while batch := queue.get_batch(100_000):
        out += batch
    return out


def test_a_cache_draft_the_scheduler_cut_counts_what_was_verified(tokenizer):
    runtime = Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), DecisionConfig(cost=GPU))
    plan = runtime.step([RequestInput("a", [100], PROMPT, workload="agentic")])
    assert plan.source.tolist() == [CACHE] and len(plan.drafts[0]) == 12
    runtime.step([RequestInput("a", [101, 102, 103, 104, 7], verified=4)])  # cut to 4, all accepted, a bonus token
    (event,) = [e for e in drain(runtime.events) if e.decision == "cache"]
    assert (event.draft_len, event.verified_len, event.accepted) == (12, 4, 4)
    s = runtime.stats
    assert (s.verified_drafts, s.verified_tokens, s.verified_accepted, s.engine_cut) == (1, 4, 4, 1)


def test_a_draft_dropped_by_preemption_counts_nothing(tokenizer):
    runtime = Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), DecisionConfig(cost=GPU))
    runtime.step([RequestInput("a", [100], PROMPT, workload="agentic")])
    # steps go by without "a" (preempted): it keeps its state; it comes back with one token, nothing verified
    other = runtime.step([RequestInput("b", [7], list(range(2000, 2060)), workload="chat")])
    assert "a" in runtime.requests and other.req_ids == ["b"]
    runtime.step([RequestInput("a", [55], verified=0)])
    s = runtime.stats
    assert (s.verified_drafts, s.verified_tokens, s.engine_cut) == (0, 0, 1)
    st = runtime.requests["a"]
    assert st.hindsight.output_len == 2  # continued where it was: 100, 55
    cache = [e for e in drain(runtime.events) if e.drafter == "cache" and e.decision == "cache"]
    assert [(e.position, e.verified_len) for e in cache][0] == (1, None)  # nothing of it verified


def test_a_model_draft_the_scheduler_cut_teaches_the_curve_what_was_verified(tokenizer):
    decision = DecisionConfig(cost=GPU)
    runtime = Runtime(survival_gate(0), token_classes(tokenizer), decision)
    plan = runtime.step([RequestInput("m", [5], list(range(3000, 3060)), workload="sql")])
    assert plan.source.tolist() == [MODEL] and plan.model_k >= 2
    w = WORKLOADS.index("sql")
    before = runtime.model_curves.reached[w].copy()
    runtime.step([RequestInput("m", [6, 7], verified=1)])  # only 1 of k verified, and accepted: bonus 7
    (event,) = [e for e in drain(runtime.events) if e.drafter == "model"]
    assert (event.draft_len, event.accepted) == (1, 1)
    reached = runtime.model_curves.reached[w] - before
    assert reached[0] > 0 and not reached[1:].any()  # position 2 was never verified: not observed


class _SwappingGate:
    """A gate that, while scoring, has the 'poller' publish a new champion (as the poller thread
    can at any moment)."""

    def __init__(self, inner: GatePredictor, runtime_ref: list, new_gate: GatePredictor, new_version: int) -> None:
        self.inner, self.runtime_ref, self.new = inner, runtime_ref, (new_gate, new_version)
        self.kind = inner.kind

    def survival(self, x):
        self.runtime_ref[0].publish(gate=self.new[0], version_id=self.new[1])
        return self.inner.survival(x)

    def predict(self, x):
        return self.survival(x).sum(axis=1)


def test_a_version_swapped_mid_step_is_not_credited_with_the_steps_events(tokenizer):
    ref: list = []
    gate = _SwappingGate(survival_gate(SURVIVAL_K), ref, survival_gate(0), 8)
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(cost=GPU), version_id=7)
    ref.append(runtime)
    plan = runtime.step([RequestInput("a", [100], PROMPT, workload="agentic")])
    assert plan.source.tolist() == [CACHE]  # decided by v7's curves
    assert runtime.version_id == 8  # the next step's
    runtime.step([RequestInput("a", [101, 7])])  # 1 accepted, then off the draft: labelled
    events = drain(runtime.events)
    assert events and {e.predictor_version_id for e in events if e.position <= 1} == {7}


def test_tokens_the_scheduler_cut_are_not_output_but_their_acceptance_counts(tokenizer):
    """vLLM's runner samples accepted draft tokens past max_tokens (or a stop token); its scheduler
    cuts them from the output but counts them accepted. HVD learns the output from what was kept
    and the acceptance from what was sampled, as vLLM's counters do."""
    runtime = Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), DecisionConfig(cost=GPU))
    runtime.step([RequestInput("a", [100], PROMPT, workload="agentic")])
    runtime.step([RequestInput("a", [101, 102], verified=12, sampled=5)])  # 4 accepted + bonus; 2 kept
    assert runtime.requests["a"].hindsight.output_len == 3
    assert (runtime.stats.verified_tokens, runtime.stats.verified_accepted, runtime.stats.accepted_not_output) == (12, 4, 2)


def test_what_vllm_keeps_of_a_step():
    """As vLLM's scheduler cuts a step's tokens (check_stop), with vLLM's own SamplingParams made as
    its engine makes them (eos 2 from the model's generation config)."""
    from vllm import SamplingParams

    from controller.engines.vllm_hybrid import _kept

    def params(max_tokens=None, ignore_eos=False, stops=None, min_tokens=0):
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stops, min_tokens=min_tokens)
        p.update_from_generation_config({"eos_token_id": 2}, eos_token_id=2)
        return p

    assert _kept(params(max_tokens=10), [1, 2, 3, 4], 8) == [1, 2]
    assert _kept(params(max_tokens=10), [1, 3], 3) == [1, 3]
    assert _kept(params(), [1, 2, 3], 0) == [1, 2]  # the eos token ends the request
    assert _kept(params(ignore_eos=True), [1, 2, 3, 2, 4], 0) == [1, 2, 3, 2, 4]  # not under ignore_eos
    assert 2 in params(ignore_eos=True).all_stop_token_ids  # though vLLM lists it among the stop ids
    assert _kept(params(ignore_eos=True, stops=[7]), [1, 2, 7, 3], 0) == [1, 2, 7]  # a stop id does
    assert _kept(params(ignore_eos=True, stops=[7], max_tokens=4), [1, 7, 3], 2) == [1, 7]
    assert _kept(None, [1, 2], 0) == [1, 2]


def test_where_vllm_would_end_a_request():
    """What the plugin tells the runtime of a request's end, from vLLM's own SamplingParams: the
    tokens it may still emit and the ids that end it (as `_kept` cuts them)."""
    from vllm import SamplingParams

    from controller.engines.vllm_hybrid import _end

    def params(max_tokens=None, ignore_eos=False, stops=None, min_tokens=0):
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stops, min_tokens=min_tokens)
        p.update_from_generation_config({"eos_token_id": 2}, eos_token_id=2)
        return p

    assert _end(params(max_tokens=10), 7) == (3, (2,))
    assert _end(params(max_tokens=10), 12) == (0, (2,))
    assert _end(params(max_tokens=None), 7)[0] is None  # vLLM fills in the model's length later
    assert _end(params(max_tokens=10, ignore_eos=True), 0) == (10, ())  # the eos does not end it
    assert _end(params(max_tokens=10, ignore_eos=True, stops=[7, 8]), 0) == (10, (7, 8))
    room, stops = _end(params(max_tokens=10, stops=[7], min_tokens=5), 1)
    assert room == 9 and set(stops) == {2, 7}  # short of min_tokens the target may not sample them
    assert _end(None, 3) == (None, ())
