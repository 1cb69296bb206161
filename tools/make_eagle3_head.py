"""Create an EAGLE3 draft head for SmolLM2 with RANDOM weights, in the format vLLM 0.32 loads.

This is plumbing only: the head is untrained, so vLLM accepts (almost) none of its drafts. It lets
the eagle3 code path (aux hidden states, EagleProposer, reduced draft vocabulary) be exercised on
the CPU before a trained head exists.

Format (what vllm/model_executor/models/llama_eagle3.py expects; the same as the EAGLE3 reference
checkpoints and `speculators` output):
  config.json   LlamaConfig of the target with num_hidden_layers=1,
                architectures=["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size,
                eagle_aux_hidden_state_layer_ids (read by GPUModelRunner
                _get_eagle3_aux_layers_from_config), tie_word_embeddings=false
  model.safetensors
                midlayer.{input_layernorm,post_attention_layernorm,hidden_norm}.weight,
                midlayer.self_attn.{q,k,v}_proj.weight [*, 2*hidden] (embeds ++ hidden),
                midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
                fc.weight [hidden, 3*hidden], norm.weight, lm_head.weight [draft_vocab, hidden],
                d2t [draft_vocab] int64 (target_id = draft_id + d2t[draft_id]),
                t2d [target_vocab] bool.  No embed_tokens: vLLM shares the target's.

    python tools/make_eagle3_head.py --target var/models/smollm2-135m-fp32 \
        --out var/models/smollm2-eagle3-random --seed 0 --draft-vocab 8192
"""
from __future__ import annotations

import argparse
import json
import lzma
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = ROOT / "data" / "traces.jsonl.xz"


def token_frequencies(traces: Path, tokenizer_file: Path, vocab_size: int) -> tuple[Counter, int]:
    """Count target-token frequencies over the `output` texts of the traces."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    texts = []
    with lzma.open(traces, "rt", encoding="utf-8") as fh:
        for line in fh:
            out = json.loads(line).get("output")
            if out:
                texts.append(out)
    counts: Counter = Counter()
    n = 0
    for i in range(0, len(texts), 512):
        for enc in tok.encode_batch(texts[i : i + 512], add_special_tokens=False):
            counts.update(enc.ids)
            n += len(enc.ids)
    for k in [k for k in counts if k >= vocab_size]:
        del counts[k]
    return counts, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path, help="converted HF folder of SmolLM2")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--draft-vocab", type=int, default=8192,
        help="reduced draft vocabulary (most frequent trace-output tokens); 0 = full vocabulary",
    )
    parser.add_argument("--aux-layers", default="1,14,27", help="target layers fed to the head")
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: TARGET/tokenizer.json")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="weight dtype (default: the target's)")
    parser.add_argument("--std", type=float, default=0.02, help="init std of the random weights")
    args = parser.parse_args()
    args.tokenizer = args.tokenizer or args.target / "tokenizer.json"

    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    tcfg = json.loads((args.target / "config.json").read_text())
    hidden = tcfg["hidden_size"]
    inter = tcfg["intermediate_size"]
    n_heads = tcfg["num_attention_heads"]
    n_kv = tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or hidden // n_heads
    vocab = tcfg["vocab_size"]
    n_layers = tcfg["num_hidden_layers"]
    aux = [int(x) for x in args.aux_layers.split(",")]
    if any(not 0 <= a < n_layers for a in aux):
        raise SystemExit(f"aux layers {aux} outside 0..{n_layers - 1}")
    dtype_name = args.dtype or tcfg.get("torch_dtype") or tcfg.get("dtype") or "bfloat16"
    dtype = getattr(torch, dtype_name)

    # Draft vocabulary.
    draft_vocab = vocab if args.draft_vocab in (0, vocab) else args.draft_vocab
    vocab_note = "full target vocabulary (no d2t/t2d)"
    d2t = t2d = None
    if draft_vocab != vocab:
        if not 0 < draft_vocab < vocab:
            raise SystemExit(f"--draft-vocab must be in 1..{vocab}")
        selected: list[int]
        if args.traces.exists() and args.tokenizer.exists():
            counts, n_tok = token_frequencies(args.traces, args.tokenizer, vocab)
            # Special tokens (ids 0..16 in SmolLM2: <|endoftext|>, <|im_start|>, <|im_end|>, ...)
            # always included so a drafter can end a turn.
            specials = list(range(17))
            ranked = specials + [t for t, _ in counts.most_common() if t not in specials]
            if len(ranked) < draft_vocab:  # pad with the lowest unused ids
                used = set(ranked)
                ranked += [t for t in range(vocab) if t not in used][: draft_vocab - len(ranked)]
            selected = sorted(ranked[:draft_vocab])
            covered = sum(counts[t] for t in selected)
            vocab_note = (
                f"{draft_vocab} ids: special ids 0-16 plus the most frequent tokens of the "
                f"`output` texts of {args.traces.name} tokenised with {args.tokenizer} "
                f"({n_tok} tokens; these ids cover {100.0 * covered / max(n_tok, 1):.2f}%)"
            )
        else:
            selected = list(range(draft_vocab))
            vocab_note = f"{draft_vocab} ids: simply the first {draft_vocab} target ids"
        sel = torch.tensor(selected, dtype=torch.long)
        d2t = sel - torch.arange(draft_vocab, dtype=torch.long)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[sel] = True

    g = torch.Generator().manual_seed(args.seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * args.std).to(dtype).contiguous()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors = {
        "midlayer.input_layernorm.weight": ones(hidden),
        "midlayer.hidden_norm.weight": ones(hidden),
        "midlayer.post_attention_layernorm.weight": ones(hidden),
        "midlayer.self_attn.q_proj.weight": rnd(n_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rnd(n_kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rnd(n_kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rnd(hidden, n_heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.up_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.down_proj.weight": rnd(hidden, inter),
        "fc.weight": rnd(hidden, len(aux) * hidden),
        "norm.weight": ones(hidden),
        "lm_head.weight": rnd(draft_vocab, hidden),
    }
    if d2t is not None:
        tensors["d2t"] = d2t
        tensors["t2d"] = t2d

    cfg = {k: v for k, v in tcfg.items() if k not in ("hvd_conversion", "_model_name_or_path")}
    cfg.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "draft_vocab_size": draft_vocab,
            "vocab_size": vocab,
            "target_hidden_size": hidden,
            "eagle_aux_hidden_state_layer_ids": aux,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
            "hvd_random_head": {"seed": args.seed, "std": args.std, "draft_vocab": draft_vocab},
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    n_params = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
    (args.out / "PROVENANCE.txt").write_text(
        "EAGLE3 draft head for SmolLM2-135M-Instruct -- RANDOM WEIGHTS, NOT TRAINED.\n"
        "For plumbing tests only: vLLM accepts (almost) none of its drafts.\n\n"
        f"Created by tools/make_eagle3_head.py (seed {args.seed}, N(0, {args.std}^2) linear "
        f"weights, unit norms, dtype {dtype_name}) from the config of {args.target}.\n"
        f"Aux hidden-state layers of the target: {aux}.\n"
        f"Draft vocabulary: {vocab_note}.\n"
        f"Parameters: {n_params / 1e6:.2f}M (embeddings shared with the target by vLLM).\n"
    )
    print(
        f"random EAGLE3 head -> {args.out} ({n_params / 1e6:.2f}M params, {dtype_name}, "
        f"aux layers {aux}, draft vocab {draft_vocab}) in {time.perf_counter() - t0:.1f}s\n"
        f"  draft vocabulary: {vocab_note}"
    )


if __name__ == "__main__":
    main()
