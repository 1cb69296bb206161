"""Hindsight: what one request's realised output says about the cache drafts made along it.

Under greedy verification a draft accepts its longest common prefix with the tokens the target
emits, so once the realised output shows a mismatch (or every draft token matched) the draft's
label is exact, whether or not it was verified. At position t only out[:t] is known: a draft made
at s < t has shown min(y_s, t - s) of its tokens to be right, which is what the history features
read.

Offline replay (a draft at every position) and the live runtime (wherever the engine drafts) both
track requests with this class and build their DraftContexts with `draft_context`, so labels and
features are computed one way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.drafting.cache_drafter import CacheDraft
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import DraftContext
from predictor.drafting.token_classes import TokenClasses

_RECENT = 4  # agree_2 / agree_4 look this far back


@dataclass(eq=False, slots=True)
class TrackedDraft:
    """A cache draft made along the request; identity names it (two drafts can be equal)."""

    position: int
    tokens: list[int]
    matched: int = 0  # leading tokens the output has confirmed so far
    label: int | None = None  # set once the output decides it


Labelled = tuple[TrackedDraft, int]


class Hindsight:
    """One request: its tokens, its drafts waiting for labels, and the history at its current position."""

    def __init__(self, prompt: np.ndarray, workload: int, classes: TokenClasses, on_policy: bool = False) -> None:
        self.prompt_len = len(prompt)
        self.workload = workload
        self.on_policy = on_policy  # DraftContext.on_policy: the output is the verifying model's own
        self._classes = classes
        self._buffer = np.zeros(max(64, 2 * len(prompt)), dtype=np.int32)  # prompt + output
        self._buffer[: len(prompt)] = prompt
        self._length = len(prompt)
        self.out: list[int] = []
        self.nesting = 0
        self._pending: list[TrackedDraft] = []
        self._recent: dict[int, TrackedDraft] = {}  # position -> draft, the last few positions
        self._latest: TrackedDraft | None = None
        self._resolved = 0
        self._resolved_sum = 0.0
        self._last_resolved_position = -1
        self._last_resolved_label = 0
        self._first_tokens: dict[int, int] = {}  # position -> its draft's first token, until realised
        self._streak = 0

    @property
    def output_len(self) -> int:
        return len(self.out)

    @property
    def tokens(self) -> np.ndarray:
        """Prompt and output so far: what the suffix cache drafts after."""
        return self._buffer[: self._length]

    def append(self, tokens: np.ndarray) -> list[Labelled]:
        """Take in realised output tokens; returns the drafts whose labels they decide, with the labels."""
        new = tokens.tolist()
        if not new:
            return []
        end = self._length + len(new)
        if end > len(self._buffer):
            grown = np.zeros(max(2 * len(self._buffer), end), dtype=np.int32)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        if len(new) == 1:  # the common case, and a scalar write is much cheaper than a slice's
            self._buffer[self._length] = new[0]
        else:
            self._buffer[self._length : end] = tokens
        self._length = end
        out, depth, first_tokens = self.out, self._classes.depth_delta, self._first_tokens
        for token in new:
            self.nesting += depth[token]
            self._streak = self._streak + 1 if first_tokens.pop(len(out), None) == token else 0
            out.append(token)
        return self._resolve(final=False) if self._pending else []

    def append_token(self, token: int) -> list[Labelled]:
        """`append` of one token given as an int: the live runtime takes a multi-token step's
        tokens one at a time (drafting in between), where a one-token array and its `tolist`
        would cost more than the rest."""
        end = self._length + 1
        if end > len(self._buffer):
            grown = np.zeros(max(2 * len(self._buffer), end), dtype=np.int32)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length] = token
        self._length = end
        out = self.out
        self.nesting += self._classes.depth_delta[token]
        self._streak = self._streak + 1 if self._first_tokens.pop(len(out), None) == token else 0
        out.append(token)
        return self._resolve(final=False) if self._pending else []

    def finish(self) -> list[Labelled]:
        """The request ended: every draft still waiting is labelled with what was realised."""
        return self._resolve(final=True)

    def draft_context(self, draft: CacheDraft) -> DraftContext:
        """The draft just made at the current position t, with all the gate may know about it."""
        t = len(self.out)
        prev = self._latest
        continues = 0
        if prev is not None and draft.token_ids:
            continues = lcp(prev.tokens[t - prev.position :], draft.token_ids)
        two, four = self._recent.get(t - 2), self._recent.get(t - 4)
        return DraftContext(
            draft, continues, t, self._length, self.nesting,
            self._classes.ends_line[self.out[-1]] if t else False,  # at_line_start
            self.workload,
            _agreement(prev, t) if prev is not None else 0.0,  # prev_agree
            t - prev.position if prev is not None else 0,  # prev_gap
            prev is not None,  # has_prev
            float(self._last_resolved_label),
            self._resolved_sum / self._resolved if self._resolved else 0.0,  # mean_label
            self._resolved,  # n_resolved
            _agreement(two, t) if two is not None else 0.0,  # agree_2
            _agreement(four, t) if four is not None else 0.0,  # agree_4
            self._streak,  # hit_streak
            self.on_policy,
        )

    def add(self, draft: CacheDraft) -> TrackedDraft:
        """The draft made at the current position joins the history (later positions see it)."""
        t = len(self.out)
        d = TrackedDraft(t, draft.token_ids)
        self._pending.append(d)
        self._latest = d
        self._first_tokens[t] = d.tokens[0]
        self._recent[t] = d
        if len(self._recent) > _RECENT + 1:  # the oldest of 6 positions is < t - 4: never looked up again
            del self._recent[next(iter(self._recent))]
        return d

    def _resolve(self, final: bool) -> list[Labelled]:
        t = len(self.out)
        out = self.out
        done, still = [], []
        for d in self._pending:
            tokens, at = d.tokens, d.position
            k = len(tokens)
            shown = k if t - at > k else t - at
            y = d.matched
            while y < shown and tokens[y] == out[at + y]:
                y += 1
            if y < shown or shown == k:  # a mismatch seen, or every token matched: the label is final
                d.label = y
                done.append((d, y))
                self._resolved += 1
                self._resolved_sum += y
                if at > self._last_resolved_position:
                    self._last_resolved_position, self._last_resolved_label = at, y
            elif final:
                d.label = y
                done.append((d, y))
            else:
                d.matched = y
                still.append(d)
        self._pending = still
        return done


def _agreement(d: TrackedDraft, t: int) -> float:
    """Of the draft's tokens realised by t, the share that matched (a pending draft matched all)."""
    k, gap = len(d.tokens), t - d.position
    shown = k if gap > k else gap
    return (shown if d.label is None else d.label) / (shown if shown > 1 else 1)
