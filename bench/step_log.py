"""What HVD's served steps cost against what they verified and ran, from an HVD_STEP_LOG file: the
decode steps' total ms by query tokens, with and without the model drafter, and the line the live
cost fit makes of the same steps (the allocator's price) against each bin's median.

Why: the allocator prices a step with that line; where a bin's median sits well off it, the line
lacks a term, and the plan trades draft tokens against steps at the wrong price.

    HVD_STEP_LOG=var/steps.jsonl hvd serve --engine vllm ...   (or bench/vllm_methods.py --server --methods hvd)
    python bench/step_log.py var/steps.jsonl [--batch 1] [--profile cpu-smollm2]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from predictor.decision.live_cost import LiveCostModel, LiveFit, StepSample
from predictor.decision.profiles import CostProfile, cost_profiles

BINS = ((1, 1), (2, 4), (5, 7), (8, 10), (11, 14), (15, 19), (20, 26), (27, 40), (41, 10_000))


def read_steps(path: Path) -> list[dict]:
    """The log's decode steps; a line that is not a step is named and refused."""
    steps = []
    for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            line = json.loads(text)
            if line["phase"] == "decode":
                steps.append({k: line[k] for k in ("batch", "query_tokens", "model_k", "drafter_ms", "total_ms")})
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{n}: not a step line of HVD_STEP_LOG ({exc})") from None
    return steps


def fit_steps(steps: list[dict], prior: CostProfile) -> LiveFit:
    """The live cost fit of every step at once, with the prior the server had."""
    live = LiveCostModel(prior, window=len(steps), min_samples=1, refit_every=len(steps))
    for s in steps:
        live.record(StepSample(s["batch"], s["query_tokens"], s["model_k"], s["total_ms"] / 1000.0))
    return live.fit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--batch", type=int, default=1, help="the batch size whose steps are binned (default 1)")
    ap.add_argument("--profile", default="cpu-smollm2", help="the live fit's prior, as served (HVD_COST_PROFILE)")
    args = ap.parse_args()
    steps = read_steps(args.log)
    if not steps:
        raise SystemExit(f"{args.log}: no decode steps")
    fit = fit_steps(steps, cost_profiles()[args.profile])
    print(f"{len(steps)} decode steps; the live fit of them all: {fit.formula()}, median error "
          f"{100 * fit.median_relative_error:.1f}%")
    mine = [s for s in steps if s["batch"] == args.batch]
    print(f"batch {args.batch}: {len(mine)} steps; total ms by query tokens, median [n] and the fit's price there:")
    for drafter, what in ((False, "without the model drafter"), (True, "with it (its k > 0)")):
        cells = []
        for lo, hi in BINS:
            cell = [s for s in mine if lo <= s["query_tokens"] <= hi and (s["model_k"] > 0) == drafter]
            if cell:
                q = statistics.median(s["query_tokens"] for s in cell)
                k = statistics.median(s["model_k"] for s in cell)
                price = float(fit.predict_ms(args.batch, q, k))
                cells.append(f"{lo}-{hi}: {statistics.median(s['total_ms'] for s in cell):.1f} [{len(cell)}] "
                             f"(fit {price:.1f})")
        print(f"  {what}: " + "; ".join(cells))
    called = [s["drafter_ms"] for s in mine if s["model_k"] > 0]
    if called:
        print(f"  the drafter part of the steps that ran it: median {statistics.median(called):.2f} ms")


if __name__ == "__main__":
    main()
