"""Repository for the online learner's checks (storage.models.LearnerCheck): written by the leader,
read by `hvd versions --log` and the dashboard's Versions page."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.limits import MAX_REASON_LEN, MAX_TENANT_LEN, MAX_WORKLOAD_LEN
from storage.models import LearnerCheck

SUBJECTS = ("promotion", "calibration")
# promotion: won (confirmation pending), confirmed (one more to go), refused, promoted, kept (a
# probation look passed), rolled back; held (the promotion or rollback was due but an operator's pin
# holds the alias), moved meanwhile (the alias no longer named what the learner read: it follows the
# database from its next round). calibration: on trial, confirmed, refused.
OUTCOMES = ("won", "confirmed", "refused", "promoted", "kept", "rolled back", "on trial", "held", "moved meanwhile")


def add_learner_check(session: Session, *, at: datetime, workload: str, tenant: str | None, subject: str,
                      outcome: str, gain: float, drafts: int, predictor_version_id: int, reason: str,
                      replica: str) -> LearnerCheck:
    """Record one check (tenant None: the whole workload). Refuses a value the table cannot hold."""
    if subject not in SUBJECTS:
        raise ValueError(f"learner check subject {subject!r} is not one of {SUBJECTS}")
    if outcome not in OUTCOMES:
        raise ValueError(f"learner check outcome {outcome!r} is not one of {OUTCOMES}")
    for name, value, limit in (("workload", workload, MAX_WORKLOAD_LEN), ("tenant", tenant or "", MAX_TENANT_LEN),
                               ("reason", reason, MAX_REASON_LEN)):
        if len(value) > limit:
            raise ValueError(f"learner check {name} is {len(value)} characters; at most {limit}")
    if drafts < 0:
        raise ValueError(f"learner check drafts must be >= 0, got {drafts}")
    row = LearnerCheck(at=at, workload=workload, tenant=tenant or "", subject=subject, outcome=outcome,
                       gain=float(gain), drafts=int(drafts), predictor_version_id=predictor_version_id,
                       reason=reason, replica=replica)
    session.add(row)
    session.flush()
    return row


def list_learner_checks(session: Session, limit: int | None = None) -> list[LearnerCheck]:
    """Newest first."""
    stmt = select(LearnerCheck).order_by(LearnerCheck.id.desc())
    return list(session.scalars(stmt if limit is None else stmt.limit(limit)))
