"""One tokenizer for every trace: SmolLM2's, read from the tokenizer.json the Makefile extracts.

The traces were produced by many models with their own tokenizers; replaying them all through
SmolLM2's BPE is an approximation (token boundaries, hence accepted lengths, differ somewhat from
what each producer's serving stack would see). It is the one real tokenizer available offline, and
it is the tokenizer of the model the vLLM engine serves here, so live and replayed labels agree.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from storage.env import read_env, text

if TYPE_CHECKING:  # annotations only: the tokenizer reads a record's context, nothing else
    from predictor.data.traces import TraceRecord

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = REPO_ROOT / "var" / "models" / "smollm2-135m-bf16" / "tokenizer.json"


class TokenizerMissingError(FileNotFoundError):
    pass


def tokenizer_path() -> Path:
    """HVD_TOKENIZER overrides the location (a tokenizer.json file or its folder)."""
    env = read_env("HVD_TOKENIZER", text)  # unset or blank: the default
    path = Path(env) if env else DEFAULT_TOKENIZER
    return path / "tokenizer.json" if path.is_dir() else path


class TraceTokenizer:
    """Encodes trace contexts (ChatML, as SmolLM2's chat template renders them) and outputs."""

    def __init__(self, path: Path | None = None) -> None:
        path = path or tokenizer_path()
        if not path.is_file():
            raise TokenizerMissingError(
                f"SmolLM2 tokenizer not found at {path}: run `make setup` (or set HVD_TOKENIZER)"
            )
        self._tok = Tokenizer.from_file(str(path))
        self._message_cache: dict[tuple[str, str], np.ndarray] = {}
        self._assistant_header = self._encode("<|im_start|>assistant\n")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_output(self, text: str) -> np.ndarray:
        return self._encode(text)

    def output_tokens(self, record: TraceRecord) -> np.ndarray:
        """A record's output as token ids: the engine's own where it recorded them (exactly what it
        served; the text may not encode back to them), else the output text encoded."""
        if record.engine is not None:
            return np.asarray(record.engine.output_ids, dtype=np.int32)
        return self._encode(record.output)

    def decode(self, ids) -> str:
        """Token ids back to text, special tokens kept (a recorded prompt keeps its ChatML markup,
        so encoding it again gives the same ids wherever the tokenizer round-trips)."""
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=False)

    def encode_context(self, record: TraceRecord) -> np.ndarray:
        """Prompt tokens; chat messages are cached one by one because agent histories repeat."""
        if isinstance(record.context, str):
            return self._encode(record.context)
        parts = []
        for message in record.context:
            key = (message.role, message.content)
            ids = self._message_cache.get(key)
            if ids is None:
                ids = self._encode(f"<|im_start|>{message.role}\n{message.content}<|im_end|>\n")
                self._message_cache[key] = ids
            parts.append(ids)
        parts.append(self._assistant_header)
        return np.concatenate(parts)

    def clear_cache(self) -> None:
        self._message_cache.clear()

    def token_texts(self) -> list[str]:
        """The text of every token id, in id order (special tokens included): what
        predictor.drafting.token_classes classifies."""
        return [self._tok.decode([token_id], skip_special_tokens=False) for token_id in range(self.vocab_size)]
