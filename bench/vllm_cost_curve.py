"""CPU cost of one vLLM engine step against batch size and query tokens per request.

The measurement and the fit are `hvd profile`'s (controller/engines/vllm_profiler.py: forced drafts
of n - 1 tokens through a custom_class proposer, `llm.llm_engine.step()` timed per batch size B and
n, the robust line t = a + b B + c B n of predictor/decision/live_cost.py); this script prints them
without storing a profile, in bf16 by default, as the bundled `cpu-smollm2` profile was measured:

    python bench/vllm_cost_curve.py --model var/models/smollm2-135m-bf16 [--json var/cost_curve.json] [--no-preload]

The engine runs as `hvd serve` runs it: tcmalloc and Intel OpenMP in LD_PRELOAD, unless --no-preload.
`hvd profile --name NAME` measures the same way and stores the result as a cost profile.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from controller.engines import vllm_engine as ve
from controller.engines.vllm_profiler import (
    DEFAULT_CTX,
    DEFAULT_STEPS,
    WARMUP_STEPS,
    MeasurePlan,
    batch_line,
    measure_in_subprocess,
    measured_profile,
    median_ms,
)
from predictor.decision.profiles import cost_profiles

PRIOR = "cpu-smollm2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ve.MODEL_BF16))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--query", "--ns", dest="query", default="1,2,4,8,16", help="query tokens per request n")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-preload", action="store_true", help="without tcmalloc + Intel OpenMP in LD_PRELOAD")
    args = ap.parse_args()
    plan = MeasurePlan(args.model, args.dtype, batches=tuple(int(x) for x in args.batches.split(",")),
                       query=tuple(int(x) for x in args.query.split(",")), steps=args.steps, warmup=args.warmup,
                       ctx=args.ctx).check()
    m = measure_in_subprocess(plan, preload=not args.no_preload)
    profile, fit = measured_profile(m, "cost-curve", cost_profiles()[PRIOR])
    a, b, c, _, _ = fit.coefficients
    for batch in plan.batches:
        base, slope = batch_line(fit, batch)
        print(f"B={batch}: t(n) = {base:.1f} ms + {slope:.2f} ms * n (per request query tokens)", flush=True)
    print(f"t = {a:.2f} + {b:.2f} B + {c:.3f} Q ms (Q = B n query tokens), median absolute percentage error "
          f"{100 * fit.median_relative_error:.1f}% over {len(m.steps)} steps", flush=True)
    if args.json:
        medians = median_ms(m.steps)
        with open(args.json, "w") as fh:
            json.dump({"plan": asdict(plan), "vllm": m.vllm_version, "cpu": m.cpu, "date": m.date,
                       "medians_ms": [{"batch": bb, "n": n, "ms": round(ms, 2)} for (bb, n), ms in medians.items()],
                       "fit": dict(zip(("a_ms", "b_ms_per_request", "c_ms_per_query_token"), fit.coefficients[:3])),
                       "median_relative_error": fit.median_relative_error,
                       "profile_description": profile.description}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
