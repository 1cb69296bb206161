"""What the benchmarks share: interleaved repetition orders, medians with their spread, and the
speculative-decoding counters turned into per-1000-token figures.

Absolute times on these shared 2-core machines move with whatever else runs, so every benchmark
interleaves what it compares (the order rotated per repetition) and prints medians with min-max.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# vLLM's own speculative-decoding counters (Prometheus adds `_total` on the server's /metrics).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)
# vLLM observes one inter-token latency per request per decode step that emitted tokens (not per
# token): its count is the served decode steps, its sum their wall time. vLLM's ACCEPTED counts a
# draft's accepted tokens before it cuts a request at max_tokens or a stop, so with long drafts
# `tokens - accepted` under-counts the steps; this count does not.
STEP_LATENCY = "vllm:inter_token_latency_seconds"
STEP_COUNTERS = (f"{STEP_LATENCY}_count", f"{STEP_LATENCY}_sum")


def rotations(items: Sequence[T], reps: int) -> list[list[T]]:
    """One order per repetition, rotated by one each time, so no item always runs first (on a
    machine that warms up or slows down over a run, a fixed order biases the comparison)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    n = len(items)
    if n == 0:
        return [[] for _ in range(reps)]
    return [list(items[r % n:]) + list(items[: r % n]) for r in range(reps)]


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float

    def fmt(self, digits: int = 1) -> str:
        return f"{self.median:.{digits}f} [{self.lo:.{digits}f}-{self.hi:.{digits}f}]"


def spread(values: Iterable[float]) -> Spread:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread of no values")
    return Spread(statistics.median(vals), min(vals), max(vals))


@dataclass(frozen=True)
class SpecRun:
    """One timed run: output tokens, wall seconds, and vLLM's counter deltas over the run."""

    tokens: int
    seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    # Streamed runs: per request, (output tokens - 1) / (seconds after its first token), the median
    # over requests: decoding timed apart from prefill.
    decode_tps: float | None = None
    # Streamed runs, pooled: every request's tokens after the first over all their seconds after the
    # first. Each request weighs by the time it decodes, so the slow ones count (the median is one
    # middle request's rate); at concurrency 1 it is the server's decoding throughput.
    decode_pooled_tps: float | None = None
    # Served runs: the server's CPU seconds over the run by role (bench/process_cpu.py), and for HVD's
    # servers the mean milliseconds of a decode step by part (hvd_step_seconds: target, hvd, drafter, rest, total).
    cpu_seconds: dict[str, float] | None = None
    step_ms: dict[str, float] | None = None
    # Served runs: the target forwards summed over requests as vLLM counted them (its decode steps
    # that emitted tokens, plus each request's prefill), and their mean wall time between a request's
    # outputs in ms (STEP_LATENCY): what `tokens - accepted` stands in for elsewhere.
    served_steps: int | None = None
    step_wall_ms: float | None = None
    # Served runs: each request's workload and decoding (tokens after the first, seconds after the
    # first), in prompt order, for per-workload and per-request comparisons across methods.
    requests: list[tuple[str, int, float]] | None = None
    # HVD's servers: per drafter, (tokens the allocator's plan expected of what was verified, tokens
    # accepted) over the run (hvd_promised_tokens, hvd_accepted_tokens).
    promises: dict[str, tuple[float, float]] | None = None
    # A server measuring the served upper bound (HVD_ORACLE): its measured requests by outcome
    # (matched, missing, diverged: hvd_oracle_requests), so the figure says how much traffic it covered.
    oracle: dict[str, int] | None = None
    # HVD's servers: the line its allocator priced steps with at the pass's end (hvd_live_cost_ms, by
    # term; None before its first live fit), for pricing every method's counts alike (`priced_per_1k`).
    live_cost: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.seconds <= 0:
            raise ValueError(f"a run needs tokens > 0 and seconds > 0, got {self.tokens} and {self.seconds}")
        if not 0 <= self.accepted <= self.draft_tokens:
            raise ValueError(f"accepted draft tokens ({self.accepted}) must be in [0, draft tokens "
                             f"({self.draft_tokens})]")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def emitted_accepted(self) -> int:
        """Accepted draft tokens the requests kept: vLLM's count less those past a request's end,
        where the steps were counted (served runs)."""
        return self.accepted if self.served_steps is None else max(0, min(self.accepted, self.tokens - self.served_steps))

    @property
    def rejected(self) -> int:
        """Draft tokens verified in vain: rejected, or accepted past the request's end."""
        return self.draft_tokens - self.emitted_accepted

    @property
    def decode_steps(self) -> int:
        """Target forwards summed over requests: as the server counted them where it did
        (`served_steps`), else output tokens less accepted ones (each emits one plus what it accepted)."""
        return self.tokens - self.accepted if self.served_steps is None else self.served_steps

    def per_1k(self, count: int) -> float:
        return 1000.0 * count / self.tokens

    def figures(self) -> dict[str, float]:
        """Per 1000 output tokens: decode steps, drafts, draft tokens, accepted and rejected ones."""
        return {"steps": self.per_1k(self.decode_steps), "drafts": self.per_1k(self.drafts),
                "draft_tokens": self.per_1k(self.draft_tokens), "accepted": self.per_1k(self.emitted_accepted),
                "rejected": self.per_1k(self.rejected)}

    def raw(self) -> str:
        decode = "" if self.decode_tps is None else f", decode {self.decode_tps:.2f} tok/s per request"
        if self.decode_pooled_tps is not None:
            decode += f" ({self.decode_pooled_tps:.2f} pooled)"
        steps = "" if self.served_steps is None else f", steps {self.served_steps}"
        if self.step_wall_ms is not None:
            steps += f" ({self.step_wall_ms:.1f} ms apart)"
        oracle = "" if self.oracle is None else ", oracle " + " ".join(f"{k} {v}" for k, v in sorted(self.oracle.items()))
        return (f"{self.tokens} tok/{self.seconds:.2f} s, drafts {self.drafts}, draft tok {self.draft_tokens}, "
                f"accepted {self.accepted}{steps}{decode}{oracle}")

    def to_dict(self) -> dict:
        return asdict(self)


def pooled_decode_rate(decoded: Sequence[tuple[int, float]]) -> float | None:
    """Tokens after the first over seconds after the first, summed over requests ((tokens, seconds)
    pairs; None for none): the rate of all the decoding a run did, not of its middle request."""
    seconds = sum(s for _, s in decoded)
    if not decoded or seconds <= 0:
        return None
    return sum(t for t, _ in decoded) / seconds


def paired_ratios(mine: Sequence[SpecRun], theirs: Sequence[SpecRun], rate: Callable[[SpecRun], float | None]) -> Spread:
    """`rate` of each of my passes over that of their pass of the same repetition (both in repetition
    order): the ratio's own spread. Passes of one repetition ran next to each other, so what the
    shared machine was doing then weighs on both; a ratio of medians hides how far it moved."""
    if len(mine) != len(theirs) or not mine:
        raise ValueError(f"pairing needs as many passes on each side, at least one: got {len(mine)} and {len(theirs)}")
    ratios = []
    for i, (a, b) in enumerate(zip(mine, theirs)):
        ra, rb = rate(a), rate(b)
        if ra is None or rb is None or rb <= 0:
            raise ValueError(f"repetition {i + 1}: no rate to pair ({ra!r} over {rb!r})")
        ratios.append(ra / rb)
    return spread(ratios)


def pooled_over_passes(runs: Sequence[SpecRun]) -> float | None:
    """The pooled decode rate of every request of every pass at once (None if a pass lacks its
    requests): all the decoding the method did over all the time it took, the rate a long-running
    server sees, where the median pass's pooled rate keeps only one pass."""
    if not runs or any(r.requests is None for r in runs):
        return None
    return pooled_decode_rate([(tokens, seconds) for r in runs for _, tokens, seconds in r.requests])


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The spec-decode counters' growth between two readings (a counter never seen counts as 0)."""
    return {name: int(round(after.get(name, 0.0) - before.get(name, 0.0))) for name in SPEC_COUNTERS}


def served_steps(before: str, after: str, requests: int) -> tuple[int | None, float | None]:
    """(target forwards summed over `requests`, mean ms between a request's outputs) from two /metrics
    pages of a vLLM server (STEP_LATENCY; each request's prefill counts one forward); (None, None)
    where the server reported no decode step between them."""
    b, a = prometheus_counters(before, STEP_COUNTERS), prometheus_counters(after, STEP_COUNTERS)
    count = int(round(a[STEP_COUNTERS[0]] - b[STEP_COUNTERS[0]]))
    if count <= 0:
        return None, None
    return count + requests, 1000.0 * (a[STEP_COUNTERS[1]] - b[STEP_COUNTERS[1]]) / count


def run_from(tokens: int, seconds: float, deltas: dict[str, int]) -> SpecRun:
    return SpecRun(tokens, seconds, deltas.get(DRAFTS, 0), deltas.get(DRAFT_TOKENS, 0), deltas.get(ACCEPTED, 0))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def prometheus_counters(text: str, names: Sequence[str] = SPEC_COUNTERS) -> dict[str, float]:
    """Each named counter summed over its label sets, from a Prometheus text page (/metrics). The
    `_total` suffix Prometheus adds to counters is accepted; `_created` samples are not counters."""
    wanted = set(names)
    out = {name: 0.0 for name in names}
    for name, _, value in _samples(text):
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in wanted:
            out[base] += value
    return out


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text page."""
    for line in text.split("\n"):  # the exposition format's lines; a label value may hold any other character
        m = _SAMPLE.match(line)
        if m:
            yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))


def prometheus_by_label(text: str, name: str, label: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
    """The samples of ``name`` summed per value of ``label`` (samples without it are skipped), from a
    Prometheus text page, only those whose labels include ``where``: e.g. hvd_step_seconds_sum per part
    of the decode steps."""
    out: dict[str, float] = {}
    for sample, labels, value in _samples(text):
        if sample == name and label in labels and all(labels.get(k) == v for k, v in (where or {}).items()):
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def step_part_ms(before: str, after: str, metric: str = "hvd_step_seconds", phase: str = "decode") -> dict[str, float] | None:
    """Mean milliseconds per ``phase`` step of each part of ``metric`` (a histogram labelled by part and
    phase, every step observing every part) between two /metrics pages; None if no such step was
    observed between them."""
    where = {"phase": phase}
    sums = [prometheus_by_label(page, f"{metric}_sum", "part", where) for page in (before, after)]
    counts = [prometheus_by_label(page, f"{metric}_count", "part", where) for page in (before, after)]
    steps = counts[1].get("total", 0.0) - counts[0].get("total", 0.0)
    if steps <= 0:
        return None
    return {part: 1000.0 * (sums[1][part] - sums[0].get(part, 0.0)) / steps for part in sums[1]}


def promises(before: str, after: str) -> dict[str, tuple[float, float]] | None:
    """Per drafter, (promised, accepted) draft tokens between two /metrics pages of an HVD server: what
    the allocator's plan expected of the verified tokens (hvd_promised_tokens) and what the target
    accepted (hvd_accepted_tokens, counted as drafts are labelled: a request's last labels wait for
    the engine's next step). None if nothing was promised between them."""
    def delta(name: str) -> dict[str, float]:
        first, last = (prometheus_by_label(page, name, "drafter") for page in (before, after))
        return {d: v - first.get(d, 0.0) for d, v in last.items()}

    promised, accepted = delta("hvd_promised_tokens_total"), delta("hvd_accepted_tokens_total")
    out = {d: (v, accepted.get(d, 0.0)) for d, v in promised.items() if v > 0}
    return out or None


def oracle_outcomes(before: str, after: str) -> dict[str, int] | None:
    """Requests by outcome (hvd_oracle_requests: matched, missing, diverged) between two /metrics pages
    of a server measuring the served upper bound; None from any other server."""
    first, last = (prometheus_by_label(page, "hvd_oracle_requests_total", "outcome") for page in (before, after))
    out = {k: int(round(v - first.get(k, 0.0))) for k, v in last.items()}
    return out or None


def live_cost_line(page: str) -> dict[str, float] | None:
    """The live cost fit an HVD server prices its steps with, by term (hvd_live_cost_ms), from a
    /metrics page; None before its first fit, or from any other server."""
    return prometheus_by_label(page, "hvd_live_cost_ms", "term") or None


def priced_per_1k(run: SpecRun, line: Mapping[str, float], decision_ms: float) -> float | None:
    """Seconds per 1000 decoded tokens (after each request's first) that a served run's exact counts
    cost at concurrency 1, priced with one engine's fitted line (`live_cost_line`): every decode step
    its fixed cost at batch 1, every query token (the step's own and each verified draft token) its
    slope, and HVD's own time per step (its decision and its model drafter: `step_ms` hvd + drafter)
    where the run has it.

    Why: on these shared cores the same work timed on two servers differs by 10-20% from pass to
    pass, while the counts are identical; this prices the counts alone. `decision_ms` is the
    fitting server's own decision time per step, which its fixed cost holds: taken out of it, so a
    method without HVD is not charged for HVD's time. What the line leaves out is every method's own
    proposer (vLLM's suffix proposer included) and how the step time bends past its knee."""
    if run.served_steps is None or not run.requests:
        return None
    prefills = len(run.requests)  # each request's first token came from its prefill: not decoding
    steps, tokens = run.served_steps - prefills, run.tokens - prefills
    if steps <= 0 or tokens <= 0:
        return None
    parts = run.step_ms or {}
    own = parts.get("hvd", 0.0) + parts.get("drafter", 0.0)
    fixed = line["base"] + line["batch"] - decision_ms
    return (steps * (fixed + own) + (steps + run.draft_tokens) * line["query_token"]) / tokens


def headroom_share(method: float, base: float, bound: float) -> float | None:
    """Of the way from `base` to `bound` (a rate the perfect predictor reaches), how far `method` went:
    0 at the base, 1 at the bound, negative below the base; None when the bound is no better."""
    return None if bound <= base else (method - base) / (bound - base)


def verdict(value: float, goal: float, higher_is_better: bool = True) -> str:
    """'met' or 'NOT met (by X)', X the gap to the goal in the goal's own units."""
    ok = value >= goal if higher_is_better else value < goal
    return "met" if ok else f"NOT met (by {abs(goal - value):.3g})"


def survival_curves(rng: np.random.Generator, lengths: np.ndarray, width: int) -> np.ndarray:
    """Survival curves shaped like a survival gate's, for timing the allocator: running products of
    per-position conditional acceptances (uniform draws), zero past each draft's real length."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (len(lengths) and lengths.min() < 0):
        raise ValueError("lengths must be a 1-d array of draft lengths >= 0")
    curves = np.cumprod(rng.uniform(size=(len(lengths), width)), axis=1)
    return curves * (np.arange(1, width + 1)[None, :] <= lengths[:, None])
