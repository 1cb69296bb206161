"""What the live cost fit costs a replica: the time of one refit of a full window, with the compute
floor (HVD_LIVE_COST_FLOOR=1) and without (the default), on steps that lie on a line and on steps
with a knee, and what that comes to per decode step (a refit every `refit_every` steps).

The plugin refits on the decode path, once per 200 steps (controller/engines/vllm_hybrid.py), so a
refit delays one step by its time. Each case feeds --refits windows of seeded synthetic steps
(batch 1 to 8, 1 to 25 query tokens a request, the drafter on 30% of steps, 3% lognormal noise and
5% pauses x3 to x10) and times `LiveCostModel.fit` with time.perf_counter, interleaving the cases.
Docs: docs/design/allocator.md, "The live cost model".

    python bench/live_cost_fit.py [--refits 100] [--window 2000]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.decision.live_cost import LiveCostModel, StepSample  # noqa: E402
from predictor.decision.profiles import cost_profiles  # noqa: E402

CASES = {"line": 0.0, "knee": 3.05}  # the steps' floor in ms per query token (0: none)


def steps(rng: np.random.Generator, n: int, floor: float) -> list[StepSample]:
    batch = rng.integers(1, 9, n)
    query = batch * rng.integers(1, 26, n)
    k = np.where(rng.random(n) < 0.3, rng.integers(1, 4, n), 0)
    target = np.maximum(28.8 + 2.0 * batch + 0.2 * query, floor * query)
    ms = (target + np.where(k > 0, 1.6 + 1.75 * k, 0.0)) * np.exp(rng.normal(0.0, 0.03, n))
    ms = np.where(rng.random(n) < 0.05, ms * rng.uniform(3.0, 10.0, n), ms)
    return [StepSample(int(b), int(q), int(kk), float(t) / 1000.0) for b, q, kk, t in zip(batch, query, k, ms)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refits", type=int, default=100)
    parser.add_argument("--window", type=int, default=2000)
    parser.add_argument("--refit-every", type=int, default=200)
    args = parser.parse_args()
    if args.refits < 3 or args.window < 200 or args.refit_every < 1:
        parser.error("--refits must be >= 3, --window >= 200, --refit-every >= 1")
    prior = cost_profiles()["cpu-smollm2"]
    rng = np.random.default_rng(0)
    models = {(case, floor): LiveCostModel(prior, window=args.window, refit_every=args.window, min_samples=args.window,
                                           floor=floor)
              for case in CASES for floor in (True, False)}
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in models}
    found: dict[tuple[str, bool], list[float]] = {key: [] for key in models}
    for _ in range(args.refits):
        for key, model in models.items():  # interleaved: the machine's drift weighs on every case alike
            for s in steps(rng, args.window, CASES[key[0]]):
                model.observe(s)
            start = time.perf_counter()
            fit = model.fit()
            times[key].append(1000.0 * (time.perf_counter() - start))
            found[key].append(fit.floor_ms_per_token)
    print(f"live cost fit: {args.refits} refits of {args.window}-step windows per case, a refit every "
          f"{args.refit_every} steps; ms a refit, median [90th percentile, max]:")
    for (case, floor), ts in times.items():
        ts = sorted(ts)
        p90 = ts[int(0.9 * (len(ts) - 1))]
        floors = found[(case, floor)]
        print(f"  steps {case:4s} floor {'on ' if floor else 'off'}: {statistics.median(ts):.2f} ms [{p90:.2f}, "
              f"{ts[-1]:.2f}] = {1000.0 * statistics.median(ts) / args.refit_every:.1f} us a step amortised; "
              f"floor found in {sum(f > 0 for f in floors)}/{len(floors)} fits"
              + (f" (median {statistics.median([f for f in floors if f > 0]):.3f} ms a query token, true "
                 f"{CASES[case]})" if any(f > 0 for f in floors) else ""), flush=True)


if __name__ == "__main__":
    main()
