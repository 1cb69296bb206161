"""What the runtime remembers about one running request: who it is for, its hindsight tracker
(tokens, drafts waiting for labels, history), what was decided about each of its cache drafts, and
the model draft awaiting the next step's token count."""
from __future__ import annotations

from dataclasses import dataclass, field

from predictor.hindsight import Hindsight, TrackedDraft


@dataclass(frozen=True, slots=True)
class CacheDraftRecord:
    """What the step that made a cache draft decided about it; its label comes later (hindsight)."""

    position: int
    draft_len: int
    decision: str  # cache | model | none for the step's own draft, shadow for the drafts in between
    predicted: float
    tau: float  # NaN for shadow drafts
    version_id: int | None
    features: bytes  # the float32 feature row the gate saw


@dataclass(frozen=True, slots=True)
class ModelDraftRecord:
    position: int
    draft_len: int


@dataclass(slots=True)
class RequestState:
    req_id: str
    tenant: str
    workload: str
    speculate: bool
    hindsight: Hindsight
    model_draft: ModelDraftRecord | None = None
    records: dict[TrackedDraft, CacheDraftRecord] = field(default_factory=dict)  # drafts not yet labelled
