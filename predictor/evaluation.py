"""Offline evaluation: every policy on the held-out traces, per workload and overall, plus the
predictor's own quality. The JSON report is an interface (see README, "Evaluation report")."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from predictor.metrics import calibration
from predictor.mlp import GatePredictor
from predictor.profiles import CostProfile, DrafterProfile
from predictor.simulator import POLICIES, SimInput, Tally, figures, model_accepted, simulate
from predictor.traces import WORKLOADS
from predictor.warmstart import Dataset, metrics_by_workload

ORACLE_GAP = 0.05
SIMULATED_NOTE = ("Model-drafter figures are SIMULATED (a chain drafter with a stated per-token acceptance); "
                  "cache-drafter figures replay real traces through arctic-inference's suffix cache; time "
                  "figures (speedup) come from the named cost profile, not from a measurement.")


def evaluate(data: Dataset, gate: GatePredictor, drafters: Sequence[DrafterProfile], cost: CostProfile,
             seed: int = 0, all_traces: bool = False, version_id: int | None = None) -> dict:
    rp = data.replay
    keep = np.ones(len(data.records), dtype=bool) if all_traces else data.test_traces
    rows = keep[rp.trace]
    predicted = gate.predict(rp.features[rows])
    sim = SimInput(
        trace=rp.trace[rows], position=rp.position[rows], draft_len=rp.draft_len[rows].astype(np.int64),
        label=rp.label[rows].astype(np.int64), score=rp.score[rows], predicted=predicted,
        traces=np.flatnonzero(keep), output_len=rp.output_len, trace_workload=rp.workload,
    )
    has = sim.draft_len > 0
    gate_quality = metrics_by_workload(predicted[has], sim.label[has].astype(np.float64), rp.workload[sim.trace][has])
    report = {
        "note": SIMULATED_NOTE,
        "predictor_version": version_id,
        "split": "all traces" if all_traces else "held-out sessions",
        "data": {"traces": int(keep.sum()), "output_tokens": int(rp.output_len[keep].sum()),
                 "cache_drafts": int(has.sum())},
        "cost_profile": {"name": cost.name, "base_ms": cost.base_ms, "per_token_ms": cost.per_token_ms,
                         "draft_token_ms": cost.draft_token_ms, "description": cost.description},
        "drafters": {},
        "predictor": {**gate_quality["overall"], "by_workload": gate_quality["by_workload"],
                      "calibration": calibration(predicted[has], sim.label[has])},
    }
    for drafter in drafters:
        model_acc = model_accepted(len(sim.trace), drafter, seed, sim.trace_workload[sim.trace])
        policies = {}
        for policy in POLICIES:
            tallies = simulate(policy, sim, drafter, cost, model_acc)
            policies[policy] = _aggregate(tallies, rp.workload, cost)
        report["drafters"][drafter.name] = {
            "simulated": True, "acceptance_measured": drafter.measured, "draft_len": drafter.draft_len,
            "acceptance": drafter.acceptance, "acceptance_by_workload": dict(drafter.by_workload),
            "tokens_per_cycle": round(drafter.tokens_per_cycle, 4), "policies": policies,
        }
    report["checks"] = checks(report)
    return report


def _aggregate(tallies: dict[int, Tally], trace_workload: np.ndarray, cost: CostProfile) -> dict:
    baseline = cost.target_ms(1)  # no speculation: one single-token forward per token
    overall, per = Tally(), {}
    for trace, tally in tallies.items():
        overall.add(tally)
        per.setdefault(WORKLOADS[trace_workload[trace]], Tally()).add(tally)
    return {"overall": figures(overall, baseline).to_json(),
            "by_workload": {w: figures(per[w], baseline).to_json() for w in WORKLOADS if w in per}}


def checks(report: dict) -> dict:
    """The evaluation's targets, evaluated: HVD beats suffix/model/arctic on every workload and is
    within 5% of the oracle gate overall, for every drafter profile."""
    out = {}
    for name, d in report["drafters"].items():
        p = d["policies"]
        beats = {}
        for w, hvd in p["hvd"]["by_workload"].items():
            beats[w] = all(hvd["cycles_per_1k"] < p[o]["by_workload"][w]["cycles_per_1k"] for o in ("suffix", "model", "arctic"))
        gap = p["hvd"]["overall"]["cycles_per_1k"] / p["oracle"]["overall"]["cycles_per_1k"] - 1.0
        out[name] = {"hvd_beats_baselines": beats, "oracle_gap": round(gap, 4), "within_oracle_gap": gap <= ORACLE_GAP}
    return out


def format_table(report: dict) -> str:
    lines = [report["note"], f"cost profile: {report['cost_profile']['name']}; split: {report['split']}; "
             f"{report['data']['traces']} traces, {report['data']['output_tokens']} output tokens"]
    for name, d in report["drafters"].items():
        lines.append("")
        lines.append(f"model drafter {name} (simulated, {d['tokens_per_cycle']:.2f} tokens/cycle): decode cycles per 1000 tokens")
        workloads = list(d["policies"]["none"]["by_workload"])
        lines.append(f"{'policy':8s} {'overall':>8s} " + " ".join(f"{w:>9s}" for w in workloads) + f" {'tok/cyc':>8s} {'wasted/1k':>9s} {'speedup':>8s}")
        for policy, fig in d["policies"].items():
            o = fig["overall"]
            lines.append(f"{policy:8s} {o['cycles_per_1k']:8.1f} " + " ".join(f"{fig['by_workload'][w]['cycles_per_1k']:9.1f}" for w in workloads)
                         + f" {o['tokens_per_cycle']:8.3f} {o['wasted_per_1k']:9.1f} {o['speedup']:8.3f}")
        c = report["checks"][name]
        lines.append(f"HVD beats suffix/model/arctic on: {', '.join(w for w, ok in c['hvd_beats_baselines'].items() if ok) or 'none'}"
                     f"; not on: {', '.join(w for w, ok in c['hvd_beats_baselines'].items() if not ok) or 'none'}"
                     f"; gap to oracle {100 * c['oracle_gap']:+.1f}%")
    p = report["predictor"]
    lines.append("")
    lines.append(f"predictor (cache drafts of the evaluated traces): precision@>=6 {p['precision_ge6']:.3f}  recall@>=6 {p['recall_ge6']:.3f}  MAE {p['mae']:.3f}")
    for w, m in p["by_workload"].items():
        lines.append(f"  {w:10s} precision {m['precision_ge6']:.3f}  recall {m['recall_ge6']:.3f}  MAE {m['mae']:.3f}  drafts {m['drafts']}")
    lines.append("calibration: " + "; ".join(f"{c['bin']} n={c['count']} pred {c['mean_predicted']:.2f} obs {c['mean_observed']:.2f}" for c in p["calibration"]))
    return "\n".join(lines)
