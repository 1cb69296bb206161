"""The feature vector phi_t the gate sees before verification, and its versioned schema.

Every model stores the hash of the schema it was trained on; loading a model against another
schema is refused, because a column shift would silently turn the gate into noise.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from predictor.cache_drafter import SOURCE_GLOBAL, SOURCE_PROMPT
from predictor.tokens import BRACKET, DIGIT, NEWLINE, QUOTE, TokenClasses
from predictor.traces import WORKLOADS

FEATURE_SCHEMA_VERSION = 3
MAX_NESTING = 8

FEATURE_NAMES: tuple[str, ...] = (
    "match_len",
    "draft_len",
    "score",
    "score_per_token",
    "prob_min",
    "prob_mean",
    "prob_first",
    "prob_last",
    "source_prompt",
    "source_global",
    "log_position",
    "log_context_len",
    "draft_has_newline",
    "draft_has_bracket",
    "draft_has_quote",
    "draft_has_digit",
    "nesting_depth",
    "at_line_start",
    "prev_agree",
    "log_prev_gap",
    "has_prev",
    "last_label",
    "mean_label",
    "log_n_resolved",
    "other_tree_score",
    "other_tree_len",
    "trees_agree",
    "continues_prev",
    "agree_2",
    "agree_4",
    "log_hit_streak",
    "first_token_newline",
    "first_token_bracket_quote",
) + tuple(f"workload_{w}" for w in WORKLOADS)
NUM_FEATURES = len(FEATURE_NAMES)
_COL = {name: i for i, name in enumerate(FEATURE_NAMES)}


def schema_hash() -> str:
    """sha256 over the version, the column names and the workload list."""
    text = json.dumps({"version": FEATURE_SCHEMA_VERSION, "names": FEATURE_NAMES, "workloads": WORKLOADS})
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class DraftColumns:
    """Raw per-draft quantities for n drafts; draft tokens and probabilities laid end to end."""

    lengths: np.ndarray  # int, tokens per draft (0 = no draft)
    tokens: np.ndarray  # int32, flat
    probs: np.ndarray  # float32, flat
    score: np.ndarray
    match_len: np.ndarray
    source: np.ndarray  # SOURCE_* per draft
    other_score: np.ndarray  # the losing tree's score
    other_len: np.ndarray
    trees_agree: np.ndarray  # leading tokens both trees propose alike
    continues_prev: np.ndarray  # leading tokens equal to the latest earlier draft's not-yet-realised tail


@dataclass
class HistoryColumns:
    """What the request's earlier drafts say by the time of each new draft (hindsight)."""

    prev_agree: np.ndarray
    prev_gap: np.ndarray
    has_prev: np.ndarray
    last_label: np.ndarray
    mean_label: np.ndarray
    n_resolved: np.ndarray
    agree_2: np.ndarray  # agreement of the draft made 2 positions back with what was realised since
    agree_4: np.ndarray
    hit_streak: np.ndarray  # consecutive latest drafts whose first token was right


def draft_features(
    drafts: DraftColumns,
    positions: np.ndarray,
    context_len: np.ndarray,
    nesting: np.ndarray,
    at_line_start: np.ndarray,
    history: HistoryColumns,
    workload: np.ndarray,
    classes: TokenClasses,
) -> np.ndarray:
    """Assemble phi for n drafts (float32, shape n x NUM_FEATURES); rows without a draft are zero-ish."""
    n = len(drafts.lengths)
    x = np.zeros((n, NUM_FEATURES), dtype=np.float32)
    lengths = np.asarray(drafts.lengths)
    has = lengths > 0
    x[:, _COL["match_len"]] = drafts.match_len
    x[:, _COL["draft_len"]] = lengths
    x[:, _COL["score"]] = drafts.score
    x[:, _COL["score_per_token"]] = np.divide(drafts.score, lengths, out=np.zeros(n), where=has)
    if has.any():
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))[has]
        ends = offsets + lengths[has] - 1
        probs = drafts.probs
        x[has, _COL["prob_min"]] = np.minimum.reduceat(probs, offsets)
        x[has, _COL["prob_mean"]] = np.add.reduceat(probs, offsets) / lengths[has]
        x[has, _COL["prob_first"]] = probs[offsets]
        x[has, _COL["prob_last"]] = probs[ends]
        flags = np.bitwise_or.reduceat(classes.flags[drafts.tokens], offsets)
        x[has, _COL["draft_has_newline"]] = (flags & NEWLINE) > 0
        x[has, _COL["draft_has_bracket"]] = (flags & BRACKET) > 0
        x[has, _COL["draft_has_quote"]] = (flags & QUOTE) > 0
        x[has, _COL["draft_has_digit"]] = (flags & DIGIT) > 0
        first = classes.flags[drafts.tokens[offsets]]
        x[has, _COL["first_token_newline"]] = (first & NEWLINE) > 0
        x[has, _COL["first_token_bracket_quote"]] = (first & (BRACKET | QUOTE)) > 0
    x[:, _COL["source_prompt"]] = drafts.source == SOURCE_PROMPT
    x[:, _COL["source_global"]] = drafts.source == SOURCE_GLOBAL
    x[:, _COL["log_position"]] = np.log1p(positions)
    x[:, _COL["log_context_len"]] = np.log1p(context_len)
    x[:, _COL["nesting_depth"]] = np.clip(nesting, 0, MAX_NESTING)
    x[:, _COL["at_line_start"]] = at_line_start
    x[:, _COL["prev_agree"]] = history.prev_agree
    x[:, _COL["log_prev_gap"]] = np.log1p(history.prev_gap)
    x[:, _COL["has_prev"]] = history.has_prev
    x[:, _COL["last_label"]] = history.last_label
    x[:, _COL["mean_label"]] = history.mean_label
    x[:, _COL["log_n_resolved"]] = np.log1p(history.n_resolved)
    x[:, _COL["other_tree_score"]] = drafts.other_score
    x[:, _COL["other_tree_len"]] = drafts.other_len
    x[:, _COL["trees_agree"]] = np.divide(drafts.trees_agree, lengths, out=np.zeros(n), where=has)
    x[:, _COL["continues_prev"]] = np.divide(drafts.continues_prev, lengths, out=np.zeros(n), where=has)
    x[:, _COL["agree_2"]] = history.agree_2
    x[:, _COL["agree_4"]] = history.agree_4
    x[:, _COL["log_hit_streak"]] = np.log1p(history.hit_streak)
    first_workload = _COL[f"workload_{WORKLOADS[0]}"]
    x[np.arange(n), first_workload + np.asarray(workload, dtype=np.int64)] = 1.0
    return x


def dense_history(labels: np.ndarray, lengths: np.ndarray) -> HistoryColumns:
    """History features for a request drafted at every output position 0..L-1 (trace replay).

    At position t the output out[:t] is known. A draft made at s < t has shown min(y_s, t - s) of
    its tokens to be right ("agreement" with what was realised since), and is fully resolved once
    t >= s + min(y_s + 1, k_s). The live runtime keeps the same quantities incrementally.
    """
    n = len(labels)
    pos = np.arange(n)
    has = lengths > 0
    latest = np.maximum.accumulate(np.where(has, pos, -1))
    prev = np.concatenate(([-1], latest[:-1]))  # latest draft strictly before t
    has_prev = prev >= 0
    gap = np.where(has_prev, pos - prev, 0)
    prev_c = np.maximum(prev, 0)
    seen = np.minimum(lengths[prev_c], gap)
    prev_agree = np.where(has_prev, np.minimum(labels[prev_c], gap) / np.maximum(seen, 1), 0.0)

    done = np.where(has, pos + np.minimum(labels + 1, lengths), n + 1)
    in_range = done <= n - 1
    count = np.cumsum(np.bincount(done[in_range], minlength=n)[:n])
    total = np.cumsum(np.bincount(done[in_range], weights=labels[in_range], minlength=n)[:n])
    last_pos = np.full(n, -1)
    np.maximum.at(last_pos, done[in_range], pos[in_range])
    last_pos = np.maximum.accumulate(last_pos)

    def agree(j: int) -> np.ndarray:
        s = pos - j
        ok = s >= 0
        s = np.maximum(s, 0)
        seen_j = np.minimum(lengths[s], j)
        return np.where(ok & (lengths[s] > 0), np.minimum(labels[s], j) / np.maximum(seen_j, 1), 0.0)

    miss = np.maximum.accumulate(np.where((labels >= 1) & has, -1, pos))
    streak = np.concatenate(([0], (pos[:-1] - miss[:-1])))
    return HistoryColumns(
        prev_agree=prev_agree,
        prev_gap=gap,
        has_prev=has_prev,
        last_label=np.where(last_pos >= 0, labels[np.maximum(last_pos, 0)], 0),
        mean_label=np.divide(total, count, out=np.zeros(n), where=count > 0),
        n_resolved=count,
        agree_2=agree(2),
        agree_4=agree(4),
        hit_streak=streak,
    )
