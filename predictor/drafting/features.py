"""The feature vector phi the gate sees before verification: its inputs, its columns, its schema.

A feature is one line of FEATURES: its name and its formula over the named inputs of a batch of
drafts (every number of DraftContext and its CacheDraft, by that name). The order of FEATURES
is the column order. Offline replay and the live runtime both build DraftContexts (through
predictor.drafting.hindsight) and call feature_matrix, so the features a predictor learns from are the ones
it is served.

A live step of a few drafts builds its rows with `_few_rows`, the same formulas computed row by row
(a change to one must be made in both; tests/test_runtime_reference.py holds them to the same bits).

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

from predictor.drafting.cache_drafter import TREE_GLOBAL, TREE_PROMPT, CacheDraft, SuffixConfig
from predictor.drafting.token_classes import BRACKET, DIGIT, NEWLINE, QUOTE, TokenClasses
from storage.workloads import WORKLOADS

FEATURE_SCHEMA_VERSION = 6  # 4: the engine's signals; 5: of them only whether the text is on-policy; 6: drafts up to 4x the match (SuffixConfig)
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
    # The output is the verifying model's own: live traffic, or a trace the serving engine recorded
    # (predictor.data.traces.EngineRecord); False for text other models wrote.
    on_policy: bool = False


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
    ("on_policy", lambda b: b.on_policy),
) + tuple((f"workload_{w}", lambda b, i=i: b.workload == i) for i, w in enumerate(WORKLOADS))

FEATURE_NAMES: tuple[str, ...] = tuple(name for name, _ in FEATURES)
NUM_FEATURES = len(FEATURE_NAMES)


def schema_hash() -> str:
    """sha256 over the version, the column names, the workload list and the shape of the drafts the
    columns describe (a gate trained on shorter drafts never saw where longer ones fail)."""
    shape = SuffixConfig()
    text = json.dumps({"version": FEATURE_SCHEMA_VERSION, "names": FEATURE_NAMES, "workloads": WORKLOADS,
                       "drafts": [shape.max_spec_factor, shape.min_token_prob]})
    return hashlib.sha256(text.encode()).hexdigest()


def feature_matrix(rows: Sequence[DraftContext], classes: TokenClasses) -> np.ndarray:
    """phi for each row (float32, rows x NUM_FEATURES); a row without a draft has its draft columns 0.

    Up to FEW_ROWS rows (a live step at small batch) the rows are built in Python by `_few_rows`,
    to the same bits: the columns' hundred-odd numpy calls cost more than the arithmetic there."""
    if len(rows) <= FEW_ROWS:
        return _few_rows(rows, classes)
    inputs = _Inputs(rows, classes)
    x = np.empty((inputs.n, NUM_FEATURES), dtype=np.float32)
    for j, (_, formula) in enumerate(FEATURES):
        x[:, j] = formula(inputs)
    return x


FEW_ROWS = 8  # up to this many rows, one Python pass per row beats the columns' numpy calls
_LOG1P_CHUNK, _LOG1P_MAX = 4096, 1 << 17
_log1p_table: list[float] = []


def _log1p(v: int) -> float:
    """np.log1p(v) for an integer count (numpy's own values: its SIMD log1p and libm's differ in
    the last bit for some arguments), from a table numpy fills, grown on demand up to _LOG1P_MAX."""
    table = _log1p_table
    if v.__class__ is not int:  # a numpy or float count: numpy's own log1p
        return float(np.log1p(np.float64(v)))
    if 0 <= v < len(table):
        return table[v]
    if 0 <= v < _LOG1P_MAX:
        end = min(_LOG1P_MAX, (v // _LOG1P_CHUNK + 1) * _LOG1P_CHUNK)
        table.extend(np.log1p(np.arange(len(table), end, dtype=np.float64)).tolist())
        return table[v]
    return float(np.log1p(np.float64(v)))


def _few_rows(rows: Sequence[DraftContext], classes: TokenClasses) -> np.ndarray:
    """The rows of `feature_matrix`, each computed in Python floats, formula for formula as FEATURES
    computes its columns in float64 before they are stored as float32 (a test holds the two to the
    same bits; a change to a formula must be made in both). The one float32 computation, the sum of
    a draft's probabilities, is numpy's own reduceat over the same segments."""
    if not rows:
        return np.empty((0, NUM_FEATURES), dtype=np.float32)
    flags = classes.flag_list
    drafts = [c.draft for c in rows]
    sums = iter(_prob_sums(drafts))
    log1p = _log1p_table  # counts below `small` are looked up inline, the rest through _log1p
    if not log1p:
        _log1p(0)
    small = len(log1p)
    workloads = range(len(WORKLOADS))
    table = []
    for c, d in zip(rows, drafts):
        (_, continues, position, context_len, nesting, at_line_start, workload, prev_agree, prev_gap, has_prev,
         last_label, mean_label, n_resolved, agree_2, agree_4, hit_streak, on_policy) = c
        tokens = d.token_ids
        k = len(tokens)
        if k:
            probs = d.probs
            seen = 0
            for t in tokens:
                seen |= flags[t]
            first = flags[tokens[0]]
            row = [float(d.match_len), k, d.score, d.score / k, min(probs), next(sums) / k, probs[0], probs[-1]]
        else:
            seen = first = 0
            row = [0.0, 0, d.score, 0.0, 0.0, 0.0, 0.0, 0.0]
        lp_position, lp_context, lp_gap, lp_resolved, lp_streak = [
            log1p[v] if v.__class__ is int and 0 <= v < small else _log1p(v)
            for v in (position, context_len, prev_gap, n_resolved, hit_streak)]
        row += [d.tree == TREE_PROMPT, d.tree == TREE_GLOBAL, lp_position, lp_context,
                (seen & NEWLINE) > 0, (seen & BRACKET) > 0, (seen & QUOTE) > 0, (seen & DIGIT) > 0,
                0.0 if nesting < 0 else (float(MAX_NESTING) if nesting > MAX_NESTING else nesting),
                at_line_start, prev_agree, lp_gap, has_prev, last_label, mean_label, lp_resolved,
                d.other_score, d.other_len, d.trees_agree / k if k else 0.0, continues / k if k else 0.0,
                agree_2, agree_4, lp_streak, (first & NEWLINE) > 0, (first & (BRACKET | QUOTE)) > 0,
                on_policy]
        row += [workload == i for i in workloads]
        table.append(row)
    return np.array(table, dtype=np.float32)


def _prob_sums(drafts: Sequence[CacheDraft]) -> list[float]:
    """Each non-empty draft's probabilities summed in float32, exactly as `_Inputs` sums them (the
    same numpy reduceat over the same segments)."""
    kept = [d for d in drafts if d.token_ids]
    if not kept:
        return []
    probs = np.fromiter(chain.from_iterable(d.probs for d in kept), dtype=np.float32)
    starts, at = [], 0
    for d in kept:  # segments by token counts, as `_Inputs.firsts`
        starts.append(at)
        at += len(d.token_ids)
    return np.add.reduceat(probs, starts).tolist()
