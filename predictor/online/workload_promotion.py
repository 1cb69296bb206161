"""Promotion per workload by counterfactual replay, and automatic rollback.

The newest `holdout` labelled drafts of each workload are held back from the challenger: the learner
trains on a draft only once it leaves its workload's window. Every `check_every` new drafts of a
workload, champion and challenger are replayed along the window's request paths
(predictor.online.counterfactual.replay_paths: the allocator's choices from each one's survival curves,
each policy walking its own path through the hindsight-labelled drafts, at the cost profile's
prices) and the challenger becomes that workload's champion only where its goodput beats the
champion's by `margin`, and clearly (predictor.online.counterfactual.wins: the gain over contiguous groups
of the window's paths, less two standard errors, is above zero; a 1% edge on a thousand correlated
drafts is noise). A winner is not promoted yet: on `confirmations` further windows, each made only
of drafts that came after the last look, it must still gain at least `rollback_margin` (what a
probation asks). Checked every `check_every` drafts on windows that overlap, a challenger now and
then wins one by luck; a window it was not chosen on says whether the edge is real, and costs a
window's delay instead of a window served worse. After a promotion the workload is on probation for
`probation` windows: each time its window holds only drafts served after the last look, the new
champion is replayed against the one it replaced, the outcomes are added to the earlier windows',
and unless it still gains at least `rollback_margin` on all of them together (0: it must not lose)
the workload moves back: a loss of half a percent shows only over several windows.
Every look also replays a perfect predictor (the true accepted lengths as curves) on the window: its
gain over the serving version is the headroom, about the most any challenger could win there.
No challenger is tried on a workload on probation. Both models are compared raw (without the fast
calibration, which is fitted afresh to whichever champion serves).

The caller (the learner service) owns the versions and aliases: this module decides.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from predictor.decision.profiles import CostProfile, known_survival
from predictor.gate.batch import Batch
from predictor.gate.mlp import GatePredictor
from predictor.online.counterfactual import CounterfactualPolicy, Goodput, Paths, gain, replay_paths, wins


@dataclass
class Verdict:
    """One comparison on a workload's window: promote, roll back, or nothing."""

    workload: int
    action: str  # "promote" | "rollback" | "keep"
    gain: float  # the candidate's goodput over the incumbent's, minus one
    candidate: Goodput
    incumbent: Goodput
    # what the look was and how it ended: "waiting" (too few later drafts), "lost", "won" (its
    # confirmations start), "confirmed" (more to go), "refused", "promoted", "kept" (a probation look
    # passed), "rolled back"
    outcome: str = "lost"
    # a perfect predictor's goodput over the serving version's on the same window (None: nothing was
    # replayed): about the most any challenger could gain there, so what is left to learn (it knows
    # the cache drafts' outcomes, not the model drafter's luck, so a policy can beat it by a hair)
    headroom: float | None = None
    window: int = 0  # drafts replayed in this look (a probation verdict's Goodputs add up all its looks)

    def to_json(self) -> dict:
        return {"action": self.action, "gain": round(self.gain, 5), "drafts": self.candidate.drafts,
                "candidate_tokens_per_ms": round(self.candidate.per_ms, 6),
                "incumbent_tokens_per_ms": round(self.incumbent.per_ms, 6)}


@dataclass
class _Watch:
    promoted: GatePredictor
    previous: GatePredictor
    windows_left: int
    since: int  # the workload's drafts held (WorkloadPromoter.seen) at the promotion or the last look
    # tokens and ms of the windows judged so far: promoted, then previous; and their drafts
    totals: np.ndarray = field(default_factory=lambda: np.zeros((2, 2)))
    drafts: int = 0

    def add(self, promoted: Goodput, previous: Goodput, now: int) -> tuple[Goodput, Goodput]:
        """One more window judged (`now`: the workload's drafts held); the outcomes of all of them so far."""
        self.totals += [[promoted.tokens, promoted.ms], [previous.tokens, previous.ms]]
        self.drafts += promoted.drafts
        self.since, self.windows_left = now, self.windows_left - 1
        return Goodput(*self.totals[0], self.drafts), Goodput(*self.totals[1], self.drafts)


@dataclass
class _Pending:
    """A challenger that won a check, waiting for its confirmations on windows of later drafts."""

    left: int
    since: int  # the workload's drafts held (WorkloadPromoter.seen) at its last win


@dataclass
class _Window:
    drafts: Batch
    seen: int = 0  # drafts of the workload ever held: the clock of its checks, watches and confirmations
    checked: int = 0  # `seen` at the last check
    watch: _Watch | None = None
    pending: _Pending | None = None
    verdicts: list[Verdict] = field(default_factory=list)


class WorkloadPromoter:
    def __init__(self, policy: CounterfactualPolicy, num_features: int, workloads: int) -> None:
        self.policy = policy
        empty = np.zeros(0)
        self._windows = [_Window(Batch(np.zeros((0, num_features), np.float32), empty.astype(np.float32),
                                       empty.astype(np.int64), empty.astype(np.int64), empty, empty.astype(object),
                                       empty.astype(bool), empty.astype(object), empty.astype(np.int64)))
                         for _ in range(workloads)]

    def hold(self, batch: Batch) -> Batch:
        """Put the new drafts in their workloads' windows; returns the drafts that left them (the
        oldest), which the challenger (and the fast calibration) may now learn from."""
        n = len(batch.label)
        # Drafts of unknown position (-1) each stand alone: a path of one step (predictor.online.counterfactual.Paths).
        alone = batch.request is None or batch.position is None
        batch = Batch(batch.features, batch.label, batch.draft_len, batch.workload, batch.tau,
                      np.full(n, "", dtype=object) if batch.tenant is None else batch.tenant,
                      np.ones(n, dtype=bool) if batch.decided is None else batch.decided,
                      np.full(n, "", dtype=object) if alone else batch.request,
                      np.full(n, -1, dtype=np.int64) if alone else batch.position)
        out: list[Batch] = [batch.take(slice(0, 0))]
        for w in np.unique(batch.workload).tolist():
            sel = batch.workload == w
            win = self._windows[w]
            win.drafts = Batch.join([win.drafts, batch.take(sel)])
            win.seen += int(sel.sum())
            spill = max(0, len(win.drafts.label) - self.policy.holdout)
            if spill:
                out.append(win.drafts.take(slice(0, spill)))
                win.drafts = win.drafts.take(slice(spill, None))
        return Batch.join(out)

    def watch(self, w: int, promoted: GatePredictor, previous: GatePredictor, fresh: int = 0) -> None:
        """Watch a promotion made elsewhere (a previous leader's), `fresh` of its workload's drafts
        served since: the rest of its probation, judged like this leader's own (the windows the
        other leader judged count as served, their outcomes are not known here)."""
        holdout, win = self.policy.holdout, self._windows[w]
        win.watch = _Watch(promoted, previous, max(1, self.policy.probation - fresh // holdout),
                           win.seen - fresh % holdout)

    def unwatch(self, w: int) -> None:
        """Stop watching workload `w`'s promotion: its alias did not move to the challenger (a pin held
        it, or it was moved meanwhile), or was moved by someone else since, so there is no promotion of
        this learner's to judge or roll back."""
        self._windows[w].watch = None

    def on_probation(self, fresh: int) -> bool:
        """Whether a promotion with `fresh` drafts of its workload served since is still watched."""
        return fresh < self.policy.probation * self.policy.holdout

    def watching(self, w: int) -> bool:
        return self._windows[w].watch is not None

    def confirming(self, w: int) -> bool:
        """Whether a challenger's win on workload `w` waits for its confirmation."""
        return self._windows[w].pending is not None

    def due(self) -> list[int]:
        """Workloads whose window is full and has seen `check_every` new drafts since its last check."""
        p = self.policy
        return [w for w, win in enumerate(self._windows)
                if len(win.drafts.label) >= p.holdout and win.seen - win.checked >= p.check_every]

    def seen(self, w: int) -> int:
        """Drafts of workload `w` held so far: a clock for whatever must wait for later drafts."""
        return self._windows[w].seen

    def judge(self, w: int, champion: GatePredictor, challenger: GatePredictor, model_survival: np.ndarray,
              cost: CostProfile) -> Verdict:
        """The comparison due on workload `w`: a promotion on probation first (nothing until the
        window is all drafts served since its last look; then roll back, or keep it, on all its
        looks so far), else the challenger against the champion: a win starts its confirmations, and
        only the last of them promotes (a loss ends them)."""
        win = self._windows[w]
        win.checked = win.seen
        watch = win.watch
        waiting = watch if watch is not None else win.pending
        if waiting is not None and win.seen - waiting.since < self.policy.holdout:  # not enough later traffic yet
            return Verdict(w, "keep", 0.0, Goodput(0, 0, 0), Goodput(0, 0, 0), "waiting")
        perfect = replay_drafts(known_survival(win.drafts.label, max(int(win.drafts.draft_len.max(initial=0)), 1)),
                                win.drafts, model_survival, cost)
        if watch is not None:
            serving = self._replay(win, watch.promoted, model_survival, cost)
            promoted, previous = watch.add(serving, self._replay(win, watch.previous, model_survival, cost), win.seen)
            kept = gain(promoted, previous)
            rollback = kept < self.policy.rollback_margin
            if rollback or watch.windows_left <= 0:
                win.watch = None
            verdict = Verdict(w, "rollback" if rollback else "keep", kept, promoted, previous,
                              "rolled back" if rollback else "kept", gain(perfect, serving), perfect.drafts)
        else:
            chal, champ = self._replay(win, challenger, model_survival, cost), self._replay(win, champion, model_survival, cost)
            if win.pending is None:
                won, g = wins(chal, champ, self.policy.margin)
                left = self.policy.confirmations if won else None
                outcome = "won" if won else "lost"
            else:  # a look it was not chosen on: it must still gain what a probation asks
                g = gain(chal, champ)
                left = win.pending.left - 1 if g >= self.policy.rollback_margin else None
                outcome = "refused" if left is None else "confirmed"
            win.pending = _Pending(left, win.seen) if left else None
            verdict = Verdict(w, "promote" if left == 0 else "keep", g, chal, champ,
                              "promoted" if left == 0 else outcome, gain(perfect, champ), perfect.drafts)
            if verdict.action == "promote":
                win.watch = _Watch(challenger, champion, max(1, self.policy.probation), win.seen)
        win.verdicts.append(verdict)
        return verdict

    @staticmethod
    def _replay(win: _Window, gate: GatePredictor, model_survival: np.ndarray, cost: CostProfile) -> Goodput:
        return replay_drafts(gate.survival(win.drafts.features), win.drafts, model_survival, cost)

    def drafts(self, w: int) -> Batch:
        """Workload `w`'s held-back drafts, oldest first (decision points and the shadow drafts between)."""
        return self._windows[w].drafts

    def window_size(self, w: int) -> int:
        return len(self._windows[w].drafts.label)


def paths_of(drafts: Batch, batch: int | None = None) -> Paths:
    """The drafts along their requests' paths (drafts of unknown request stand alone), replayed
    `batch` at a time (None: as many as were served at once)."""
    n = len(drafts.label)
    return Paths.of(np.full(n, "", dtype=object) if drafts.request is None else drafts.request,
                    np.full(n, -1, dtype=np.int64) if drafts.position is None else drafts.position,
                    drafts.draft_len, drafts.label, np.ones(n, dtype=bool) if drafts.decided is None else drafts.decided,
                    batch=batch)


def replay_drafts(curves: np.ndarray, drafts: Batch, model_survival: np.ndarray, cost: CostProfile,
                  batch: int | None = None) -> Goodput:
    """predictor.online.counterfactual.replay_paths on a batch of drafts (one curve per draft), the model
    drafter's curve the same for all."""
    return replay_paths(curves, paths_of(drafts, batch), np.asarray(model_survival).reshape(-1), cost)
