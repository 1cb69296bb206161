"""What the runtime remembers about one running request: who it is for, its hindsight tracker
(tokens, drafts waiting for labels, history), what was decided about each of its cache drafts, and
the draft the engine verifies this step, awaiting the next step's token count."""
from __future__ import annotations

from dataclasses import dataclass, field

from controller.core.events import quick_init
from predictor.drafting.hindsight import Hindsight, TrackedDraft


@quick_init  # one per draft, on the decode path
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
    verified_len: int | None = None  # the prefix the step verified (cache decisions only)
    promised: float | None = None  # what the plan expected of the verified prefix (LabelledEvent.promised)


@quick_init  # one per verified draft, on the decode path
@dataclass(frozen=True, slots=True)
class VerifiedDraft:
    """What the engine verifies for the request in this step; the tokens it reports next step say
    how many were accepted (as the engine counts them: tokens emitted - 1)."""

    position: int
    draft_len: int  # tokens verified: the cache draft's prefix, or the step's model draft length k
    model: bool  # the model drafter's draft (else a cache prefix)
    version_id: int | None = None  # the predictor version of the step that planned it (model drafts' events)
    tracked: TrackedDraft | None = None  # the cache draft verified (its record learns what was verified)
    token_prob: tuple[float, ...] | None = None  # a rival rule's cache draft: its tokens' probabilities (it learns from them)
    # What the allocator's plan expected of each verified token: the draft's survival curve S(1..l)
    # (the model drafter's live curve for a model draft); None where no allocator planned the step.
    promised: tuple[float, ...] | None = None


@dataclass(slots=True)
class RequestState:
    req_id: str
    tenant: str
    workload: str
    speculate: bool
    hindsight: Hindsight
    verifying: VerifiedDraft | None = None
    records: dict[TrackedDraft, CacheDraftRecord] = field(default_factory=dict)  # drafts not yet labelled
