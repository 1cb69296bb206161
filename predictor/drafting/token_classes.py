"""What each vocabulary id's text contains, as lookup tables: the structure features' input.

Built once per tokenizer from the text of every token id (`token_classes`), so that structure
features are lookups, not string work, at serving as in replay. Any object with `token_texts()`
(predictor.data.tokens.TraceTokenizer, for one) is a vocabulary here.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

# Bits of TokenClasses.flags: what a draft token contains, for the structure features.
NEWLINE, BRACKET, QUOTE, DIGIT = 1, 2, 4, 8
_OPEN, _CLOSE = "([{", ")]}"


class Vocabulary(Protocol):
    def token_texts(self) -> Sequence[str]:
        """The text of every token id, in id order."""
        ...


@dataclass(frozen=True)
class TokenClasses:
    """Per-vocabulary-id lookup tables, so structure features are lookups, not string work: an
    array where drafts are looked up whole, lists where output tokens are looked up one by one."""

    flags: np.ndarray  # uint8 bit set per token id
    depth_delta: list[int]  # opening minus closing brackets in the token's text
    ends_line: list[bool]  # the token's text ends with a newline
    # `flags` as a list: a few drafts' tokens are looked up faster one by one than through numpy
    flag_list: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flag_list", np.asarray(self.flags).tolist())

    @staticmethod
    def of_texts(texts: Sequence[str]) -> "TokenClasses":
        size = len(texts)
        flags = np.zeros(size, dtype=np.uint8)
        depth = [0] * size
        ends_line = [False] * size
        for token_id, text in enumerate(texts):
            f = 0
            if "\n" in text:
                f |= NEWLINE
            if any(c in text for c in "()[]{}<>"):
                f |= BRACKET
            if any(c in text for c in "\"'`"):
                f |= QUOTE
            if any(c.isdigit() for c in text):
                f |= DIGIT
            flags[token_id] = f
            depth[token_id] = sum(text.count(c) for c in _OPEN) - sum(text.count(c) for c in _CLOSE)
            ends_line[token_id] = text.endswith("\n")
        return TokenClasses(flags, depth, ends_line)


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_classes(vocabulary: Vocabulary) -> TokenClasses:
    """The vocabulary's TokenClasses, built once per vocabulary object (as long as it lives)."""
    classes = _BUILT.get(vocabulary)
    if classes is None:
        classes = _BUILT[vocabulary] = TokenClasses.of_texts(vocabulary.token_texts())
    return classes
