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
from predictor.trace_replay import replay  # noqa: E402
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


class TimedDrafter(CacheDrafter):
    """The cache drafter, timing its own lookups (append + draft) into a shared counter, so the
    runtime's overhead is the rest of the step."""

    seconds = 0.0

    def extend(self, req_id, token_ids) -> None:
        t0 = time.perf_counter()
        super().extend(req_id, token_ids)
        TimedDrafter.seconds += time.perf_counter() - t0

    def draft(self, req_id, context, max_spec_tokens=None):
        t0 = time.perf_counter()
        d = super().draft(req_id, context, max_spec_tokens)
        TimedDrafter.seconds += time.perf_counter() - t0
        return d

    def start(self, req_id, prompt_token_ids) -> None:
        t0 = time.perf_counter()
        super().start(req_id, prompt_token_ids)
        TimedDrafter.seconds += time.perf_counter() - t0

    def stop(self, req_id) -> None:
        t0 = time.perf_counter()
        super().stop(req_id)
        TimedDrafter.seconds += time.perf_counter() - t0


def bench_runtime(records, tokenizer) -> None:
    """Runtime.step driven by the replay engine at batch 1, 32 and 256: its overhead (features,
    prediction, decision, hindsight bookkeeping) as a ratio to the suffix lookups of the same steps."""
    from controller.core.decision import DecisionConfig
    from controller.engines.trace_engine import run_replay
    from controller.core.runtime import Runtime
    from predictor.profiles import drafter_profiles

    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
    print("runtime overhead per step vs the suffix lookups of the same step (goal <= 0.5):")
    for batch in (1, 32, 256):
        runtime = Runtime(gate, tokenizer.classes, DecisionConfig(fixed_tau=1.0), drafter_factory=TimedDrafter)
        TimedDrafter.seconds = 0.0
        step_seconds, steps = [0.0], [0]
        inner = runtime.step

        def timed_step(inputs, finished=(), inner=inner):
            t0 = time.perf_counter()
            plan = inner(inputs, finished)
            step_seconds[0] += time.perf_counter() - t0
            steps[0] += 1
            return plan

        inner_finish = runtime.finish

        def timed_finish(req_id, last_tokens=(), inner_finish=inner_finish):
            t0 = time.perf_counter()
            inner_finish(req_id, last_tokens)
            step_seconds[0] += time.perf_counter() - t0

        runtime.step, runtime.finish = timed_step, timed_finish
        limit = 400 if batch == 1 else 60
        run_replay(runtime, records[: max(batch * 2, 40)], tokenizer, drafter_profiles()["eagle3-1.75"],
                   batch_size=batch, stop=lambda: steps[0] >= limit)
        lookups = TimedDrafter.seconds
        overhead = step_seconds[0] - lookups
        print(f"  batch {batch:4d}: {steps[0]} steps, lookups {1e6 * lookups / steps[0]:8.1f} us/step, "
              f"overhead {1e6 * overhead / steps[0]:8.1f} us/step, ratio {overhead / lookups:5.2f} "
              f"({'met' if overhead <= 0.5 * lookups else 'NOT met'})")


def bench_learner(records, tokenizer) -> None:
    """Labelled events per second through the online learner (shadow scoring + updates + drift)."""
    from predictor.online import Batch, LearnerConfig, OnlineLearner

    result = replay(records, tokenizer)
    keep = result.draft_len > 0
    batch = Batch(result.features[keep], result.label[keep].astype(np.float32), result.draft_len[keep].astype(np.int64),
                  result.row_workload()[keep].astype(np.int64), np.full(int(keep.sum()), 0.7))
    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())

    def goodput(label, k, cache, w):
        return np.where(cache, label + 1.0, 1.75), np.where(cache, 6.5 + 0.03 * (1 + k), 7.8)

    learner = OnlineLearner(gate, goodput, LearnerConfig())
    start = time.perf_counter()
    for i in range(0, len(batch.label), 2000):
        s = slice(i, i + 2000)
        learner.learn_many(Batch(batch.features[s], batch.label[s], batch.draft_len[s], batch.workload[s], batch.tau[s]))
    rate = len(batch.label) / (time.perf_counter() - start)
    print(f"online learner: {len(batch.label)} labelled events in batches of 2000: {rate:,.0f} events/s on one core")


def bench_writer() -> None:
    """Events per second the writer (raw events + statistics) sustains into SQLite and PostgreSQL,
    with a queue large enough that nothing is dropped."""
    import tempfile

    from sqlalchemy import create_engine, text

    from controller.services.event_writer import EventWriter
    from controller.core.events import EventQueue, LabelledEvent
    from controller.services.stats_writer import StatsWriter
    from storage.migrate import upgrade

    n = 50_000
    feats = np.zeros(NUM_FEATURES, np.float32).tobytes()
    events = [LabelledEvent(time.time(), f"t{i % 3}", ("agentic", "sql")[i % 2], f"r{i // 100}", i % 100, "cache",
                            "cache", 8, i % 9, 3.0, 1.0, 1, feats) for i in range(n)]
    targets = {"sqlite": (f"sqlite:///{tempfile.mkdtemp()}/bench.db", {})}
    targets["postgresql"] = ("postgresql+psycopg2://postgres@127.0.0.1:5432/test",
                             {"options": "-csearch_path=hvd_bench"})
    for name, (url, connect_args) in targets.items():
        engine = create_engine(url, connect_args=connect_args)
        try:
            if name == "postgresql":
                with engine.begin() as c:
                    c.execute(text("DROP SCHEMA IF EXISTS hvd_bench CASCADE; CREATE SCHEMA hvd_bench"))
            upgrade(engine)
        except Exception as exc:  # noqa: BLE001 - a missing server is reported, not fatal
            print(f"writer into {name}: skipped ({str(exc).splitlines()[0]})")
            continue
        queue = EventQueue(n + 1)
        for e in events:
            queue.put(e)
        writer = EventWriter(engine, queue, batch_size=5000, stats=StatsWriter(engine))
        start = time.perf_counter()
        ok = writer.flush() and writer.stats.flush()
        rate = n / (time.perf_counter() - start)
        print(f"event writer into {name}: {n} events (raw rows + statistics buckets) at {rate:,.0f} events/s, "
              f"dropped {queue.dropped + writer.dropped}, {'ok' if ok else 'FAILED'}")
        if name == "postgresql":
            with engine.begin() as c:
                c.execute(text("DROP SCHEMA hvd_bench CASCADE"))
        engine.dispose()


def main() -> None:
    torch.set_num_threads(1)
    records, _ = load_traces([bundled_traces_path()])
    tokenizer = TraceTokenizer()
    bench_replay(subset(records, 40), tokenizer)
    bench_gate(subset(records, 60), tokenizer)
    bench_runtime(subset(records, 80), tokenizer)
    bench_learner(subset(records, 30), tokenizer)
    bench_writer()


if __name__ == "__main__":
    main()
