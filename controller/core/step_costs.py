"""What each engine step cost, split into parts, and its per-minute summary: plain data, no I/O.

The engine (the vLLM plugin) times every step and hands a `StepTiming` to the Prometheus metrics
(HvdMetrics.step_seconds) and to the step-cost writer (controller.services.step_cost_writer), which
folds the timings into one `MinuteSummary` per minute (`MinuteAggregator`) and stores those. The
parts say where a step's time went, so HVD's own overhead can be read beside the model's:

- target: the target model's forward pass and sampling (verification included);
- hvd: HVD's own runtime work (suffix lookups, features, the gate, the allocator);
- drafter: the model drafter's proposer (EAGLE3), zero in a step that did not run it;
- rest: everything else in the step (scheduling, input preparation, output handling).

Quantiles need the minute's samples, so memory is bounded: each open minute keeps a uniform
reservoir sample (Algorithm R, seeded: reproducible) of at most `max_samples` steps, and its p50
and p90 come from that sample. Sums, counts and means are exact over every step. A CPU step here
takes 20-200 ms (a few hundred steps a minute: the sample is the whole minute); a GPU step 5-10 ms
(up to ~12,000 a minute: 4,096 sampled steps put p90 within about a percentile rank).
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

PARTS: tuple[str, ...] = ("target", "hvd", "drafter", "rest")
SUMMARY_PARTS: tuple[str, ...] = PARTS + ("total",)  # a summary's sums and quantiles, in this order
MINUTE_SECONDS = 60
MAX_SAMPLES = 4096  # steps kept per open minute for its quantiles


class StepTimingError(ValueError):
    """A step timing the engine got wrong; `field` names the bad value."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"step timing {field}: {problem}")
        self.field = field


def _count(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise StepTimingError(field, f"must be an integer, got {value!r}")
    if value < 0:
        raise StepTimingError(field, f"must be >= 0, got {value}")
    return int(value)


def _seconds(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise StepTimingError(field, f"must be a number of seconds, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise StepTimingError(field, f"must be finite and >= 0, got {value}")
    return x


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One engine step: when it started (unix seconds, time.time(): it decides the step's minute),
    the running requests (`batch`), the tokens the target model processed (`query_tokens`: 1 + the
    verified draft tokens per request), the step's model draft length (`model_k`, 0: none) and its
    parts' seconds in PARTS order. Integers and reals of any numeric type (numpy's included) are
    accepted and stored as int and float; anything else raises StepTimingError."""

    at: float
    batch: int
    query_tokens: int
    model_k: int
    parts: tuple[float, ...]

    def __post_init__(self) -> None:
        at = _seconds("at", self.at)
        if at == 0:
            raise StepTimingError("at", "must be a unix time in seconds, got 0")
        object.__setattr__(self, "at", at)
        for name in ("batch", "query_tokens", "model_k"):
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        if isinstance(self.parts, (str, bytes)) or not isinstance(self.parts, Sequence) \
                or len(self.parts) != len(PARTS):
            raise StepTimingError("parts", f"must be {len(PARTS)} seconds in the order {PARTS}, got {self.parts!r}")
        object.__setattr__(self, "parts", tuple(_seconds(f"parts.{p}", v) for p, v in zip(PARTS, self.parts)))

    @property
    def total(self) -> float:
        """The whole step's seconds: the sum of its parts."""
        return sum(self.parts)

    @classmethod
    def of(cls, at: float, batch: int, query_tokens: int, model_k: int, *, target: float, hvd: float,
           drafter: float, rest: float) -> "StepTiming":
        """A timing from its parts by name (the parts' order cannot be mixed up)."""
        return cls(at, batch, query_tokens, model_k, (target, hvd, drafter, rest))

    @classmethod
    def from_wall(cls, at: float, batch: int, query_tokens: int, model_k: int, *, wall: float, target: float,
                  hvd: float, drafter: float) -> "StepTiming":
        """A timing from the step's wall-clock seconds and the three timed parts: rest is what the
        wall time leaves (clamped at 0: timers read a few microseconds apart)."""
        named = {"wall": wall, "target": target, "hvd": hvd, "drafter": drafter}
        wall, target, hvd, drafter = (_seconds(k, v) for k, v in named.items())
        return cls(at, batch, query_tokens, model_k, (target, hvd, drafter, max(0.0, wall - target - hvd - drafter)))


def minute_of(at: float) -> int:
    """The start (unix seconds, a multiple of 60) of the minute containing `at`."""
    return int(math.floor(at / MINUTE_SECONDS)) * MINUTE_SECONDS


@dataclass(frozen=True, slots=True)
class MinuteSummary:
    """One minute of steps of one process (the replica is the writer's to add). `sum_s`, `p50_s`
    and `p90_s` hold one value per SUMMARY_PARTS (the parts, then the whole step), in seconds;
    `drafter_steps` counts the steps whose drafter part was above 0 (EAGLE ran)."""

    minute: int
    steps: int
    sum_s: tuple[float, ...]
    p50_s: tuple[float, ...]
    p90_s: tuple[float, ...]
    batch_mean: float
    query_tokens_mean: float
    drafter_steps: int

    def part(self, name: str) -> tuple[float, float, float]:
        """(sum, p50, p90) seconds of one of SUMMARY_PARTS."""
        i = SUMMARY_PARTS.index(name)
        return self.sum_s[i], self.p50_s[i], self.p90_s[i]


def merge_summaries(a: MinuteSummary, b: MinuteSummary) -> MinuteSummary:
    """Two summaries of the same minute as one: steps, sums and drafter steps add, the means are
    weighted by steps, and p50/p90 are those of the summary with more steps (a's on a tie). The
    quantiles are an approximation (the samples are gone); storage.step_costs.record_minutes adds a
    minute into its stored row by the same rule."""
    if a.minute != b.minute:
        raise ValueError(f"cannot merge the minutes {a.minute} and {b.minute}")
    steps = a.steps + b.steps
    big = b if b.steps > a.steps else a
    return MinuteSummary(
        minute=a.minute, steps=steps, sum_s=tuple(x + y for x, y in zip(a.sum_s, b.sum_s)),
        p50_s=big.p50_s, p90_s=big.p90_s,
        batch_mean=(a.batch_mean * a.steps + b.batch_mean * b.steps) / steps,
        query_tokens_mean=(a.query_tokens_mean * a.steps + b.query_tokens_mean * b.steps) / steps,
        drafter_steps=a.drafter_steps + b.drafter_steps)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, linear between the closest ranks (numpy's default)."""
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class _OpenMinute:
    """The running totals and the reservoir of the minute being filled."""

    __slots__ = ("minute", "steps", "sums", "batch", "query_tokens", "drafter_steps", "samples")

    def __init__(self, minute: int) -> None:
        self.minute = minute
        self.steps = 0
        self.sums = [0.0] * len(SUMMARY_PARTS)
        self.batch = 0
        self.query_tokens = 0
        self.drafter_steps = 0
        self.samples: list[tuple[float, ...]] = []

    def add(self, t: StepTiming, max_samples: int, rng: random.Random) -> None:
        row = t.parts + (t.total,)
        for i, x in enumerate(row):
            self.sums[i] += x
        self.batch += t.batch
        self.query_tokens += t.query_tokens
        if t.parts[2] > 0:
            self.drafter_steps += 1
        self.steps += 1
        if len(self.samples) < max_samples:
            self.samples.append(row)
        else:  # Algorithm R: every step of the minute stays in the sample with probability max_samples / steps
            j = rng.randrange(self.steps)
            if j < max_samples:
                self.samples[j] = row

    def summary(self) -> MinuteSummary:
        columns = [sorted(col) for col in zip(*self.samples)]
        return MinuteSummary(
            minute=self.minute, steps=self.steps, sum_s=tuple(self.sums),
            p50_s=tuple(quantile(c, 0.5) for c in columns), p90_s=tuple(quantile(c, 0.9) for c in columns),
            batch_mean=self.batch / self.steps, query_tokens_mean=self.query_tokens / self.steps,
            drafter_steps=self.drafter_steps)


class MinuteAggregator:
    """Step timings in, closed minutes out. One minute is open at a time: a timing in another
    minute closes it (a later one, normally; an earlier one only when the clock stepped back, and
    then that minute gets a second summary, which storage adds to the first). O(1) per timing; the
    sort for the quantiles happens once per minute, on at most `max_samples` values. Not
    thread-safe: the writer holds its lock around it."""

    def __init__(self, max_samples: int = MAX_SAMPLES, seed: int = 0) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        self._rng = random.Random(seed)
        self._open: _OpenMinute | None = None

    @property
    def open_minute(self) -> int | None:
        """The start of the minute being filled, or None."""
        return None if self._open is None else self._open.minute

    def add(self, timing: StepTiming) -> list[MinuteSummary]:
        """Count `timing` in its minute; returns the minute it closed, if any (zero or one)."""
        minute = minute_of(timing.at)
        closed: list[MinuteSummary] = []
        if self._open is not None and self._open.minute != minute:
            closed.append(self._open.summary())
            self._open = None
        if self._open is None:
            self._open = _OpenMinute(minute)
        self._open.add(timing, self.max_samples, self._rng)
        return closed

    def drain(self) -> list[MinuteSummary]:
        """The open minute's steps so far, as a summary (storage adds the later pieces of the same
        minute to it); the next step starts a new piece."""
        if self._open is None:
            return []
        out = [self._open.summary()]
        self._open = None
        return out
