"""`make bench` (part): the runtime's own time per engine step, on recorded realistic steps.

`Runtime.step` runs inside every engine step, so its time is paid on the decode path (issue 27:
<= 0.2 ms per step at batch 1, <= 1 ms at batch 64). What a step costs depends on what it is fed
(how many tokens each request emitted, how long its context is, how many drafts are waiting for
labels), so the steps timed here are real ones: the replay engine serves held-out bundled traces
(`controller.engines.trace_engine.run_replay`) at batch 1 and batch 64 with a survival gate trained
on a small slice of the bundle, and every call it makes into the runtime (`step`, `finish`,
`reset_cache`) is recorded. That exact sequence is then replayed into fresh runtimes, built as
`hvd serve --engine replay` builds them (statistics sink, event queue; Prometheus metrics too with
`--metrics`), and each `step` call is timed. The phases (`_observe_step`, `_score`, `_plan`,
`_commit`) are timed in separate passes, so their wrappers do not weigh on the totals. Batches and
passes are interleaved, the order rotated per repetition; medians and min-max over repetitions.

Every replay also hashes what the runtime produced (plans, labelled events, counters): equal
hashes across passes, and against a saved reference (`--save-reference` before a change,
`--reference` after it, which replays the reference's own recorded sequence), show that an
optimisation changed no decision, event or label.

    python bench/runtime_step.py [--reps 3] [--json var/bench-runtime-step.json]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import base64  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import lzma  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field, fields  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from controller.core.events import LabelledEvent  # noqa: E402
from controller.core.runtime import RequestInput, Runtime, StepPlan  # noqa: E402
from predictor.drafting.cache_drafter import CacheDrafter  # noqa: E402
from predictor.drafting.token_classes import token_classes  # noqa: E402
from predictor.gate.mlp import GatePredictor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import rotations, spread, verdict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / "var" / "bench"
GOALS_MS = {1: 0.2, 64: 1.0}  # issue 27: the runtime's own time per step
PHASES = ("_observe_step", "_score", "_plan", "_commit")
SUFFIX = "suffix_cache"  # the suffix cache's own calls inside the step (phase passes)
STEP_SECONDS = 0.025  # the simulated clock advances this much per engine step (event times only)
_EVENT_FIELDS = tuple(f.name for f in fields(LabelledEvent))


# ---------------------------------------------------------------- the recorded calls
@dataclass
class Recording:
    """Every call one replay-engine run made into its runtime, in order: ("step", inputs, finished),
    ("finish", req_id, last_tokens) or ("reset",)."""

    batch: int
    calls: list[tuple] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(1 for c in self.calls if c[0] == "step")

    def requests(self) -> int:
        return len({inp.req_id for c in self.calls if c[0] == "step" for inp in c[1]})

    def mean_batch(self) -> float:
        sizes = [len(c[1]) for c in self.calls if c[0] == "step"]
        return sum(sizes) / max(len(sizes), 1)


class SimClock:
    """The runtime's clock, set by the driver before each call: event times then depend only on
    the step a label became known in, not on how often the runtime reads the clock."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


class TimedDrafter(CacheDrafter):
    """The suffix cache, timing its own calls (prompt trees, appends, lookups), so that a step's
    time splits into what the suffix cache costs (vLLM's `method="suffix"` pays most of it too)
    and the rest; only used in the phase passes."""

    seconds = 0.0

    def start(self, req_id, prompt_token_ids) -> None:
        t0 = time.perf_counter()
        super().start(req_id, prompt_token_ids)
        TimedDrafter.seconds += time.perf_counter() - t0

    def extend(self, req_id, token_ids) -> None:
        t0 = time.perf_counter()
        super().extend(req_id, token_ids)
        TimedDrafter.seconds += time.perf_counter() - t0

    def draft(self, req_id, context):
        t0 = time.perf_counter()
        d = super().draft(req_id, context)
        TimedDrafter.seconds += time.perf_counter() - t0
        return d

    def stop(self, req_id) -> None:
        t0 = time.perf_counter()
        super().stop(req_id)
        TimedDrafter.seconds += time.perf_counter() - t0


def make_runtime(gate: GatePredictor, *, metrics: bool = False, clock: Callable[[], float] | None = None,
                 drafter_factory: Callable = CacheDrafter) -> Runtime:
    """A runtime as `hvd serve --engine replay` builds it (its decision configuration, a statistics
    sink, the event queue), on a simulated clock; with `metrics`, Prometheus counters as the vLLM
    plugin always has them (in a private registry)."""
    from controller.cli.replay_options import ReplayServeOptions
    from controller.services.stack import decision_config
    from controller.services.stats_writer import StatsWriter
    from predictor.data.tokens import TraceTokenizer
    from predictor.decision.profiles import cost_profiles, drafter_profiles

    opts = ReplayServeOptions()
    config = decision_config(drafter_profiles()[opts.drafter], cost_profiles()[opts.cost_profile], rule=opts.rule)
    hvd_metrics = None
    if metrics:
        from prometheus_client import CollectorRegistry

        from controller.core.metrics import HvdMetrics
        hvd_metrics = HvdMetrics(CollectorRegistry())
    return Runtime(gate, token_classes(TraceTokenizer()), config, version_id=1, clock=clock or SimClock(),
                   stats_sink=StatsWriter(None), metrics=hvd_metrics,  # type: ignore[arg-type]
                   drafter_factory=drafter_factory)


def record(gate: GatePredictor, groups: Sequence[Sequence], batch: int, steps_per_group: int) -> Recording:
    """Serve each group of records (one deployment each) on the replay engine at `batch` for up to
    `steps_per_group` steps, recording every call into the runtime, and only until its last request
    has started (its last requests draining out of the batch are not batch-`batch` steps); the requests
    still running when a group stops are finished (recorded too), so the next group starts on a
    clean runtime."""
    from controller.cli.serve_traces import tenant_of
    from controller.engines.trace_engine import run_replay
    from predictor.data.tokens import TraceTokenizer
    from predictor.decision.profiles import drafter_profiles
    from controller.cli.replay_options import ReplayServeOptions

    opts = ReplayServeOptions()
    clock = SimClock()
    runtime = make_runtime(gate, clock=clock)
    rec = Recording(batch)
    step, finish, reset = runtime.step, runtime.finish, runtime.reset_cache
    done, started = [0], [0]

    def rec_step(inputs, finished=()):
        rec.calls.append(("step", list(inputs), list(finished)))
        done[0] += 1
        started[0] += sum(1 for inp in inputs if inp.prompt is not None)
        clock.now += STEP_SECONDS
        return step(inputs, finished)

    def rec_finish(req_id, last_tokens=()):
        rec.calls.append(("finish", req_id, np.array(last_tokens, dtype=np.int32)))
        return finish(req_id, last_tokens)

    def rec_reset():
        rec.calls.append(("reset",))
        return reset()

    runtime.step, runtime.finish, runtime.reset_cache = rec_step, rec_finish, rec_reset
    drafter, tokenizer, tenants = drafter_profiles()[opts.drafter], TraceTokenizer(), tenant_of(opts.tenants)
    for group in groups:
        done[0], started[0] = 0, 0
        serving = sum(1 for r in group if len(tokenizer.encode_output(r.output)))  # run_replay skips empty outputs
        last = serving if batch > 1 else serving + 1  # at batch 1 a deployment may run to its end
        run_replay(runtime, list(group), tokenizer, drafter, batch_size=batch, seed=opts.seed, tenant_of=tenants,
                   stop=lambda: done[0] >= steps_per_group or started[0] >= last)
        for req_id in list(runtime.requests):
            runtime.finish(req_id)
    return rec


def _plain(call: tuple) -> list:
    """A recorded call as JSON values (a reference file outlives changes to RequestInput: a field
    added since reads as its default)."""
    if call[0] == "finish":
        return ["finish", call[1], np.asarray(call[2]).tolist()]
    if call[0] != "step":
        return list(call)
    return ["step", [inp.to_json() for inp in call[1]], list(call[2])]


def _from_plain(call: list) -> tuple:
    if call[0] == "finish":
        return ("finish", call[1], np.array(call[2], dtype=np.int32))
    if call[0] != "step":
        return tuple(call)
    return ("step", [RequestInput.from_json(d) for d in call[1]], call[2])


# ---------------------------------------------------------------- replaying it, timed
@dataclass
class Pass:
    """One replay of a recording: per-step seconds, seconds in finish calls, seconds per phase
    (phase passes only), the digest of everything the runtime produced, and its counters."""

    step_seconds: list[float]
    finish_seconds: float
    phase_seconds: dict[str, float]
    digest: str
    drafts: int
    events: int
    requests: int


def _phase_timers(runtime: Runtime, totals: dict[str, float]) -> None:
    for name in PHASES:
        inner = getattr(runtime, name)

        def timed(*args, _inner=inner, _name=name):
            t0 = time.perf_counter()
            out = _inner(*args)
            totals[_name] += time.perf_counter() - t0
            return out

        setattr(runtime, name, timed)


def canonical_plan(plan: StepPlan) -> tuple:
    """A plan as plain values (float arrays by their bytes, so NaN compares equal to NaN)."""
    return (plan.req_ids, plan.source.tolist(), plan.drafts, np.asarray(plan.predicted, np.float32).tobytes(),
            np.asarray(plan.tau, np.float32).tobytes(), np.asarray(plan.cache_len).tolist(), plan.cache_drafts,
            int(plan.model_k))


def canonical_event(event) -> tuple:
    """An event as plain values (floats by repr, so NaN compares equal to NaN)."""
    return tuple(repr(v) if isinstance(v, float) else v for v in map(event.__getattribute__, _EVENT_FIELDS))


def replay(rec: Recording, gate: GatePredictor, *, phases: bool = False, metrics: bool = False,
           clock: Callable[[], float] = time.perf_counter, keep: list | None = None) -> Pass:
    """Feed the recorded calls to a fresh runtime, timing each step (and, with `phases`, each phase
    inside it). `keep`: a list that receives the plans and events as plain values."""
    sim = SimClock()
    runtime = make_runtime(gate, metrics=metrics, clock=sim, drafter_factory=TimedDrafter if phases else CacheDrafter)
    phase_totals = dict.fromkeys(PHASES + (SUFFIX,), 0.0)
    if phases:
        _phase_timers(runtime, phase_totals)
    digest = hashlib.sha256()
    times: list[float] = []
    finish_s = 0.0
    events = 0
    gc.collect()
    for call in rec.calls:
        kind = call[0]
        if kind == "step":
            sim.now += STEP_SECONDS
            TimedDrafter.seconds = 0.0
            t0 = clock()
            plan = runtime.step(call[1], call[2])
            times.append(clock() - t0)
            phase_totals[SUFFIX] += TimedDrafter.seconds
            out = ("plan", canonical_plan(plan))
        elif kind == "finish":
            t0 = clock()
            runtime.finish(call[1], call[2])
            finish_s += clock() - t0
            out = ("finish", call[1])
        else:
            runtime.reset_cache()
            out = ("reset",)
        digest.update(repr(out).encode())
        if keep is not None:
            keep.append(out)
        batch = runtime.events.get_batch(1 << 30)
        events += len(batch)
        for e in batch:
            ce = canonical_event(e)
            digest.update(repr(ce).encode())
            if keep is not None:
                keep.append(("event", ce))
    stats = runtime.stats
    digest.update(repr(sorted(vars(stats).items())).encode())
    return Pass(times, finish_s, phase_totals, digest.hexdigest(), stats.cache_drafts, events, stats.requests_seen)


# ---------------------------------------------------------------- the gate and the traffic
def trained_gate(tokens_per_source: int, epochs: int, held_out: set[str], log=print) -> GatePredictor:
    """A survival gate warm-started as `hvd warmstart --max-tokens-per-source` does, on each
    source's head, on rows of traces outside the held-out set the benchmark serves; cached."""
    from predictor.drafting.features import schema_hash
    from predictor.gate.config import TrainConfig
    from predictor.gate.training import train_gate
    from predictor.replay.dataset import build_dataset

    path = CACHE / f"runtime-step-gate-{tokens_per_source}-{epochs}.safetensors"
    if path.exists():
        return GatePredictor.from_bytes(path.read_bytes(), schema_hash())
    data = build_dataset(max_tokens_per_source=tokens_per_source, log=log)
    rp = data.replay
    train_trace = np.array([r.trace_id not in held_out for r in data.records], dtype=bool)
    rows = train_trace[rp.trace] & (rp.draft_len > 0)
    log(f"training a survival gate on {int(rows.sum())} drafts ({epochs} epochs)")
    model = train_gate(rp.features[rows], rp.label[rows], rp.row_workload()[rows], TrainConfig(epochs=epochs))
    gate = GatePredictor.from_torch(model, schema_hash())
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gate.to_bytes())
    return gate


def held_out_deployments() -> list[list]:
    """The deployments (source, model, run) of the held-out bundled traces (the default split)."""
    from predictor.data.split import test_mask
    from predictor.data.traces import bundled_traces_path, load_traces
    from predictor.replay.trace_replay import deployments

    records, _ = load_traces([bundled_traces_path()])
    return list(deployments([r for r, t in zip(records, test_mask(records)) if t]).values())


def largest_per_source(groups: Sequence[list], min_records: int) -> list[list]:
    """Per source, its largest deployment with at least `min_records` traces (sources in name order)."""
    best: dict[str, list] = {}
    for group in groups:
        source = group[0].source
        if len(group) >= min_records and len(group) > len(best.get(source, [])):
            best[source] = group
    return [best[s] for s in sorted(best)]


# ---------------------------------------------------------------- the report
def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def summarise(passes: list[Pass], phase_passes: list[Pass]) -> dict:
    """Per repetition: mean step time (total / steps), per-step median and p90, finish time per
    step, each phase's time per step; over repetitions: median, min, max of each (ms)."""
    n = len(passes[0].step_seconds)
    per = {
        "mean": [1e3 * sum(p.step_seconds) / n for p in passes],
        "median": [1e3 * statistics.median(p.step_seconds) for p in passes],
        "p90": [1e3 * _pct(p.step_seconds, 90) for p in passes],
        "finish_per_step": [1e3 * p.finish_seconds / n for p in passes],
    }
    for name in PHASES + (SUFFIX,):
        per[name] = [1e3 * p.phase_seconds[name] / n for p in phase_passes]
    # the step without the suffix cache's own calls: per phase pass, its step time minus them
    per["own"] = [1e3 * (sum(p.step_seconds) - p.phase_seconds[SUFFIX]) / n for p in phase_passes]
    out = {k: vars(spread(v)) for k, v in per.items() if v}
    out["raw"] = per
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3, at least 3 for a figure)")
    ap.add_argument("--steps-b1", type=int, default=300, help="steps recorded per deployment at batch 1 (default 300)")
    ap.add_argument("--steps-b64", type=int, default=60, help="steps recorded per deployment at batch 64 (default 60)")
    ap.add_argument("--gate-tokens", type=int, default=4000,
                    help="output tokens per source the gate is trained on (default 4000)")
    ap.add_argument("--gate-epochs", type=int, default=4, help="training epochs of the gate (default 4)")
    ap.add_argument("--metrics", action="store_true", help="count into Prometheus metrics, as the vLLM plugin does")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time.perf_counter (default) or this thread's CPU time")
    ap.add_argument("--save-reference", type=Path, help="write the recordings, gate and output digests here")
    ap.add_argument("--reference", type=Path,
                    help="replay this reference's recordings with its gate; fail unless outputs are identical")
    ap.add_argument("--batches", type=int, nargs="+", choices=(1, 64), default=[1, 64],
                    help="which recordings to time (default both)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    from predictor.drafting.features import schema_hash

    if args.reference is not None:
        ref = json.loads(lzma.decompress(args.reference.read_bytes()))
        gate = GatePredictor.from_bytes(base64.b64decode(ref["gate"]), schema_hash())
        recordings = {int(b): Recording(int(b), [_from_plain(c) for c in calls]) for b, calls in ref["recordings"].items()}
        print(f"recordings and gate from {args.reference}")
    else:
        t0 = time.perf_counter()
        held = held_out_deployments()
        groups_b1, groups_b64 = largest_per_source(held, 1), largest_per_source(held, 80)
        gate = trained_gate(args.gate_tokens, args.gate_epochs, {r.trace_id for g in held for r in g})
        recordings = {1: record(gate, groups_b1, 1, args.steps_b1), 64: record(gate, groups_b64, 64, args.steps_b64)}
        print(f"recorded in {time.perf_counter() - t0:.1f} s: batch 1 on {len(groups_b1)} deployments, "
              f"batch 64 on {len(groups_b64)} (held-out bundled traces, one per source)")
    batches = sorted(b for b in recordings if b in args.batches)
    first = {b: replay(recordings[b], gate, metrics=args.metrics, clock=clock) for b in batches}  # warm-up + digest
    ok = True
    if args.reference is not None:
        for b in batches:
            want = ref["digests"].get(f"{b}:{int(args.metrics)}")
            same = want is None or want == first[b].digest
            ok &= same
            print(f"batch {b}: plans, events and counters {'IDENTICAL to' if same else 'DIFFER from'} the reference"
                  + ("" if want is not None else " (no reference digest for this setting)"))
    if args.save_reference is not None:
        digests = {f"{b}:{int(args.metrics)}": first[b].digest for b in batches}
        args.save_reference.parent.mkdir(parents=True, exist_ok=True)
        args.save_reference.write_bytes(lzma.compress(json.dumps(
            {"gate": base64.b64encode(gate.to_bytes()).decode("ascii"),
             "recordings": {str(b): [_plain(c) for c in r.calls] for b, r in recordings.items()},
             "digests": digests}).encode()))
        print(f"reference written to {args.save_reference}")
    cases = [(b, phases) for phases in (False, True) for b in batches]
    passes: dict[tuple[int, bool], list[Pass]] = {c: [] for c in cases}
    for order in rotations(cases, args.reps):
        for b, phases in order:
            p = replay(recordings[b], gate, phases=phases, metrics=args.metrics, clock=clock)
            if p.digest != first[b].digest:
                ok = False
                print(f"batch {b}: a repetition produced other outputs than the first (nondeterminism)")
            passes[(b, phases)].append(p)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "clock": args.clock, "reps": args.reps,
                    "metrics": args.metrics, "batches": {}}
    print(f"Runtime.step per engine step ({args.clock} clock, {args.reps} interleaved repetitions; ms, median "
          f"[min-max] over repetitions; {'with' if args.metrics else 'without'} Prometheus metrics):")
    met_all = True
    for b in batches:
        rec, p0 = recordings[b], first[b]
        s = summarise(passes[(b, False)], passes[(b, True)])
        goal = GOALS_MS.get(b)
        met = goal is None or s["mean"]["median"] <= goal
        met_all &= met
        print(f"  batch {b:3d}: {rec.steps} steps (mean batch {rec.mean_batch():.1f}), {p0.requests} requests, "
              f"{p0.drafts} cache drafts scored (shadow included), {p0.events} labelled events")
        print(f"    step: mean {_fmt(s['mean'])}  per-step median {_fmt(s['median'])}  p90 {_fmt(s['p90'])}"
              + (f"  (goal <= {goal} ms: {verdict(s['mean']['median'], goal + 1e-12, False)})" if goal else ""))
        print("    phases: " + "  ".join(f"{name.strip('_')} {_fmt(s[name])}" for name in PHASES)
              + f"  |  finish calls per step {_fmt(s['finish_per_step'])}")
        print(f"    of the step: suffix cache calls {_fmt(s[SUFFIX])}, the rest {_fmt(s['own'])} "
              f"(phase passes: their wrappers included)")
        report["batches"][str(b)] = {"steps": rec.steps, "mean_batch": rec.mean_batch(), "requests": p0.requests,
                                     "drafts": p0.drafts, "events": p0.events, "digest": p0.digest,
                                     "goal_ms": goal, "met": met, **s}
    report["identical"] = ok
    report["met"] = met_all
    print(f"targets (<= {GOALS_MS[1]} ms at batch 1, <= {GOALS_MS[64]} ms at batch 64): "
          f"{'met' if met_all else 'NOT met'}; outputs {'identical' if ok else 'NOT identical'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


def _fmt(s: dict) -> str:
    return f"{s['median']:.3f} [{s['lo']:.3f}-{s['hi']:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
