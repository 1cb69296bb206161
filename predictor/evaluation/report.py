"""Offline evaluation: every policy on the held-out traces, per workload and overall, in decode cycles
at batch 1 and in simulated engine time at each (cost profile, batch size) setting, plus the
predictor's own quality and the calibration of its survival curves. The JSON report is an interface
(see docs/reference/eval-report.md and its JSON Schema, docs/reference/eval-report.schema.json)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from predictor.decision.profiles import CostProfile, DrafterProfile, ProfileError, cost_profiles
from predictor.decision.rivals.step_view import conditional_matrix
from predictor.decision.rivals.vllm_adaptive import POSITIONS
from predictor.drafting.features import FEATURE_NAMES
from predictor.evaluation.gate_quality import calibration, survival_reliability
from predictor.evaluation.gate_quality import metrics_by_workload
from predictor.evaluation.simulator import (POLICIES, RIVALS, SETTINGS, SimInput, Simulator, Tally, figures,
                                            model_accepted, setting_name)
from predictor.gate.mlp import GatePredictor
from predictor.replay.dataset import Dataset
from storage.workloads import WORKLOADS

ORACLE_GAP = 0.05  # hvd's decode cycles against the binary oracle's (batch 1): the seed's target
BINARY_MARGIN = 0.005  # hvd's ms_per_1k may exceed hvd-binary's by at most this, anywhere
ORACLE_LENGTH_GAP = 0.10  # hvd's overall ms_per_1k within this of oracle-length's, in every setting
RELIABILITY_GAP = 0.03  # |mean predicted S(j) - observed| at every draft position j
EXPENSIVE_SETTINGS = ("cpu-smollm2/b8", "gpu-8b/b64")  # where verification is dear: hvd must beat the oracle gate
BASELINES = ("suffix", "model", "arctic", *RIVALS)
VLLM_DRAFTS = ("suffix", "arctic")  # the policies simulated on vLLM's suffix drafts (ReplayResult.vllm_len)
RELIABILITY_KEY = "survival_reliability"  # the predictor's entry in `checks` (the others are drafter profiles)
_GATE_CHUNK = 1 << 16
SIMULATED_NOTE = ("Model-drafter figures are SIMULATED (a chain drafter with a stated per-token acceptance); "
                  "cache-drafter figures replay real traces through arctic-inference's suffix cache; time "
                  "figures (speedup, ms_per_1k) come from the named cost profiles, not from a measurement. "
                  "hvd is the verification allocator (predictor.decision.allocator, the runtime's code) fed the "
                  "predictor's survival curves; hvd-binary is the binary goodput rule; oracle-length is the "
                  "allocator fed the true accepted lengths. vllm-adaptive, sglang-hybrid and trtllm are the competitors' own "
                  "rules (predictor.decision.rivals) on the same drafts and costs, each starting cold and learning only "
                  "from what it verified.")
POINT_GATE_NOTE = ("This predictor is a point-estimate gate (no survival curve): hvd falls back to the binary "
                   "rule (hvd-binary) and there is no reliability table.")


def default_settings() -> list[tuple[CostProfile, int]]:
    profiles = cost_profiles()
    return [(profiles[name], batch) for name, batch in SETTINGS]


def parse_settings(names: Sequence[str], profiles: dict[str, CostProfile]) -> list[tuple[CostProfile, int]]:
    """"cpu-smollm2/b8" -> (the cpu-smollm2 profile, 8)."""
    out = []
    for name in names:
        profile, sep, batch = name.rpartition("/b")
        if not sep or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"setting {name!r} is not PROFILE/bN with N >= 1 (e.g. cpu-smollm2/b8)")
        if profile not in profiles:
            raise ProfileError(f"setting {name!r}: unknown cost profile {profile!r}; known: {sorted(profiles)}")
        out.append((profiles[profile], int(batch)))
    return out


def evaluate(data: Dataset, gate: GatePredictor, drafters: Sequence[DrafterProfile], cost: CostProfile,
             seed: int = 0, all_traces: bool = False, version_id: int | None = None,
             settings: Sequence[tuple[CostProfile, int]] | None = None, decide: CostProfile | None = None,
             traces: tuple[str, np.ndarray] | None = None) -> dict:
    """`cost` prices the batch-1 figures (cycles, speedup: the seed's report); `settings` the ms_per_1k.
    `decide`, if given, is what the policies decide with (e.g. the prior a replica serves with before
    its live fit) while every step is still priced with `cost` or the setting's profile. `traces`:
    (what they are, a mask over data.records) to evaluate instead of the held-out sessions, e.g. a
    source the gate never saw."""
    settings = list(default_settings() if settings is None else settings)
    if not settings:
        raise ValueError("evaluate needs at least one (cost profile, batch) setting")
    names = [setting_name(c, b) for c, b in settings]
    if len(set(names)) != len(names):
        raise ValueError(f"settings repeat: {names}")
    rp = data.replay
    if traces is not None and all_traces:
        raise ValueError("evaluate: give all_traces or traces, not both")
    split, keep = traces if traces is not None else (
        ("all traces", np.ones(len(data.records), dtype=bool)) if all_traces else ("held-out sessions", data.test_traces))
    if len(keep) != len(data.records) or not keep.any():
        raise ValueError(f"evaluate: no traces to evaluate in {split!r}")
    rows = keep[rp.trace]
    survival, predicted = _gate_outputs(gate, rp.features[rows])
    sim = SimInput(
        trace=rp.trace[rows], position=rp.position[rows], draft_len=rp.draft_len[rows].astype(np.int64),
        label=rp.label[rows].astype(np.int64), score=rp.score[rows], predicted=predicted,
        traces=np.flatnonzero(keep), output_len=rp.output_len, trace_workload=rp.workload, survival=survival,
        match_len=rp.features[rows, FEATURE_NAMES.index("match_len")].astype(np.int64),
        token_prob=conditional_matrix(rp.token_probs, rp.draft_len, POSITIONS, rows),
    )
    # vLLM's suffix method and ArcticInference's rule verify the drafts vLLM's suffix shape makes, not
    # the longer ones HVD asks the cache for (cache_drafter.VLLM_SUFFIX)
    vllm_sim = replace(sim, draft_len=rp.vllm_len[rows].astype(np.int64), label=rp.vllm_label[rows].astype(np.int64),
                       score=rp.vllm_score[rows])
    has = sim.draft_len > 0
    gate_quality = metrics_by_workload(predicted[has], sim.label[has].astype(np.float64), rp.workload[sim.trace][has])
    reliability = (survival_reliability(survival[has], sim.draft_len[has], sim.label[has])
                   if survival is not None else [])
    report = {
        "note": SIMULATED_NOTE + ("" if survival is not None else " " + POINT_GATE_NOTE),
        "predictor_version": version_id,
        "split": split,
        "data": {"traces": int(keep.sum()), "output_tokens": int(rp.output_len[keep].sum()),
                 "cache_drafts": int(has.sum())},
        "decided_with": decide.name if decide is not None else None,
        "cost_profile": {"name": cost.name, "base_ms": cost.base_ms, "per_token_ms": cost.per_token_ms,
                         "draft_token_ms": cost.draft_token_ms, "description": cost.description},
        "settings": {name: {"cost_profile": c.name, "batch": b} for name, (c, b) in zip(names, settings)},
        "cost_profiles": {c.name: _profile_json(c) for c in {c.name: c for c, _ in [*settings, (cost, 1)]}.values()},
        "drafters": {},
        "predictor": {**gate_quality["overall"], "kind": gate.kind, "by_workload": gate_quality["by_workload"],
                      "calibration": calibration(predicted[has], sim.label[has]), "reliability": reliability},
    }
    groups = {w: sim.traces[rp.workload[sim.traces] == i] for i, w in enumerate(WORKLOADS)}
    groups = {w: t for w, t in groups.items() if len(t)}
    for drafter in drafters:
        model_acc = model_accepted(len(sim.trace), drafter, seed, sim.trace_workload[sim.trace])
        simulators = {False: Simulator(sim, drafter, model_acc), True: Simulator(vllm_sim, drafter, model_acc)}
        policies = {}
        for policy in POLICIES:
            simulator = simulators[policy in VLLM_DRAFTS]
            fig = _aggregate(simulator.per_trace(policy, cost, decide), rp.workload, cost)
            ms = {name: _ms_per_1k(simulator, policy, c, b, groups, decide) for name, (c, b) in zip(names, settings)}
            for key in ("ms_per_1k", "decode_ms_per_1k"):
                fig["overall"][key] = {name: by[key]["overall"] for name, by in ms.items()}
                for w, f in fig["by_workload"].items():
                    f[key] = {name: by[key][w] for name, by in ms.items()}
            policies[policy] = fig
        report["drafters"][drafter.name] = {
            "simulated": True, "acceptance_measured": drafter.measured, "draft_len": drafter.draft_len,
            "acceptance": drafter.acceptance, "acceptance_by_workload": dict(drafter.by_workload),
            "tokens_per_cycle": round(drafter.tokens_per_cycle, 4), "policies": policies,
        }
    report["checks"] = checks(report)
    return report


def _gate_outputs(gate: GatePredictor, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(survival curves or None for a point gate, expected accepted length), in chunks to bound memory."""
    if gate.kind != "survival":
        return None, np.concatenate([gate.predict(x[i : i + _GATE_CHUNK]) for i in range(0, len(x), _GATE_CHUNK)]
                                    or [np.zeros(0, np.float32)])
    parts = [gate.survival(x[i : i + _GATE_CHUNK]) for i in range(0, len(x), _GATE_CHUNK)]
    survival = np.concatenate(parts) if parts else np.zeros((0, gate.survival(x[:0]).shape[1]), np.float32)
    return survival, survival.sum(axis=1)


def _profile_json(c: CostProfile) -> dict:
    return {"base_ms": c.base_ms, "per_token_ms": c.per_token_ms, "draft_token_ms": c.draft_token_ms,
            "batch8_base_ms": c.batch8_base_ms, "batch8_per_token_ms": c.batch8_per_token_ms,
            "batch8_draft_token_ms": c.batch8_draft_token_ms, "draft_call_ms": c.draft_call_ms,
            "per_request_ms": c.per_request_ms, "compute_ms_per_token": c.compute_ms_per_token,
            "sources": list(c.sources), "description": c.description}


def _ms_per_1k(simulator: Simulator, policy: str, cost: CostProfile, batch: int,
               groups: dict[str, np.ndarray], decide: CostProfile | None = None) -> dict[str, dict[str, float]]:
    """Engine ms per 1000 tokens, per workload (each workload's traces on their own `batch` lanes) and
    overall (the workloads' time and tokens summed): over every step (`ms_per_1k`) and over the steps
    without a prefill cycle (`decode_ms_per_1k`, what an engine's decode-only steps are compared with)."""
    if batch == 1:
        per_trace = simulator.per_trace(policy, cost, decide)
        tallies = {}
        for w, traces in groups.items():
            tallies[w] = Tally()
            for t in traces.tolist():
                tallies[w].add(per_trace[t])
    else:
        tallies = {w: simulator.lanes(policy, cost, batch, traces, decide) for w, traces in groups.items()}
    overall = Tally()
    for t in tallies.values():
        overall.add(t)
    return {key: {"overall": round(getattr(overall, key), 3), **{w: round(getattr(t, key), 3) for w, t in tallies.items()}}
            for key in ("ms_per_1k", "decode_ms_per_1k")}


def _aggregate(tallies: dict[int, Tally], trace_workload: np.ndarray, cost: CostProfile) -> dict:
    baseline = cost.target_ms(1)  # no speculation: one single-token forward per token
    overall, per = Tally(), {}
    for trace, tally in tallies.items():
        overall.add(tally)
        per.setdefault(WORKLOADS[trace_workload[trace]], Tally()).add(tally)
    return {"overall": figures(overall, baseline).to_json(),
            "by_workload": {w: figures(per[w], baseline).to_json() for w in WORKLOADS if w in per}}


def checks(report: dict) -> dict:
    """The evaluation's targets, evaluated, per drafter profile; and the survival curve's calibration."""
    out: dict = {}
    for name, d in report["drafters"].items():
        p = d["policies"]
        hvd = p["hvd"]
        beats = {w: all(f["cycles_per_1k"] < p[o]["by_workload"][w]["cycles_per_1k"] for o in BASELINES)
                 for w, f in hvd["by_workload"].items()}
        gap = hvd["overall"]["cycles_per_1k"] / p["oracle"]["overall"]["cycles_per_1k"] - 1.0
        entry = {"hvd_beats_baselines": beats, "oracle_gap": round(gap, 4), "within_oracle_gap": gap <= ORACLE_GAP}
        failures = []

        def ms(policy: str, setting: str, scope: str) -> float:
            f = p[policy]["overall"] if scope == "overall" else p[policy]["by_workload"][scope]
            return f["ms_per_1k"][setting]

        settings = list(hvd["overall"]["ms_per_1k"])
        scopes = ["overall", *hvd["by_workload"]]
        ms_beats, vs_binary, vs_oracle, vs_length, vs_rivals = {}, {}, {}, {}, {}
        for s in settings:
            ms_beats[s] = {}
            vs_rivals[s] = {w: {r: round(ms("hvd", s, w) / ms(r, s, w) - 1.0, 4) for r in RIVALS} for w in scopes}
            for w in scopes[1:]:
                losers = [o for o in BASELINES if not ms("hvd", s, w) < ms(o, s, w)]
                ms_beats[s][w] = not losers
                if losers:
                    failures.append(f"{s} {w}: hvd {ms('hvd', s, w):.1f} ms/1k not below {', '.join(f'{o} {ms(o, s, w):.1f}' for o in losers)}")
            vs_binary[s] = {w: round(ms("hvd", s, w) / ms("hvd-binary", s, w) - 1.0, 4) for w in scopes}
            failures += [f"{s} {w}: hvd {100 * r:+.2f}% against hvd-binary (limit +{100 * BINARY_MARGIN:.1f}%)"
                         for w, r in vs_binary[s].items() if r > BINARY_MARGIN]
            vs_length[s] = round(ms("hvd", s, "overall") / ms("oracle-length", s, "overall") - 1.0, 4)
            if vs_length[s] > ORACLE_LENGTH_GAP:
                failures.append(f"{s}: hvd {100 * vs_length[s]:+.1f}% above oracle-length overall (limit {100 * ORACLE_LENGTH_GAP:.0f}%)")
            if s in EXPENSIVE_SETTINGS:
                vs_oracle[s] = round(ms("hvd", s, "overall") / ms("oracle", s, "overall") - 1.0, 4)
                if vs_oracle[s] >= 0.0:
                    failures.append(f"{s}: hvd {100 * vs_oracle[s]:+.1f}% against the binary oracle gate (must be below)")
        entry.update({
            "ms_beats_baselines": ms_beats,
            "ms_vs_rivals": vs_rivals,
            "ms_vs_hvd_binary": vs_binary,
            "within_hvd_binary": all(r <= BINARY_MARGIN for by in vs_binary.values() for r in by.values()),
            "ms_vs_oracle": vs_oracle,
            "beats_oracle": all(r < 0.0 for r in vs_oracle.values()),
            "ms_vs_oracle_length": vs_length,
            "within_oracle_length": all(r <= ORACLE_LENGTH_GAP for r in vs_length.values()),
            "failures": failures,
        })
        entry["all_met"] = (all(ok for by in ms_beats.values() for ok in by.values()) and entry["within_hvd_binary"]
                            and entry["beats_oracle"] and entry["within_oracle_length"])
        out[name] = entry
    table = report["predictor"].get("reliability") or []
    if table:
        failing = [row["position"] for row in table if abs(row["gap"]) > RELIABILITY_GAP]
        out[RELIABILITY_KEY] = {"tolerance": RELIABILITY_GAP, "max_abs_gap": max(abs(row["gap"]) for row in table),
                                "failing_positions": failing, "within": not failing}
    else:
        out[RELIABILITY_KEY] = {"tolerance": RELIABILITY_GAP, "within": None,
                                "reason": "no survival curve (a point-estimate gate)"}
    return out


def format_table(report: dict) -> str:
    lines = [report["note"], f"cost profile (cycles, speedup): {report['cost_profile']['name']}; split: {report['split']}; "
             f"{report['data']['traces']} traces, {report['data']['output_tokens']} output tokens"]
    for name, d in report["drafters"].items():
        lines.append("")
        lines.append(f"model drafter {name} (simulated, {d['tokens_per_cycle']:.2f} tokens/cycle): decode cycles per 1000 tokens, batch 1")
        workloads = list(d["policies"]["none"]["by_workload"])
        lines.append(f"{'policy':13s} {'overall':>8s} " + " ".join(f"{w:>9s}" for w in workloads) + f" {'tok/cyc':>8s} {'wasted/1k':>9s} {'speedup':>8s}")
        for policy, fig in d["policies"].items():
            o = fig["overall"]
            lines.append(f"{policy:13s} {o['cycles_per_1k']:8.1f} " + " ".join(f"{fig['by_workload'][w]['cycles_per_1k']:9.1f}" for w in workloads)
                         + f" {o['tokens_per_cycle']:8.3f} {o['wasted_per_1k']:9.1f} {o['speedup']:8.3f}")
        c = report["checks"][name]
        lines.append(f"HVD cycles below every baseline and rule on: {', '.join(w for w, ok in c['hvd_beats_baselines'].items() if ok) or 'none'}"
                     f"; not on: {', '.join(w for w, ok in c['hvd_beats_baselines'].items() if not ok) or 'none'}"
                     f"; cycles against the oracle gate {100 * c['oracle_gap']:+.1f}%")
        for setting in d["policies"]["none"]["overall"]["ms_per_1k"]:
            lines.append(f"ms per 1000 tokens, {setting} (simulated engine time)")
            lines.append(f"{'policy':13s} {'overall':>9s} " + " ".join(f"{w:>9s}" for w in workloads))
            for policy, fig in d["policies"].items():
                lines.append(f"{policy:13s} {fig['overall']['ms_per_1k'][setting]:9.1f} "
                             + " ".join(f"{fig['by_workload'][w]['ms_per_1k'][setting]:9.1f}" for w in workloads))
        lines.append("hvd against the competitors' rules, ms per 1000 tokens (negative: hvd faster):")
        for setting, by in c["ms_vs_rivals"].items():
            lines.append(f"  {setting:15s} " + "; ".join(
                f"{r} " + " ".join(f"{w} {100 * v[r]:+.1f}%" for w, v in by.items()) for r in RIVALS))
        lines.append(f"checks: hvd below {'/'.join(BASELINES)} on every workload in every setting: "
                     + ("yes" if all(ok for by in c["ms_beats_baselines"].values() for ok in by.values()) else "NO")
                     + f"; never more than {100 * BINARY_MARGIN:.1f}% above hvd-binary: {'yes' if c['within_hvd_binary'] else 'NO'}"
                     + f"; below the oracle gate at {', '.join(c['ms_vs_oracle']) or '-'}: {'yes' if c['beats_oracle'] else 'NO'}"
                     + f"; within {100 * ORACLE_LENGTH_GAP:.0f}% of oracle-length: {'yes' if c['within_oracle_length'] else 'NO'}")
        lines.append("  hvd against hvd-binary (overall): " + ", ".join(f"{s} {100 * by['overall']:+.2f}%" for s, by in c["ms_vs_hvd_binary"].items()))
        lines.append("  hvd against oracle (overall): " + (", ".join(f"{s} {100 * r:+.2f}%" for s, r in c["ms_vs_oracle"].items()) or "-")
                     + "; against oracle-length: " + ", ".join(f"{s} {100 * r:+.2f}%" for s, r in c["ms_vs_oracle_length"].items()))
        lines += [f"  not met: {f}" for f in c["failures"]]
    p = report["predictor"]
    lines.append("")
    lines.append(f"predictor ({p['kind']}; cache drafts of the evaluated traces): precision@>=6 {p['precision_ge6']:.3f}  recall@>=6 {p['recall_ge6']:.3f}  MAE {p['mae']:.3f}")
    for w, m in p["by_workload"].items():
        lines.append(f"  {w:10s} precision {m['precision_ge6']:.3f}  recall {m['recall_ge6']:.3f}  MAE {m['mae']:.3f}  drafts {m['drafts']}")
    lines.append("calibration: " + "; ".join(f"{c['bin']} n={c['count']} pred {c['mean_predicted']:.2f} obs {c['mean_observed']:.2f}" for c in p["calibration"]))
    r = report["checks"][RELIABILITY_KEY]
    if p["reliability"]:
        lines.append("survival reliability (per draft position j: drafts reaching j, mean predicted S(j), observed P(accepted >= j)):")
        lines += [f"  j={row['position']:2d} n={row['count']:7d} predicted {row['mean_predicted']:.3f} observed {row['observed']:.3f} gap {row['gap']:+.3f}"
                  for row in p["reliability"]]
        lines.append(f"  within {r['tolerance']} at every position: {'yes' if r['within'] else 'NO, positions ' + ', '.join(map(str, r['failing_positions']))}"
                     f" (largest gap {r['max_abs_gap']:.3f})")
    else:
        lines.append(f"survival reliability: none ({r['reason']})")
    return "\n".join(lines)
