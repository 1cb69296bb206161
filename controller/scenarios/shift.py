"""The workload-shift scenario: warm start without one workload, then that workload starts arriving.

Two predictors are trained offline on the training sessions: one without workload W (the
champion the online run starts from) and one on all workloads (the reference). The held-out
sessions are then served on the replay engine, first the other workloads, then W, twice: online
(learner on, starting from the W-less champion) and static (the all-workload predictor, learning
off). Both runs are synchronous, so the whole scenario is deterministic under its seed. Reported
per window of W's tokens: cycles per 1000 tokens of both runs, and the online gate's precision and
recall at accepted length >= 6; plus after how many W tokens the online run stays within 5% of the
reference. Every event, bucket, version and drift event of the online run is in its database.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controller.cli.serve_traces import ReplayServeOptions, serve_replay
from controller.scenarios.defaults import OTHERS
from controller.scenarios.defaults import SHIFT_WINDOW_TOKENS as WINDOW_TOKENS
from predictor.drafting.features import schema_hash
from predictor.evaluation.gate_quality import precision_recall
from predictor.gate.mlp import GatePredictor
from predictor.gate.registry import store_champion
from predictor.gate.training import TrainConfig, train_mlp
from predictor.online.learner import LearnerConfig
from predictor.online.promotion import PromotionPolicy
from predictor.replay.dataset import Dataset
from storage.engine import make_engine, session_scope
from storage.events import list_events
from storage.migrate import upgrade
from storage.workloads import WORKLOADS

WITHIN = 0.05


@dataclass
class Window:
    tokens_until: int
    online_cycles_per_1k: float
    offline_cycles_per_1k: float
    online_precision: float
    online_recall: float


def _train(data: Dataset, keep_workloads: set[int], config: TrainConfig) -> GatePredictor:
    rows = data.rows(test=False) & np.isin(data.replay.row_workload(), list(keep_workloads))
    rp = data.replay
    model = train_mlp(rp.features[rows], rp.label[rows], rp.row_workload()[rows], config)
    return GatePredictor.from_torch(model, schema_hash())


def fresh_db(path: Path, gate: GatePredictor, reason: str, actor: str = "hvd scenario shift") -> str:
    """A new SQLite database at `path` (any old one replaced) whose champion is `gate`; its URL."""
    path.unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    upgrade(engine)
    with session_scope(engine) as s:
        store_champion(s, gate, reason=reason, actor=actor)
    engine.dispose()
    return url


def run_shift(data: Dataset, workload: str, folder: Path, others: int = OTHERS, window_tokens: int = WINDOW_TOKENS,
              seed: int = 0, log: Callable[[str], None] = print) -> dict:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {WORKLOADS}")
    w = WORKLOADS.index(workload)
    config = TrainConfig(seed=seed)
    log(f"training the warm-start predictor without {workload} and the reference on all workloads")
    without = _train(data, set(range(len(WORKLOADS))) - {w}, config)
    reference = _train(data, set(range(len(WORKLOADS))), config)
    test = [r for r, t in zip(data.records, data.test_traces) if t]
    stream = [r for r in test if r.workload != workload][:others] + [r for r in test if r.workload == workload]
    log(f"serving {len(stream)} held-out requests: {others} of other workloads, then "
        f"{sum(r.workload == workload for r in stream)} of {workload}")
    folder.mkdir(parents=True, exist_ok=True)
    curves = {}
    for name, gate, learn in (("online", without, True), ("offline_all", reference, False)):
        url = fresh_db(folder / f"shift-{name}.db", gate, f"shift scenario ({name})")
        points: list[tuple[int, int]] = []

        def on_step(run, runtime, points=points) -> None:
            t = run.by_workload.get(workload)
            if t is not None and (not points or t.tokens - points[-1][0] >= window_tokens // 4):
                points.append((t.tokens, t.cycles))

        learner = LearnerConfig(seed=seed, window=4000, promotion=PromotionPolicy(min_events=2000))
        opts = ReplayServeOptions(batch_size=8, seed=seed, learn=learn, synchronous=True, sync_every=20,
                                  progress_seconds=30.0, learner=learner)
        result = serve_replay(make_engine(url), stream, opts, log=log, on_step=on_step)
        final = result.run.by_workload[workload]
        points.append((final.tokens, final.cycles))
        curves[name] = (points, url, result)
        log(f"  {name}: {workload} {final.cycles_per_1k:.1f} cycles/1k; promotions {result.promotions}")
    return _report(workload, curves, window_tokens)


def _cycles_at(points: list[tuple[int, int]], tokens: int) -> int:
    """Cycles spent by the time `tokens` tokens of the workload were out (linear between samples)."""
    xs, ys = zip(*points)
    return int(np.interp(tokens, xs, ys))


def _report(workload: str, curves: dict, window_tokens: int) -> dict:
    online_pts, online_url, online_res = curves["online"]
    offline_pts, _, offline_res = curves["offline_all"]
    total = min(online_pts[-1][0], offline_pts[-1][0])
    with session_scope(make_engine(online_url)) as s:
        events = [e for e in list_events(s, workload=workload) if e.drafter == "cache"]
    # events come in decoding order; map them onto token windows by their share of the total
    pred = np.array([e.predicted if e.predicted is not None else 0.0 for e in events])
    label = np.array([e.accepted for e in events])
    windows, edges = [], list(range(window_tokens, total, window_tokens)) + [total]
    start = 0
    for i, end in enumerate(edges):
        lo = 0 if i == 0 else edges[i - 1]
        on = (_cycles_at(online_pts, end) - _cycles_at(online_pts, lo)) * 1000.0 / max(end - lo, 1)
        off = (_cycles_at(offline_pts, end) - _cycles_at(offline_pts, lo)) * 1000.0 / max(end - lo, 1)
        stop = int(round(len(events) * end / total))
        p, r = precision_recall(pred[start:stop], label[start:stop])
        start = stop
        windows.append(Window(end, round(on, 1), round(off, 1), round(p, 3), round(r, 3)))
    after = None
    for i in range(len(windows)):
        if all(x.online_cycles_per_1k <= (1 + WITHIN) * x.offline_cycles_per_1k for x in windows[i:]):
            after = windows[i - 1].tokens_until if i else 0
            break
    on_final = online_res.run.by_workload[workload].cycles_per_1k
    off_final = offline_res.run.by_workload[workload].cycles_per_1k
    return {
        "workload": workload, "window_tokens": window_tokens,
        "windows": [w.__dict__ for w in windows],
        "online_cycles_per_1k": round(on_final, 1), "offline_all_cycles_per_1k": round(off_final, 1),
        "online_within_5pct_after_tokens": after, "promotions": online_res.promotions,
        "drift_events": [list(d) for d in online_res.drifts], "online_database": online_url,
    }


def format_report(report: dict) -> str:
    w = report["workload"]
    lines = [f"workload shift: warm start without {w}, then {w} arrives (held-out sessions, replay engine)",
             f"{'tokens of ' + w:>14s} {'online cyc/1k':>14s} {'offline-all':>12s} {'precision@6':>12s} {'recall@6':>9s}"]
    for x in report["windows"]:
        lines.append(f"{x['tokens_until']:14d} {x['online_cycles_per_1k']:14.1f} {x['offline_cycles_per_1k']:12.1f} "
                     f"{x['online_precision']:12.3f} {x['online_recall']:9.3f}")
    after = report["online_within_5pct_after_tokens"]
    lines.append(f"overall on {w}: online {report['online_cycles_per_1k']} vs offline-all "
                 f"{report['offline_all_cycles_per_1k']} cycles/1k; online within 5% of offline-all "
                 + (f"from {after} tokens of {w} on" if after is not None else "never (in this run)")
                 + f"; promotions {report['promotions']}; drift events {len(report['drift_events'])}")
    return "\n".join(lines)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
