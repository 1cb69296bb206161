"""The feature vector phi the gate sees before verification: its inputs, its columns, its schema.

A feature is one line of FEATURES: its name and its formula over the named inputs of a batch of
drafts (every number of DraftContext and its CacheDraft, by that name). The order of FEATURES
is the column order. Offline replay and the live runtime both build DraftContexts (through
predictor.drafting.hindsight) and call feature_matrix, so the features a predictor learns from are the ones
it is served.

Every model stores the hash of the schema it was trained on; loading a model against another
schema is refused, because a column shift would silently turn the gate into noise. Changing a
formula or the order means bumping FEATURE_SCHEMA_VERSION.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import NamedTuple

import numpy as np

from predictor.drafting.cache_drafter import TREE_GLOBAL, TREE_PROMPT, CacheDraft
from predictor.drafting.token_classes import BRACKET, DIGIT, NEWLINE, QUOTE, TokenClasses
from storage.workloads import WORKLOADS

FEATURE_SCHEMA_VERSION = 3
MAX_NESTING = 8


class DraftContext(NamedTuple):
    """One cache draft and everything else the gate may know about it before verification."""

    draft: CacheDraft
    continues_prev: int  # leading tokens equal to the latest earlier draft's not-yet-realised tail
    position: int  # t: output tokens realised when it was drafted
    context_len: int  # prompt + output tokens
    nesting: int  # open brackets in the output so far
    at_line_start: bool  # the last realised token ends a line
    workload: int  # index into WORKLOADS
    # What the request's earlier drafts have shown by t, in hindsight (predictor.drafting.hindsight):
    prev_agree: float  # of the latest earlier draft's tokens realised since, the share it got right
    prev_gap: int  # positions since that draft
    has_prev: bool
    last_label: float  # label of the latest-positioned draft whose label is known
    mean_label: float  # mean label of the drafts whose labels are known
    n_resolved: int  # how many those are
    agree_2: float  # prev_agree of the draft made at t - 2 (0 if none)
    agree_4: float
    hit_streak: int  # consecutive positions up to t whose draft's first token was right


_draft, _token_ids, _probs = attrgetter("draft"), attrgetter("token_ids"), attrgetter("probs")


class _Inputs:
    """A batch of DraftContexts as named columns (every number of DraftContext and its CacheDraft,
    by its own name), plus the drafts' tokens and probabilities laid end to end."""

    _DRAFT = tuple(name for name in CacheDraft._fields if name not in ("token_ids", "probs"))
    _CONTEXT = DraftContext._fields[1:]
    _draft_numbers = attrgetter(*_DRAFT)
    _context_numbers = itemgetter(slice(1, None))

    def __init__(self, rows: Sequence[DraftContext], classes: TokenClasses) -> None:
        # map/attrgetter rather than comprehensions: replay gathers a row per output position
        n = self.n = len(rows)
        drafts = list(map(_draft, rows))
        for names, values in ((self._DRAFT, map(self._draft_numbers, drafts)),
                              (self._CONTEXT, map(self._context_numbers, rows))):
            columns = np.fromiter(chain.from_iterable(values), dtype=np.float64, count=n * len(names))
            self.__dict__.update(zip(names, columns.reshape(n, len(names)).T))
        token_ids = list(map(_token_ids, drafts))
        self.lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=n)
        self.has = self.lengths > 0
        self.tokens = np.fromiter(chain.from_iterable(token_ids), dtype=np.int32)
        self.probs = np.fromiter(chain.from_iterable(map(_probs, drafts)), dtype=np.float32)
        self.firsts = (np.cumsum(self.lengths) - self.lengths)[self.has]  # where each draft starts
        self.lasts = self.firsts + self.lengths[self.has] - 1
        self.flags = classes.flags[self.tokens]

    def per_draft(self, values: np.ndarray) -> np.ndarray:
        """Values given for the rows with a draft, 0 elsewhere."""
        out = np.zeros(self.n)
        out[self.has] = values
        return out

    def over_draft(self, ufunc: np.ufunc, values: np.ndarray) -> np.ndarray:
        """`ufunc` reduced over each draft's tokens."""
        return self.per_draft(ufunc.reduceat(values, self.firsts))

    def per_token(self, values: np.ndarray) -> np.ndarray:
        return np.divide(values, self.lengths, out=np.zeros(self.n), where=self.has)

    def draft_has(self, flag: int) -> np.ndarray:
        return self.per_draft((np.bitwise_or.reduceat(self.flags, self.firsts) & flag) > 0)

    def first_token_has(self, flag: int) -> np.ndarray:
        return self.per_draft((self.flags[self.firsts] & flag) > 0)


Formula = Callable[[_Inputs], np.ndarray]

FEATURES: tuple[tuple[str, Formula], ...] = (
    ("match_len", lambda b: np.where(b.has, b.match_len, 0.0)),  # a match that found nothing to draft counts 0
    ("draft_len", lambda b: b.lengths),
    ("score", lambda b: b.score),
    ("score_per_token", lambda b: b.per_token(b.score)),
    ("prob_min", lambda b: b.over_draft(np.minimum, b.probs)),
    ("prob_mean", lambda b: b.per_token(b.over_draft(np.add, b.probs))),
    ("prob_first", lambda b: b.per_draft(b.probs[b.firsts])),
    ("prob_last", lambda b: b.per_draft(b.probs[b.lasts])),
    ("source_prompt", lambda b: b.tree == TREE_PROMPT),
    ("source_global", lambda b: b.tree == TREE_GLOBAL),
    ("log_position", lambda b: np.log1p(b.position)),
    ("log_context_len", lambda b: np.log1p(b.context_len)),
    ("draft_has_newline", lambda b: b.draft_has(NEWLINE)),
    ("draft_has_bracket", lambda b: b.draft_has(BRACKET)),
    ("draft_has_quote", lambda b: b.draft_has(QUOTE)),
    ("draft_has_digit", lambda b: b.draft_has(DIGIT)),
    ("nesting_depth", lambda b: np.clip(b.nesting, 0, MAX_NESTING)),
    ("at_line_start", lambda b: b.at_line_start),
    ("prev_agree", lambda b: b.prev_agree),
    ("log_prev_gap", lambda b: np.log1p(b.prev_gap)),
    ("has_prev", lambda b: b.has_prev),
    ("last_label", lambda b: b.last_label),
    ("mean_label", lambda b: b.mean_label),
    ("log_n_resolved", lambda b: np.log1p(b.n_resolved)),
    ("other_tree_score", lambda b: b.other_score),
    ("other_tree_len", lambda b: b.other_len),
    ("trees_agree", lambda b: b.per_token(b.trees_agree)),
    ("continues_prev", lambda b: b.per_token(b.continues_prev)),
    ("agree_2", lambda b: b.agree_2),
    ("agree_4", lambda b: b.agree_4),
    ("log_hit_streak", lambda b: np.log1p(b.hit_streak)),
    ("first_token_newline", lambda b: b.first_token_has(NEWLINE)),
    ("first_token_bracket_quote", lambda b: b.first_token_has(BRACKET | QUOTE)),
) + tuple((f"workload_{w}", lambda b, i=i: b.workload == i) for i, w in enumerate(WORKLOADS))

FEATURE_NAMES: tuple[str, ...] = tuple(name for name, _ in FEATURES)
NUM_FEATURES = len(FEATURE_NAMES)


def schema_hash() -> str:
    """sha256 over the version, the column names and the workload list."""
    text = json.dumps({"version": FEATURE_SCHEMA_VERSION, "names": FEATURE_NAMES, "workloads": WORKLOADS})
    return hashlib.sha256(text.encode()).hexdigest()


def feature_matrix(rows: Sequence[DraftContext], classes: TokenClasses) -> np.ndarray:
    """phi for each row (float32, rows x NUM_FEATURES); a row without a draft has its draft columns 0."""
    inputs = _Inputs(rows, classes)
    x = np.empty((inputs.n, NUM_FEATURES), dtype=np.float32)
    for j, (_, formula) in enumerate(FEATURES):
        x[:, j] = formula(inputs)
    return x
