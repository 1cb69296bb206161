"""What the live cost fit costs a replica: the time of one refit of a full window, with the compute
floor (HVD_LIVE_COST_FLOOR=1) and without (the default), on steps that lie on a line and on steps
with a knee, and what of it a decode step still pays.

The plugin refits once per 200 decode steps (controller/engines/vllm_hybrid.py) on its own thread
(controller/services/live_cost_fitter.py): the step that makes a refit due only copies the window
(`LiveCostModel.take_window`) and hands it over; the fit (`fit_window`) runs beside the engine. Each
case feeds --refits windows of seeded synthetic steps (batch 1 to 8, 1 to 25 query tokens a request,
the drafter on 30% of steps, 3% lognormal noise and 5% pauses x3 to x10) and times both parts with
time.perf_counter, interleaving the cases. Docs: docs/design/allocator.md, "The live cost model".

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

from predictor.decision.live_cost import LiveCostModel, StepSample, fit_window  # noqa: E402
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
    handover: dict[tuple[str, bool], list[float]] = {key: [] for key in models}
    found: dict[tuple[str, bool], list[float]] = {key: [] for key in models}
    for _ in range(args.refits):
        for key, model in models.items():  # interleaved: the machine's drift weighs on every case alike
            for s in steps(rng, args.window, CASES[key[0]]):
                model.record(s)
            start = time.perf_counter()
            window = model.take_window()  # what the decode step does
            mid = time.perf_counter()
            fit = fit_window(window)  # what the fitter's thread does
            end = time.perf_counter()
            handover[key].append(1e6 * (mid - start))
            times[key].append(1000.0 * (end - mid))
            found[key].append(fit.floor_ms_per_token)
    print(f"live cost fit: {args.refits} refits of {args.window}-step windows per case, a refit every "
          f"{args.refit_every} steps; the fit on the fitter's thread, ms, and the window's hand-over in the "
          "decode step, us; median [90th percentile, max]:")
    for (case, floor), ts in times.items():
        ts, hs = sorted(ts), sorted(handover[(case, floor)])
        floors = found[(case, floor)]
        print(f"  steps {case:4s} floor {'on ' if floor else 'off'}: fit {statistics.median(ts):.2f} ms "
              f"[{_p90(ts):.2f}, {ts[-1]:.2f}] ({1000.0 * statistics.median(ts) / args.refit_every:.1f} us of CPU "
              f"a step amortised); the step's hand-over {statistics.median(hs):.1f} us [{_p90(hs):.1f}, {hs[-1]:.1f}]; "
              f"floor found in {sum(f > 0 for f in floors)}/{len(floors)} fits"
              + (f" (median {statistics.median([f for f in floors if f > 0]):.3f} ms a query token, true "
                 f"{CASES[case]})" if any(f > 0 for f in floors) else ""), flush=True)


def _p90(sorted_values: list[float]) -> float:
    return sorted_values[int(0.9 * (len(sorted_values) - 1))]


if __name__ == "__main__":
    main()
