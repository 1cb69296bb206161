"""The runtime deciding with the verification allocator: cache prefixes cut where the survival curve
falls, one model draft length per step, constraints from opt-outs, back-off and overrides, the
point-gate fallback to the binary rule, the model drafter's live curve, and tau for operators."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from functools import partial

import numpy as np
import pytest

from controller.core.decision import CACHE, MODEL, NONE, DecisionConfig
from controller.core.events import EventQueue, LabelledEvent
from controller.core.runtime import RequestInput
from controller.core.runtime import Runtime as _Runtime
from controller.core.snapshot import Controls
from controller.core.tau_tuner import TauTuner
from controller.engines.trace_engine import run_replay
from controller.services.event_writer import EventWriter
from controller.services.learner_service import LearnerService
from predictor.decision.profiles import cost_profiles, drafter_profiles
from predictor.drafting.cache_drafter import VLLM_SUFFIX
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import SURVIVAL_K, GatePredictor
from predictor.gate.registry import store_champion
from predictor.online.learner import LearnerConfig
from storage.engine import make_engine, session_scope
from storage.events import EventCursor, events_after
from storage.migrate import upgrade
from storage.models import TauHistory
from storage.overrides import ActiveOverride, OverrideSnapshot
from storage.workloads import WORKLOADS

from support.gates import match_len_gate, random_survival_gate

DRAFTER = drafter_profiles()["eagle3-1.75"]
CPU, GPU = cost_profiles()["cpu-smollm2"], cost_profiles()["gpu-8b"]
PROMPT = list(range(100, 140)) * 3  # repeats: after token 100 the cache drafts 101.. (12 tokens)

# These cases hand-build drafts as long as their match (vLLM's shape); HVD's wider drafts are the
# cache drafter's and the runtime's own tests' (test_cache_drafter.py, test_runtime.py)
Runtime = partial(_Runtime, suffix=VLLM_SUFFIX)


def survival_gate(certain: int) -> GatePredictor:
    """A transparent survival gate: S(j) = 1 for j <= `certain`, 0 after (and past the draft's end)."""
    z = np.full(SURVIVAL_K, -30.0, dtype=np.float32)
    z[:certain] = 30.0
    return GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32),
                         [np.zeros((NUM_FEATURES, SURVIVAL_K), np.float32)], [z], schema_hash())


def repeat(req_id: str, tenant: str = "default", workload: str = "agentic", speculate: bool = True) -> RequestInput:
    return RequestInput(req_id, [100], PROMPT, tenant, workload, speculate)


def fresh(i: int, workload: str = "chat") -> RequestInput:
    """A request whose prompt never repeats: no cache draft."""
    base = 1000 + 100 * i
    return RequestInput(f"f{i}", [base + 99], list(range(base, base + 60)), workload=workload)


def drain(queue: EventQueue) -> list[LabelledEvent]:
    out = []
    while batch := queue.get_batch(100_000):
        out += batch
    return out


@pytest.mark.parametrize("cost", [GPU, CPU], ids=lambda c: c.name)
def test_a_certain_cache_draft_is_verified_whole(tokenizer, cost):
    runtime = Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), DecisionConfig(cost=cost))
    assert runtime.rule == "allocator"
    plan = runtime.step([repeat("a")])
    assert plan.source.tolist() == [CACHE] and plan.model_k == 0
    assert plan.cache_len[0] == 12 and plan.drafts[0] == plan.cache_drafts[0] == list(range(101, 113))
    assert plan.predicted[0] == 12.0
    assert runtime.stats.truncated == 0


@pytest.mark.parametrize("cost", [GPU, CPU], ids=lambda c: c.name)
def test_a_cliff_in_the_survival_curve_cuts_the_draft(tokenizer, cost):
    """S = 1, 1, 1, 0, ...: three certain tokens are verified, the rest never pays. The event keeps
    the whole draft and its hindsight label; the engine-side tally counts what was verified."""
    runtime = Runtime(survival_gate(3), token_classes(tokenizer), DecisionConfig(cost=cost))
    plan = runtime.step([repeat("a")])
    assert plan.source.tolist() == [CACHE] and plan.cache_len[0] == 12
    assert plan.drafts[0] == plan.cache_drafts[0][:3] == [101, 102, 103]
    assert plan.predicted[0] == 3.0 and np.isfinite(plan.tau[0])
    assert runtime.stats.truncated == 1
    runtime.step([RequestInput("a", [101, 102, 103, 7])])  # 3 accepted + a bonus token off the draft
    (event,) = [e for e in drain(runtime.events) if e.decision == "cache"]
    assert (event.position, event.draft_len, event.accepted, event.predicted) == (1, 12, 3, 3.0)
    assert event.verified_len == 3 and event.to_row()["verified_len"] == 3
    assert event.tau == pytest.approx(float(plan.tau[0]), rel=1e-6)
    stats = runtime.stats
    assert (stats.verified_drafts, stats.verified_tokens, stats.verified_accepted, stats.accepted_count) == (1, 3, 3, {3: 1})


def test_a_perfect_predictor_verifies_exactly_what_will_be_accepted(tokenizer):
    """Given the continuation (the replay engine's perfect predictor), the allocator plans from each
    draft's true accepted length whatever the gate says; requests without one keep the gate's curve,
    and the event still carries the gate's prediction."""
    runtime = Runtime(survival_gate(0), token_classes(tokenizer), DecisionConfig(cost=GPU))
    right = [101, 102, 103, 104, 105, 999]
    a = RequestInput("a", [100], PROMPT, workload="agentic", continuation=np.array(right))
    plan = runtime.step([a, repeat("b")])
    assert plan.source.tolist() == [CACHE, NONE] and plan.cache_len.tolist() == [12, 12]  # b: the gate says useless
    assert plan.drafts[0] == right[:5] and plan.predicted[0] == 5.0 and plan.predicted[1] == pytest.approx(0, abs=1e-6)
    runtime.step([RequestInput("a", right, workload="agentic"), RequestInput("b", [101], workload="agentic")])
    event = next(e for e in drain(runtime.events) if e.request_id == "a" and e.drafter == "cache" and e.position == 1)
    assert (event.accepted, event.verified_len, event.decision) == (5, 5, "cache")
    assert event.predicted == pytest.approx(0, abs=1e-6)
    sure = Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), DecisionConfig(cost=GPU))
    assert sure.step([RequestInput("a", [100], PROMPT, workload="agentic", continuation=[7, 8])]).source.tolist() == [MODEL]


def test_opt_out_backoff_and_no_model_fallback(tokenizer):
    """A useless cache draft (S = 0): the model draft where it may be used, else nothing."""
    useless = survival_gate(0)
    two = [repeat("a"), repeat("b", speculate=False)]
    decision = DecisionConfig(cost=GPU)
    plan = Runtime(useless, token_classes(tokenizer), decision).step(two)
    curve = decision.model_survival().curve(WORKLOADS.index("agentic"))
    rate = [(2 + curve[:k].sum()) / GPU.step_ms(2, 2 + k, k) for k in (1, 2, 3)]
    assert plan.source.tolist() == [MODEL, NONE] and plan.cache_len.tolist() == [12, 0]
    assert plan.model_k == 1 + int(np.argmax(rate))
    off = Runtime(useless, token_classes(tokenizer), DecisionConfig(cost=GPU, max_running_for_speculation=1))
    plan = off.step([repeat("a"), repeat("b")])
    assert plan.source.tolist() == [NONE, NONE] and plan.cache_len.tolist() == [0, 0] and plan.model_k == 0
    cache_only = DecisionConfig(cost=GPU, max_running_for_speculation=1, backoff="cache_only")
    assert Runtime(useless, token_classes(tokenizer), cache_only).step([repeat("a"), repeat("b")]).source.tolist() == [NONE] * 2
    plan = Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), cache_only).step([repeat("a"), repeat("b")])
    assert plan.source.tolist() == [CACHE] * 2 and [len(d) for d in plan.drafts] == [12, 12]
    no_model = Runtime(useless, token_classes(tokenizer), DecisionConfig(cost=GPU, fallback="none"))
    assert no_model.step([repeat("a"), fresh(0)]).source.tolist() == [NONE, NONE]


@pytest.mark.parametrize("n", [1, 8])
def test_one_model_draft_length_per_step_the_best_one(tokenizer, n):
    """Requests without a cache draft: the step drafts with the model at the k that maximises
    expected tokens per millisecond of the whole step (from the drafter's curve and the cost
    profile), or not at all; every model draft of the step is k long, and its event says so."""
    decision = DecisionConfig(cost=CPU)
    runtime = Runtime(survival_gate(0), token_classes(tokenizer), decision)
    inputs = [fresh(i) for i in range(n)]
    plan = runtime.step(inputs)
    assert plan.cache_len.tolist() == [0] * n and runtime.stats.model_k_steps == {plan.model_k: 1}
    curve = decision.model_survival().curve(WORKLOADS.index("chat"))
    rate = {0: n / CPU.step_ms(n, n, 0)}
    rate.update({k: n * (1 + curve[:k].sum()) / CPU.step_ms(n, n * (1 + k), k) for k in (1, 2, 3)})
    best = max(rate, key=rate.get)
    assert best > 0 and plan.model_k == best
    assert plan.source.tolist() == [MODEL] * n
    runtime.step([RequestInput(inp.req_id, [5, 6]) for inp in inputs])  # one accepted + bonus each
    model = [e for e in drain(runtime.events) if e.drafter == "model"]
    assert [(e.draft_len, e.accepted) for e in model] == [(best, 1)] * n


def test_overrides_take_precedence_over_the_allocator(tokenizer):
    """Precedence as documented (tenant+workload > tenant > workload auto > default). A fixed tau,
    or bounds that move the automatic (break-even) tau, hold the request to the binary decision:
    the whole draft iff the predicted length beats tau, else the model draft or nothing. Hybrid
    off: always the model draft / always the whole cache draft. Learned corrections are the binary
    rule's and do not move the allocator. An opted-out request verifies nothing whatever its tenant."""
    now = datetime.now(timezone.utc)
    snapshot = OverrideSnapshot([
        ActiveOverride("acme", None, "fixed", 50.0, None, None, None, 1),
        ActiveOverride("acme", "agentic", "fixed", -1.0, None, None, None, 2),
        ActiveOverride("beta", None, "off_model", None, None, None, None, 3),
        ActiveOverride("gamma", None, "bounds", None, 30.0, 40.0, now + timedelta(hours=1), 4),
        ActiveOverride("delta", None, "bounds", None, 0.0, 100.0, None, 5),
        ActiveOverride("eps", None, "off_cache", None, None, None, None, 6),
        ActiveOverride("old", None, "fixed", 50.0, None, None, now - timedelta(seconds=1), 7),
    ])
    runtime = Runtime(survival_gate(3), token_classes(tokenizer), DecisionConfig(cost=GPU))  # predicts 3 of 12
    runtime.set_controls(Controls(corrections={"agentic": 100.0}, overrides=snapshot))
    tenants = [("acme", "agentic"), ("acme", "sql"), ("beta", "agentic"), ("gamma", "agentic"),
               ("delta", "agentic"), ("eps", "agentic"), ("old", "agentic"), ("zeta", "agentic")]
    inputs = [repeat(f"r{i}", t, w) for i, (t, w) in enumerate(tenants)] + [repeat("r8", "beta", speculate=False)]
    plan = runtime.step(inputs)
    assert plan.source.tolist() == [CACHE, MODEL, MODEL, MODEL, CACHE, CACHE, CACHE, CACHE, NONE]
    assert [len(d) for d in plan.drafts] == [12, 0, 0, 0, 3, 12, 3, 3, 0]
    assert plan.model_k >= 1
    tau = plan.tau.tolist()
    assert tau[0] == -1.0 and tau[1] == 50.0 and tau[3] == 30.0  # held to the override (gamma: clamped)
    assert tau[4] == tau[6] == tau[7] < 30.0  # the break-even tau, inside delta's bounds: automatic
    # The events carry each request's automatic tau, whatever override held it.
    recorded = [r.tau for i in range(8) for r in runtime.requests[f"r{i}"].records.values() if r.decision != "shadow"]
    assert len(recorded) == 8 and len(set(recorded)) == 1 and recorded[0] not in (-1.0, 50.0, 30.0)


def test_a_point_gate_serves_with_the_binary_rule(tokenizer, caplog):
    point = match_len_gate()
    inputs = [repeat("a"), fresh(0)]
    with caplog.at_level(logging.WARNING, logger="hvd.runtime"):
        runtime = Runtime(point, token_classes(tokenizer), DecisionConfig(cost=CPU), version_id=4)
        plan = runtime.step(inputs)
        runtime.set_gate(point, 5)
    assert runtime.rule == "binary"
    assert [r.getMessage() for r in caplog.records] == [
        "predictor v4 is a point estimate (no survival curve): deciding with the binary rule instead of the "
        "allocator; a survival predictor (hvd warmstart) brings it back"]
    binary = Runtime(point, token_classes(tokenizer), DecisionConfig(cost=CPU, rule="binary")).step(inputs)
    assert plan.source.tolist() == binary.source.tolist() == [CACHE, MODEL]
    assert plan.drafts == binary.drafts and plan.drafts[0] == list(range(101, 113))  # whole drafts
    np.testing.assert_array_equal(plan.tau, binary.tau)
    assert plan.model_k == 3  # the configured k
    runtime.set_gate(survival_gate(3), 6)
    assert runtime.rule == "allocator" and len(runtime.step([repeat("b")]).drafts[0]) == 3


def test_gate_is_no_longer_a_rule():
    with pytest.raises(ValueError, match=r"rule 'gate' was renamed: 'binary' .* 'allocator' the default"):
        DecisionConfig(rule="gate")
    assert DecisionConfig().rule == "allocator"


def test_replay_verifies_the_truncated_drafts(records, tokenizer):
    """The replay engine verifies exactly the prefixes the plan cut: its tally of verified drafts and
    rejected draft tokens matches what the runtime counts from the tokens each step emitted (up to
    one token at a request's end, where the last step may emit less than accepted + 1); verifying
    the whole drafts would reject many more."""
    runtime = Runtime(random_survival_gate(), token_classes(tokenizer), DecisionConfig(cost=CPU, fallback="none"))
    prefixes: list[int] = []
    step = runtime.step

    def spy(inputs, finished=()):
        plan = step(inputs, finished)
        prefixes.extend(len(d) for d, s in zip(plan.drafts, plan.source.tolist()) if s == CACHE)
        return plan

    runtime.step = spy
    total = run_replay(runtime, records, tokenizer, DRAFTER, batch_size=4).total()
    stats = runtime.stats
    assert stats.truncated > 100 and total.model_cycles == 0
    assert total.cache_cycles == stats.verified_drafts == len(prefixes) == stats.decisions["cache"]
    assert stats.verified_tokens == sum(prefixes)
    wasted = stats.verified_tokens - stats.verified_accepted
    assert 0 < total.wasted <= wasted <= total.wasted + len(records)


def test_labels_and_the_model_drafters_curve_follow_hindsight(records, tokenizer, record_drafts):
    """Interleaved requests (batch 4), allocator decisions with truncation and varying k: every cache
    draft's label is the LCP of the WHOLE draft with the true continuation; every model draft's event
    has the step's k; the runtime's model-drafter curves are exactly a DrafterSurvival fed those
    events in order, and the tau tuner fed the same events has the same mean accepted length."""
    decision = DecisionConfig(cost=CPU)
    runtime = Runtime(random_survival_gate(), token_classes(tokenizer), decision)
    drafts = record_drafts(runtime)
    run = run_replay(runtime, records, tokenizer, DRAFTER, batch_size=4)
    outputs = {r.trace_id: tokenizer.encode_output(r.output).tolist() for r in records}
    events = drain(runtime.events)
    cache = [e for e in events if e.drafter == "cache"]
    assert len(cache) == len(drafts) and {e.decision for e in cache} >= {"cache", "shadow"}
    for e in cache:
        assert e.accepted == lcp(drafts[(e.request_id, e.position)], outputs[e.request_id][e.position:])
    model = [e for e in events if e.drafter == "model"]
    stats = runtime.stats
    assert len(model) == sum(t.model_cycles for t in run.by_workload.values()) == stats.decisions["model"]
    assert len(stats.model_k_steps) >= 2 and {e.draft_len for e in model} == set(stats.model_k_steps)  # k varies by step
    assert stats.truncated > 0 and stats.mixed_steps > 0
    expected = decision.model_survival()
    tuner = TauTuner(decision)
    for e in model:
        expected.observe(WORKLOADS.index(e.workload), e.draft_len, e.accepted)
        tuner.observe_model(e.workload, e.draft_len, e.accepted)
    every = np.arange(len(WORKLOADS))
    np.testing.assert_allclose(runtime.model_curves.curves(every), expected.curves(every), rtol=1e-12)
    assert np.abs(expected.curves(every) - decision.model_survival().curves(every)).max() > 0.01  # it learned
    for i, w in enumerate(WORKLOADS):
        assert runtime.mu_e[w] == pytest.approx(expected.mean_accepted(i), rel=1e-12)
        assert tuner.state[w].mu_e == pytest.approx(runtime.mu_e[w], rel=1e-12)


def test_tau_history_shows_the_break_even_tau(tmp_path, records, tokenizer):
    """What operators see as a workload's automatic tau under the allocator: the running mean of the
    break-even tau on its decided cache drafts (from their events), no correction; the model
    drafter's mean accepted length next to it is the runtime's."""
    engine = make_engine(f"sqlite:///{tmp_path}/tau.db")
    upgrade(engine)
    gate = random_survival_gate()
    with session_scope(engine) as s:
        version = store_champion(s, gate, reason="test", actor="test")
    decision = DecisionConfig(cost=CPU)
    runtime = Runtime(gate, token_classes(tokenizer), decision, version_id=version)
    writer = EventWriter(engine, runtime.events)
    run_replay(runtime, records[:8], tokenizer, DRAFTER, batch_size=4)
    assert writer.flush()
    service = LearnerService(engine, decision, LearnerConfig(seed=1), replica="r", start_at_end=False,
                             batch_events=500)
    while service.run_once():
        pass
    tuner = service.tuner
    with session_scope(engine) as s:
        events = events_after(s, EventCursor(), 1_000_000)
        history = [(h.workload, h.tau, h.rule_tau, h.correction, h.model_mean_accepted)
                   for h in s.query(TauHistory).order_by(TauHistory.id)]
    decided = [e for e in events if e.drafter == "cache" and e.decision != "shadow"]
    assert decided and history
    for w in {e.workload for e in decided}:
        mean = None
        for e in decided:
            if e.workload == w:
                mean = e.tau if mean is None else (1 - tuner.decay) * mean + tuner.decay * e.tau
        assert tuner.state[w].break_even == pytest.approx(mean, rel=1e-9)
        last = [h for h in history if h[0] == w][-1]
        assert last[1] == last[2] and last[3] == 0.0
        assert abs(last[1] - mean) < tuner.report_step
    assert {h[0] for h in history} == {e.workload for e in decided}  # no tau before one is seen
    for w in WORKLOADS:
        assert tuner.state[w].mu_e == pytest.approx(runtime.mu_e[w], rel=1e-9)


def test_calibrations_and_workload_champions_change_what_is_served(tokenizer):
    """The fast correction applies per tenant's workload where the leader fitted one, else per
    workload; a workload's own champion decides its drafts and stamps its version on their events."""
    from predictor.gate.calibration import Calibration

    runtime = Runtime(survival_gate(3), token_classes(tokenizer), DecisionConfig(cost=GPU), version_id=1)
    raw = runtime.step([repeat("a", tenant="t1"), repeat("b", tenant="t2")])
    assert raw.predicted.tolist() == [3.0, 3.0]
    nothing = Calibration(np.ones(SURVIVAL_K), np.full(SURVIVAL_K, -200.0), 500)  # accepts nothing
    runtime.set_controls(Controls(calibrations={("agentic", None): Calibration.identity(),
                                                ("agentic", "t2"): nothing}))
    plan = runtime.step([repeat("c", tenant="t1"), repeat("d", tenant="t2")])
    assert plan.predicted[0] == pytest.approx(3.0, abs=1e-3) and plan.predicted[1] == pytest.approx(0.0, abs=1e-6)
    assert plan.source.tolist()[1] != CACHE
    runtime.set_controls(Controls())
    runtime.set_workload_gates({"agentic": (survival_gate(SURVIVAL_K), 7)})
    drain(runtime.events)
    plan = runtime.step([repeat("e"), fresh(1)])
    assert plan.predicted[0] == 12.0 and runtime.version_for("agentic") == 7 and runtime.version_for("sql") == 1
    runtime.step([RequestInput("e", list(range(101, 114)))])
    events = [e for e in drain(runtime.events) if e.drafter == "cache" and e.request_id == "e"]
    assert events and {e.predictor_version_id for e in events} == {7}
