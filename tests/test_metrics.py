"""The hvd_* Prometheus metrics, counted in a fresh registry: the same numbers the stored statistics
give for the same events, the tenant cap, the queue's depth and drops, a runtime's decisions, and
each step's cost by part (also across processes, through PROMETHEUS_MULTIPROC_DIR).
(Scraped from real servers: tests/test_serve_replay.py, tests/test_vllm_server.py.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from controller.core.decision import DecisionConfig
from controller.core.events import EventQueue, LabelledEvent
from controller.core.metrics import DEFAULT_MAX_TENANTS, LIVE_COST_TERMS, OTHER_TENANT, HvdMetrics
from controller.core.runtime import Runtime
from controller.core.step_costs import StepTiming
from controller.engines.trace_engine import run_replay
from controller.settings import read
from predictor.decision.profiles import drafter_profiles
from predictor.drafting.token_classes import token_classes
from storage.stats import GATE_OUTCOMES, aggregate
from storage.workloads import WORKLOADS

from support.gates import random_survival_gate


def event(tenant: str, workload: str, drafter: str, decision: str, draft_len: int, accepted: int,
          predicted: float | None, verified_len: int | None = None) -> LabelledEvent:
    return LabelledEvent(1_700_000_000.0, tenant, workload, "r", 3, drafter, decision, draft_len, accepted, predicted,
                         2.0, 7, None, verified_len)


EVENTS = [
    event("acme", "sql", "cache", "cache", 10, 8, 7.5),  # whole draft verified: tp
    event("acme", "sql", "cache", "cache", 10, 9, 7.0, verified_len=4),  # a 4-token prefix verified: tp
    event("acme", "sql", "cache", "cache", 8, 2, 6.5, verified_len=5),  # fp
    event("acme", "sql", "cache", "shadow", 12, 12, 3.0),  # fn, nothing verified
    event("acme", "sql", "cache", "none", 5, 0, 1.0),  # tn, nothing verified
    event("acme", "sql", "cache", "cache", 6, 6, None),  # not scored: no gate outcome
    event("acme", "sql", "model", "model", 3, 1, None),
    event("acme", "sql", "model", "model", 3, 3, None),
    event("zeta", "chat", "cache", "cache", 9, 6, 6.0),  # tp at exactly LONG
    event("zeta", "chat", "cache", "cache", 9, 5, 5.99),  # tn just under LONG
    event("zeta", "chat", "model", "model", 2, 0, None),
]


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_event_counts_equal_the_stored_statistics_of_the_same_events():
    registry = CollectorRegistry()
    metrics = HvdMetrics(registry)
    queue = EventQueue(observer=metrics)
    for e in EVENTS:
        assert queue.put(e)
    stored = aggregate(EVENTS)
    for tenant, workload in (("acme", "sql"), ("zeta", "chat")):
        rows = [d for (_, t, w, _), d in stored.items() if (t, w) == (tenant, workload)]
        assert rows
        for outcome in GATE_OUTCOMES:
            assert value(registry, "hvd_gate_outcomes_total", workload=workload, tenant=tenant, outcome=outcome) \
                == sum(getattr(d, outcome) for d in rows), outcome
        by_drafter = {d: {k: value(registry, f"hvd_{k}_tokens_total", workload=workload, tenant=tenant, drafter=d)
                          for k in ("draft", "accepted", "rejected")} for d in ("cache", "model")}
        assert sum(c["draft"] for c in by_drafter.values()) == sum(d.draft_tokens for d in rows)
        assert sum(c["accepted"] for c in by_drafter.values()) == sum(d.accepted_tokens for d in rows)
        for c in by_drafter.values():
            assert c["rejected"] == c["draft"] - c["accepted"] >= 0
    # By hand, for acme/sql: cache verified 10 + 4 + 5 + 6 tokens, accepted 8 + 4 + 2 + 6; model 6 and 4.
    acme = {"workload": "sql", "tenant": "acme"}
    assert value(registry, "hvd_draft_tokens_total", drafter="cache", **acme) == 25
    assert value(registry, "hvd_accepted_tokens_total", drafter="cache", **acme) == 20
    assert value(registry, "hvd_rejected_tokens_total", drafter="cache", **acme) == 5
    assert value(registry, "hvd_draft_tokens_total", drafter="model", **acme) == 6
    assert value(registry, "hvd_accepted_tokens_total", drafter="model", **acme) == 4
    assert [value(registry, "hvd_gate_outcomes_total", outcome=o, **acme) for o in GATE_OUTCOMES] == [2, 1, 1, 1]


def test_queue_depth_and_drops_follow_the_queue():
    registry = CollectorRegistry()
    metrics = HvdMetrics(registry)
    queue = EventQueue(maxsize=4, observer=metrics)
    results = [queue.put(e) for e in EVENTS[:6]]
    assert results == [True] * 4 + [False] * 2
    assert value(registry, "hvd_event_queue_depth") == queue.depth() == 4
    assert value(registry, "hvd_events_dropped_total") == queue.dropped == 2
    assert len(queue.get_batch(3)) == 3
    assert value(registry, "hvd_event_queue_depth") == queue.depth() == 1
    queue.close()
    assert not queue.put(EVENTS[0])
    assert value(registry, "hvd_events_dropped_total") == queue.dropped == 3
    # a dropped event's tokens still count: the metrics say what was decoded, not what was stored
    cache_tokens = value(registry, "hvd_draft_tokens_total", workload="sql", tenant="acme", drafter="cache")
    assert cache_tokens == 10 + 4 + 5 + 6 + 10


def test_tenants_past_the_cap_are_other():
    assert read("HVD_METRICS_MAX_TENANTS", {}) == DEFAULT_MAX_TENANTS == 20  # the plugin's default is the class's
    registry = CollectorRegistry()
    metrics = HvdMetrics(registry, max_tenants=20)
    queue = EventQueue(observer=metrics)
    for i in range(21):
        queue.put(event(f"t{i:02d}", "chat", "model", "model", 2, 1, None))
    queue.put(event("t00", "chat", "model", "model", 2, 2, None))  # a named tenant keeps its name
    queue.put(event("t99", "chat", "model", "model", 2, 2, None))

    def accepted(tenant: str) -> float:
        return value(registry, "hvd_accepted_tokens_total", workload="chat", tenant=tenant, drafter="model")

    assert [accepted(f"t{i:02d}") for i in range(20)] == [3] + [1] * 19
    assert accepted("t20") == accepted("t99") == 0
    assert accepted(OTHER_TENANT) == 1 + 2
    tenants = {s.labels["tenant"] for m in registry.collect() for s in m.samples if "tenant" in s.labels}
    assert len(tenants) == 21 and OTHER_TENANT in tenants
    help_text = next(m.documentation for m in registry.collect() if m.name == "hvd_decisions")
    assert "first 20 distinct tenants" in help_text and f"'{OTHER_TENANT}'" in help_text


def test_a_step_counts_one_decision_per_request_and_the_mean_tau_per_workload():
    from types import SimpleNamespace

    from controller.core.decision import CACHE, MODEL, NONE

    registry = CollectorRegistry()
    metrics = HvdMetrics(registry)
    a, b, c = (SimpleNamespace(tenant=t, workload=w) for t, w in (("acme", "sql"), ("acme", "sql"), ("zeta", "chat")))
    metrics.step([a, b, c], [CACHE, NONE, MODEL], [1.0, 3.0, float("nan")])
    metrics.step([a, c], [CACHE, NONE], [float("nan"), float("nan")])  # no cache draft: tau stays
    assert value(registry, "hvd_decisions_total", workload="sql", tenant="acme", source="cache") == 2
    assert value(registry, "hvd_decisions_total", workload="sql", tenant="acme", source="none") == 1
    assert value(registry, "hvd_decisions_total", workload="chat", tenant="zeta", source="model") == 1
    assert value(registry, "hvd_decisions_total", workload="chat", tenant="zeta", source="none") == 1
    assert registry.get_sample_value("hvd_tau", {"workload": "sql"}) == 2.0
    assert registry.get_sample_value("hvd_tau", {"workload": "chat"}) is None  # never seen: no series, not 0


def test_one_set_per_registry_and_observing_never_raises(caplog):
    registry = CollectorRegistry()
    shared = HvdMetrics.shared(registry)
    assert HvdMetrics.shared(registry) is shared
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        HvdMetrics(registry)  # why `shared` exists
    bad = event("acme", "sql", "eagle", "cache", 2, 1, None)  # a drafter no series has
    shared.offered(bad, True)
    shared.offered(bad, True)
    assert sum("HVD metrics: counting an event failed" in r.getMessage() for r in caplog.records) == 1


def test_a_runtime_counts_its_decisions_tau_and_versions(records, tokenizer):
    """Two runtimes on one registry's metrics (no duplicate registration); the counters are the
    runtime's own tallies: one decision per request and step, every labelled draft's tokens."""
    registry = CollectorRegistry()
    metrics = HvdMetrics.shared(registry)
    gate = random_survival_gate()
    first = Runtime(gate, token_classes(tokenizer), DecisionConfig(), version_id=5, metrics=metrics)
    second = Runtime(gate, token_classes(tokenizer), DecisionConfig(), version_id=5, metrics=HvdMetrics.shared(registry))
    assert second.metrics is first.metrics
    first.set_workload_gates({"sql": (gate, 9)})
    drafter = drafter_profiles()["eagle3-1.75"]
    some = [r for r in records if r.workload in ("sql", "chat", "coding")][:6]
    run_replay(first, some, tokenizer, drafter, batch_size=3, tenant_of=lambda r: f"tenant-{r.workload}")
    events = first.events.get_batch(1_000_000)
    assert events and first.events.dropped == 0
    assert value(registry, "hvd_event_queue_depth") == 0

    decisions = {s: sum(value(registry, "hvd_decisions_total", workload=w, tenant=f"tenant-{w}", source=s)
                        for w in WORKLOADS) for s in ("cache", "model", "none")}
    assert decisions == first.stats.decisions and min(decisions.values()) > 0, decisions
    assert decisions["cache"] == sum(e.drafter == "cache" and e.decision == "cache" for e in events)
    assert decisions["model"] == sum(e.drafter == "model" for e in events)
    stored = aggregate(events)
    draft = sum(value(registry, "hvd_draft_tokens_total", workload=w, tenant=f"tenant-{w}", drafter=d)
                for w in WORKLOADS for d in ("cache", "model"))
    assert draft == sum(d.draft_tokens for d in stored.values()) > 0
    for w in {r.workload for r in some}:
        tau = registry.get_sample_value("hvd_tau", {"workload": w})
        assert tau is not None and np.isfinite(tau) and tau > 0
    assert value(registry, "hvd_champion_version") == 5
    assert value(registry, "hvd_predictor_version", workload="sql") == 9
    assert value(registry, "hvd_predictor_version", workload="chat") == 5
    # the poller's next rounds load the same versions afresh (new objects holding arrays), then a new one
    first.set_workload_gates({"sql": (random_survival_gate(), 9)})
    assert value(registry, "hvd_predictor_version", workload="sql") == 9
    first.set_workload_gates({"sql": (random_survival_gate(), 11)})
    assert value(registry, "hvd_predictor_version", workload="sql") == 11


def test_events_the_writer_drops_in_an_outage_count_as_dropped(tmp_path):
    """The writer's buffer overflows while the database refuses writes (here: no tables): what it
    drops is counted with the queue's drops."""
    from controller.services.event_writer import EventWriter
    from storage.engine import make_engine

    registry = CollectorRegistry()
    metrics = HvdMetrics(registry)
    queue = EventQueue(maxsize=100, observer=metrics)
    engine = make_engine(f"sqlite:///{tmp_path / 'no-tables.db'}")
    writer = EventWriter(engine, queue, max_buffered=3, spill_dir=tmp_path)
    writer.on_dropped = metrics.writer_dropped
    for e in EVENTS[:7]:
        assert queue.put(e)
    writer.round()  # drains 7 into a buffer of 3, then fails to write
    assert writer.dropped == 4 and writer.failures == 1
    assert value(registry, "hvd_events_dropped_total") == 4 and value(registry, "hvd_event_queue_depth") == 0
    engine.dispose()


STEPS = [StepTiming.of(1_700_000_000.0, 4, 12, 3, target=0.05, hvd=0.0004, drafter=0.012, rest=0.003),
         StepTiming.of(1_700_000_000.2, 4, 4, 0, target=0.02, hvd=0.0002, drafter=0.0, rest=0.001)]
# per part: (count, sum, cumulative count at one bucket's upper bound)
STEP_EXPECTED = {"target": (2, 0.07, ("0.02", 1)), "hvd": (2, 0.0006, ("0.00025", 1)),
                 "drafter": (2, 0.012, ("0.0001", 1)), "rest": (2, 0.004, ("0.001", 1)),
                 "total": (2, 0.0866, ("0.03", 1))}  # totals 65.4 ms and 21.2 ms


def assert_step_seconds(get) -> None:
    for part, (count, total, (le, below)) in STEP_EXPECTED.items():
        decode = {"part": part, "phase": "decode"}
        assert get("hvd_step_seconds_count", decode) == count, part
        assert get("hvd_step_seconds_sum", decode) == pytest.approx(total), part
        assert get("hvd_step_seconds_bucket", {**decode, "le": le}) == below, part
        assert get("hvd_step_seconds_bucket", {**decode, "le": "2.0"}) == count, part


def test_step_seconds_observes_every_part_and_the_total_of_every_step(caplog):
    registry = CollectorRegistry()
    metrics = HvdMetrics(registry)
    samples = {(s.labels["part"], s.labels["phase"]) for m in registry.collect() for s in m.samples
               if m.name == "hvd_step_seconds"}
    # every series exists from the start, at 0
    assert samples == {(p, ph) for p in ("target", "hvd", "drafter", "rest", "total") for ph in ("decode", "prefill")}
    for t in STEPS:
        metrics.step_seconds(t, decode=True)
    prompt = StepTiming.of(1_700_000_000.4, 2, 900, 0, target=0.8, hvd=0.0003, drafter=0.0, rest=0.01)
    metrics.step_seconds(prompt, decode=False)  # a step with a prompt chunk: apart from the decode steps
    assert_step_seconds(registry.get_sample_value)
    prefill = {"part": "target", "phase": "prefill"}
    assert registry.get_sample_value("hvd_step_seconds_count", prefill) == 1
    assert registry.get_sample_value("hvd_step_seconds_sum", prefill) == pytest.approx(0.8)
    # the drafter did not run in the second step: it still counts, at 0 (sum / count = its cost per step)
    assert registry.get_sample_value("hvd_step_seconds_bucket", {"part": "drafter", "phase": "decode", "le": "0.015"}) == 2
    metrics.step_seconds(None, decode=True)  # a broken timing is logged once, never raised into the decode path
    metrics.step_seconds(None, decode=True)
    assert sum("HVD metrics: timing a step failed" in r.getMessage() for r in caplog.records) == 1
    assert_step_seconds(registry.get_sample_value)


def test_step_seconds_from_two_processes_meet_in_the_multiprocess_folder(tmp_path):
    """vLLM's worker observes, its API server answers /metrics: each process writes its own files
    under PROMETHEUS_MULTIPROC_DIR and the collector adds them up. One timing per process here."""
    import os
    import subprocess
    import sys

    from prometheus_client import multiprocess

    script = ("import sys\n"
              "from prometheus_client import CollectorRegistry\n"
              "from controller.core.metrics import HvdMetrics\n"
              "from controller.core.step_costs import StepTiming\n"
              "target, hvd, drafter, rest = map(float, sys.argv[1:])\n"
              "HvdMetrics(CollectorRegistry()).step_seconds(StepTiming.of(1_700_000_000.0, 4, 4, 0, "
              "target=target, hvd=hvd, drafter=drafter, rest=rest), decode=True)\n")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for t in STEPS:
        subprocess.run([sys.executable, "-c", script, *map(repr, t.parts)], env=env, check=True, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert len(list(tmp_path.glob("histogram_*.db"))) == 2  # one file per process
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    assert_step_seconds(registry.get_sample_value)


def test_a_perfect_predictor_keeps_every_promise_and_a_gate_is_held_to_its_own(records, tokenizer):
    """hvd_promised_tokens: what the plan expected of the verified tokens. A runtime planning from the
    true accepted lengths (the replay engine's perfect predictor) is promised exactly what its cache
    drafts then accept; a gate's promises are counted as the runtime tallies them, one per verified draft."""
    drafter = drafter_profiles()["eagle3-1.75"]
    some = [r for r in records if r.workload in ("sql", "chat", "coding")][:6]

    def serve(oracle: str | None) -> tuple[Runtime, CollectorRegistry]:
        registry = CollectorRegistry()
        runtime = Runtime(random_survival_gate(), token_classes(tokenizer), DecisionConfig(), version_id=1,
                          metrics=HvdMetrics.shared(registry))
        run_replay(runtime, some, tokenizer, drafter, batch_size=3, oracle=oracle)
        return runtime, registry

    def total(registry: CollectorRegistry, name: str, drafter: str) -> float:
        return sum(value(registry, name, workload=w, tenant="default", drafter=drafter) for w in WORKLOADS)

    perfect, registry = serve("predictor")
    kept = total(registry, "hvd_accepted_tokens_total", "cache")
    assert kept > 20 and total(registry, "hvd_promised_tokens_total", "cache") == pytest.approx(kept, abs=1e-6)
    gated, registry = serve(None)
    promised = total(registry, "hvd_promised_tokens_total", "cache") + total(registry, "hvd_promised_tokens_total", "model")
    assert promised == pytest.approx(gated.stats.promised) and promised > 0
    assert gated.stats.promised_accepted == gated.stats.verified_accepted  # every verified draft was planned
    assert gated.stats.promised != pytest.approx(gated.stats.promised_accepted, rel=0.01)  # a random gate misjudges


def _promise_sums(runtime: Runtime) -> tuple[float, int, float, int]:
    """(cache promised, cache kept, model promised, model kept) over the runtime's events, as the
    statistics store them (every bucket summed)."""
    deltas = aggregate(runtime.events.get_batch(1 << 30)).values()
    return (sum(d.cache_promised_milli for d in deltas) / 1000, sum(d.cache_promise_kept for d in deltas),
            sum(d.model_promised_milli for d in deltas) / 1000, sum(d.model_promise_kept for d in deltas))


def test_the_events_carry_the_plans_promises_into_the_statistics(records, tokenizer):
    """Each verified draft's event carries what the plan promised of it, so the stored statistics hold
    the runtime's tally (to the thousandth of a token they are kept in): a perfect predictor's cache
    promises equal what its drafts accepted; a gate's, its own count, model drafts included."""
    drafter = drafter_profiles()["eagle3-1.75"]
    some = [r for r in records if r.workload in ("sql", "chat", "coding")][:6]

    def serve(oracle: str | None) -> Runtime:
        runtime = Runtime(random_survival_gate(), token_classes(tokenizer), DecisionConfig(), version_id=1)
        run_replay(runtime, some, tokenizer, drafter, batch_size=3, oracle=oracle)
        return runtime

    perfect = serve("predictor")
    cache_promised, cache_kept, model_promised, _ = _promise_sums(perfect)
    assert cache_kept > 20 and cache_promised == pytest.approx(cache_kept, abs=0.05)
    gated = serve(None)
    cache_promised, cache_kept, model_promised, model_kept = _promise_sums(gated)
    assert model_kept > 0 and cache_kept > 0
    # The runtime counts what the engine accepted (tokens emitted - 1), the events what the output
    # realised: they part only where a request's last step ends inside the verified tokens (no bonus
    # token), at most once a request.
    assert 0 <= cache_kept + model_kept - gated.stats.promised_accepted <= len(some)
    assert cache_promised + model_promised == pytest.approx(gated.stats.promised, abs=0.001 * gated.stats.verified_drafts)


def test_the_live_cost_fit_is_published_term_by_term(caplog):
    """What the allocator prices a step with, from a real fit of synthetic steps (the line known)."""
    from predictor.decision.live_cost import LiveCostModel, StepSample
    from predictor.decision.profiles import cost_profiles

    registry = CollectorRegistry()
    metrics = HvdMetrics(registry)
    assert registry.get_sample_value("hvd_live_cost_ms", {"term": "base"}) is None  # no fit yet: absent
    live = LiveCostModel(cost_profiles()["cpu-smollm2"], min_samples=50)
    rng = np.random.default_rng(0)
    for _ in range(300):
        b, q = int(rng.integers(1, 5)), 0
        q = b + int(rng.integers(0, 8 * b + 1))
        k = int(rng.integers(0, 4))
        live.observe(StepSample(b, q, k, (20.0 + 3.0 * b + 1.5 * q + (2.0 if k else 0.0) + 1.0 * k) / 1000))
    fit = live.current
    metrics.live_cost_fit(fit.coefficients, fit.floor_ms_per_token, fit.samples)
    got = {t: registry.get_sample_value("hvd_live_cost_ms", {"term": t}) for t in LIVE_COST_TERMS}
    assert got == dict(zip(LIVE_COST_TERMS, (*fit.coefficients, fit.floor_ms_per_token)))
    # the line's identified terms are the steps' (the drafter's split leans on the prior)
    assert (got["base"], got["batch"], got["query_token"]) == pytest.approx((20.0, 3.0, 1.5), abs=0.05)
    assert registry.get_sample_value("hvd_live_cost_steps") == fit.samples > 0
    metrics.live_cost_fit((1.0, 2.0), 0.0, 5)  # a malformed fit: logged, never raised into the decode path
    assert any("publishing the live cost fit failed" in r.getMessage() for r in caplog.records)
