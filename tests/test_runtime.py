"""The per-step runtime: hindsight labels and features equal dense replay, decisions, the queue.
(The allocator's decisions through the runtime: tests/test_runtime_allocator.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from controller.core.decision import CACHE, MODEL, NONE, DecisionConfig
from controller.core.events import EventQueue, LabelledEvent
from controller.core.runtime import RequestInput, Runtime, RequestInputError
from controller.engines.trace_engine import run_replay
from controller.services.event_writer import EventWriter
from predictor.decision.profiles import chain_acceptance, drafter_profiles
from predictor.drafting.common_prefix import lcp
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import GatePredictor
from predictor.replay.trace_replay import replay
from storage.engine import make_engine, session_scope
from storage.events import list_events
from support import rows as readback
from storage.migrate import upgrade

from support.gates import match_len_gate, random_survival_gate

DRAFTER = drafter_profiles()["eagle3-1.75"]


@pytest.fixture(scope="module")
def gate() -> GatePredictor:
    """A survival gate (random weights): the runtime decides with the allocator."""
    return random_survival_gate()


def drain(queue: EventQueue) -> list[LabelledEvent]:
    out = []
    while batch := queue.get_batch(100_000):
        out += batch
    return out


@pytest.mark.parametrize("tau", [1e9, -1.0], ids=["one-token-steps", "verify-every-cache-draft"])
def test_runtime_reproduces_dense_replay_labels_and_features(records, tokenizer, gate, tau):
    """Whatever the steps emit (one token, or a whole accepted draft), the runtime's drafts at every
    output position (main and shadow) carry the labels and features of the offline dense replay."""
    dense = replay(records, tokenizer)
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(fallback="none", fixed_tau=tau))
    run_replay(runtime, records, tokenizer, DRAFTER, batch_size=1)
    events = drain(runtime.events)
    index = {r.trace_id: i for i, r in enumerate(records)}
    row = {(int(t), int(p)): j for j, (t, p) in enumerate(zip(dense.trace, dense.position))}
    assert len(events) == int((dense.draft_len > 0).sum()) > 1000
    for e in events:
        j = row[(index[e.request_id], e.position)]
        assert (e.accepted, e.draft_len) == (dense.label[j], dense.draft_len[j])
        np.testing.assert_allclose(np.frombuffer(e.features, dtype=np.float32), dense.features[j], atol=1e-5)
        assert e.drafter == "cache" and e.decision in ({"none"} if tau > 1e8 else {"cache", "shadow"})
    if tau < 0:
        assert runtime.stats.decisions["cache"] < len(events)  # multi-token steps: shadow drafts in between


def test_hindsight_labels_with_batching_are_exact_lcps(records, tokenizer, gate, record_drafts):
    """Interleaved requests (batch 4), real decisions: every cache draft's label is its LCP with
    the true continuation, whether or not it was verified."""
    runtime = Runtime(match_len_gate(), token_classes(tokenizer), DecisionConfig(fixed_tau=8.0))
    drafts = record_drafts(runtime)
    run = run_replay(runtime, records, tokenizer, DRAFTER, batch_size=4)
    outputs = {r.trace_id: tokenizer.encode_output(r.output).tolist() for r in records}
    events = drain(runtime.events)
    cache_events = [e for e in events if e.drafter == "cache"]
    assert len(cache_events) == len(drafts)
    assert {e.decision for e in cache_events} >= {"cache", "model"}
    for e in cache_events:
        draft = drafts[(e.request_id, e.position)]
        assert e.accepted == lcp(draft, outputs[e.request_id][e.position:])
    model_events = [e for e in events if e.drafter == "model"]
    assert len(model_events) == sum(t.model_cycles for t in run.by_workload.values())
    assert all(0 <= e.accepted <= runtime.decision.model_draft_len for e in model_events)


def test_fallback_none_and_opt_out(tokenizer, gate):
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(fallback="none", fixed_tau=-1.0))
    prompt = list(range(100, 140)) * 3
    plan = runtime.step([RequestInput("a", [100], prompt, workload="agentic"),
                         RequestInput("b", [100], prompt, workload="agentic", speculate=False)])
    assert plan.source.tolist() == [CACHE, NONE]
    assert plan.drafts[0] == list(range(101, 101 + len(plan.drafts[0]))) and plan.drafts[1] == []
    assert plan.cache_len[1] == 0  # an opted-out request costs no cache lookup


def test_backoff_above_running_limit(tokenizer, gate):
    prompt = list(range(100, 140)) * 3
    inputs = [RequestInput(f"r{i}", [100], prompt, workload="coding") for i in range(3)]
    off = Runtime(gate, token_classes(tokenizer), DecisionConfig(fixed_tau=-1.0, max_running_for_speculation=2))
    assert off.step(inputs).source.tolist() == [NONE] * 3
    cache_only = Runtime(gate, token_classes(tokenizer), DecisionConfig(fixed_tau=-1.0, max_running_for_speculation=2,
                                                                 backoff="cache_only"))
    assert cache_only.step(inputs).source.tolist() == [CACHE] * 3
    under = Runtime(gate, token_classes(tokenizer), DecisionConfig(fixed_tau=1e9, max_running_for_speculation=5))
    assert under.step(inputs).source.tolist() == [MODEL] * 3


def test_model_acceptance_recorded_from_next_step_tokens(tokenizer, gate):
    """The binary rule drafts k = model_draft_len; the next step's tokens say how many were accepted,
    and the model drafter's survival curve (prior: mean 0.75 at k = 3, worth 50 drafts) takes them in
    per position: positions 1 and 2 accepted, position 3 reached and rejected."""
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(fixed_tau=1e9, model_draft_len=3, rule="binary"))
    assert runtime.step([RequestInput("a", [5], [1, 2, 3, 4], workload="chat")]).source.tolist() == [MODEL]
    runtime.step([RequestInput("a", [6, 7, 8], workload="chat")])  # 2 accepted + bonus
    events = [e for e in drain(runtime.events) if e.drafter == "model"]
    assert [(e.position, e.accepted, e.draft_len) for e in events] == [(1, 2, 3)]
    a = chain_acceptance(0.75, 3)  # the prior's conditional acceptance per position
    r12, r3 = (50 * a + 1) / 51, 50 * a / 51
    assert runtime.mu_e["chat"] == pytest.approx(r12 + r12**2 + r12**2 * r3)
    assert runtime.mu_e["sql"] == pytest.approx(0.75)
    assert (runtime.stats.verified_drafts, runtime.stats.verified_tokens, runtime.stats.verified_accepted) == (1, 3, 2)


def test_bad_requests_are_clear_errors(tokenizer, gate):
    runtime = Runtime(gate, token_classes(tokenizer))
    with pytest.raises(RequestInputError, match="without its prompt"):
        runtime.step([RequestInput("x", [1])])
    with pytest.raises(RequestInputError, match="unknown workload 'poetry'"):
        runtime.step([RequestInput("y", [1], [1, 2], workload="poetry")])
    with pytest.raises(ValueError, match="fallback"):
        DecisionConfig(fallback="eagle")


def test_full_queue_drops_and_counts_exactly():
    q = EventQueue(maxsize=5)
    event = LabelledEvent(0.0, "t", "chat", "r", 1, "cache", "none", 3, 1, 0.5, 1.0, None, None)
    results = [q.put(event) for _ in range(8)]
    assert results == [True] * 5 + [False] * 3
    assert (q.queued, q.dropped, q.depth()) == (5, 3, 5)


def test_runtime_never_blocks_on_a_full_queue(records, tokenizer, gate):
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(fallback="none", fixed_tau=1e9), events=EventQueue(10))
    run_replay(runtime, records[:3], tokenizer, DRAFTER)
    assert runtime.events.queued == 10
    assert runtime.events.dropped == runtime.stats.cache_drafts - 10 > 0


def test_events_reach_sql_in_batches(tmp_path, records, tokenizer, gate):
    engine = make_engine(f"sqlite:///{tmp_path}/ev.db")
    upgrade(engine)
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(fixed_tau=1.0), version_id=None)
    writer = EventWriter(engine, runtime.events, batch_size=500, flush_interval=0.05).start()
    run_replay(runtime, records[:6], tokenizer, DRAFTER, batch_size=3, tenant_of=lambda r: f"tenant-{r.source[:3]}")
    writer.stop()
    assert writer.written == runtime.events.queued > 0 and writer.dropped == 0
    with session_scope(engine) as session:
        assert readback.count(session) == writer.written
        first = list_events(session, limit=1)[0]
        assert first.tenant.startswith("tenant-") and first.workload in {r.workload for r in records[:6]}
        cache_rows = readback.count(session, drafter="cache")
    assert cache_rows == runtime.stats.cache_drafts


def test_overrides_and_corrections_reach_the_decision(tokenizer):
    from datetime import datetime, timedelta, timezone

    from controller.core.snapshot import Controls
    from storage.overrides import ActiveOverride, OverrideSnapshot

    gate = match_len_gate()  # predicts the match length
    prompt = list(range(100, 140)) * 3
    now = datetime.now(timezone.utc)

    def plan_for(controls, tenant, workload="agentic"):
        runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(fallback="none"))
        runtime.set_controls(controls)
        return runtime.step([RequestInput("r", [100], prompt, tenant=tenant, workload=workload)])

    auto = plan_for(Controls(), "acme")
    assert auto.source.tolist() == [CACHE]  # a long match: the rule verifies it
    raised = plan_for(Controls(corrections={"agentic": 100.0}), "acme")
    assert raised.source.tolist() == [NONE] and raised.tau[0] == pytest.approx(auto.tau[0] + 100.0)
    assert plan_for(Controls(corrections={"sql": 100.0}), "acme").source.tolist() == [CACHE]
    snapshot = OverrideSnapshot([
        ActiveOverride("acme", None, "fixed", 50.0, None, None, None, 1),
        ActiveOverride("acme", "agentic", "fixed", -1.0, None, None, None, 2),
        ActiveOverride("beta", None, "off_model", None, None, None, None, 3),
        ActiveOverride("gamma", None, "bounds", None, 30.0, 40.0, now + timedelta(hours=1), 4),
        ActiveOverride("old", None, "fixed", 50.0, None, None, now - timedelta(seconds=1), 5),
    ])
    controls = Controls(corrections={"agentic": 100.0}, overrides=snapshot)
    assert plan_for(controls, "acme").source.tolist() == [CACHE]  # tenant+workload (-1) beats tenant (50)
    assert plan_for(controls, "acme", "sql").tau[0] == pytest.approx(50.0)  # tenant-wide override
    assert plan_for(controls, "beta").source.tolist() == [MODEL]  # hybrid off: always the model drafter
    assert plan_for(controls, "gamma").tau[0] == pytest.approx(40.0)  # auto + 100 clipped into [30, 40]
    assert plan_for(controls, "old").tau[0] == pytest.approx(auto.tau[0] + 100.0)  # expired: auto again


def test_arctic_rule_verifies_by_score_not_by_the_gate(tokenizer, gate):
    """The baseline: cache draft iff its suffix-tree score reaches the model draft length, whatever
    the gate predicts (a repeating prompt scores high; a request with no match falls back)."""
    prompt = list(range(100, 140)) * 3
    inputs = [RequestInput("rep", [100], prompt, workload="coding"),
              RequestInput("new", [7], list(range(500, 560)), workload="coding")]
    runtime = Runtime(gate, token_classes(tokenizer), DecisionConfig(rule="arctic", model_draft_len=3, fixed_tau=1e9))
    plan = runtime.step(inputs)
    assert plan.cache_len[0] > 0 and plan.source.tolist() == [CACHE, MODEL]
    assert plan.tau[0] == 3.0
    strict = Runtime(gate, token_classes(tokenizer), DecisionConfig(rule="arctic", model_draft_len=16))
    plan = strict.step(inputs)  # a score (sum of token probabilities) never reaches 16 here
    assert plan.cache_len[0] > 0 and plan.source.tolist() == [MODEL, MODEL]
    with pytest.raises(ValueError, match="rule must be one of"):
        DecisionConfig(rule="greedy")
