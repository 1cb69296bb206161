"""How well vLLM's per-position acceptance logistic (the `vllm-adaptive` rule's estimator) fits suffix
drafts, with and without the rule's trust region: the fit's coefficients, its mean predicted
survival S(j) against the observed rate per draft position, and its AUC for accepted >= 1.

A seeded sample of the bundled held-out cache drafts is fed to the estimator --batch drafts at a
time, each draft one step of a one-request engine (as `hvd eval` runs the rule at batch 1: a refit
every 100 drafts), every verified draft labelled as vLLM labels it (accepted slots and the first
rejected one), for --train drafts; then it is scored on drafts it never saw. Docs: docs/design/rivals.md.

    python bench/rival_estimator_fit.py [--sample 200000] [--train 60000] [--batch 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictor.decision.rivals import vllm_adaptive  # noqa: E402
from predictor.decision.rivals.step_view import conditional_matrix  # noqa: E402
from predictor.evaluation.gate_quality import auc  # noqa: E402
from predictor.replay.dataset import build_dataset  # noqa: E402


def fit(q: np.ndarray, length: np.ndarray, label: np.ndarray, order: np.ndarray, batch: int,
        max_step: float) -> vllm_adaptive.AcceptanceLogistic:
    est = vllm_adaptive.AcceptanceLogistic(max_step=max_step)
    for i in range(0, len(order), batch):
        rows = order[i : i + batch]
        est.learn(q[rows], length[rows], label[rows], steps=len(rows))  # one-request engines, as at batch 1
    return est


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=200_000)
    parser.add_argument("--train", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = build_dataset(seed=args.seed, log=lambda line: None)
    rp = data.replay
    rows = np.flatnonzero((rp.draft_len > 0) & data.test_traces[rp.trace])
    rng = np.random.default_rng(args.seed)
    rows = np.sort(rng.choice(rows, min(args.sample, len(rows)), replace=False))
    q = conditional_matrix(rp.token_probs, rp.draft_len, vllm_adaptive.POSITIONS, rows)
    label, length = rp.label[rows].astype(np.int64), rp.draft_len[rows].astype(np.int64)
    order = rng.permutation(len(rows))
    train, test = order[: args.train], order[args.train :]
    j = np.arange(q.shape[1])[None, :]
    reached = j < length[test][:, None]
    observed = label[test][:, None] > j
    print(f"{len(rows)} held-out cache drafts; past the first token the tree's conditional frequency is 1 in "
          + ", ".join(f"{100 * np.mean(q[length > k, k] >= 1.0 - 1e-9):.0f}%" for k in (1, 2, 4, 8))
          + " of slots (positions 2, 3, 5, 9)")
    for name, max_step in (("as vLLM ships it (no trust region)", float("inf")),
                           (f"with the trust region (MAX_STEP {vllm_adaptive.MAX_STEP:g})", vllm_adaptive.MAX_STEP)):
        est = fit(q, length, label, train, args.batch, max_step)
        conf = est.confidence(q[test])
        s = np.cumprod(conf, axis=1)
        curve = " ".join(f"S({k + 1}) {s[reached[:, k], k].mean():.2f}/{observed[reached[:, k], k].mean():.2f}"
                         for k in (0, 1, 2, 3, 5, 7))
        print(f"{name}: {est.refits} refits, slope {est.slope:.3g}, intercepts {np.array2string(est.intercepts[:4], precision=3)}")
        print(f"  predicted/observed {curve}; AUC for accepted >= 1: "
              f"{auc(conf[:, 0], (label[test] >= 1).astype(np.float64)):.3f}")


if __name__ == "__main__":
    main()
