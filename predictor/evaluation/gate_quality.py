"""Gate quality: precision/recall at accepted length >= 6, MAE, calibration. Plain arrays in and out."""
from __future__ import annotations

import numpy as np

from storage.stats import LONG
from storage.workloads import WORKLOADS

CALIBRATION_EDGES = (0, 1, 2, 3, 4, 6, 8, 10, 25)


def precision_recall(predicted: np.ndarray, label: np.ndarray) -> tuple[float, float]:
    """A draft is 'long' when its accepted length >= LONG; predicted long when y_hat >= LONG.
    An empty denominator gives NaN-free 0.0 (no positives predicted / present)."""
    pred = np.asarray(predicted) >= LONG
    true = np.asarray(label) >= LONG
    tp = int(np.sum(pred & true))
    precision = tp / int(pred.sum()) if pred.any() else 0.0
    recall = tp / int(true.sum()) if true.any() else 0.0
    return precision, recall


def gate_metrics(predicted: np.ndarray, label: np.ndarray) -> dict[str, float | int]:
    precision, recall = precision_recall(predicted, label)
    mae = float(np.mean(np.abs(np.asarray(predicted) - np.asarray(label)))) if len(label) else 0.0
    return {"precision_ge6": round(precision, 4), "recall_ge6": round(recall, 4), "mae": round(mae, 4),
            "drafts": int(len(label)), "long_drafts": int(np.sum(np.asarray(label) >= LONG))}


def calibration(predicted: np.ndarray, label: np.ndarray) -> list[dict[str, float | int | str]]:
    """Mean predicted vs mean observed accepted length per bin of the prediction."""
    edges = np.asarray(CALIBRATION_EDGES, dtype=np.float64)
    bins = np.clip(np.digitize(predicted, edges) - 1, 0, len(edges) - 2)
    table = []
    for b in range(len(edges) - 1):
        sel = bins == b
        if sel.any():
            table.append({"bin": f"[{edges[b]:g},{edges[b + 1]:g})", "count": int(sel.sum()),
                          "mean_predicted": round(float(predicted[sel].mean()), 3),
                          "mean_observed": round(float(label[sel].mean()), 3)})
    return table


def survival_reliability(survival: np.ndarray, draft_len: np.ndarray,
                         label: np.ndarray) -> list[dict[str, float | int]]:
    """Per draft position j: over the drafts long enough to reach j, the mean predicted S(j) vs
    the share whose accepted length reached j (a calibrated curve has gap ~ 0 at every j).
    Positions no draft reaches are left out."""
    survival = np.asarray(survival, dtype=np.float64)
    draft_len = np.asarray(draft_len)
    label = np.asarray(label)
    if survival.ndim != 2 or len(survival) != len(draft_len) or len(label) != len(draft_len):
        raise ValueError(f"survival must be (n x K) with n = len(draft_len) = len(label); got {survival.shape}, "
                         f"{len(draft_len)} draft lengths, {len(label)} labels")
    table = []
    for j in range(1, survival.shape[1] + 1):
        reach = draft_len >= j
        n = int(reach.sum())
        if n:
            predicted = float(survival[reach, j - 1].mean())
            observed = float(np.mean(label[reach] >= j))
            table.append({"position": j, "count": n, "mean_predicted": round(predicted, 4),
                          "observed": round(observed, 4), "gap": round(predicted - observed, 4)})
    return table


def metrics_by_workload(predicted: np.ndarray, label: np.ndarray, workload: np.ndarray) -> dict:
    out = {"overall": gate_metrics(predicted, label), "by_workload": {}}
    for i, name in enumerate(WORKLOADS):
        sel = workload == i
        if sel.any():
            out["by_workload"][name] = gate_metrics(predicted[sel], label[sel])
    return out


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """The area under the ROC curve: P(a positive scores above a negative), ties counted half
    (Mann-Whitney on average ranks); nan without both classes."""
    score = np.asarray(score, dtype=np.float64)
    positive = np.asarray(positive).astype(bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    sorted_scores = score[order]
    first = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    last = np.r_[first[1:], len(score)] - 1
    ranks = np.empty(len(score), dtype=np.float64)
    ranks[order] = np.repeat((first + last) / 2.0 + 1.0, last - first + 1)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))

