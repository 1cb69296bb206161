"""`make bench`: replay throughput, and what the decision costs next to the suffix lookups it
decides on: the gate, the verification allocator, the whole runtime step.

Ratios are measured side by side in one run (interleaved repeats, medians with min-max), because
absolute times on these shared machines move with whatever else runs. Single-threaded on purpose:
the goals are stated per core.

    python bench/run.py [--only allocator runtime ...] [--reps 3]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from predictor.data.tokens import TraceTokenizer  # noqa: E402
from predictor.data.traces import bundled_traces_path, load_traces  # noqa: E402
from predictor.drafting.cache_drafter import CacheDrafter  # noqa: E402
from predictor.drafting.features import NUM_FEATURES, schema_hash  # noqa: E402
from predictor.drafting.token_classes import token_classes  # noqa: E402
from predictor.gate.mlp import MLP, GatePredictor  # noqa: E402
from predictor.replay.trace_replay import replay  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import rotations, spread, survival_curves, verdict  # noqa: E402

REPLAY_GOAL = 20_000
BATCHES = (1, 64, 256)
ALLOCATOR_BATCHES = (1, 32, 256)
ALLOCATOR_RATIO_GOAL = 0.5  # allocator time / suffix lookups of the same step, at batch 32 and 256
ALLOCATOR_B1_GOAL_MS = 0.3  # allocator time per step at batch 1
MODEL_K_MAX = 3
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = [time.thread_time]


def _clock_name() -> str:
    return next(name for name, fn in CLOCKS.items() if fn is _clock[0])


def clock() -> float:
    """The allocator and runtime benchmarks' clock: this thread's CPU time by default, so that
    other jobs on a shared machine do not land in the ratios (everything timed is single-threaded);
    --clock wall for elapsed time."""
    return _clock[0]()


def subset(records, per_source: int):
    seen: dict[str, int] = {}
    out = []
    for r in records:
        if seen.get(r.source, 0) < per_source:
            seen[r.source] = seen.get(r.source, 0) + 1
            out.append(r)
    return out


def bench_replay(records, tokenizer) -> None:
    token_classes(tokenizer)  # built once per process; not part of the per-position cost
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


def bench_allocator(records, tokenizer, reps: int, steps: int) -> None:
    """predictor.decision.allocator.allocate for the whole step against the suffix lookups of the same step
    (append the sampled token + draft, per request, on real bundled traces, as the runtime does),
    at batch 1, 32 and 256. Curves: K = the survival gate's width over each request's real draft
    length; the model drafter's measured per-workload curve (eagle3-smollm2) up to k = 3; the
    measured cpu-smollm2 step-cost profile. The survival gate's own forward over the step's
    feature rows is timed beside it (random weights: only its cost matters here). Each repetition
    times the batch sizes in a rotated order, lookup and allocation alternating per step."""
    from predictor.decision.allocator import allocate
    from predictor.decision.profiles import cost_profiles, drafter_profiles
    from predictor.gate.mlp import SURVIVAL_K
    from storage.workloads import WORKLOADS

    cost = cost_profiles()["cpu-smollm2"]
    model_curve = {w: drafter_profiles()["eagle3-smollm2"].survival_for(w)[:MODEL_K_MAX] for w in WORKLOADS}
    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES, outputs=SURVIVAL_K), schema_hash())
    rng = np.random.default_rng(0)
    fresh = {}
    for batch in ALLOCATOR_BATCHES:  # one drafter per batch size: each holds its own live requests
        drafter, contexts = live_requests(records, tokenizer, batch)
        workloads = [records[req_id].workload for req_id, _, _ in contexts]
        model = np.stack([model_curve.get(w, model_curve["agentic"]) for w in workloads])
        fresh[batch] = [drafter, contexts, model, 0]
    times = {b: {"lookup": [], "allocate": [], "predict": []} for b in ALLOCATOR_BATCHES}
    print(f"allocator vs the suffix lookups of the same step (K = {SURVIVAL_K}, model k_max {MODEL_K_MAX}, "
          f"cost cpu-smollm2, {_clock_name()} time, {reps} interleaved repetitions of {steps} steps; per-step medians, min-max over "
          f"repetitions):")
    for order in rotations(list(ALLOCATOR_BATCHES), reps):
        for batch in order:
            drafter, contexts, model, done = fresh[batch]
            lookup, alloc, pred = [], [], []
            for step in range(done, done + steps):
                t0 = clock()
                lengths = np.empty(batch, dtype=np.int64)
                for i, (req_id, seq, at) in enumerate(contexts):
                    end = at + step + 1
                    if end <= len(seq):  # a request past its trace's end only drafts again
                        drafter.extend(req_id, seq[end - 1 : end])
                    lengths[i] = drafter.draft(req_id, seq[: min(end, len(seq))]).length
                t1 = clock()
                curves = survival_curves(rng, lengths, SURVIVAL_K)
                x = rng.normal(size=(batch, NUM_FEATURES)).astype(np.float32)
                t2 = clock()
                allocate(curves, lengths, model, cost, batch=batch)
                t3 = clock()
                gate.survival(x)
                t4 = clock()
                lookup.append(t1 - t0)
                alloc.append(t3 - t2)
                pred.append(t4 - t3)
            fresh[batch][3] = done + steps
            times[batch]["lookup"].append(statistics.median(lookup))
            times[batch]["allocate"].append(statistics.median(alloc))
            times[batch]["predict"].append(statistics.median(pred))
    for batch in ALLOCATOR_BATCHES:
        t = times[batch]
        lk, al, pr = (spread(1e6 * v for v in t[k]) for k in ("lookup", "allocate", "predict"))
        ratios = spread(a / b for a, b in zip(t["allocate"], t["lookup"]))
        both = spread((a + p) / b for a, p, b in zip(t["allocate"], t["predict"], t["lookup"]))
        if batch == 1:
            goal = f"allocate < {ALLOCATOR_B1_GOAL_MS} ms: {verdict(al.median / 1000, ALLOCATOR_B1_GOAL_MS, False)}"
        else:
            goal = f"ratio <= {ALLOCATOR_RATIO_GOAL}: {verdict(ratios.median, ALLOCATOR_RATIO_GOAL + 1e-12, False)}"
        print(f"  batch {batch:4d}: lookups {lk.fmt()} us  allocate {al.fmt()} us  survival gate {pr.fmt()} us  "
              f"allocate/lookups {ratios.fmt(3)}  (allocate+gate)/lookups {both.fmt(3)}  ({goal})")


class TimedDrafter(CacheDrafter):
    """The cache drafter, timing its own lookups (append + draft) into a shared counter, so the
    runtime's overhead is the rest of the step."""

    seconds = 0.0

    def extend(self, req_id, token_ids) -> None:
        t0 = clock()
        super().extend(req_id, token_ids)
        TimedDrafter.seconds += clock() - t0

    def draft(self, req_id, context):
        t0 = clock()
        d = super().draft(req_id, context)
        TimedDrafter.seconds += clock() - t0
        return d

    def start(self, req_id, prompt_token_ids) -> None:
        t0 = clock()
        super().start(req_id, prompt_token_ids)
        TimedDrafter.seconds += clock() - t0

    def stop(self, req_id) -> None:
        t0 = clock()
        super().stop(req_id)
        TimedDrafter.seconds += clock() - t0


def bench_runtime(records, tokenizer, reps: int) -> None:
    """Runtime.step driven by the replay engine at batch 1, 32 and 256: its overhead (features,
    prediction, decision, hindsight bookkeeping) as a ratio to the suffix lookups of the same steps,
    for the allocator (a survival gate; the measured cpu-smollm2 costs and eagle3-smollm2 drafter)
    and the binary rule (a point gate, a fixed tau), repetitions interleaved."""
    from controller.core.decision import DecisionConfig
    from predictor.decision.profiles import cost_profiles, drafter_profiles
    from predictor.gate.mlp import SURVIVAL_K

    torch.manual_seed(0)
    gates = {"allocator": GatePredictor.from_torch(MLP(NUM_FEATURES, outputs=SURVIVAL_K), schema_hash()),
             "binary": GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())}
    base = dict(cost=cost_profiles()["cpu-smollm2"], drafter=drafter_profiles()["eagle3-smollm2"])
    configs = {"allocator": DecisionConfig(**base), "binary": DecisionConfig(fixed_tau=1.0, rule="binary", **base)}
    cases = [(rule, batch) for rule in configs for batch in ALLOCATOR_BATCHES]
    ratios: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    per_step: dict[tuple[str, int], list[tuple[float, float, int]]] = {c: [] for c in cases}
    for order in rotations(cases, reps):
        for rule, batch in order:
            lookups, overhead, steps = _runtime_overhead(records, tokenizer, gates[rule], configs[rule], batch)
            ratios[(rule, batch)].append(overhead / lookups)
            per_step[(rule, batch)].append((lookups / steps, overhead / steps, steps))
    print(f"runtime overhead per step vs the suffix lookups of the same step ({_clock_name()} time, {reps} "
          f"interleaved repetitions; "
          f"goal <= {ALLOCATOR_RATIO_GOAL} at batch 32 and 256, < {ALLOCATOR_B1_GOAL_MS} ms at batch 1):")
    for rule, batch in cases:
        lk = spread(1e6 * v[0] for v in per_step[(rule, batch)])
        ov = spread(1e6 * v[1] for v in per_step[(rule, batch)])
        r = spread(ratios[(rule, batch)])
        goal = (verdict(ov.median / 1000, ALLOCATOR_B1_GOAL_MS, False) if batch == 1
                else verdict(r.median, ALLOCATOR_RATIO_GOAL + 1e-12, False))
        print(f"  {rule:9s} batch {batch:4d}: {per_step[(rule, batch)][0][2]} steps, lookups {lk.fmt()} us/step, "
              f"overhead {ov.fmt()} us/step, ratio {r.fmt(2)} ({goal})")


def _runtime_overhead(records, tokenizer, gate, config, batch: int) -> tuple[float, float, int]:
    """(lookup seconds, the rest of the runtime's seconds, steps) over one bounded replay."""
    from controller.core.runtime import Runtime
    from controller.engines.trace_engine import run_replay

    runtime = Runtime(gate, token_classes(tokenizer), config, drafter_factory=TimedDrafter)
    TimedDrafter.seconds = 0.0
    step_seconds, steps = [0.0], [0]
    inner = runtime.step

    def timed_step(inputs, finished=(), inner=inner):
        t0 = clock()
        plan = inner(inputs, finished)
        step_seconds[0] += clock() - t0
        steps[0] += 1
        return plan

    inner_finish = runtime.finish

    def timed_finish(req_id, last_tokens=(), inner_finish=inner_finish):
        t0 = clock()
        inner_finish(req_id, last_tokens)
        step_seconds[0] += clock() - t0

    runtime.step, runtime.finish = timed_step, timed_finish
    limit = 400 if batch == 1 else 60
    run_replay(runtime, records[: max(batch * 2, 40)], tokenizer, config.drafter, batch_size=batch,
               stop=lambda: steps[0] >= limit)
    return TimedDrafter.seconds, step_seconds[0] - TimedDrafter.seconds, steps[0]


def bench_learner(records, tokenizer) -> None:
    """Labelled events per second through the online learner (shadow scoring + updates + drift)."""
    from predictor.gate.batch import Batch
    from predictor.online.learner import LearnerConfig, OnlineLearner

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

    from controller.core.events import EventQueue, LabelledEvent
    from controller.services.event_writer import EventWriter
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


SECTIONS = ("replay", "gate", "allocator", "runtime", "learner", "writer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help=f"run only these parts (default: all of {SECTIONS})")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the allocator and runtime "
                                                       "benchmarks (default 3)")
    ap.add_argument("--steps", type=int, default=50, help="steps per repetition of the allocator benchmark")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="allocator and runtime timings: this thread's CPU time (default) or wall time")
    args = ap.parse_args()
    _clock[0] = CLOCKS[args.clock]
    if args.reps < 1 or args.steps < 1:
        ap.error("--reps and --steps must be >= 1")
    only = set(args.only or SECTIONS)
    torch.set_num_threads(1)
    records, _ = load_traces([bundled_traces_path()])
    tokenizer = TraceTokenizer()
    if "replay" in only:
        bench_replay(subset(records, 40), tokenizer)
    if "gate" in only:
        bench_gate(subset(records, 60), tokenizer)
    if "allocator" in only:
        bench_allocator(subset(records, 80), tokenizer, args.reps, args.steps)
    if "runtime" in only:
        bench_runtime(subset(records, 80), tokenizer, args.reps)
    if "learner" in only:
        bench_learner(subset(records, 30), tokenizer)
    if "writer" in only:
        bench_writer()


if __name__ == "__main__":
    main()
