"""Where a request can end, and so which draft tokens can still be output.

Why: an engine stops a request at its max_tokens or at a stop token (vLLM: `check_stop`), and drops
whatever else the step sampled for it; a draft token verified past that point costs its query
token and can never be output. And the request's last token needs no draft: the step that verifies
the tokens before it samples it as its bonus token, whether or not it was drafted. So of a draft,
only the tokens before the request's last possible token can pay: with `room` tokens left to emit,
the first room - 1; with a stop token at draft position j (1-based), the first j - 1. Suffix caches
draft happily past both (the global tree holds longer answers; a prompt holds the chat template's
end-of-turn and what follows it), most of all in the last step of every request.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence


def useful_length(draft: Sequence[int], room: int | None, stops: Collection[int]) -> int:
    """How many of `draft`'s leading tokens can add to the request's output: none past its last
    possible token (the room left, or the first stop token in the draft)."""
    n = len(draft)
    if room is not None:
        n = min(n, max(0, room - 1))
    if stops:
        for j in range(n):
            if draft[j] in stops:
                return j
    return n


def model_room(room: int | None, k_max: int) -> int:
    """The longest model draft that can add to the output: the model drafter's tokens are not known
    before it runs, so only the room left bounds them."""
    return k_max if room is None else max(0, min(k_max, room - 1))
