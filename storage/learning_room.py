"""Repository for the learner's headroom measurements (storage.models.LearningRoom): written by the
leader at each promotion check, read by the dashboard's Versions page."""
from __future__ import annotations

import math
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.limits import MAX_WORKLOAD_LEN
from storage.models import LearningRoom
from storage.retention import keep_newest


def add_learning_room(session: Session, *, at: datetime, workload: str, predictor_version_id: int, drafts: int,
                      headroom: float, challenger_gain: float | None, replica: str) -> LearningRoom:
    """Record one measurement. Refuses a value the table cannot hold, or a gain that is not a number."""
    if len(workload) > MAX_WORKLOAD_LEN:
        raise ValueError(f"learning room workload is {len(workload)} characters; at most {MAX_WORKLOAD_LEN}")
    if drafts < 0:
        raise ValueError(f"learning room drafts must be >= 0, got {drafts}")
    for name, value in (("headroom", headroom), ("challenger_gain", challenger_gain)):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"learning room {name} must be a finite number, got {value}")
    row = LearningRoom(at=at, workload=workload, predictor_version_id=predictor_version_id, drafts=int(drafts),
                       headroom=float(headroom), challenger_gain=None if challenger_gain is None else float(challenger_gain),
                       replica=replica)
    session.add(row)
    session.flush()
    return row


def latest_learning_room(session: Session) -> list[LearningRoom]:
    """Each workload's newest measurement, by workload."""
    newest = select(func.max(LearningRoom.id)).group_by(LearningRoom.workload)
    return list(session.scalars(select(LearningRoom).where(LearningRoom.id.in_(newest)).order_by(LearningRoom.workload)))


def prune_learning_room(session: Session, keep_last: int) -> int:
    """Delete the oldest measurements beyond the newest `keep_last`; returns the count."""
    return keep_newest(session, LearningRoom, keep_last)
