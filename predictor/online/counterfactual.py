"""What serving would have got from a predictor on drafts whose outcome is known: counterfactual
replay under the serving decision rule and the cost profile.

`replay_paths` walks each request's output along the policy's own path: hindsight labels a draft at
every output position (the shadow drafts between decision points), so a policy that verifies more at
one step lands on a later position at the next, as it would have at serving. Pricing each draft
alone at the step that decided it does not judge: measured on an unseen source (toolbench, one logit
shift of every curve), per-draft replay called the shift +1.8% goodput while serving it lost 1.2%;
walked paths lose too (the drafts a
champion decided on are where its own path went, which over-credits a policy that verifies more
there: in a run of good drafts it would have been past most of them). Paths are walked at the
batch the drafts were served at (`concurrency`): what a step costs, and so what the allocator
verifies, depends on the requests beside it.

Hindsight labels give every cache draft's accepted length, whether it was verified or not, so any
predictor can be replayed on the same drafts: its survival curves (with the fast calibration it
would serve with) go through the allocator exactly as at serving (one request's step, every cache
prefix, the model draft at every k, or nothing), and the step's outcome is read from the label:
a verified cache prefix of l tokens yields 1 + min(label, l) tokens, the model draft its expected
tokens (its outcome is not in the label), nothing 1 token; each at the step's cost. Goodput is
tokens per millisecond over a window. Promotion compares champion and challenger this way, per
workload, on drafts the challenger has not trained on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from predictor.decision.allocator import CACHE, MODEL, allocate, allocate_each
from predictor.decision.profiles import CostProfile, accepted_from_survival
from predictor.gate.calibration import Calibration
from predictor.gate.calibration import apply as apply_calibration


@dataclass(frozen=True)
class CounterfactualPolicy:
    """predictor.online.workload_promotion's margins and windows."""

    holdout: int = 3000  # newest labelled drafts per workload held back from the challenger
    check_every: int = 1000  # new drafts of a workload between comparisons
    margin: float = 0.01  # the challenger's goodput must beat the champion's by this fraction
    # After a promotion the workload is on probation for this many windows of `holdout` drafts served
    # after it; after each, the new champion's goodput over its predecessor's on all of them so far
    # must be at least rollback_margin (0: any loss), else it is rolled back. Chosen as the best of
    # many checks, a challenger's winning edge is partly luck; the drafts served after it are the
    # first unbiased look, and one window of them is too little to see a loss of 0.5%.
    rollback_margin: float = 0.0
    probation: int = 5
    # A challenger that wins a check is promoted only if it still gains at least rollback_margin on
    # this many further windows of `holdout` drafts, each all drafts after the last look. It is checked
    # every `check_every` drafts against a window it shares two thirds of with the last check, so over a
    # stream one such check passes by luck now and then (the best of many looks); a fresh window is a
    # look that was not chosen, and failing it costs a window's delay, not a window served worse.
    # (Asking the full margin again confirmed none in six runs on unseen sources, one that had paid
    # +0.7% in serving included: the edge served is often below 1%.)
    confirmations: int = 1


@dataclass(frozen=True)
class Goodput:
    tokens: float
    ms: float
    drafts: int
    # per draft (tokens, ms), in window order: what the evidence behind a comparison is read from
    each: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)

    @property
    def per_ms(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


def served_curves_from(raw: np.ndarray, draft_len: np.ndarray, calibration: Calibration | None) -> np.ndarray:
    """The curves the runtime would plan with: the gate's own, corrected if a calibration is set."""
    if calibration is None or calibration.is_identity:
        return raw
    return apply_calibration(raw, draft_len, calibration.slope, calibration.bias)


SEGMENT = 32  # positions of a path per outcome slice (what gain_interval's blocks are made of)


@dataclass(frozen=True)
class Paths:
    """Labelled drafts laid out along their requests' outputs, for `replay_paths`: one row per output
    position of each request's span in the drafts (its draft there, or none: a position without a
    cache draft). Drafts of unknown position (< 0) stand alone, a path of one step, and only at
    decision points."""

    draft_len: np.ndarray  # per row (0: no cache draft at that position)
    label: np.ndarray  # per row
    span: np.ndarray  # per path, its rows (positions), paths one after the other
    kept: np.ndarray  # the input drafts laid out (indices)
    slot: np.ndarray  # each kept draft's row
    luck: np.ndarray  # per row, the model drafter's uniform draw: every policy replayed meets the same
    segment: np.ndarray  # per row, its stretch of SEGMENT positions of its path (numbered in order)
    segments: int
    batch: int = 1  # requests replayed at once (see `concurrency`)

    @staticmethod
    def of(request: np.ndarray, position: np.ndarray, draft_len: np.ndarray, label: np.ndarray, decided: np.ndarray,
           seed: int = 0, batch: int | None = None) -> "Paths":
        """`batch`: how many requests `replay_paths` runs at once; None: as many as were served at
        once when these drafts were (their `concurrency`)."""
        position = np.asarray(position, dtype=np.int64)
        known = position >= 0
        decided = np.asarray(decided, dtype=bool)
        if batch is None:
            batch = concurrency(request, known & decided)
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        kept = np.flatnonzero(known | decided)
        first: dict = {}  # request -> (path number, lowest position, highest position), in order of appearance
        for i in kept.tolist():
            key = request[i] if known[i] else ("alone", i)
            p = int(position[i]) if known[i] else 0
            if key in first:
                n, lo, hi = first[key]
                first[key] = (n, min(lo, p), max(hi, p))
            else:
                first[key] = (len(first), p, p)
        lows = np.array([lo for _, lo, _ in first.values()], dtype=np.int64)
        spans = np.array([hi - lo + 1 for _, lo, hi in first.values()], dtype=np.int64)
        offset = np.concatenate(([0], np.cumsum(spans)[:-1]))
        path = np.array([first[request[i] if known[i] else ("alone", i)][0] for i in kept.tolist()], dtype=np.int64)
        slot = offset[path] + np.where(known[kept], position[kept], 0) - lows[path]
        rows = int(spans.sum())
        dense_len = np.zeros(rows, dtype=np.int64)
        dense_label = np.zeros(rows, dtype=np.int64)
        dense_len[slot] = np.asarray(draft_len)[kept]  # a position drafted twice keeps its later draft
        dense_label[slot] = np.asarray(label)[kept]
        path_of_row = np.repeat(np.arange(len(spans)), spans)
        per_path = -(-spans // SEGMENT)
        segment = (np.concatenate(([0], np.cumsum(per_path)[:-1]))[path_of_row]
                   + (np.arange(rows) - offset[path_of_row]) // SEGMENT)
        return Paths(dense_len, dense_label, spans, kept, slot, np.random.default_rng(seed).random(rows), segment,
                     int(per_path.sum()), batch)


def concurrency(request: np.ndarray, decided: np.ndarray) -> int:
    """How many requests were served at once, read from the order of their decided drafts: the most
    requests whose first-to-last decision spans overlap (each step records one decision per
    request it serves, so requests in one batch interleave). At least 1."""
    at = np.flatnonzero(np.asarray(decided, dtype=bool))
    if not len(at):
        return 1
    first: dict = {}
    last: dict = {}
    for i, r in zip(at.tolist(), np.asarray(request, dtype=object)[at].tolist()):
        first.setdefault(r, i)
        last[r] = i
    starts = np.sort(np.fromiter(first.values(), dtype=np.int64))
    ends = np.sort(np.fromiter(last.values(), dtype=np.int64))
    # live just after each start: begun so far minus ended before it
    live = np.arange(1, len(starts) + 1) - np.searchsorted(ends, starts, side="left")
    return max(1, int(live.max()))


def replay_paths(curves: np.ndarray, paths: Paths, model_survival: np.ndarray, cost: CostProfile) -> Goodput:
    """Tokens and milliseconds of each request's path under the allocator with these curves (one per
    input draft): a verified cache prefix of l tokens moves the path 1 + min(label, l) positions on,
    the model draft 1 + its drawn acceptance (cut to k), nothing 1; a path ends once it has passed
    its span, its last step's tokens all counted (so a path of one step at batch 1 is its draft
    priced alone). The outcomes (`each`) are per stretch of SEGMENT positions of a path,
    in order, by where each step starts: the same stretches for every policy replayed, so that
    `gain_interval` can compare them slice by slice. At batch 1 every step of every path is decided
    at once; at `paths.batch` > 1 the paths run that many at a time (_replay_batched)."""
    rows = len(paths.draft_len)
    if not rows:
        return Goodput(0.0, 0.0, 0)
    se = np.asarray(model_survival, dtype=np.float64).reshape(-1)
    s = np.zeros((rows, np.asarray(curves).shape[1]))
    s[paths.slot] = np.asarray(curves)[paths.kept]
    if paths.batch > 1:
        return _replay_batched(s, paths, se, cost)
    plan = allocate_each(s, paths.draft_len, np.broadcast_to(se, (rows, len(se))), cost)
    draws = accepted_from_survival(se, paths.luck)
    accepted = np.where(plan.source == CACHE, np.minimum(paths.label, plan.length),
                        np.where(plan.source == MODEL, np.minimum(draws, plan.length), 0))
    advance, price = accepted + 1, np.asarray(plan.step_ms, dtype=np.float64)
    end = np.cumsum(paths.span)
    row = end - paths.span  # each path's next step, all paths at once (one row per path per round)
    tokens, time = np.zeros(paths.segments), np.zeros(paths.segments)
    going = np.flatnonzero(row < end)
    while len(going):
        at = row[going]
        tokens[paths.segment[at]] += advance[at]  # one row per path: no segment twice in a round
        time[paths.segment[at]] += price[at]
        row[going] = at + advance[at]
        going = going[row[going] < end[going]]
    return Goodput(float(tokens.sum()), float(time.sum()), len(paths.kept), (tokens, time))


def _replay_batched(s: np.ndarray, paths: Paths, se: np.ndarray, cost: CostProfile) -> Goodput:
    """`replay_paths` at serving's batch: `paths.batch` paths at a time in order of appearance (a
    finished one's slot goes to the next), the whole batch's step planned by one `allocate` call as
    the runtime plans it, each request's step charged an equal share of the step's time (as the
    replay engine does). At batch 8 a policy's choices cost what they cost beside seven others (one
    model draft length for the batch, one step price), which batch 1 misreads: on an unseen source
    a promotion walked at batch 1 gained 0.2% and lost 0.4% served at batch 8, where this replay
    said -0.2%."""
    end = np.cumsum(paths.span)
    start = end - paths.span
    draws = accepted_from_survival(se, paths.luck)
    tokens, time = np.zeros(paths.segments), np.zeros(paths.segments)
    waiting = list(range(len(paths.span)))[::-1]
    live: list[int] = []  # each live path's current row
    live_end: list[int] = []
    while waiting or live:
        while waiting and len(live) < paths.batch:
            p = waiting.pop()
            live.append(int(start[p]))
            live_end.append(int(end[p]))
        at = np.array(live)
        n = len(at)
        plan = allocate(s[at], paths.draft_len[at], np.broadcast_to(se, (n, len(se))), cost)
        accepted = np.where(plan.source == CACHE, np.minimum(paths.label[at], plan.length),
                            np.where(plan.source == MODEL, np.minimum(draws[at], plan.length), 0))
        np.add.at(tokens, paths.segment[at], accepted + 1)
        np.add.at(time, paths.segment[at], plan.step_ms / n)
        going = [(r, e) for r, e in zip((at + accepted + 1).tolist(), live_end) if r < e]
        live, live_end = [r for r, _ in going], [e for _, e in going]
    return Goodput(float(tokens.sum()), float(time.sum()), len(paths.kept), (tokens, time))


def gain(challenger: Goodput, champion: Goodput) -> float:
    """The challenger's goodput over the champion's, minus one (0 when there is nothing to compare)."""
    if champion.per_ms <= 0 or not champion.drafts:
        return 0.0
    return challenger.per_ms / champion.per_ms - 1.0


def gain_interval(challenger: Goodput, champion: Goodput, blocks: int = 10, z: float = 2.0) -> tuple[float, float]:
    """A rough interval for `gain` from `blocks` contiguous slices of the same outcomes (drafts, or
    stretches of paths; contiguous, since neighbouring drafts of one request are alike): mean block
    gain -+ z standard errors. (0, 0) without outcomes or with too few to make three slices."""
    blocks = min(blocks, len(champion.each[0]) // 2) if champion.each is not None else 0
    if challenger.each is None or blocks < 3:
        return 0.0, 0.0
    gains = []
    for part in np.array_split(np.arange(len(champion.each[0])), blocks):
        (tb, mb), (ta, ma) = ((e[0][part], e[1][part]) for e in (challenger.each, champion.each))
        gains.append((tb.sum() / mb.sum()) / (ta.sum() / ma.sum()) - 1.0 if ta.sum() > 0 and mb.sum() > 0 else 0.0)
    mean, se = float(np.mean(gains)), float(np.std(gains, ddof=1) / np.sqrt(blocks))
    return mean - z * se, mean + z * se


def wins(challenger: Goodput, champion: Goodput, margin: float) -> tuple[bool, float]:
    """Whether the challenger wins by `margin` and clearly (its interval above zero); and the gain."""
    g = gain(challenger, champion)
    low, _ = gain_interval(challenger, champion)
    return g >= margin and low > 0.0, g
