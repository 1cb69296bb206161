"""Repository for the fast survival calibrations: one row per (workload, tenant) scope, replaced by
the leader, read by every replica's control poller."""
from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.models import SurvivalCalibration, utcnow
from storage.versions import check_plain_json

ALL_TENANTS = ""


def save_calibration(session: Session, *, workload: str, tenant: str | None, predictor_version_id: int,
                     params: dict[str, Any], events: int, reason: str) -> None:
    """Replace the scope's correction (tenant None: the whole workload)."""
    check_plain_json(params, "params")
    key = ALL_TENANTS if tenant is None else tenant
    row = session.scalar(select(SurvivalCalibration).where(SurvivalCalibration.workload == workload,
                                                            SurvivalCalibration.tenant == key))
    if row is None:
        row = SurvivalCalibration(workload=workload, tenant=key)
        session.add(row)
    row.predictor_version_id, row.params, row.events, row.reason = predictor_version_id, params, events, reason
    row.updated_at = utcnow()
    session.flush()


def clear_calibrations(session: Session, workload: str | None = None, tenant: str | None = None) -> int:
    """Drop the corrections of `workload` (every workload if None; only `tenant`'s if given);
    returns how many."""
    stmt = delete(SurvivalCalibration)
    if workload is not None:
        stmt = stmt.where(SurvivalCalibration.workload == workload)
    if tenant is not None:
        stmt = stmt.where(SurvivalCalibration.tenant == tenant)
    return session.execute(stmt).rowcount or 0


def calibrations_for(session: Session, served: dict[str, int | None]) -> dict[tuple[str, str | None], dict]:
    """The corrections of each workload fitted to the outputs of the version serving it (`served`:
    {workload: version id}): {(workload, tenant or None): params}. One fitted to another version's
    outputs does not apply and is left out."""
    rows = session.scalars(select(SurvivalCalibration))
    return {(r.workload, None if r.tenant == ALL_TENANTS else r.tenant): r.params for r in rows
            if served.get(r.workload) == r.predictor_version_id}


def list_calibrations(session: Session) -> list[SurvivalCalibration]:
    return list(session.scalars(select(SurvivalCalibration).order_by(SurvivalCalibration.workload,
                                                                      SurvivalCalibration.tenant)))
