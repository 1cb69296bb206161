"""Read-only queries behind the dashboard, returning plain data (lists of dicts, dicts).

Every query is a SQLAlchemy construct (no SQL assembled from strings) and takes a caller-owned
Session; nothing here writes. The dashboard (and its tests) compare what is shown with these.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, func, inspect, select
from sqlalchemy.orm import Session

from storage.events import replica_health
from storage.models import (
    Alias,
    AliasEvent,
    DecisionEvent,
    DriftEvent,
    PredictorVersion,
    ReplicaHealth,
    StatBucket,
    TauHistory,
    utcnow,
)
from storage.overrides import list_overrides, override_state, snapshot
from storage.stats import HIST_BINS, LONG
from storage.versions import CHAMPION, get_alias_version, version_problem

REQUIRED_TABLES = ("predictor_versions", "aliases", "decision_events", "stat_buckets", "tau_history", "tau_overrides")
DEFAULT_SAMPLE = 50_000  # newest decision events used for calibration and the PR curve
TAU_GRID: tuple[float, ...] = tuple(x / 2 for x in range(-2, 49))  # -1.0 .. 24.0 step 0.5


def missing_tables(engine: Engine) -> list[str]:
    """Tables the dashboard needs that the database lacks (a fresh URL: run the migrations)."""
    present = set(inspect(engine).get_table_names())
    return [t for t in REQUIRED_TABLES if t not in present]


def is_empty(session: Session) -> bool:
    """No version, no statistics and no decisions yet (a fresh install)."""
    for model in (PredictorVersion, StatBucket, DecisionEvent):
        if session.scalar(select(func.count()).select_from(model)):
            return False
    return True


def _ratio(num: float, den: float) -> float | None:
    return None if not den else num / den


def _filters(stmt, tenant: str | None, workload: str | None):
    if tenant is not None:
        stmt = stmt.where(StatBucket.tenant == tenant)
    if workload is not None:
        stmt = stmt.where(StatBucket.workload == workload)
    return stmt


def tenants(session: Session) -> list[str]:
    return list(session.scalars(select(StatBucket.tenant).distinct().order_by(StatBucket.tenant)))


def workloads(session: Session) -> list[str]:
    return list(session.scalars(select(StatBucket.workload).distinct().order_by(StatBucket.workload)))


def _path_row(tokens: int, cycles: int, cache_verified: int, model_drafts: int) -> dict[str, Any]:
    none = max(cycles - cache_verified - model_drafts, 0)
    per_1k = (lambda n: None if not tokens else 1000.0 * n / tokens)
    return {
        "tokens": tokens,
        "cycles": cycles,
        "cache_verified": cache_verified,
        "model_drafts": model_drafts,
        "no_draft": none,
        "tokens_per_cycle": _ratio(tokens, cycles),
        "cycles_per_1k": per_1k(cycles),
        "cycles_per_1k_cache": per_1k(cache_verified),
        "cycles_per_1k_model": per_1k(model_drafts),
        "cycles_per_1k_none": per_1k(none),
        # Without speculation every token costs one decode cycle: speedup = tokens / cycles.
        "speedup": _ratio(tokens, cycles),
    }


def _sums(*columns) -> tuple:
    return tuple(func.coalesce(func.sum(c), 0) for c in columns)


def _totals(session: Session, sums: tuple, tenant: str | None, workload: str | None) -> list[int]:
    return [int(v) for v in session.execute(_filters(select(*sums), tenant, workload)).one()]


def _grouped(session: Session, key, sums: tuple, tenant: str | None = None,
             workload: str | None = None) -> list[tuple[Any, list[int]]]:
    """(value of `key`, its sums) in `key` order."""
    stmt = _filters(select(key, *sums), tenant, workload).group_by(key).order_by(key)
    return [(k, [int(v) for v in vals]) for k, *vals in session.execute(stmt)]


_PATH_SUMS = _sums(StatBucket.tokens, StatBucket.cycles, StatBucket.cache_verified, StatBucket.model_drafts)


def overview_totals(session: Session, tenant: str | None = None, workload: str | None = None) -> dict[str, Any]:
    """Totals over all buckets (optionally one tenant/workload)."""
    return _path_row(*_totals(session, _PATH_SUMS, tenant, workload))


def overview_by_bucket(session: Session, tenant: str | None = None, workload: str | None = None) -> list[dict[str, Any]]:
    """Per time bucket: tokens per cycle, cycles per 1000 tokens by decision path, speedup."""
    return [{"bucket_start": start, **_path_row(*sums)}
            for start, sums in _grouped(session, StatBucket.bucket_start, _PATH_SUMS, tenant, workload)]


def _quality(tp: int, fp: int, fn: int) -> dict[str, Any]:
    return {"tp": tp, "fp": fp, "fn": fn, "precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn)}


_CONF_SUMS = _sums(StatBucket.tp, StatBucket.fp, StatBucket.fn)


def quality_totals(session: Session, tenant: str | None = None, workload: str | None = None) -> dict[str, Any]:
    return _quality(*_totals(session, _CONF_SUMS, tenant, workload))


def quality_by_bucket(session: Session, tenant: str | None = None, workload: str | None = None) -> list[dict[str, Any]]:
    """Precision/recall of "verify the cache draft" at accepted length >= LONG, per time bucket."""
    return [{"bucket_start": start, **_quality(*sums)}
            for start, sums in _grouped(session, StatBucket.bucket_start, _CONF_SUMS, tenant, workload)]


def quality_by_version(session: Session) -> list[dict[str, Any]]:
    return [{"version": int(v), **_quality(*sums)}
            for v, sums in _grouped(session, StatBucket.predictor_version_id, _CONF_SUMS)]


def accepted_histograms(session: Session, tenant: str | None = None, workload: str | None = None) -> list[dict[str, Any]]:
    """Labelled cache drafts by accepted length (0..24, 24 = 24 or more) per workload (long form)."""
    stmt = _filters(select(StatBucket.workload, StatBucket.accepted_hist), tenant, workload)
    sums: dict[str, list[int]] = {}
    for wl, hist in session.execute(stmt):
        acc = sums.setdefault(wl, [0] * HIST_BINS)
        for i, n in enumerate(hist or []):
            acc[min(i, HIST_BINS - 1)] += int(n)
    return [{"workload": wl, "accepted": i, "drafts": n} for wl in sorted(sums) for i, n in enumerate(sums[wl])]


def _cache_sample(session: Session, limit: int) -> list[tuple[float, int, str]]:
    stmt = (select(DecisionEvent.predicted, DecisionEvent.accepted, DecisionEvent.workload)
            .where(DecisionEvent.drafter == "cache", DecisionEvent.predicted.is_not(None))
            .order_by(DecisionEvent.id.desc()).limit(limit))
    return [(float(p), int(a), w) for p, a, w in session.execute(stmt)]


def calibration(session: Session, limit: int = DEFAULT_SAMPLE) -> list[dict[str, Any]]:
    """Cache-drafter events binned by predicted accepted length (1-token bins): mean predicted vs
    mean observed. Calibrated = points on the diagonal."""
    bins: dict[int, list[float]] = {}
    for p, a, _ in _cache_sample(session, limit):
        b = min(max(int(math.floor(p)), -1), HIST_BINS - 1)
        acc = bins.setdefault(b, [0.0, 0.0, 0])
        acc[0] += p
        acc[1] += a
        acc[2] += 1
    return [{"bin": b, "mean_predicted": s[0] / s[2], "mean_accepted": s[1] / s[2], "events": int(s[2])}
            for b, s in sorted(bins.items())]


def latest_tau(session: Session) -> dict[str, float]:
    """The live automatic tau per workload (latest tau_history row of each)."""
    newest = (select(TauHistory.workload, func.max(TauHistory.id).label("id"))
              .group_by(TauHistory.workload).subquery())
    stmt = select(TauHistory.workload, TauHistory.tau).join(newest, TauHistory.id == newest.c.id)
    return {w: float(t) for w, t in session.execute(stmt)}


def pr_curve(session: Session, grid: Sequence[float] = TAU_GRID, limit: int = DEFAULT_SAMPLE) -> list[dict[str, Any]]:
    """For tau in the grid: precision/recall of (predicted > tau) against (accepted >= LONG)."""
    sample = _cache_sample(session, limit)
    out = []
    for tau in grid:
        tp = sum(1 for p, a, _ in sample if p > tau and a >= LONG)
        fp = sum(1 for p, a, _ in sample if p > tau and a < LONG)
        fn = sum(1 for p, a, _ in sample if p <= tau and a >= LONG)
        out.append({"tau": float(tau), **_quality(tp, fp, fn)})
    return out


def tau_history(session: Session) -> list[dict[str, Any]]:
    stmt = select(TauHistory).order_by(TauHistory.id)
    return [{"at": r.at, "workload": r.workload, "tau": r.tau, "rule_tau": r.rule_tau, "correction": r.correction,
             "model_mean_accepted": r.model_mean_accepted, "reason": r.reason, "replica": r.replica}
            for r in session.scalars(stmt)]


def effective_taus(session: Session, known_workloads: Sequence[str], now: datetime | None = None) -> list[dict[str, Any]]:
    """Per tenant (seen in statistics or overrides) x workload: the tau the controller would use and
    why, resolved exactly as the runtime does (OverrideSnapshot.resolve with the latest auto tau)."""
    now = utcnow() if now is None else now
    snap = snapshot(session, now=now)
    auto = latest_tau(session)
    names = set(tenants(session)) | {o.tenant for o in snap.overrides}
    out = []
    for tenant in sorted(names):
        for wl in known_workloads:
            eff = snap.resolve(tenant, wl, auto.get(wl), float("nan"), now)
            tau = None if eff.tau is None or math.isnan(eff.tau) else float(eff.tau)
            out.append({"tenant": tenant, "workload": wl, "tau": tau, "source": eff.source, "mode": eff.mode,
                        "expires_at": eff.expires_at, "override_id": eff.override_id})
    return out


def overrides_audit(session: Session, now: datetime | None = None) -> list[dict[str, Any]]:
    now = utcnow() if now is None else now
    return [{"id": r.id, "state": override_state(r, now), "tenant": r.tenant, "workload": r.workload or "(all)",
             "mode": r.mode, "tau": r.tau, "tau_min": r.tau_min, "tau_max": r.tau_max, "expires_at": r.expires_at,
             "author": r.author, "reason": r.reason, "created_at": r.created_at, "cleared_at": r.cleared_at,
             "cleared_by": r.cleared_by, "clear_reason": r.clear_reason}
            for r in reversed(list_overrides(session, include_inactive=True, now=now))]


def versions(session: Session) -> list[dict[str, Any]]:
    """Lineage: every version with its parent, metrics, which aliases point at it, and why it
    cannot be served if its stored blob no longer matches its checksum (the dashboard loads no model)."""
    aliases: dict[int, list[str]] = {}
    for name, vid in session.execute(select(Alias.name, Alias.version_id).order_by(Alias.name)):
        aliases.setdefault(vid, []).append(name)
    return [{"id": v.id, "parent_id": v.parent_id, "created_at": v.created_at, "kind": v.kind,
             "aliases": ", ".join(aliases.get(v.id, [])), "unloadable": version_problem(v) or "",
             "metrics": v.metrics, "reason": v.reason, "created_by": v.created_by}
            for v in session.scalars(select(PredictorVersion).order_by(PredictorVersion.id))]


def champion_status(session: Session, now: datetime | None = None, grace: timedelta = timedelta(seconds=30),
                    window: timedelta = timedelta(minutes=5)) -> dict[str, Any]:
    """Is the champion what replicas serve? Decision events record the version that decided them,
    so events after the alias moved (plus ``grace`` for replicas to poll) that come from another
    version mean a replica could not load the champion and serves its last good gate."""
    champ = get_alias_version(session, CHAMPION)
    if champ is None:
        return {"version": None, "problem": None, "since": None, "served": {}, "stale": {}}
    now = now or utcnow()
    moved = session.scalar(select(func.max(AliasEvent.at)).where(AliasEvent.alias_name == CHAMPION,
                                                                  AliasEvent.to_version_id == champ.id))
    since = max(moved + grace, now - window) if moved is not None else now - window
    stmt = (select(DecisionEvent.predictor_version_id, func.count()).where(DecisionEvent.at >= since)
            .group_by(DecisionEvent.predictor_version_id))
    served = {vid: int(n) for vid, n in session.execute(stmt)}
    return {"version": champ.id, "problem": version_problem(champ), "since": since, "served": served,
            "stale": {vid: n for vid, n in served.items() if vid is not None and vid != champ.id}}


def alias_events(session: Session) -> list[dict[str, Any]]:
    stmt = select(AliasEvent).order_by(AliasEvent.id.desc())
    return [{"id": e.id, "at": e.at, "alias": e.alias_name, "from_version": e.from_version_id,
             "to_version": e.to_version_id, "actor": e.actor, "reason": e.reason} for e in session.scalars(stmt)]


def calibrations(session: Session) -> list[dict[str, Any]]:
    """The fast survival corrections in force, one row per scope, with a one-number summary: the
    mean bias over positions (> 0: the correction raises the model's acceptance odds)."""
    from storage.calibrations import list_calibrations

    out = []
    for c in list_calibrations(session):
        bias = [float(b) for b in (c.params or {}).get("bias", [])]
        slope = [float(a) for a in (c.params or {}).get("slope", [])]
        out.append({"workload": c.workload, "tenant": c.tenant or "(all)", "version": c.predictor_version_id,
                    "drafts": c.events, "mean_bias": round(sum(bias) / len(bias), 3) if bias else None,
                    "mean_slope": round(sum(slope) / len(slope), 3) if slope else None,
                    "updated": c.updated_at, "reason": c.reason})
    return out


def database_size(session: Session) -> int | None:
    """Bytes on disk: the SQLite file (plus WAL) or pg_database_size."""
    bind = session.get_bind()
    if bind.dialect.name == "sqlite":
        db = bind.url.database
        if not db or db == ":memory:" or db.startswith("file:"):
            return None
        return sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))
    if bind.dialect.name == "postgresql":
        return int(session.scalar(select(func.pg_database_size(func.current_database()))))
    return None


def health(session: Session) -> dict[str, Any]:
    last_tau = session.scalar(select(func.max(TauHistory.at)))
    last_alias = session.scalar(select(func.max(AliasEvent.at)))
    updates = [t for t in (last_tau, last_alias) if t is not None]
    return {
        "decision_events": int(session.scalar(select(func.count()).select_from(DecisionEvent)) or 0),
        "dropped_events": int(session.scalar(select(*_sums(StatBucket.dropped_events))) or 0),
        "drift_events": int(session.scalar(select(func.count()).select_from(DriftEvent)) or 0),
        "last_event_at": session.scalar(select(func.max(DecisionEvent.at))),
        "last_bucket_at": session.scalar(select(func.max(StatBucket.bucket_start))),
        "last_learner_update": max(updates) if updates else None,
        "database_bytes": database_size(session),
        "champion": champion_status(session),
        "replicas": [_replica(r) for r in replica_health(session)],
    }


CHAMPION_NOT_LOADED = "champion not loaded: "  # how the control poller reports it (its last_error)


def _replica(r: ReplicaHealth) -> dict[str, Any]:
    """One heartbeat row, its services JSON read into `service_list` (one dict per service)."""
    service_list = _services(r.services)
    problem = next((s["last_error"][len(CHAMPION_NOT_LOADED):] for s in service_list
                    if (s["last_error"] or "").startswith(CHAMPION_NOT_LOADED)), "")
    return {"replica": r.replica, "updated_at": r.updated_at, "queue_depth": r.queue_depth,
            "events_written": r.events_written, "events_dropped": r.events_dropped,
            "events_dead_lettered": r.events_dead_lettered, "flush_ms": round(r.flush_ms, 2),
            "services": ", ".join(f"{s['name']}: {s['state']}" for s in service_list),
            "champion_not_loaded": problem, "service_list": service_list}


def _services(services: str | None) -> list[dict[str, Any]]:
    """A heartbeat's services JSON (controller.services.lifecycle.Health.to_json, one per service) as
    plain rows; `last_success` (unix time) becomes an aware UTC datetime. A row written by an older
    replica, or garbled, reads as no services rather than breaking the page."""
    try:
        states = json.loads(services) if services else []
    except ValueError:
        return []
    rows = []
    for s in states if isinstance(states, list) else []:
        if not isinstance(s, dict):
            continue
        success = s.get("last_success")
        rows.append({"name": str(s.get("name")), "state": str(s.get("state")),
                     "failing": int(s.get("failing") or 0), "failures": int(s.get("failures") or 0),
                     "last_error": None if s.get("last_error") is None else str(s["last_error"]),
                     "last_success": datetime.fromtimestamp(success, timezone.utc)
                     if isinstance(success, (int, float)) else None})
    return rows


def drift_events(session: Session, limit: int = 200) -> list[dict[str, Any]]:
    stmt = select(DriftEvent).order_by(DriftEvent.id.desc()).limit(limit)
    return [{"at": d.at, "workload": d.workload, "detector": d.detector, "version": d.predictor_version_id,
             "detail": d.detail} for d in session.scalars(stmt)]
