"""What the EAGLE3 head's agreement with the cache draft would tell the gate, measured before building it.

Issue 30's other engine signal: in a step where EAGLE3 runs, its first draft token and probability,
and whether they agree with the cache draft's. This measures what that would buy on the recorded
held-out sessions (data/onpolicy-held-out.jsonl.xz, SmolLM2's own answers), offline:

1. The committed head (fp32, teacher-forced over the fp32 target's hidden states of prompt and
   answer, the head's window the last --context prompt tokens as it was trained) gives, at every
   answer position t, the first token vLLM's proposer would draft right after the target emitted
   output[t-1] (its input: that token with the target's states at the position before), that
   token's probability, and the probability it gives the cache draft's first token there. The
   alignment is printed: the head's token equals output[t] about as often as its served
   position-1 acceptance (docs/results/eagle3.md), and far less often shifted by one.
2. The shipped gate (the on-policy warm start of `hvd scenario signals`, trained or read from
   var/scenario-signals/gates) scores the same drafts. A logistic regression on [logit S(1),
   agreement, the head's top-1 probability, its probability of the cache token], fitted on half the
   sessions and scored on the other half (both ways), replaces the gate's S(1); the curve past the
   first token keeps the gate's conditional survival, S'(j) = S(j) * p' / S(1).
3. The simulator's allocator (the runtime's code) serves the held-out sessions with S, with S' and
   with S' priced at one head call per engine step (an upper bound on what running the head before
   every decision costs: steps that drafted with the model ran it anyway), beside a perfect
   first-token predictor and the perfect predictor; headroom recovered = (gate - x) / (gate - perfect).

    python bench/eagle_agreement.py [--rows N] [--context 128] [--seed 0]
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.engines import vllm_engine as ve  # noqa: E402
from predictor.data.tokens import TraceTokenizer  # noqa: E402
from predictor.data.traces import TraceRecord, load_traces, onpolicy_traces_path  # noqa: E402
from predictor.decision.profiles import cost_profiles, drafter_profiles  # noqa: E402
from predictor.evaluation.gate_quality import auc  # noqa: E402
from predictor.evaluation.simulator import SimInput, Simulator, model_accepted  # noqa: E402
from predictor.replay.trace_replay import ReplayResult  # noqa: E402
from predictor.replay.trace_replay_cache import cached_replay  # noqa: E402

SETTINGS = (("gpu-8b", 1), ("gpu-8b", 8), ("cpu-smollm2", 1), ("cpu-smollm2", 8))
CACHE = Path(__file__).resolve().parents[1] / "var" / "eagle-agreement"


def head_view(records: list[TraceRecord], rp: ReplayResult, first: np.ndarray, context: int) -> dict[str, np.ndarray]:
    """Per replay row: the head's first token (target id), its probability, the probability it
    gives the cache draft's first token (0 outside its draft vocabulary), and per answer position
    whether its token is output[t] (and output[t -/+ 1], the alignment check)."""
    import torch

    from eagle3_training.generate import Sample
    from eagle3_training.hidden_states import HiddenStateReader, training_row
    from eagle3_training.serving_walk import load_head, row_inputs

    model = load_head(ve.EAGLE_HEAD, ve.MODEL_FP32)
    d2t, t2d = model.d2t.long(), model.t2d.bool()
    draft_index = torch.full((len(t2d),), -1, dtype=torch.long)
    draft_index[t2d] = torch.arange(int(t2d.sum()))
    reader = HiddenStateReader(ve.MODEL_FP32, dtype=torch.float32)
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, inputs, out: logits.append(out.detach()))
    tokenizer = TraceTokenizer()
    out = {name: np.zeros(rp.rows, dtype=np.float32) for name in ("top1", "top1_prob", "p_cache")}
    hits = np.zeros(3, dtype=np.int64)  # head's token == output[t - 1], output[t], output[t + 1]
    positions = 0
    starts = np.zeros(len(records), dtype=np.int64)  # each trace's rows are contiguous, positions 1..n-1
    traces, first_rows = np.unique(rp.trace, return_index=True)
    starts[traces] = first_rows
    t0 = time.perf_counter()
    for i, record in enumerate(records):
        answer = tokenizer.output_tokens(record)
        n = len(answer)
        if n < 2:
            continue
        prompt = tokenizer.encode_context(record)
        sample = Sample(record.trace_id, record.workload, tuple(prompt.tolist()), tuple(answer.tolist()))
        kept, _, keep_from = training_row(sample, context)
        logits.clear()
        with torch.no_grad():
            states = reader(list(sample.prompt_ids) + list(sample.output_ids))[keep_from:]
            draft = model(**row_inputs(states, kept), ttt_steps=1)[0][0]
        rows = torch.arange(n - 1) + len(kept) - n - 1  # predicting output[t], t = 1..n-1: row P + t - 2
        probs = torch.softmax(logits[0][0, rows].float(), dim=-1)
        top1 = (draft[rows] + d2t[draft[rows]]).numpy()
        at = slice(starts[i], starts[i] + n - 1)
        assert (rp.trace[at] == i).all() and (rp.position[at] == np.arange(1, n)).all()
        cache = torch.from_numpy(first[at].astype(np.int64))
        index = torch.where(cache >= 0, draft_index[cache.clamp(min=0)], -1)
        known = index >= 0
        p_cache = torch.zeros(n - 1)
        p_cache[known] = probs[torch.arange(n - 1)[known], index[known]]
        out["top1"][at], out["top1_prob"][at], out["p_cache"][at] = top1, probs.max(-1).values.numpy(), p_cache.numpy()
        hits += [(top1[1:] == answer[1:-1]).sum(), (top1 == answer[1:]).sum(), (top1[:-1] == answer[2:]).sum()]
        positions += n - 1
        if (i + 1) % 40 == 0:
            print(f"  head: {i + 1}/{len(records)} answers, {time.perf_counter() - t0:.0f} s", flush=True)
    out["alignment"] = hits / max(positions, 1)
    return out


def cached_head_view(records, rp, first, context: int) -> dict[str, np.ndarray]:
    """head_view, kept in var/eagle-agreement by what it depends on (the records' token ids, the head
    and the target, the window)."""
    h = hashlib.sha256(repr([context, rp.rows, [r.trace_id for r in records]]).encode())
    h.update(first.astype(np.int32).tobytes())
    for path in (ve.EAGLE_HEAD / "model.safetensors", ve.MODEL_FP32 / "model.safetensors"):
        h.update(str(path.stat().st_size).encode())
    path = CACHE / f"head-{h.hexdigest()[:16]}.npz"
    if path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    view = head_view(records, rp, first, context)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **view)
    return view


def logistic(x: np.ndarray, y: np.ndarray, iterations: int = 30, l2: float = 1e-4) -> np.ndarray:
    """Newton's method on the L2-penalised log-loss (x carries its own intercept column)."""
    w = np.zeros(x.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-x @ w))
        hessian = (x * (p * (1 - p))[:, None]).T @ x + l2 * np.eye(x.shape[1])
        w -= np.linalg.solve(hessian, x.T @ (p - y) + l2 * w)
    return w


def cross_fitted(x: np.ndarray, y: np.ndarray, fold: np.ndarray) -> np.ndarray:
    """P(accepted >= 1) per row from the model fitted on the other fold."""
    p = np.empty(len(y))
    for f in (0, 1):
        w = logistic(x[fold != f], y[fold != f])
        p[fold == f] = 1.0 / (1.0 + np.exp(-x[fold == f] @ w))
    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="the first N held-out answers (default: all 320)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens in the head's window (as trained)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rows is not None and args.rows < 2:
        parser.error(f"--rows must be >= 2 (two folds of sessions), got {args.rows}")
    if args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    from controller.scenarios.signals import ON_POLICY, train_variant
    from predictor.data.traces import bundled_traces_path
    from predictor.gate.training import TrainConfig
    from predictor.replay.dataset import build_dataset

    held, _ = load_traces([onpolicy_traces_path("held-out")])
    held = held[: args.rows]
    tokenizer = TraceTokenizer()
    rp = cached_replay(held, tokenizer)
    first = rp.first_token
    view = cached_head_view(held, rp, first, args.context)
    data = build_dataset([bundled_traces_path(), onpolicy_traces_path("train")], seed=args.seed, log=lambda _: None)
    gate = train_variant(data, ON_POLICY, TrainConfig(seed=args.seed), CACHE.parent / "scenario-signals" / "gates", print)
    survival = gate.survival(rp.features)
    has = np.flatnonzero(rp.draft_len > 0)
    y = (rp.label[has] >= 1).astype(np.float64)
    s1 = np.clip(survival[has, 0].astype(np.float64), 1e-6, 1 - 1e-6)
    agree = (view["top1"][has] == first[has]).astype(np.float64)
    head = np.column_stack([agree, view["top1_prob"][has], view["p_cache"][has]])
    sessions = np.array([held[t].session_id for t in rp.trace[has]])
    names = np.unique(sessions)
    fold = dict(zip(names, np.random.default_rng(args.seed).permutation(len(names)) % 2))
    fold = np.array([fold[s] for s in sessions])
    ones = np.ones((len(y), 1))
    p_head = cross_fitted(np.hstack([head, ones]), y, fold)
    p_both = cross_fitted(np.hstack([np.log(s1 / (1 - s1))[:, None], head, ones]), y, fold)

    a = view["alignment"]
    print(f"{len(held)} held-out recorded answers, {rp.output_len.sum()} tokens, {len(has)} cache drafts; "
          f"head fp32 teacher-forced, window {args.context} prompt tokens")
    print(f"alignment: the head's first token is output[t] at {a[1]:.4f} of positions "
          f"(output[t-1] {a[0]:.4f}, output[t+1] {a[2]:.4f})")
    agreeing = agree > 0
    print(f"agreement with the cache draft's first token: {agreeing.mean():.4f} of drafts; P(accepted >= 1) "
          f"{y[agreeing].mean():.4f} agreeing, {y[~agreeing].mean():.4f} not; all {y.mean():.4f}")
    print(f"AUC(accepted >= 1): gate S(1) {auc(s1, y > 0):.4f}; the head alone (logistic, cross-fitted) "
          f"{auc(p_head, y > 0):.4f}; gate and head {auc(p_both, y > 0):.4f}")
    curves = {"gate": survival}
    for name, p1 in (("gate + head", p_both), ("gate + perfect first token", y)):
        s = survival.copy()
        s[has] = np.minimum(survival[has] * (np.clip(p1, 1e-6, 1.0) / s1)[:, None], 1.0)
        curves[name] = s
    drafter = drafter_profiles()["eagle3-smollm2"]
    model_acc = model_accepted(rp.rows, drafter, args.seed, rp.workload[rp.trace])
    traces = np.unique(rp.trace)
    print(f"simulated ms per 1k tokens, the allocator on the held-out sessions (EAGLE3 simulated: {drafter.name}); "
          "in brackets: the perfect predictor's headroom recovered")
    for cost_name, batch in SETTINGS:
        cost = cost_profiles()[cost_name]
        figures: dict[str, float] = {}
        for name, s in curves.items():
            sim = Simulator(SimInput(trace=rp.trace, position=rp.position, draft_len=rp.draft_len.astype(np.int64),
                                     label=rp.label.astype(np.int64), score=rp.score, predicted=s.sum(axis=1),
                                     traces=traces, output_len=rp.output_len, trace_workload=rp.workload,
                                     survival=s), drafter, model_acc)
            tally = sim.lanes("hvd", cost, batch, traces)
            figures[name] = tally.ms_per_1k
            if name == "gate + head":
                head_call = cost.step_ms(batch, batch, 1) - cost.step_ms(batch, batch, 0)
                figures["gate + head, head run every step"] = tally.ms_per_1k + head_call * tally.cycles_per_1k
            if name == "gate":
                figures["perfect predictor"] = sim.lanes("oracle-length", cost, batch, traces).ms_per_1k
        room = figures["gate"] - figures["perfect predictor"]
        print(f"  {cost_name} b{batch}: " + "; ".join(
            f"{k} {v:.1f} [{(figures['gate'] - v) / room:+.1%}]" for k, v in figures.items()))


if __name__ == "__main__":
    main()
