"""`make bench`: replay throughput and the gate's cost relative to the suffix lookup it gates.

Ratios are measured side by side in one run (interleaved repeats, medians), because absolute times
on these shared machines move with whatever else runs. Single-threaded on purpose: the goals are
stated per core.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from predictor.cache_drafter import CacheDrafter  # noqa: E402
from predictor.features import NUM_FEATURES, schema_hash  # noqa: E402
from predictor.mlp import MLP, GatePredictor  # noqa: E402
from predictor.replay import replay  # noqa: E402
from predictor.tokens import TraceTokenizer  # noqa: E402
from predictor.traces import bundled_traces_path, load_traces  # noqa: E402

REPLAY_GOAL = 20_000
BATCHES = (1, 64, 256)


def subset(records, per_source: int):
    seen: dict[str, int] = {}
    out = []
    for r in records:
        if seen.get(r.source, 0) < per_source:
            seen[r.source] = seen.get(r.source, 0) + 1
            out.append(r)
    return out


def bench_replay(records, tokenizer) -> None:
    tokenizer.classes  # built once per process; not part of the per-position cost
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        result = replay(records, tokenizer)
        rates.append(result.rows / (time.perf_counter() - start))
    rate = statistics.median(rates)
    print(f"replay: {len(records)} traces, {result.rows} labelled positions, "
          f"{rate:,.0f} positions/s on one core (median of 3; goal >= {REPLAY_GOAL:,}: "
          f"{'met' if rate >= REPLAY_GOAL else 'NOT met'})")


def live_requests(records, tokenizer, count: int):
    """A drafter holding `count` active requests part-way through real traces (with their outputs,
    so each timed step can append the next realised token, as an engine step does)."""
    drafter = CacheDrafter()
    contexts = []
    for i, r in enumerate(records[: count + 50]):
        prompt, out = tokenizer.encode_context(r), tokenizer.encode_output(r.output)
        drafter.start(i, prompt)
        half = len(out) // 2
        drafter.extend(i, out[:half])
        if i < 50:  # the first ones finish, so the global tree holds earlier responses
            drafter.extend(i, out[half:])
            drafter.stop(i)
        else:
            contexts.append((i, np.concatenate([prompt, out]).astype(np.int32), len(prompt) + half))
    return drafter, contexts


def bench_gate(records, tokenizer) -> None:
    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
    drafter, contexts = live_requests(records, tokenizer, max(BATCHES))
    rng = np.random.default_rng(0)
    print(f"gate vs the suffix cache's per-step work (append the sampled token + draft from both trees) (MLP {tuple(w.shape[1] for w in gate.weights[:-1])}, numpy, float32):")
    for batch in BATCHES:
        reqs = contexts[:batch]
        x = rng.normal(size=(batch, NUM_FEATURES)).astype(np.float32)
        lookup, predict = [], []
        for step in range(30):
            t0 = time.perf_counter()
            for req_id, seq, at in reqs:  # one engine step: append the sampled token, then draft
                end = min(at + step + 1, len(seq))
                drafter.extend(req_id, seq[end - 1 : end])
                drafter.draft(req_id, seq[:end])
            t1 = time.perf_counter()
            gate.predict(x)
            t2 = time.perf_counter()
            lookup.append(t1 - t0)
            predict.append(t2 - t1)
        lk, pr = statistics.median(lookup), statistics.median(predict)
        print(f"  batch {batch:4d}: cache {lk * 1e6:9.1f} us  gate {pr * 1e6:8.1f} us  "
              f"gate/lookup {pr / lk:5.2f} (goal < 1: {'met' if pr < lk else 'NOT met'})")


def main() -> None:
    torch.set_num_threads(1)
    records, _ = load_traces([bundled_traces_path()])
    tokenizer = TraceTokenizer()
    bench_replay(subset(records, 40), tokenizer)
    bench_gate(subset(records, 60), tokenizer)


if __name__ == "__main__":
    main()
