"""What one EAGLE3 training step costs on this CPU: the trainer's own kernels against HVD's cheaper
exact ones (eagle3_training.document_attention, eagle3_training.cpu_kernels), side by side.

The real head for the bundled SmolLM2 (speculators' own model builder, 8,192-token draft vocabulary,
three test-time-training steps, AdamW; bf16 autocast where the CPU has bf16 arithmetic, as `make
eagle3` trains, fp32 elsewhere: emulated bf16 took 349 s a step on an AVX2 machine) on one packed
2048-token row of synthetic hidden states, its documents as long as the training rows (the last 128 prompt positions and an
answer; the sizes are fixed below so every run packs alike). Each variant runs in its own process
(the swap is process-wide), the two alternating for --repeats rounds; each round times --steps steps
after a warm-up step. Prints medians and ranges, and the exact work per step (tokens, documents,
attention pairs each kernel set computes).

    python bench/eagle3_train_step.py [--repeats 3] [--steps 3] [--threads N] [--dtype auto] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

SEQ = 2048
# Rows as `make eagle3` writes them: 128 prompt positions of context and an answer (median answer of
# the committed answers archive is about 290 tokens); the tail is padding, as the packer leaves it.
DOCUMENTS = (128 + 212, 128 + 377, 128 + 95, 128 + 302, 128 + 251)
VARIANTS = {"trainer": True, "hvd": False}  # plain kernels?
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 arithmetic


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return False
    return any(f in flags for f in BF16_FLAGS)


def _one_process(steps: int, plain_kernels: bool, dtype: str) -> dict:
    """Runs inside a child: builds the head, times `steps` steps after one warm-up step."""
    import torch

    from eagle3_training.speculators_cpu import build_head, patch_for_cpu

    patch_for_cpu(plain_kernels=plain_kernels)
    from speculators.losses import resolve_loss_config

    from controller.engines import vllm_engine as ve

    verifier = ve.MODEL_BF16 if dtype == "bfloat16" else ve.MODEL_FP32
    model = build_head(verifier, 8192, SEQ, hidden_states_dtype=dtype)
    store = getattr(torch, dtype)
    model.train()
    used = sum(DOCUMENTS)
    g = torch.Generator().manual_seed(0)
    doc = torch.cat([torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS)),
                     torch.full((SEQ - used,), -1)]).unsqueeze(0)
    batch = {"hidden_states": torch.randn(1, SEQ, 3 * 576, generator=g).to(store),
             "input_ids": torch.randint(0, 8192, (1, SEQ), generator=g), "document_ids": doc,
             "loss_mask": torch.cat([torch.tensor([0] * 128 + [1] * (n - 128)) for n in DOCUMENTS]
                                    + [torch.zeros(SEQ - used, dtype=torch.long)]).bool().unsqueeze(0),
             "position_ids": torch.cat([torch.arange(n) for n in DOCUMENTS]
                                       + [torch.zeros(SEQ - used, dtype=torch.long)]).unsqueeze(0),
             "verifier_last_hidden_states": torch.randn(1, SEQ, 576, generator=g).to(store)}
    loss_config = resolve_loss_config("kl_div", "eager")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            _, loss, _ = model(**batch, ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    first = step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"seconds": times, "first_loss": first, "threads": torch.get_num_threads()}


def attention_pairs() -> dict[str, int]:
    """Query-key pairs scored per step (three test-time-training steps): dense over the whole row
    against per document (causal within it, plus one diagonal per later block; padding its own)."""
    pad = SEQ - sum(DOCUMENTS)
    dense = sum(SEQ * SEQ * b for b in (1, 2, 3))
    per_doc = sum(sum(n * n * b for n in DOCUMENTS) + pad * b for b in (1, 2, 3))
    return {"trainer": dense, "hvd": per_doc}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process, after one warm-up step")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="training precision (auto: bfloat16 where the CPU has bf16 arithmetic, else float32)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain-kernels", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_one_process(a.steps, a.plain_kernels, a.dtype)))
        return
    if a.repeats < 1 or a.steps < 1:
        p.error(f"--repeats and --steps must be >= 1, got {a.repeats} and {a.steps}")
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if native_bf16() else "float32")
    env = dict(os.environ)
    if a.threads is not None:
        env["OMP_NUM_THREADS"] = str(a.threads)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(a.repeats):
        for variant, plain in VARIANTS.items():
            out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(a.steps), "--dtype", dtype]
                                 + (["--plain-kernels"] if plain else []), check=True,
                                 capture_output=True, text=True, cwd=REPO_ROOT, env=env)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {variant}: {[round(s, 2) for s in runs[variant][-1]['seconds']]} s/step", flush=True)
    pairs = attention_pairs()
    print(f"\nper step: {SEQ} positions, {len(DOCUMENTS)} documents ({sum(DOCUMENTS)} tokens, "
          f"{sum(n - 128 for n in DOCUMENTS)} in the loss), 3 test-time-training steps, "
          f"{'bf16 autocast' if dtype == 'bfloat16' else 'fp32'}, "
          f"{runs['hvd'][0]['threads']} threads")
    report = {"documents": list(DOCUMENTS), "seq": SEQ, "dtype": dtype, "attention_pairs": pairs, "variants": {}}
    medians = {}
    for variant, rs in runs.items():
        per_round = [statistics.median(x["seconds"]) for x in rs]
        medians[variant] = statistics.median(per_round)
        report["variants"][variant] = {"median_s": medians[variant], "rounds_s": per_round,
                                       "first_loss": [x["first_loss"] for x in rs]}
        print(f"{variant:8s} median {medians[variant]:.2f} s/step (rounds {min(per_round):.2f}-{max(per_round):.2f}); "
              f"attention pairs {pairs[variant]:,}; first-step loss {rs[0]['first_loss']:.4f}")
    report["speedup"] = medians["trainer"] / medians["hvd"]
    print(f"speedup {report['speedup']:.2f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
