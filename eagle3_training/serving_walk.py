"""What serving gets from an EAGLE3 head, against what its trainer reports, on the held-out answers.

The trainer's held-out figure (`full_acc_i`, eagle3_training.selection) averages, over every answer
position, whether a k-token draft started there would have its first i tokens right. Serving does
not draft at every position: a draft starts after each verification, so a stretch the head gets
right is covered by few drafts and a stretch it gets wrong by one draft per token. Walking the same
per-position hits the way serving does (draft at the first answer position, accept the right
prefix, start the next draft after it and the target's bonus token) gives the accepted tokens per
draft that vLLM counts. Both figures come from one teacher-forced pass of the head, in torch.

    python -m eagle3_training.serving_walk [--head models/eagle3-smollm2-135m] [--rows N] [--max-new-tokens N]
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle3_training.generate import Sample


def chains(predicted: Sequence[np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """[k, n] bool: whether the draft started at row r has its first j + 1 tokens right.

    Row r is the head's input (tokens[r + 1], the target's hidden state at r); its j-th test-time
    step predicts tokens[r + 2 + j] (`predicted[j][r]`, target ids). Steps past the end are wrong."""
    n, k = len(tokens), len(predicted)
    hits = np.zeros((k, n), dtype=bool)
    for j, pred in enumerate(predicted):
        rows = np.arange(max(0, n - 2 - j))
        hits[j, rows] = np.asarray(pred)[rows] == tokens[rows + 2 + j]
    return np.logical_and.accumulate(hits, axis=0)


def right_at_every_start(chain: np.ndarray, first: int) -> np.ndarray:
    """Per i = 1..k, how many rows from `first` on would have a draft started there right in its
    first i tokens; over the number of those rows, it is the trainer's held-out figure."""
    return chain[:, first : chain.shape[1] - 2].sum(axis=1).astype(np.float64)


def walk(chain: np.ndarray, first: int) -> tuple[int, np.ndarray]:
    """(drafts, accepted per position) of greedy serving over the answer from row `first` on: each
    draft accepts its right prefix, and the next one starts after that prefix and the bonus token."""
    k, n = chain.shape
    accepted = np.zeros(k, dtype=np.int64)
    drafts, r = 0, first
    while r < n - 2:
        a = int(np.argmin(np.append(chain[:, r], False)))  # length of the right prefix
        drafts += 1
        accepted[:a] += 1
        r += a + 1
    return drafts, accepted


@dataclass
class Tally:
    """A workload's (or all) drafts under both readings of the same hits."""

    rows: int = 0  # answers
    starts: int = 0  # answer positions a draft could start at (the trainer's denominator)
    right_at_every_start: np.ndarray = field(default_factory=lambda: np.zeros(0))
    drafts: int = 0  # drafts serving makes
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add(self, chain: np.ndarray, first: int) -> None:
        k = chain.shape[0]
        if not self.accepted.size:
            self.right_at_every_start, self.accepted = np.zeros(k), np.zeros(k, dtype=np.int64)
        drafts, accepted = walk(chain, first)
        self.rows += 1
        self.starts += max(0, chain.shape[1] - 2 - first)
        self.right_at_every_start = self.right_at_every_start + right_at_every_start(chain, first)
        self.drafts += drafts
        self.accepted = self.accepted + accepted

    @property
    def average(self) -> np.ndarray:
        return self.right_at_every_start / max(self.starts, 1)

    @property
    def served(self) -> np.ndarray:
        return self.accepted / max(self.drafts, 1)


def held_out_samples(rows: int | None = None, max_new_tokens: int | None = None) -> list[Sample]:
    """The pipeline's validation answers (its held-out split, from the committed answers archive),
    the first `rows`, each cut to `max_new_tokens`."""
    from eagle3_training.answers_archive import restore
    from eagle3_training.corpus import prompts
    from eagle3_training.generate import read_samples, run_settings
    from eagle3_training.pipeline import PipelineConfig, _within_budget
    from predictor.data.traces import bundled_traces_path, load_traces

    cfg = PipelineConfig()
    records, _ = load_traces([bundled_traces_path()])
    held_prompts = prompts(records, True, cfg.max_prompt_tokens, cfg.seed)
    settings = run_settings(held_prompts, cfg.target, "bfloat16", cfg.max_new_tokens, cfg.shard_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        if not cfg.answers or not restore(cfg.answers, "held_out", Path(tmp), held_prompts, settings, log=lambda m: None):
            raise FileNotFoundError(f"{cfg.answers} holds no held-out answers for the pipeline's settings")
        samples = _within_budget(read_samples(Path(tmp)), cfg.held_out_tokens)[:rows]
    return [Sample(s.trace_id, s.workload, s.prompt_ids, s.output_ids[:max_new_tokens]) for s in samples]


def load_head(head: Path, target: Path):
    """An exported head (vLLM's layout) as the trainer's torch model, fp32, for `target`."""
    from safetensors.torch import load_file

    from eagle3_training.hidden_states import DEFAULT_LAYERS
    from eagle3_training.speculators_cpu import build_head

    layers = json.loads((head / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids")
    if layers != list(DEFAULT_LAYERS):
        raise ValueError(f"{head} reads the target's layers {layers}; this check builds heads on {list(DEFAULT_LAYERS)}")
    tensors = load_file(str(head / "model.safetensors"))
    model = build_head(target, len(tensors["d2t"]), 2048, t2d=tensors["t2d"].bool(), d2t=tensors["d2t"].long())
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return model.eval()


def row_inputs(hidden_states, kept: Sequence[int]) -> dict:
    """One row as the trainer feeds it (speculators' shift_batch): [n, 4, hidden] states of the kept
    tokens -> the head's inputs, row r being token r + 1 with the aux states at r."""
    import torch

    n = len(kept)
    return {"hidden_states": hidden_states[:-1, :3].reshape(1, n - 1, -1), "input_ids": torch.tensor([list(kept[1:])]),
            "document_ids": torch.zeros(1, n - 1, dtype=torch.long), "position_ids": torch.arange(1, n).unsqueeze(0)}


def head_chains(head: Path, samples: Sequence[Sample], target: Path, context_tokens: int = 128,
                draft_len: int = 3) -> Iterator[tuple[str, np.ndarray, int]]:
    """(workload, chain, first answer row) per sample: the exported head (fp32) over the fp32
    target's hidden states, as the trainer packs a row (the last `context_tokens` prompt positions)."""
    import torch

    from eagle3_training.hidden_states import HiddenStateReader, training_row

    model = load_head(head, target)
    d2t = model.d2t.long()  # loaded with the head
    reader = HiddenStateReader(target, dtype=torch.float32)
    for s in samples:
        kept, _, keep_from = training_row(s, context_tokens)
        hs = reader(list(s.prompt_ids) + list(s.output_ids))[keep_from:]
        with torch.no_grad():
            drafts = model(**row_inputs(hs, kept), ttt_steps=draft_len)
        predicted = [(d[0] + d2t[d[0]]).numpy() for d in drafts]  # draft ids -> target ids
        yield s.workload, chains(predicted, np.array(kept)), len(kept) - len(s.output_ids) - 2


def report(tallies: dict[str, Tally]) -> str:
    lines = [f"{'workload':10s} {'answers':>7s} {'starts':>7s} {'average':>8s}  {'drafts':>7s} {'served':>7s}  "
             "per position: average | served"]
    for name, t in tallies.items():
        lines.append(f"{name:10s} {t.rows:7d} {t.starts:7d} {t.average.sum():8.3f}  {t.drafts:7d} "
                     f"{t.served.sum():7.3f}  {' '.join(f'{v:.3f}' for v in t.average)} | "
                     f"{' '.join(f'{v:.3f}' for v in t.served)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from controller.engines import vllm_engine as ve

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", type=Path, default=ve.EAGLE_HEAD)
    p.add_argument("--rows", type=int, default=None, help="the first N held-out answers (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cut each answer to N tokens")
    p.add_argument("--draft-len", type=int, default=ve.MODEL_DRAFT_LEN)
    a = p.parse_args(argv)
    for needed in ("model.safetensors", "config.json"):
        if not (a.head / needed).is_file():
            p.error(f"{a.head} holds no exported head ({needed} missing)")
    if (a.rows is not None and a.rows < 1) or (a.max_new_tokens is not None and a.max_new_tokens < 1):
        p.error("--rows and --max-new-tokens must be >= 1")
    tallies: dict[str, Tally] = {}
    for workload, chain, first in head_chains(a.head, held_out_samples(a.rows, a.max_new_tokens), ve.MODEL_FP32,
                                              draft_len=a.draft_len):
        for name in (workload, "all"):
            tallies.setdefault(name, Tally()).add(chain, first)
    tallies["all"] = tallies.pop("all")  # printed last
    print(f"{a.head}: fp32, k = {a.draft_len}, teacher-forced over the held-out answers; 'average' is the "
          "trainer's figure (every start), 'served' the accepted tokens per draft serving makes")
    print(report(tallies))


if __name__ == "__main__":
    main()
