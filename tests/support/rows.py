"""Reading back what the code under test wrote, with plain SQLAlchemy selects (the production code
has no reader for these: the tests are the only ones that count or list them)."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import DeadLetterEvent, DecisionEvent, LearningRoom, StatBucket


def count(session: Session, model: type = DecisionEvent, **filters: Any) -> int:
    """Rows of `model` (decision events by default) whose columns equal `filters`."""
    stmt = select(func.count()).select_from(model)
    for name, value in filters.items():
        stmt = stmt.where(getattr(model, name) == value)
    return int(session.scalar(stmt) or 0)


def count_dead_letters(session: Session) -> int:
    return count(session, DeadLetterEvent)


def buckets(session: Session, since: datetime | None = None, tenant: str | None = None,
            workload: str | None = None) -> list[StatBucket]:
    """Statistics buckets (bucket_start >= since, optionally one tenant/workload), oldest first."""
    stmt = select(StatBucket).order_by(StatBucket.bucket_start, StatBucket.tenant, StatBucket.workload,
                                       StatBucket.predictor_version_id)
    if since is not None:
        stmt = stmt.where(StatBucket.bucket_start >= since)
    if tenant is not None:
        stmt = stmt.where(StatBucket.tenant == tenant)
    if workload is not None:
        stmt = stmt.where(StatBucket.workload == workload)
    return list(session.scalars(stmt))


def learning_room(session: Session) -> list[LearningRoom]:
    """Every learning-room measurement, newest first."""
    return list(session.scalars(select(LearningRoom).order_by(LearningRoom.id.desc())))


def accepted_per_position(accepted_count: dict[int, int]) -> list[int]:
    """[j]: verified drafts whose position j + 1 was accepted (as vLLM counts per position), from
    RuntimeStats.accepted_count (drafts per number of tokens accepted)."""
    longest = max(accepted_count, default=0)
    return [sum(c for a, c in accepted_count.items() if a > j) for j in range(longest)]
