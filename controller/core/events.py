"""Labelled events and the bounded queue that carries them off the decode path.

The decode path must never wait for storage or learning: `put` never blocks; when the queue is
full (or closed, at shutdown) the event is dropped and counted, and the count is itself reported
(it is a health figure). An optional observer (the Prometheus metrics) sees every event offered,
admitted or not, and every batch taken off, from the one place events pass through.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import MISSING, dataclass, fields
from typing import Protocol, TypeVar

DRAFTER_CACHE, DRAFTER_MODEL = "cache", "model"

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Give a frozen, slotted dataclass an `__init__` that fills its slots through their descriptors.

    The one dataclasses generates calls `object.__setattr__` by name per field, several
    microseconds for an event's fourteen; the runtime makes an event or a record per draft, on the
    decode path, so that is a good part of a step. Same parameters, defaults and result; equality,
    hashing, `replace` and `fields` are the dataclass's own (only fields with plain defaults)."""
    params, body, scope = [], [], {}
    for f in fields(cls):
        if f.default_factory is not MISSING:  # type: ignore[misc]
            raise TypeError(f"quick_init: {cls.__name__}.{f.name} has a default factory")
        scope[f"_set_{f.name}"] = getattr(cls, f.name).__set__
        if f.default is MISSING:
            params.append(f.name)
        else:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body) + "\n", scope)  # noqa: S102
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]
    return cls


@quick_init
@dataclass(frozen=True, slots=True)
class LabelledEvent:
    """One draft with its exact label: accepted tokens under greedy verification."""

    at: float  # unix time the label became known
    tenant: str
    workload: str
    request_id: str
    position: int  # output tokens emitted when the draft was made
    drafter: str  # whose draft is labelled: cache | model
    decision: str  # what the step verified: cache | model | none
    draft_len: int
    accepted: int
    predicted: float | None
    tau: float | None
    predictor_version_id: int | None
    features: bytes | None  # float32 row of the feature vector the gate saw (cache drafts)
    # Draft tokens the engine verified: a prefix of a cache draft the allocator cut (the label is the
    # whole draft's, for learning); None when nothing of this draft was verified.
    verified_len: int | None = None
    # What the allocator's plan expected the target to accept of the tokens the engine verified (the
    # draft's survival curve, or the model drafter's, summed over them); None where nothing was
    # verified or no allocator planned the step. Beside the tokens accepted among them it says whether
    # the plan over-promises on the drafts it acts on.
    promised: float | None = None

    def to_row(self) -> dict:
        from datetime import datetime, timezone

        return {
            "at": datetime.fromtimestamp(self.at, tz=timezone.utc), "tenant": self.tenant, "workload": self.workload,
            "request_id": self.request_id, "position": self.position, "drafter": self.drafter,
            "decision": self.decision, "draft_len": self.draft_len, "accepted": self.accepted,
            "predicted": self.predicted, "tau": self.tau, "predictor_version_id": self.predictor_version_id,
            "features": self.features, "verified_len": self.verified_len, "promised": self.promised,
        }


class QueueObserver(Protocol):
    """Told of what passes through an EventQueue; must be cheap and never raise (it runs on the
    decode path)."""

    def offered(self, event: LabelledEvent, admitted: bool) -> None: ...

    def taken(self, count: int) -> None: ...


class EventQueue:
    """A bounded FIFO: `put` drops (and counts) instead of waiting when full or closed.

    A deque under one lock rather than a `queue.Queue`: nothing ever waits on this queue, so its
    condition variables were pure cost (a put took about four times as long), paid per event on
    the decode path."""

    def __init__(self, maxsize: int = 65536, observer: QueueObserver | None = None) -> None:
        if maxsize < 1:
            raise ValueError(f"event queue size must be >= 1, got {maxsize}")
        self._items: deque[LabelledEvent] = deque()
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self.dropped = 0
        self.queued = 0  # events put on the queue (not dropped) since it was made
        self.closed = False
        self.observer = observer

    def close(self) -> None:
        """Admit nothing more (shutdown): later events are dropped and counted."""
        self.closed = True

    def put(self, event: LabelledEvent) -> bool:
        with self._lock:
            admitted = not self.closed and len(self._items) < self.maxsize
            if admitted:
                self._items.append(event)
                self.queued += 1
            else:
                self.dropped += 1
        if self.observer is not None:
            self.observer.offered(event, admitted)
        return admitted

    def get_batch(self, max_items: int) -> list[LabelledEvent]:
        """Up to max_items queued events, without waiting (the writer paces itself)."""
        items = self._items
        with self._lock:
            batch = [items.popleft() for _ in range(min(max_items, len(items)))]
        if batch and self.observer is not None:
            self.observer.taken(len(batch))
        return batch

    def depth(self) -> int:
        return len(self._items)
