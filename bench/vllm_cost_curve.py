"""CPU cost of one vLLM engine step against batch size and query tokens per request.

The measurement and the fit are `hvd profile`'s (controller/engines/vllm_profiler.py: forced drafts
of n - 1 tokens through a custom_class proposer, `llm.llm_engine.step()` timed per batch size B and
n, the robust line t = a + b B + c B n of predictor/decision/live_cost.py); this script prints them
without storing a profile, in bf16 by default, as the bundled `cpu-smollm2` profile was measured:

    python bench/vllm_cost_curve.py --model var/models/smollm2-135m-bf16 [--json var/cost_curve.json] [--no-preload]

--dtype both: which dtype this CPU decodes faster in, the question `hvd serve`'s default answers from
/proc/cpuinfo (vllm_engine.cpu_dtype): the bundled model's bf16 and fp32 folders measured alternately
(--reps times, the order rotated), the median step time per (batch, n) of each with its min-max,
and the fp32/bf16 ratio:

    python bench/vllm_cost_curve.py --dtype both --batches 1,8 --query 1,4,16 --reps 3

The engine runs as `hvd serve` runs it: tcmalloc and Intel OpenMP in LD_PRELOAD, unless --no-preload.
`hvd profile --name NAME` measures the same way and stores the result as a cost profile.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import rotations, spread  # noqa: E402

from controller.engines import vllm_engine as ve  # noqa: E402
from controller.engines.vllm_profiler import (  # noqa: E402
    DEFAULT_CTX,
    DEFAULT_STEPS,
    WARMUP_STEPS,
    MeasurePlan,
    batch_line,
    measure_in_subprocess,
    measured_profile,
    median_ms,
)
from predictor.decision.profiles import cost_profiles  # noqa: E402

PRIOR = "cpu-smollm2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ve.MODEL_BF16))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "both"],
                    help="both: the bundled bf16 and fp32 models compared (--model is not used)")
    ap.add_argument("--reps", type=int, default=3, help="--dtype both: alternating measurements of each (default 3)")
    ap.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="prompt tokens per request")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--query", "--ns", dest="query", default="1,2,4,8,16", help="query tokens per request n")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-preload", action="store_true", help="without tcmalloc + Intel OpenMP in LD_PRELOAD")
    args = ap.parse_args()
    plan = MeasurePlan(args.model, "bfloat16" if args.dtype == "both" else args.dtype,
                       batches=tuple(int(x) for x in args.batches.split(",")),
                       query=tuple(int(x) for x in args.query.split(",")), steps=args.steps, warmup=args.warmup,
                       ctx=args.ctx).check()
    if args.dtype == "both":
        return compare_dtypes(plan, args.reps, not args.no_preload, args.json)
    m = measure_in_subprocess(plan, preload=not args.no_preload)
    profile, fit = measured_profile(m, "cost-curve", cost_profiles()[PRIOR])
    for batch in plan.batches:
        base, slope = batch_line(fit, batch)
        print(f"B={batch}: t(n) = {base:.1f} ms + {slope:.2f} ms * n (per request query tokens)", flush=True)
    print(f"{fit.formula()}, median absolute percentage error "
          f"{100 * fit.median_relative_error:.1f}% over {len(m.steps)} steps", flush=True)
    if args.json:
        medians = median_ms(m.steps)
        with open(args.json, "w") as fh:
            json.dump({"plan": asdict(plan), "vllm": m.vllm_version, "cpu": m.cpu, "date": m.date,
                       "medians_ms": [{"batch": bb, "n": n, "ms": round(ms, 2)} for (bb, n), ms in medians.items()],
                       "fit": {**dict(zip(("a_ms", "b_ms_per_request", "c_ms_per_query_token"), fit.coefficients[:3])),
                               "floor_ms_per_query_token": fit.floor_ms_per_token},
                       "median_relative_error": fit.median_relative_error,
                       "profile_description": profile.description}, fh, indent=2)
    return 0


def compare_dtypes(plan: MeasurePlan, reps: int, preload: bool, out: str) -> int:
    """Both bundled dtypes, alternately, `reps` times each: median step ms per (batch, n) and the ratio."""
    runs: dict[str, list[dict[tuple[int, int], float]]] = {"bfloat16": [], "float32": []}
    for order in rotations(list(runs), reps):
        for dtype in order:
            m = measure_in_subprocess(replace(plan, model=str(ve.model_folder(dtype)), dtype=dtype), preload=preload)
            runs[dtype].append(median_ms(m.steps))
    print(f"step time, median [min-max] over {reps} alternating measurements of {plan.steps} steps each, "
          f"ctx {plan.ctx}, {ve.cpu_dtype()[1]}:")
    print(f"  {'batch':>5s} {'n':>3s} {'bfloat16 ms':>22s} {'float32 ms':>22s} {'fp32/bf16':>9s}")
    table, ratios = [], []
    for key in runs["bfloat16"][0]:
        bf, fp = (spread(r[key] for r in runs[d] if key in r) for d in ("bfloat16", "float32"))
        ratios.append(fp.median / bf.median)
        table.append({"batch": key[0], "n": key[1], "bfloat16_ms": asdict(bf), "float32_ms": asdict(fp),
                      "ratio": round(ratios[-1], 3)})
        print(f"  {key[0]:5d} {key[1]:3d} {bf.fmt():>22s} {fp.fmt():>22s} {ratios[-1]:9.2f}")
    faster = "bfloat16" if min(ratios) > 1.0 else "float32" if max(ratios) < 1.0 else "neither everywhere"
    print(f"faster on this CPU: {faster} (fp32/bf16 from {min(ratios):.2f} to {max(ratios):.2f}); hvd serve's "
          f"default here: {ve.cpu_dtype()[0]}")
    if out:
        with open(out, "w") as fh:
            json.dump({"plan": asdict(plan), "table": table, "faster": faster, "default": ve.cpu_dtype()[0]}, fh,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
