"""`hvd scenario signals`: what the engine's own signal buys, on SmolLM2's own held-out answers.

The engine knows one thing the text-only traces do not: that the output it verifies is its own.
The `on_policy` feature says so (live traffic and the traces the engine recorded: 1; text other
models wrote: 0). The target's confidence at the last emitted position (top-1 probability, logit gap,
entropy) was measured here too and bought nothing beyond it, so it was removed (docs/results/figures.md).

The warm start learns from the bundled traces and the recorded on-policy corpus
(data/onpolicy-train.jsonl.xz: SmolLM2's answers as the engine emitted them) twice: with the column
("on-policy") and with it zeroed ("text-only": as if every trace were other models' text, so the gate
ignores it). Both learn from the same seeded sample of drafts with the same training config. Each is
then judged on the held-out recorded sessions (data/onpolicy-held-out.jsonl.xz, never trained on):

- offline, on the held-out replay's drafts: AUC of S(1) for "accepted >= 1" and precision/recall
  at accepted length >= 6;
- served on the replay engine (synchronous, seeded) with learning off and on; beside them the
  perfect predictor (every cache draft's true accepted length), which bounds what any predictor
  can buy. The headroom a variant recovers is (text-only - variant) / (text-only - perfect) in
  simulated ms per 1k tokens.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from controller.cli.serve_traces import ReplayServeOptions
from controller.scenarios.unseen import TRAIN_DRAFTS, serve_mode
from predictor.data.traces import TraceRecord
from predictor.drafting.features import FEATURE_NAMES, schema_hash
from predictor.evaluation.gate_quality import auc, precision_recall
from predictor.gate.mlp import GatePredictor
from predictor.gate.training import TrainConfig, train_gate
from predictor.replay.dataset import Dataset
from predictor.replay.trace_replay import ReplayResult

ON_POLICY, TEXT_ONLY = "on-policy", "text-only"
ON_POLICY_COLUMN = FEATURE_NAMES.index("on_policy")
VARIANTS = (ON_POLICY, TEXT_ONLY)


def dropped_columns(variant: str) -> list[int]:
    """The feature columns a variant zeroes."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    return [ON_POLICY_COLUMN] if variant == TEXT_ONLY else []


def masked(x: np.ndarray, variant: str) -> np.ndarray:
    """`x` as the variant sees it in training (its dropped columns 0)."""
    drop = dropped_columns(variant)
    if not drop:
        return x
    out = x.copy()
    out[:, drop] = 0.0
    return out


def train_variant(data: Dataset, variant: str, config: TrainConfig, cache_dir: Path | None,
                  log: Callable[[str], None], max_drafts: int = TRAIN_DRAFTS) -> GatePredictor:
    """The warm start of one variant on a seeded sample of at most `max_drafts` of every trace's
    drafts (both sides of the split: the held-out corpus is a file of its own), cached by the
    replay key, variant, sample size and config."""
    key = hashlib.sha256(json.dumps([data.key, variant, config.to_json(), max_drafts, schema_hash()]).encode()
                         ).hexdigest()[:16]
    path = None if cache_dir is None else cache_dir / f"{variant}-{key}.hvd"
    if path is not None and path.exists():
        return GatePredictor.from_bytes(path.read_bytes(), expected_schema_hash=schema_hash())
    rp = data.replay
    rows = np.flatnonzero(rp.draft_len > 0)
    if len(rows) > max_drafts:
        rows = np.sort(np.random.default_rng(config.seed).choice(rows, max_drafts, replace=False))
    on_policy = int(rp.features[rows, ON_POLICY_COLUMN].sum())
    log(f"  training the {variant} warm start on {len(rows)} drafts ({on_policy} on-policy)")
    model = train_gate(masked(rp.features[rows], variant), rp.label[rows], rp.row_workload()[rows], config)
    gate = GatePredictor.from_torch(model, schema_hash())
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gate.to_bytes())
    return gate


def quality(gate: GatePredictor, held: ReplayResult) -> dict[str, float]:
    """On the held-out replay's drafts, as served (every column present): AUC of S(1) for accepted
    >= 1, precision/recall at >= 6 of the predicted length."""
    rows = held.draft_len > 0
    x, label = held.features[rows], held.label[rows].astype(np.float64)
    p, r = precision_recall(gate.predict(x).astype(np.float64), label)
    return {"auc_accept_1": round(auc(gate.survival(x)[:, 0], label >= 1), 4), "precision_6": round(p, 4),
            "recall_6": round(r, 4), "drafts": int(rows.sum())}


def run_signals(data: Dataset, held: Sequence[TraceRecord], held_replay: ReplayResult, folder: Path,
                opts: ReplayServeOptions, train: TrainConfig | None = None, variants: Sequence[str] = VARIANTS,
                log: Callable[[str], None] = print) -> dict:
    """Train every variant, judge each offline and served on `held`; the report as plain data."""
    if not held:
        raise ValueError("no held-out recorded sessions to serve")
    if not any(r.engine is not None for r in held):
        raise ValueError("the held-out traces are none of them recorded by the engine (record them: "
                         "tools/record_onpolicy.py)")
    train = train or TrainConfig(seed=opts.seed)
    folder.mkdir(parents=True, exist_ok=True)
    gates = {v: train_variant(data, v, train, folder / "gates", log) for v in variants}
    static = replace(opts, learn=False)
    whole = int(held_replay.output_len.sum())  # one report window: the whole held-out stream
    report: dict = {"cost_profile": opts.cost_profile, "batch_size": opts.batch_size, "seed": opts.seed,
                    "held_out_tokens": whole, "variants": {}}
    for v in (*gates, "perfect"):
        (folder / v).mkdir(exist_ok=True)
    for v, gate in gates.items():
        figures = quality(gate, held_replay)
        figures["static_ms_per_1k"] = serve_mode("static", gate, held, folder / v, static, whole, log).ms_per_1k
        figures["learn_ms_per_1k"] = serve_mode("learn", gate, held, folder / v, opts, whole, log).ms_per_1k
        report["variants"][v] = figures
    perfect = serve_mode("perfect", gates[variants[0]], held, folder / "perfect", static, whole, log)
    report["perfect_ms_per_1k"] = perfect.ms_per_1k
    base = report["variants"].get(TEXT_ONLY, {}).get("static_ms_per_1k")
    if base is not None:
        room = base - perfect.ms_per_1k
        for figures in report["variants"].values():
            for mode in ("static", "learn"):
                if f"{mode}_ms_per_1k" in figures and room > 0:
                    figures[f"{mode}_headroom_recovered"] = round((base - figures[f"{mode}_ms_per_1k"]) / room, 3)
    return report


def format_report(report: dict) -> str:
    lines = [f"held-out recorded sessions: {report['held_out_tokens']} tokens, replay engine, {report['cost_profile']} "
             f"batch {report['batch_size']}, seed {report['seed']}; perfect predictor {report['perfect_ms_per_1k']:.1f} ms/1k",
             f"{'variant':<22}{'AUC(>=1)':>9}{'P@6':>7}{'R@6':>7}{'static ms/1k':>14}{'recovered':>10}"
             f"{'learn ms/1k':>13}{'recovered':>10}"]
    for v, f in report["variants"].items():
        def cell(key: str, width: int, fmt: str) -> str:
            return f"{format(f[key], fmt):>{width}}" if key in f else " " * (width - 1) + "-"
        lines.append(f"{v:<22}{f['auc_accept_1']:>9.4f}{f['precision_6']:>7.3f}{f['recall_6']:>7.3f}"
                     f"{cell('static_ms_per_1k', 14, '.1f')}{cell('static_headroom_recovered', 10, '.3f')}"
                     f"{cell('learn_ms_per_1k', 13, '.1f')}{cell('learn_headroom_recovered', 10, '.3f')}")
    return "\n".join(lines)
