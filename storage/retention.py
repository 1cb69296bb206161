"""Bounded history: the append-only tables that grow with traffic keep only their newest rows."""
from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.models import Base


def keep_newest(session: Session, model: type[Base], keep_last: int) -> int:
    """Delete `model`'s oldest rows beyond the newest `keep_last` (by id); returns the count."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    # The id of the newest row to delete: the (keep_last+1)-th newest.
    cutoff = session.scalar(select(model.id).order_by(model.id.desc()).offset(keep_last).limit(1))
    if cutoff is None:
        return 0
    return int(session.execute(delete(model).where(model.id <= cutoff)).rowcount or 0)
