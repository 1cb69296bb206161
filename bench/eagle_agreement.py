"""What the EAGLE3 head's agreement with the cache draft would tell the gate, measured before building it.

Issue 30's other engine signal: in a step where EAGLE3 runs, its draft tokens and probabilities, and
the length over which its draft equals the cache draft. This measures what that would buy on the
recorded held-out sessions (data/onpolicy-held-out.jsonl.xz, SmolLM2's own answers), offline:

1. The committed head (fp32, teacher-forced over the fp32 target's hidden states of prompt and
   answer, the head's window the last --context prompt tokens as it was trained) gives, at every
   answer position t, the 3-token draft vLLM's proposer would make right after the target emitted
   output[t-1] (its first input: that token with the target's states at the position before; then
   its own tokens and states, the test-time steps serving runs), its top-1 probability at each
   position, and the probability it gives the cache draft's first token there. The replay keeps
   each cache draft's first 3 tokens (ReplayResult.lead_tokens), so the agreement length (0-3) is
   exact. The alignment is printed: the head's first token equals output[t] about as often as its
   served position-1 acceptance (docs/results/eagle3.md), and far less often shifted by one.
2. The shipped gate (the on-policy warm start of `hvd scenario signals`, trained or read from
   var/scenario-signals/gates) scores the same drafts. Its curve is read as conditional rates,
   S(j) / S(j-1); at positions 1 (first token) or 1-3 (the head's whole draft) a logistic
   regression on [logit of the gate's rate, agreement up to j, the head's top-1 probability at j,
   both together, (j = 1) its probability of the cache token], fitted on the drafts that reached j
   in half the sessions and scored on the other half (both ways), replaces the gate's rate; the
   curve past those positions keeps the gate's rates. AUC at accepted >= 1, 2, 3 and
   precision/recall at >= 6 are printed for the gate and both variants.
3. The simulator's allocator (the runtime's code) serves the held-out sessions with each curve,
   free and priced at one head call of 1 or 3 positions per engine step (an upper bound on what
   running the head before every decision costs: steps that drafted with the model ran it anyway),
   beside perfect predictors of the first token, of the first 3 tokens, and of the whole length;
   headroom recovered = (gate - x) / (gate - perfect).

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
from predictor.gate.calibration import conditional, logit  # noqa: E402
from predictor.evaluation.simulator import SimInput, Simulator, model_accepted  # noqa: E402
from predictor.replay.trace_replay import LEAD_TOKENS, ReplayResult  # noqa: E402
from predictor.replay.trace_replay_cache import cached_replay  # noqa: E402

SETTINGS = (("gpu-8b", 1), ("gpu-8b", 8), ("cpu-smollm2", 1), ("cpu-smollm2", 8))
CACHE = Path(__file__).resolve().parents[1] / "var" / "eagle-agreement"


def head_view(records: list[TraceRecord], rp: ReplayResult, context: int) -> dict[str, np.ndarray]:
    """Per replay row: the head's LEAD_TOKENS-token draft (target ids, test-time steps feeding its own
    tokens and states as vLLM's proposer does), its top-1 probability at each position, the
    probability it gives the cache draft's first token (0 outside its draft vocabulary), and per
    answer position whether its first token is output[t] (and output[t -/+ 1], the alignment check)."""
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
    out = {"head": np.full((rp.rows, LEAD_TOKENS), -1, dtype=np.int32),
           "head_prob": np.zeros((rp.rows, LEAD_TOKENS), dtype=np.float32), "p_cache": np.zeros(rp.rows, dtype=np.float32)}
    hits = np.zeros(3, dtype=np.int64)  # head's first token == output[t - 1], output[t], output[t + 1]
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
            drafts = model(**row_inputs(states, kept), ttt_steps=LEAD_TOKENS)
        rows = torch.arange(n - 1) + len(kept) - n - 1  # predicting output[t], t = 1..n-1: row P + t - 2
        at = slice(starts[i], starts[i] + n - 1)
        assert (rp.trace[at] == i).all() and (rp.position[at] == np.arange(1, n)).all()
        probs = [torch.softmax(step[0, rows].float(), dim=-1) for step in logits]  # one per test-time step
        for j in range(LEAD_TOKENS):  # step j predicts output[t + j]
            d = drafts[j][0][rows]
            out["head"][at, j] = (d + d2t[d]).numpy()
            out["head_prob"][at, j] = probs[j].max(-1).values.numpy()
        cache = torch.from_numpy(rp.lead_tokens[at, 0].astype(np.int64))
        index = torch.where(cache >= 0, draft_index[cache.clamp(min=0)], -1)
        known = index >= 0
        p_cache = torch.zeros(n - 1)
        p_cache[known] = probs[0][torch.arange(n - 1)[known], index[known]]
        out["p_cache"][at] = p_cache.numpy()
        top1 = out["head"][at, 0]
        hits += [(top1[1:] == answer[1:-1]).sum(), (top1 == answer[1:]).sum(), (top1[:-1] == answer[2:]).sum()]
        positions += n - 1
        if (i + 1) % 40 == 0:
            print(f"  head: {i + 1}/{len(records)} answers, {time.perf_counter() - t0:.0f} s", flush=True)
    out["alignment"] = hits / max(positions, 1)
    return out


def agreement_length(head: np.ndarray, lead: np.ndarray, draft_len: np.ndarray) -> np.ndarray:
    """Per row: how many leading tokens the head's draft and the cache draft share (at most the
    cache draft's length and LEAD_TOKENS)."""
    same = (head == lead) & (lead >= 0) & (np.arange(head.shape[1]) < np.asarray(draft_len)[:, None])
    return np.logical_and.accumulate(same, axis=1).sum(axis=1)


def cached_head_view(records, rp, context: int) -> dict[str, np.ndarray]:
    """head_view, kept in var/eagle-agreement by what it depends on (the records' token ids, the head
    and the target, the window)."""
    h = hashlib.sha256(repr([context, rp.rows, LEAD_TOKENS, [r.trace_id for r in records]]).encode())
    h.update(rp.lead_tokens.astype(np.int32).tobytes())
    for path in (ve.EAGLE_HEAD / "model.safetensors", ve.MODEL_FP32 / "model.safetensors"):
        h.update(str(path.stat().st_size).encode())
    path = CACHE / f"head-{h.hexdigest()[:16]}.npz"
    if path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    view = head_view(records, rp, context)
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


def cross_fitted(x: np.ndarray, y: np.ndarray, fold: np.ndarray, train: np.ndarray | None = None) -> np.ndarray:
    """P(y) for every row from the model fitted on the other fold's `train` rows (default: all)."""
    train = np.ones(len(x), dtype=bool) if train is None else train
    p = np.empty(len(x))
    for f in (0, 1):
        fit = (fold != f) & train
        w = logistic(x[fit], y[fit].astype(np.float64))
        p[fold == f] = 1.0 / (1.0 + np.exp(-x[fold == f] @ w))
    return p


def with_head(cond: np.ndarray, label: np.ndarray, draft_len: np.ndarray, fold: np.ndarray, agree: np.ndarray,
              head_prob: np.ndarray, p_cache: np.ndarray, positions: int) -> np.ndarray:
    """The gate's conditional acceptance rates with the first `positions` re-predicted: at position j a
    logistic regression on [logit of the gate's rate, the drafts agree up to j, the head's top-1
    probability at j, both together, (j = 1) the head's probability of the cache token], fitted on
    the drafts that reached j, cross-fitted by session fold, applied to every draft."""
    out = cond.copy()
    ones = np.ones((len(cond), 1))
    for j in range(positions):
        agreed = (agree >= j + 1).astype(np.float64)
        cols = [logit(cond[:, j]), agreed, head_prob[:, j], agreed * head_prob[:, j]] + ([p_cache] if j == 0 else [])
        reached = (label >= j) & (draft_len >= j + 1)
        out[:, j] = cross_fitted(np.hstack([np.column_stack(cols), ones]), label >= j + 1, fold, reached)
    return out


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
    from predictor.evaluation.gate_quality import precision_recall
    from predictor.gate.training import TrainConfig
    from predictor.replay.dataset import build_dataset

    held, _ = load_traces([onpolicy_traces_path("held-out")])
    held = held[: args.rows]
    rp = cached_replay(held, TraceTokenizer())
    view = cached_head_view(held, rp, args.context)
    data = build_dataset([bundled_traces_path(), onpolicy_traces_path("train")], seed=args.seed, log=lambda _: None)
    gate = train_variant(data, ON_POLICY, TrainConfig(seed=args.seed), CACHE.parent / "scenario-signals" / "gates", print)
    survival = gate.survival(rp.features).astype(np.float64)
    has = np.flatnonzero(rp.draft_len > 0)
    label, draft_len = rp.label[has].astype(np.int64), rp.draft_len[has].astype(np.int64)
    lead, head = rp.lead_tokens[has], view["head"][has]
    agree = agreement_length(head, lead, draft_len)
    sessions = np.array([held[t].session_id for t in rp.trace[has]])
    names = np.unique(sessions)
    fold = dict(zip(names, np.random.default_rng(args.seed).permutation(len(names)) % 2))
    fold = np.array([fold[s] for s in sessions])
    cond = conditional(np.clip(survival[has], 1e-6, 1.0))  # floored: every rate is defined, none 0
    perfect = (label[:, None] >= np.arange(1, LEAD_TOKENS + 1)).astype(np.float64)
    conds = {"gate": cond}
    for name, positions in (("gate + head, first token", 1), (f"gate + head, {LEAD_TOKENS} tokens", LEAD_TOKENS)):
        conds[name] = with_head(cond, label, draft_len, fold, agree, view["head_prob"][has], view["p_cache"][has], positions)
    for name, positions in (("perfect first token", 1), (f"perfect first {LEAD_TOKENS} tokens", LEAD_TOKENS)):
        c = cond.copy()
        c[:, :positions] = perfect[:, :positions]
        conds[name] = c

    a = view["alignment"]
    print(f"{len(held)} held-out recorded answers, {rp.output_len.sum()} tokens, {len(has)} cache drafts; "
          f"head fp32 teacher-forced, window {args.context} prompt tokens, {LEAD_TOKENS}-token head drafts")
    print(f"alignment: the head's first token is output[t] at {a[1]:.4f} of positions "
          f"(output[t-1] {a[0]:.4f}, output[t+1] {a[2]:.4f})")
    for k in range(LEAD_TOKENS + 1):  # agreement_length stops at LEAD_TOKENS
        at = agree == k
        if at.any():
            print(f"  drafts agreeing on exactly {k} leading token(s): {at.mean():.4f}; their mean accepted "
                  f"{label[at].mean():.2f} (P(accepted >= {max(k, 1)}) {(label[at] >= max(k, 1)).mean():.4f})")
    curves = {}
    for name, c in conds.items():
        s = survival.copy()
        s[has] = np.cumprod(c, axis=1)
        curves[name] = s
    print("gate quality on the cache drafts (head variants cross-fitted by session):")
    for name in list(conds)[:3]:
        s = curves[name][has]
        aucs = " ".join(f"AUC(>= {j}) {auc(s[:, j - 1], label >= j):.4f}" for j in range(1, LEAD_TOKENS + 1))
        p, r = precision_recall(s.sum(axis=1), label)
        print(f"  {name:28s} {aucs}  P/R at >= 6 {p:.3f}/{r:.3f}")
    drafter = drafter_profiles()["eagle3-smollm2"]
    model_acc = model_accepted(rp.rows, drafter, args.seed, rp.workload[rp.trace])
    traces = np.unique(rp.trace)
    print(f"simulated ms per 1k tokens, the allocator on the held-out sessions (EAGLE3 simulated: {drafter.name}); "
          "in brackets: the perfect predictor's headroom recovered; 'paid': the head run before every decision, "
          "priced as a head call of that many positions in every step")
    paid = {"gate + head, first token": 1, f"gate + head, {LEAD_TOKENS} tokens": LEAD_TOKENS}
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
            if name in paid:
                head_call = cost.step_ms(batch, batch, paid[name]) - cost.step_ms(batch, batch, 0)
                figures[name + ", paid"] = tally.ms_per_1k + head_call * tally.cycles_per_1k
            if name == "gate":
                figures["perfect predictor"] = sim.lanes("oracle-length", cost, batch, traces).ms_per_1k
        room = figures["gate"] - figures["perfect predictor"]
        print(f"  {cost_name} b{batch}:")
        for k, v in figures.items():
            print(f"    {k:36s} {v:9.1f} [{(figures['gate'] - v) / room:+.1%}]")


if __name__ == "__main__":
    main()
