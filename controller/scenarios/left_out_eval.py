"""`hvd eval --left-out`: the offline evaluation of a source the warm start never saw.

`hvd scenario unseen` serves each left-out source on the replay engine in one setting (gpu-8b,
batch 8). Its offline twin evaluates the same gate (the scenario's warm start without the source,
from the same cache) on the same stream, every policy and competitor's rule in every setting of
`hvd eval`: the honest proxy for traffic HVD was never tuned on, in all four settings.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from controller.scenarios.unseen import stream_mask, train_without
from predictor.decision.profiles import CostProfile, DrafterProfile
from predictor.evaluation.report import evaluate
from predictor.evaluation.simulator import RIVALS
from predictor.gate.training import TrainConfig
from predictor.replay.dataset import Dataset


def left_out_report(data: Dataset, source: str, train: TrainConfig, gates: Path | None, drafters: Sequence[DrafterProfile],
                    cost: CostProfile, settings: Sequence[tuple[CostProfile, int]] | None,
                    decide: CostProfile | None, seed: int, max_tokens: int | None,
                    log: Callable[[str], None] = print) -> dict:
    """`evaluate`'s report for `source`'s scenario stream under the warm start trained without it
    (trained now, and cached in `gates`, unless the scenario already did)."""
    gate = train_without(data, source, train, gates, log)
    mask = stream_mask(data, source, max_tokens)
    tokens = int(data.replay.output_len[mask].sum())
    return evaluate(data, gate, drafters, cost, seed=seed, settings=settings, decide=decide,
                    traces=(f"left-out source {source}: its scenario stream ({tokens} tokens), warm start without it", mask))


def format_left_out(reports: dict[str, dict]) -> str:
    """One line per left-out source, drafter and setting: HVD's overall ms against each rule's, and
    its worst workload margin (positive: the rule is faster there)."""
    lines = ["hvd against the competitors' rules on left-out sources, ms per 1000 tokens (negative: hvd faster; "
             "overall, then the worst workload):"]
    lost = []
    for source, report in reports.items():
        for drafter, c in report["checks"].items():
            if "ms_vs_rivals" not in c:
                continue
            for setting, by in c["ms_vs_rivals"].items():
                parts = []
                for rule in RIVALS:
                    worst = max((w for w in by if w != "overall"), key=lambda w: by[w][rule])
                    parts.append(f"{rule} {100 * by['overall'][rule]:+.1f}% (worst {worst} {100 * by[worst][rule]:+.1f}%)")
                    lost += [f"{source} {drafter} {setting} {w} against {rule} {100 * v[rule]:+.1f}%"
                             for w, v in by.items() if w != "overall" and v[rule] >= 0.0]
                lines.append(f"  {source:32s} {drafter:16s} {setting:15s} " + "; ".join(parts))
    lines.append("hvd below every rule on every workload in every setting: "
                 + ("yes" if not lost else "NO: " + ", ".join(lost)))
    return "\n".join(lines)
