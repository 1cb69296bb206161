"""What reading the engine's signals costs per step (controller/engines/vllm_signals.py).

A step at batch B hands the sampler's logits (one row per verified position, SmolLM2's 49,152-token
vocabulary, float32) to `step_signals`: serving reads each request's last emitted row (B rows), the
recorder every emitted row. Timed here: `step_signals` as serving calls it and as the recorder does
(4 tokens emitted per request), at batch 1, 8 and 32, in torch's thread setting of vLLM's CPU
worker (one thread per core it binds; here `--threads`, default 1 as vLLM sets it on these 2
cores). Each figure is the median over `--reps` interleaved repetitions of the median of 200
calls, with the spread (min-max) over repetitions. Target (issue 30): at most 0.1 ms per step at
batch 8.

    python bench/engine_signals_cost.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from controller.engines.vllm_signals import step_signals  # noqa: E402

VOCAB = 49_152
DRAFT = 3  # draft tokens verified per request; every request emits DRAFT + 1


def case(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=(batch * (DRAFT + 1), VOCAB)).astype(np.float32)
    peaks = rng.integers(0, VOCAB, size=len(logits))
    logits[np.arange(len(logits)), peaks] += 12.0
    sampled = torch.from_numpy(peaks.reshape(batch, DRAFT + 1).astype(np.int64))
    return torch.from_numpy(logits), sampled, [DRAFT] * batch


def time_call(fn, calls: int = 200) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    cases = {b: case(b) for b in batches}
    modes = {"serving (last row)": False, "recording (every row)": True}
    results: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.reps):
        for b in batches:
            logits, sampled, drafts = cases[b]
            for name, every in modes.items():
                results.setdefault((b, name), []).append(
                    time_call(lambda: step_signals(logits, sampled, drafts, every_token=every)))
    print(f"engine signals per step: float32 logits of {VOCAB} tokens, {DRAFT} draft tokens verified and "
          f"{DRAFT + 1} emitted per request, torch threads {args.threads}; median [min-max] of {args.reps} repetitions")
    for b in batches:
        for name, every in modes.items():
            ms = results[(b, name)]
            rows = b * (DRAFT + 1) if every else b
            print(f"  batch {b:>3} {name:<22} {rows:>4} rows  {statistics.median(ms):7.3f} ms [{min(ms):.3f}-{max(ms):.3f}]")
    at8 = statistics.median(results[(8, "serving (last row)")]) if 8 in batches else None
    if at8 is not None:
        print(f"target <= 0.1 ms per step at batch 8 (serving): {at8:.3f} ms -> {'met' if at8 <= 0.1 else 'NOT met'}")


if __name__ == "__main__":
    main()
