"""The training set in the layout `speculators` reads, written from transformers forward hooks.

Per sample: the prompt and the target's own answer run through the target in one forward (no
padding, positions from 0, as vLLM's prefill); kept are the last `context_tokens` prompt positions
and the whole answer, with the loss on the answer only. Per row i, `hidden_states/hs_i.safetensors`
holds `hidden_states` [seq, len(layers)+1, hidden] (the aux layers' inputs in ascending id order,
then the final hidden state before the last norm) and `token_ids`; beside them the arrow dataset
(input_ids, loss_mask, seq_len) and `token_freq.pt` (answer-token counts, for the draft vocabulary).

Layer ids mean what vLLM 0.32 means (llama.py `_maybe_add_hidden_state`): id k is the input of
decoder layer k, i.e. transformers' `hidden_states[k]`, residual included. Rows already on disk are
not recomputed, so a stopped extraction resumes.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from eagle3_training.generate import Sample

DEFAULT_LAYERS = (2, 15, 27)  # vLLM's default for a 30-layer target: (2, n // 2, n - 3)


def training_row(sample: Sample, context_tokens: int) -> tuple[list[int], list[int], int]:
    """(kept input ids, loss mask, offset of the kept window in the full sequence)."""
    full = list(sample.prompt_ids) + list(sample.output_ids)
    keep_from = max(0, len(sample.prompt_ids) - context_tokens)
    kept = full[keep_from:]
    mask = [0] * (len(sample.prompt_ids) - keep_from) + [1] * len(sample.output_ids)
    return kept, mask, keep_from


class HiddenStateReader:
    """The target in transformers with hooks on the aux layers' inputs and the final norm's input."""

    def __init__(self, target: Path, layers: Sequence[int] = DEFAULT_LAYERS, dtype: torch.dtype = torch.bfloat16):
        from transformers import AutoModelForCausalLM

        with torch.inference_mode(False):
            self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).eval()
        inner = self.model.model
        n = len(inner.layers)
        self.layers = tuple(sorted(set(int(k) for k in layers)))
        if len(self.layers) != 3 or not all(0 <= k < n for k in self.layers):
            raise ValueError(f"EAGLE3 takes three aux layer ids in [0, {n}), got {list(layers)}")
        self._captured: dict = {}
        for k in self.layers:
            inner.layers[k].register_forward_pre_hook(self._grab(k), with_kwargs=True)
        inner.norm.register_forward_pre_hook(self._grab("final"), with_kwargs=True)

    def _grab(self, key):
        def hook(_module, args, kwargs):
            self._captured[key] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    def __call__(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[len(token_ids), 4, hidden]: the three aux inputs, then the final pre-norm state."""
        self._captured.clear()
        with torch.no_grad():
            self.model.model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long), use_cache=False)
        slots = [self._captured[k] for k in self.layers] + [self._captured["final"]]
        return torch.stack([s[0] for s in slots], dim=1)


Row = tuple[list[int], list[int]]  # (input ids, loss mask)


def extract(samples: Sequence[Sample], target: Path, folder: Path, layers: Sequence[int] = DEFAULT_LAYERS,
            context_tokens: int = 128, save_dtype: torch.dtype = torch.bfloat16,
            log: Callable[[str], None] = print) -> list[Row]:
    """Hidden states of every sample with an answer into `folder`/hs_<i>.safetensors (resumes)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    meta_path = folder / "hvd_meta.json"
    meta = {"target": str(target), "layers": sorted(set(int(k) for k in layers)), "context_tokens": context_tokens,
            "save_dtype": str(save_dtype).removeprefix("torch.")}
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{folder} holds hidden states written with other settings "
                         f"({meta_path.read_text().strip()}); delete it or use another folder")
    meta_path.write_text(json.dumps(meta, indent=1))
    kept_samples = [s for s in samples if s.output_ids]
    reader = None
    rows: list[Row] = []
    began, fresh = time.perf_counter(), 0
    for i, sample in enumerate(kept_samples):
        kept, mask, keep_from = training_row(sample, context_tokens)
        path = folder / f"hs_{i}.safetensors"
        if not path.is_file():
            reader = reader or HiddenStateReader(target, layers)
            full = list(sample.prompt_ids) + list(sample.output_ids)
            hs = reader(full)[keep_from:].to(save_dtype).contiguous()
            tmp = path.with_suffix(".tmp")
            save_file({"hidden_states": hs, "token_ids": torch.tensor(kept, dtype=torch.long)}, str(tmp))
            tmp.replace(path)
            fresh += len(full)
            if i % 50 == 0 or i == len(kept_samples) - 1:
                log(f"hidden states {folder.name}: {i + 1}/{len(kept_samples)} rows "
                    f"({fresh / (time.perf_counter() - began):.0f} target tok/s)")
        rows.append((kept, mask))
    return rows


def assemble(data: Path, train: tuple[Path, Sequence[Row]], held_out: tuple[Path, Sequence[Row]],
             repeats: Sequence[int] | None = None) -> float:
    """The folder `speculators train --data-path` reads: training rows first (row j `repeats[j]`
    times, each copy linked to the same hidden states: eagle3_training.balance), held-out rows last
    (once), hidden states linked from where they were extracted, token counts from training rows
    only (with their repeats). Returns the --train-data-ratio that makes exactly the held-out rows
    its validation split."""
    from datasets import Dataset

    times = [1] * len(train[1]) if repeats is None else list(repeats)
    if len(times) != len(train[1]) or min(times, default=1) < 1:
        raise ValueError(f"repeats must give every one of the {len(train[1])} training rows a count >= 1")
    hs_dir = data / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    for stale in hs_dir.glob("hs_*.safetensors"):  # an earlier assembly may have had more rows
        stale.unlink()
    rows: list[Row] = []
    for (folder, part), counts in ((train, times), (held_out, [1] * len(held_out[1]))):
        for j, (row, count) in enumerate(zip(part, counts)):
            for _ in range(count):
                (hs_dir / f"hs_{len(rows)}.safetensors").symlink_to((folder / f"hs_{j}.safetensors").resolve())
                rows.append(row)
    freq: Counter = Counter()
    for (ids, mask), count in zip(train[1], times):
        for t, m in zip(ids, mask):
            if m:
                freq[t] += count
    torch.save(dict(freq), data / "token_freq.pt")
    for stale in data.glob("[dt]2[td]-*.npy"):  # vocab maps cached by the trainer for older counts
        stale.unlink()
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                            "seq_len": [len(r[0]) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))
    n_train, n = sum(times), len(rows)
    ratio = (n_train + 0.5) / n
    assert int(n * ratio) == n_train
    return ratio
