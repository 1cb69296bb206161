"""Read-only queries behind the dashboard, returning plain data (lists of dicts, dicts).

Every query is a SQLAlchemy construct (no SQL assembled from strings) and takes a caller-owned
Session; nothing here writes. The dashboard (and its tests) compare what is shown with these.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, Integer, func, inspect, literal, select
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
    StatHour,
    StepCostMinute,
    TauHistory,
    utcnow,
)
from storage.overrides import list_overrides, override_state, snapshot
from storage.stats import ALL, BUCKET_SECONDS, HIST_BINS, LONG
from storage.step_costs import STEP_PARTS, column, recent_minutes
from storage.versions import CHAMPION, get_alias_version, serving_schema_problem, version_problem

TENANT_WIDE = "(all)"  # the workload column of an override for every workload of its tenant
REQUIRED_TABLES = ("predictor_versions", "aliases", "decision_events", "stat_buckets", "tau_history", "tau_overrides")
DEFAULT_SAMPLE = 50_000  # newest decision events used for calibration and the PR curve
TAU_GRID: tuple[float, ...] = tuple(x / 2 for x in range(-2, 49))  # -1.0 .. 24.0 step 0.5


def missing_tables(engine: Engine) -> list[str]:
    """Tables the dashboard needs that the database lacks (a fresh URL: run the migrations)."""
    present = set(inspect(engine).get_table_names())
    return [t for t in REQUIRED_TABLES if t not in present]


def is_empty(session: Session) -> bool:
    """No version, no statistics and no decisions yet (a fresh install). One row is enough to know:
    a count would read millions of buckets on every page."""
    for model in (PredictorVersion, StatBucket, DecisionEvent):
        if session.scalar(select(model.id).limit(1)) is not None:
            return False
    return True


def _ratio(num: float, den: float) -> float | None:
    return None if not den else num / den


@dataclass(frozen=True)
class Scope:
    """What every page shows: one tenant or all (None), one workload or all, since a time or all time."""

    tenant: str | None = None
    workload: str | None = None
    since: datetime | None = None


ALL_TIME = Scope()


def _scoped(stmt, scope: Scope, model=StatBucket):
    """`stmt` limited to the scope, on the statistics buckets or the decision events."""
    if scope.tenant is not None:
        stmt = stmt.where(model.tenant == scope.tenant)
    if scope.workload is not None:
        stmt = stmt.where(model.workload == scope.workload)
    if scope.since is not None:
        stmt = stmt.where((model.at if model is DecisionEvent else model.bucket_start) >= scope.since)
    return stmt


# Tenant names come from clients: 10,000 of them is normal. Lists of tenants a page shows are cut at
# TENANT_LIST_LIMIT (the busiest of the last day of traffic, or those matching a search), never all.
TENANT_LIST_LIMIT = 100
BUSIEST_WINDOW = timedelta(days=1)  # "busiest": most tokens in the day before the newest bucket


def _distinct(session: Session, column, where=(), limit: int | None = None) -> list[str]:
    """The distinct values of an indexed column, in order, by one index probe per value (a loose
    index scan: a DISTINCT would read every row, millions of buckets, on every page)."""
    out: list[str] = []
    last = None
    while limit is None or len(out) < limit:
        stmt = select(func.min(column)).where(*where)
        if last is not None:
            stmt = stmt.where(column > last)
        last = session.scalar(stmt)
        if last is None:
            break
        out.append(last)
    return out


def newest_bucket(session: Session) -> datetime | None:
    """The start of the newest statistics bucket (one index probe)."""
    return session.scalar(select(func.max(StatBucket.bucket_start)))


def busiest_tenants(session: Session, limit: int = TENANT_LIST_LIMIT,
                    window: timedelta = BUSIEST_WINDOW) -> list[str]:
    """The `limit` tenants with the most tokens in the `window` before the newest bucket (not before
    now: an idle database still lists who used it), busiest first; aggregated in SQL over that window."""
    newest = newest_bucket(session)
    if newest is None:
        return []
    tokens = func.sum(StatBucket.tokens + StatBucket.cache_drafts + StatBucket.model_drafts)
    stmt = (select(StatBucket.tenant).where(StatBucket.bucket_start >= newest - window, StatBucket.tenant != ALL)
            .group_by(StatBucket.tenant).order_by(tokens.desc(), StatBucket.tenant).limit(limit))
    return list(session.scalars(stmt))


def _prefix(column, text: str):
    """`column` starts with `text` (a range on the index, unlike LIKE, whose wildcards and case
    rules differ between backends)."""
    return (column >= text) & (column < text + "\U0010ffff")


def tenants(session: Session, search: str = "", limit: int = TENANT_LIST_LIMIT) -> list[str]:
    """Tenants a selection or an edit may name, at most `limit`: without `search`, the busiest of the
    last day of traffic, then those with an active override (at most half the list); with it, the tenants whose name
    starts with it (with statistics or an override), in name order."""
    from storage.models import TauOverride
    from storage.overrides import _active_clause

    if search:
        names = set(_distinct(session, StatBucket.tenant, [_prefix(StatBucket.tenant, search)], limit))
        names |= set(_distinct(session, TauOverride.tenant, [_prefix(TauOverride.tenant, search)], limit))
        return sorted(n for n in names - {ALL} if n.startswith(search))[:limit]
    busy = busiest_tenants(session, limit)
    overridden = session.scalars(select(TauOverride.tenant).where(_active_clause(utcnow())).distinct()
                                 .order_by(TauOverride.tenant).limit(limit))
    extra = [t for t in overridden if t not in set(busy)][:limit // 2]  # at most half the list
    return busy[:limit - len(extra)] + extra


def tenant_known(session: Session, tenant: str) -> bool:
    """The tenant has statistics or an override (one index probe each)."""
    from storage.models import TauOverride

    return any(session.scalar(select(m.id).where(m.tenant == tenant).limit(1)) is not None
               for m in (StatBucket, TauOverride))


def workloads(session: Session) -> list[str]:
    """The workloads with statistics (a handful: the loose index scan reads one index entry each)."""
    return [w for w in _distinct(session, StatBucket.workload) if w != ALL]


# Time series are drawn at most MAX_POINTS points wide: 30 days of 1-minute buckets would be 43,200
# points per line, too many to send and draw. Buckets are summed (in SQL) into the finest of these.
BIN_SECONDS = (60, 300, 900, 3600, 4 * 3600, 86400)
MAX_POINTS = 1500


# All tenants over more than a day: read stat_hours (every tenant summed per hour, a few rows an hour)
# instead of the minutes (one row per active tenant a minute: millions over 30 days), drawn in bins
# of an hour or more. A `since` inside an hour leaves that first hour out.
HOURLY_BEYOND = timedelta(days=1)


def _span(session: Session, scope: Scope, model) -> float:
    first, last = session.execute(_scoped(select(func.min(model.bucket_start), func.max(model.bucket_start)),
                                          scope, model)).one()
    return 0.0 if first is None else (last - first).total_seconds()


def _counts(session: Session, scope: Scope):
    """The table the scope's sums come from: stat_hours for all tenants over more than
    HOURLY_BEYOND, else stat_buckets (two index probes on the small table decide)."""
    if scope.tenant is None and _span(session, scope, StatHour) > HOURLY_BEYOND.total_seconds():
        return StatHour
    return StatBucket


def bucket_resolution(session: Session, scope: Scope = ALL_TIME) -> timedelta:
    """The time bin of the scope's series: the finest of BIN_SECONDS that draws the span of the
    scope's buckets (oldest to newest, two index probes) in at most MAX_POINTS bins; an hour at
    least where the sums come from stat_hours."""
    model = _counts(session, scope)
    span = _span(session, scope, model)
    finest = 3600 if model is StatHour else 0
    return timedelta(seconds=next((b for b in BIN_SECONDS if span / b <= MAX_POINTS and b >= finest),
                                  BIN_SECONDS[-1]))


def _time_bin(session: Session, seconds: int, model=StatBucket):
    """bucket_start floored to `seconds`, as unix seconds, in SQL (per dialect)."""
    col = model.bucket_start
    if session.get_bind().dialect.name == "sqlite":
        return func.cast(func.strftime("%s", col), Integer) / seconds * seconds
    return func.floor(func.extract("epoch", col) / seconds) * seconds


def _binned(session: Session, sums: Callable[[Any], tuple], scope: Scope,
            resolution: timedelta | None) -> list[tuple[datetime, list[int]]]:
    """(bin start, its sums) in time order, the scope's buckets summed into `resolution` bins
    (None: bucket_resolution's); 1-minute bins are the buckets themselves."""
    model = _counts(session, scope)
    seconds = int((resolution or bucket_resolution(session, scope)).total_seconds())
    if model is StatHour:
        seconds = max(seconds, 3600)
    if seconds <= BUCKET_SECONDS:
        return _grouped(session, StatBucket.bucket_start, sums(StatBucket), scope)
    key = _time_bin(session, seconds, model).label("bin")
    stmt = _scoped(select(key, *sums(model)), scope, model).group_by(key).order_by(key)
    return [(datetime.fromtimestamp(int(k), timezone.utc), [int(v) for v in vals])
            for k, *vals in session.execute(stmt)]


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
    }


def _sums(*columns) -> tuple:
    return tuple(func.coalesce(func.sum(c), 0) for c in columns)


def _totals(session: Session, sums: Callable[[Any], tuple], scope: Scope) -> list[int]:
    model = _counts(session, scope)
    return [int(v) for v in session.execute(_scoped(select(*sums(model)), scope, model)).one()]


def _grouped(session: Session, key, sums: tuple, scope: Scope = ALL_TIME, model=StatBucket) -> list[tuple[Any, list[int]]]:
    """(value of `key`, its sums) in `key` order."""
    stmt = _scoped(select(key, *sums), scope, model).group_by(key).order_by(key)
    return [(k, [int(v) for v in vals]) for k, *vals in session.execute(stmt)]


def _by(session: Session, column: str, sums: Callable[[Any], tuple], scope: Scope) -> list[tuple[Any, list[int]]]:
    """The scope's sums grouped by one of the counts' key columns (workload, version)."""
    model = _counts(session, scope)
    return _grouped(session, getattr(model, column), sums(model), scope, model)


def _path_sums(m) -> tuple:
    return _sums(m.tokens, m.cycles, m.cache_verified, m.model_drafts)


def overview_totals(session: Session, scope: Scope = ALL_TIME) -> dict[str, Any]:
    """Totals over the scope's buckets."""
    return _path_row(*_totals(session, _path_sums, scope))


def overview_by_bucket(session: Session, scope: Scope = ALL_TIME,
                       resolution: timedelta | None = None) -> list[dict[str, Any]]:
    """Per time bin (bucket_resolution's unless given): tokens per cycle, cycles per 1000 tokens by
    decision path."""
    return [{"bucket_start": start, **_path_row(*sums)}
            for start, sums in _binned(session, _path_sums, scope, resolution)]


@dataclass(frozen=True)
class ServedCounts:
    """What the scope's traffic did, as the cost model needs it (storage.stats counts, exact)."""

    tokens: int
    cycles: int
    draft_tokens: int  # draft tokens verified (cache and model)
    accepted_tokens: int
    model_drafts: int
    model_positions: int  # positions the model drafter drafted in all (sampled events)
    tokens_by_workload: dict[str, int]
    model_by_workload: dict[str, tuple[int, int]]  # workload -> (model drafts, accepted tokens), sampled events


def served_counts(session: Session, scope: Scope = ALL_TIME) -> ServedCounts:
    tokens, cycles, draft, accepted, model = _totals(session, lambda m: _sums(
        m.tokens, m.cycles, m.draft_tokens, m.accepted_tokens, m.model_drafts), scope)
    by_workload = {w: sums[0] for w, sums in _by(session, "workload", lambda m: _sums(m.tokens), scope)
                   if w != ALL and sums[0]}
    stmt = _scoped(select(DecisionEvent.workload, func.count(), func.sum(DecisionEvent.accepted),
                          func.sum(DecisionEvent.draft_len)).where(DecisionEvent.drafter == "model"),
                   scope, DecisionEvent).group_by(DecisionEvent.workload)
    model_by, calls, positions = {}, 0, 0
    for w, n, acc, length in session.execute(stmt):
        model_by[w] = (int(n), int(acc or 0))
        calls, positions = calls + int(n), positions + int(length or 0)
    # The raw events may be a pruned sample: scale their mean draft length to the buckets' count.
    model_positions = round(model * positions / calls) if calls else 0
    return ServedCounts(tokens, cycles, draft, accepted, model, model_positions, by_workload, model_by)


def cache_drafts(session: Session, scope: Scope = ALL_TIME, limit: int = 200_000) -> list[tuple[str, int, int, int]]:
    """The newest `limit` cache drafts of the scope (decision points and shadow drafts alike), each
    (request id, position, draft length, hindsight label), for the suffix-alone counterfactual."""
    stmt = (_scoped(select(DecisionEvent.request_id, DecisionEvent.position, DecisionEvent.draft_len,
                           DecisionEvent.accepted).where(DecisionEvent.drafter == "cache"), scope, DecisionEvent)
            .order_by(DecisionEvent.id.desc()).limit(limit))
    return [(r, int(p), int(n), int(a)) for r, p, n, a in session.execute(stmt)]


def _quality(tp: int, fp: int, fn: int, tn: int = 0) -> dict[str, Any]:
    return {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "labelled": tp + fp + fn + tn,
            "precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn)}


def _conf_sums(m) -> tuple:
    return _sums(m.tp, m.fp, m.fn, m.tn)


def quality_totals(session: Session, scope: Scope = ALL_TIME) -> dict[str, Any]:
    return _quality(*_totals(session, _conf_sums, scope))


def quality_by_bucket(session: Session, scope: Scope = ALL_TIME,
                      resolution: timedelta | None = None) -> list[dict[str, Any]]:
    """Precision/recall of "predicted >= LONG" against "accepted >= LONG", per time bin
    (bucket_resolution's unless given)."""
    return [{"bucket_start": start, **_quality(*sums)}
            for start, sums in _binned(session, _conf_sums, scope, resolution)]


def quality_by_workload(session: Session, scope: Scope = ALL_TIME) -> list[dict[str, Any]]:
    """The question the product answers per workload: precision, recall and counts at >= LONG; and,
    from the same query, the plans' promises (`promises_by_workload` reads them)."""
    return [{"workload": w, **_quality(*sums[:4]), **_promises(*sums[4:])}
            for w, sums in _by(session, "workload", lambda m: _conf_sums(m) + _promise_sums(m), scope) if w != ALL]


def quality_by_version(session: Session, scope: Scope = ALL_TIME) -> list[dict[str, Any]]:
    return [{"version": int(v), **_quality(*sums)}
            for v, sums in _by(session, "predictor_version_id", _conf_sums, scope) if v]


def _promise_sums(m) -> tuple:
    return _sums(m.cache_promised_milli, m.cache_promise_kept, m.model_promised_milli, m.model_promise_kept)


def _promises(cache_milli: int, cache_kept: int, model_milli: int, model_kept: int) -> dict[str, Any]:
    cache, model = cache_milli / 1000.0, model_milli / 1000.0
    return {"cache_promised": cache, "cache_kept": cache_kept, "cache_share": _ratio(cache_kept, cache),
            "model_promised": model, "model_kept": model_kept, "model_share": _ratio(model_kept, model)}


def promises_by_workload(per_workload: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """From `quality_by_workload`'s rows (no query of its own), the workloads whose plans promised
    anything and their sum (workload None, last), per drafter: the tokens the allocator's plans
    expected the target to accept of what they verified, the tokens it accepted, and their ratio.
    Calibration over every draft cannot show it: the plan verifies the drafts its curves rate
    highest, so it is where they overrate that a gate calibrated on average over-promises."""
    keys = ("cache_promised", "cache_kept", "cache_share", "model_promised", "model_kept", "model_share")
    rows = [{"workload": r["workload"], **{k: r[k] for k in keys}}
            for r in per_workload if r["cache_promised"] or r["model_promised"]]
    if rows:  # sums of thousandths of a token, as stored: exact
        milli = [sum(round(1000 * r[k]) for r in rows) for k in ("cache_promised", "model_promised")]
        kept = [sum(r[k] for r in rows) for k in ("cache_kept", "model_kept")]
        rows.append({"workload": None, **_promises(milli[0], kept[0], milli[1], kept[1])})
    return rows


def accepted_histograms(session: Session, scope: Scope = ALL_TIME) -> list[dict[str, Any]]:
    """Labelled cache drafts by accepted length (0..24, 24 = 24 or more) per workload (long form),
    summed in SQL (one row per workload comes back, not one per bucket)."""
    sums: dict[str, list[int]] = {}
    m = _counts(session, scope)
    if session.get_bind().dialect.name == "sqlite":  # json_extract per element: SQLite's cheapest way
        bins = _sums(*(m.accepted_hist[i].as_integer() for i in range(HIST_BINS)))
        stmt = (_scoped(select(m.workload, *bins), scope, m).where(m.workload != ALL)
                .group_by(m.workload))
        sums = {wl: [int(n) for n in counts] for wl, *counts in session.execute(stmt)}
    else:  # each array parsed once into (position, count) rows: 25 ->> would parse it 25 times
        elements = (func.json_array_elements_text(m.accepted_hist)
                    .table_valued("value", with_ordinality="ord").render_derived())
        pos = func.least(elements.c.ord - 1, HIST_BINS - 1).label("pos")
        stmt = (_scoped(select(m.workload, pos, func.sum(func.cast(elements.c.value, Integer))), scope, m)
                .select_from(m).join(elements, literal(True))
                .where(m.workload != ALL).group_by(m.workload, pos))
        for wl, i, n in session.execute(stmt):
            sums.setdefault(wl, [0] * HIST_BINS)[int(i)] += int(n or 0)
    return [{"workload": wl, "accepted": i, "drafts": n} for wl in sorted(sums) for i, n in enumerate(sums[wl])]


def _cache_sample(session: Session, scope: Scope, limit: int) -> list[tuple[float, int, str]]:
    """The newest `limit` cache-drafter events the gate scored, in the scope."""
    stmt = (_scoped(select(DecisionEvent.predicted, DecisionEvent.accepted, DecisionEvent.workload)
                    .where(DecisionEvent.drafter == "cache", DecisionEvent.predicted.is_not(None)), scope, DecisionEvent)
            .order_by(DecisionEvent.id.desc()).limit(limit))
    return [(float(p), int(a), w) for p, a, w in session.execute(stmt)]


def calibration(session: Session, scope: Scope = ALL_TIME, limit: int = DEFAULT_SAMPLE) -> list[dict[str, Any]]:
    """Cache-drafter events binned by predicted accepted length (1-token bins): mean predicted vs
    mean observed. Calibrated = points on the diagonal."""
    bins: dict[int, list[float]] = {}
    for p, a, _ in _cache_sample(session, scope, limit):
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


def pr_curves(session: Session, scope: Scope = ALL_TIME, grid: Sequence[float] = TAU_GRID,
              limit: int = DEFAULT_SAMPLE) -> list[dict[str, Any]]:
    """Per workload and threshold t of the grid: precision/recall of calling a cache draft long when
    its predicted accepted length is >= t (t = LONG is the operating point of the quality table),
    on the newest `limit` scored cache drafts of the scope."""
    import numpy as np

    sample = _cache_sample(session, scope, limit)
    out = []
    for wl in sorted({w for _, _, w in sample}):
        pred = np.array([p for p, _, w in sample if w == wl])
        long = np.array([a >= LONG for _, a, w in sample if w == wl])
        for t in grid:
            called = pred >= t
            tp = int((called & long).sum())
            fp = int((called & ~long).sum())
            fn = int((~called & long).sum())
            tn = int((~called & ~long).sum())
            out.append({"workload": wl, "threshold": float(t), **_quality(tp, fp, fn, tn)})
    return out


TAU_HISTORY_LIMIT = 5000  # tau rows drawn at most (the newest of the window)


def tau_history(session: Session, since: datetime | None = None, workload: str | None = None,
                limit: int = TAU_HISTORY_LIMIT) -> list[dict[str, Any]]:
    """The automatic tau's changes since `since` (None: all kept, storage.tau_history's 30 days), of
    one workload or all, oldest first: the newest `limit` of them (read newest first on the index)."""
    stmt = select(TauHistory).order_by(TauHistory.id.desc()).limit(limit)
    if since is not None:
        stmt = stmt.where(TauHistory.at >= since)
    if workload is not None:
        stmt = stmt.where(TauHistory.workload == workload)
    return [{"at": r.at, "workload": r.workload, "tau": r.tau, "rule_tau": r.rule_tau, "correction": r.correction,
             "model_mean_accepted": r.model_mean_accepted, "reason": r.reason, "replica": r.replica}
            for r in reversed(list(session.scalars(stmt)))]


def effective_taus(session: Session, known_workloads: Sequence[str], now: datetime | None = None,
                   names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Per tenant x workload: the tau the controller would use and why, resolved exactly as the runtime
    does (OverrideSnapshot.resolve with the latest auto tau). Tenants: `names`, else `tenants()`'s
    (the busiest and those with an active override, at most TENANT_LIST_LIMIT), never all of them."""
    now = utcnow() if now is None else now
    snap = snapshot(session, now=now)
    auto = latest_tau(session)
    names = tenants(session) if names is None else names
    out = []
    for tenant in sorted(set(names)):
        for wl in known_workloads:
            eff = snap.resolve(tenant, wl, auto.get(wl), float("nan"), now)
            tau = None if eff.tau is None or math.isnan(eff.tau) else float(eff.tau)
            out.append({"tenant": tenant, "workload": wl, "tau": tau, "source": eff.source, "mode": eff.mode,
                        "expires_at": eff.expires_at, "override_id": eff.override_id})
    return out


def tau_change(session: Session, tenant: str, known_workloads: Sequence[str], *, set_spec=None,
               clear_workload: str | None = None, now: datetime | None = None) -> list[dict[str, Any]]:
    """Effective tau of `tenant` per workload before and after setting `set_spec` (validated first:
    an OverrideError names the bad field) or clearing the override on (tenant, clear_workload), without
    writing anything: what an edit's confirmation shows."""
    from storage.overrides import ActiveOverride, OverrideSnapshot, validate_spec

    now = utcnow() if now is None else now
    before = snapshot(session, now=now)
    if set_spec is not None:
        spec = validate_spec(set_spec, known_workloads, now)
        tenant, key = spec.tenant, (spec.tenant, spec.workload)
        kept = [o for o in before.overrides if (o.tenant, o.workload) != key]
        new = ActiveOverride(spec.tenant, spec.workload, spec.mode, spec.tau, spec.tau_min, spec.tau_max,
                             spec.expires_at, id=max((o.id for o in kept), default=0) + 1)
        after = OverrideSnapshot([*kept, new])
    else:
        after = OverrideSnapshot(o for o in before.overrides if (o.tenant, o.workload) != (tenant, clear_workload))
    auto = latest_tau(session)
    rows = []
    for wl in known_workloads:
        b = before.resolve(tenant, wl, auto.get(wl), float("nan"), now)
        a = after.resolve(tenant, wl, auto.get(wl), float("nan"), now)
        rows.append({"workload": wl, "before": _tau_words(b), "after": _tau_words(a), "changes": b[:3] != a[:3]})
    return rows


def _tau_words(eff) -> str:
    """An effective tau as the confirmation shows it: the value (or what the mode does) and its source."""
    if eff.mode == "off_model":
        what = "gate off: always the model drafter"
    elif eff.mode == "off_cache":
        what = "gate off: always the whole cache draft"
    elif eff.tau is None or math.isnan(eff.tau):
        what = "allocator default (per step)"
    else:
        what = f"{eff.tau:.2f}"
    return f"{what} ({eff.source})"


def overrides_audit(session: Session, now: datetime | None = None) -> list[dict[str, Any]]:
    now = utcnow() if now is None else now
    return [{"id": r.id, "state": override_state(r, now), "tenant": r.tenant, "workload": r.workload or TENANT_WIDE,
             "mode": r.mode, "tau": r.tau, "tau_min": r.tau_min, "tau_max": r.tau_max, "expires_at": r.expires_at,
             "author": r.author, "reason": r.reason, "created_at": r.created_at, "cleared_at": r.cleared_at,
             "cleared_by": r.cleared_by, "clear_reason": r.clear_reason}
            for r in reversed(list_overrides(session, include_inactive=True, now=now))]


def versions(session: Session) -> list[dict[str, Any]]:
    """Lineage: every version with its parent, metrics, which aliases point at it, and why it
    cannot be served if its stored blob no longer matches its checksum or its feature schema is not
    the one the champion serves (the dashboard loads no model: versions were scored when stored)."""
    aliases: dict[int, list[str]] = {}
    for name, vid in session.execute(select(Alias.name, Alias.version_id).order_by(Alias.name)):
        aliases.setdefault(vid, []).append(name)
    champion = get_alias_version(session, CHAMPION)
    return [{"id": v.id, "parent_id": v.parent_id, "created_at": v.created_at, "kind": v.kind,
             "aliases": ", ".join(aliases.get(v.id, [])),
             "unloadable": version_problem(v) or serving_schema_problem(v, champion) or "",
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


def learner_checks(session: Session, limit: int = 500) -> list[dict[str, Any]]:
    """The learner's recorded checks, newest first (storage.learner_checks)."""
    from storage.learner_checks import list_learner_checks

    return [{"at": c.at, "workload": c.workload, "tenant": c.tenant or "(all)", "subject": c.subject,
             "outcome": c.outcome, "gain_pct": round(100 * c.gain, 2), "drafts": c.drafts,
             "version": c.predictor_version_id, "reason": c.reason, "replica": c.replica}
            for c in list_learner_checks(session, limit)]


def learning_room(session: Session) -> list[dict[str, Any]]:
    """Each workload's newest headroom measurement (storage.learning_room), in percent."""
    from storage.learning_room import latest_learning_room

    return [{"workload": r.workload, "version": r.predictor_version_id,
             "headroom_pct": round(100 * r.headroom, 2),
             "challenger_pct": None if r.challenger_gain is None else round(100 * r.challenger_gain, 2),
             "drafts": r.drafts, "at": r.at, "replica": r.replica} for r in latest_learning_room(session)]


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


# A replica's heartbeat row is rewritten at least every controller.services.event_writer.HEARTBEAT_S
# (10 s) while it runs: older than STALE_AFTER it is late, older than DOWN_AFTER it is gone.
STALE_AFTER = timedelta(seconds=60)
DOWN_AFTER = timedelta(minutes=5)
LEARNER_STALE_EVENTS = 20_000  # learner behind the event log by more than this is stale


def age_state(age: timedelta | None, stale: timedelta = STALE_AFTER, down: timedelta = DOWN_AFTER) -> str:
    """ok / stale / down for something that should be refreshed continuously (None: never seen: down)."""
    if age is None or age > down:
        return "down"
    return "stale" if age > stale else "ok"


def health(session: Session, now: datetime | None = None) -> dict[str, Any]:
    now = utcnow() if now is None else now
    last_tau = session.scalar(select(func.max(TauHistory.at)))
    last_alias = session.scalar(select(func.max(AliasEvent.at)))
    updates = [t for t in (last_tau, last_alias) if t is not None]
    replicas = [_replica(r, now) for r in replica_health(session)]
    promotion = session.scalars(select(AliasEvent).order_by(AliasEvent.id.desc()).limit(1)).first()
    return {
        "now": now,
        "decision_events": int(session.scalar(select(func.count()).select_from(DecisionEvent)) or 0),
        # dropped events are counted under tenant "*" only (storage.stats.add_dropped): an index range
        "dropped_events": int(session.scalar(select(*_sums(StatBucket.dropped_events))
                                             .where(StatBucket.tenant == ALL)) or 0),
        "drift_events": int(session.scalar(select(func.count()).select_from(DriftEvent)) or 0),
        "last_event_at": session.scalar(select(func.max(DecisionEvent.at))),
        "last_bucket_at": session.scalar(select(func.max(StatBucket.bucket_start))),
        "last_learner_update": max(updates) if updates else None,
        "last_promotion": None if promotion is None else {
            "at": promotion.at, "age": now - promotion.at, "alias": promotion.alias_name,
            "from_version": promotion.from_version_id, "to_version": promotion.to_version_id,
            "actor": promotion.actor, "reason": promotion.reason},
        "learner": learner_lag(session, replicas, now),
        "database_bytes": database_size(session),
        "champion": champion_status(session),
        "replicas": replicas,
    }


def learner_lag(session: Session, replicas: list[dict[str, Any]], now: datetime) -> dict[str, Any]:
    """How far the leading learner is behind the event log, in events and in seconds of traffic
    (newest stored event minus the event at its cursor), from the cursor it reports in its
    heartbeat. State: ok; stale when it lags by more than LEARNER_STALE_EVENTS or its replica's
    heartbeat is late; down when no live replica runs a learner."""
    learners = [(r, x) for r in replicas for x in r["service_list"] if x["name"] == "hvd-learner"]
    live = [(r, x) for r, x in learners if x["state"] != "stopped" and r["heartbeat_state"] != "down"]
    leading = [(r, x) for r, x in live if (x.get("progress") or {}).get("leading")]
    if not leading and replicas and all(r["heartbeat_state"] == "shut down" for r in replicas):
        return {"replica": None, "state": "shut down", "lag_events": None, "lag_seconds": None, "cursor": None,
                "cursor_at": None, "why": "every replica has shut down cleanly: no learner runs"}
    if not leading:
        return {"replica": None, "state": "down", "lag_events": None, "lag_seconds": None, "cursor": None,
                "cursor_at": None, "why": "no running replica leads the learner" if learners else
                "no replica runs the learner"}
    r, x = max(leading, key=lambda rx: rx[0]["updated_at"])
    cursor = int(x["progress"].get("cursor") or 0)
    at = x["progress"].get("cursor_at")
    cursor_at = datetime.fromtimestamp(at, timezone.utc) if isinstance(at, (int, float)) else None
    behind = int(session.scalar(select(func.count()).select_from(DecisionEvent).where(DecisionEvent.id > cursor)) or 0)
    newest = session.scalar(select(func.max(DecisionEvent.at)))
    seconds = 0.0 if not behind else (
        (newest - cursor_at).total_seconds() if newest is not None and cursor_at is not None else None)
    state = "ok"
    why = f"{behind:,} events behind the log"
    if r["heartbeat_state"] != "ok" or x["state"] != "ok":
        state, why = "stale", f"its replica {r['replica']} is {r['heartbeat_state']}, the learner {x['state']}"
    elif behind > LEARNER_STALE_EVENTS:
        state = "stale"
    return {"replica": r["replica"], "state": state, "lag_events": behind, "lag_seconds": seconds,
            "cursor": cursor, "cursor_at": cursor_at, "why": why, "tenant_scopes": tenant_scopes(x["progress"])}


def tenant_scopes(progress: dict[str, Any]) -> dict[str, int] | None:
    """The learner's calibration tenant scopes as its heartbeat reports them (held, cap, evicted since
    it started), or None from a learner that does not report them (an older replica)."""
    try:
        return {k: int(progress[f"tenant_{k}"]) for k in ("scopes", "scope_cap", "scopes_evicted")}
    except (KeyError, TypeError, ValueError):
        return None


CHAMPION_NOT_LOADED = "champion not loaded: "  # how the control poller reports it (its last_error)


def _replica(r: ReplicaHealth, now: datetime) -> dict[str, Any]:
    """One heartbeat row, its services JSON read into `service_list` (one dict per service), its
    age and state: ok / stale / down, or "shut down" when its last heartbeat said every service had
    stopped (a clean exit, not an outage)."""
    service_list = _services(r.services)
    problem = next((s["last_error"][len(CHAMPION_NOT_LOADED):] for s in service_list
                    if (s["last_error"] or "").startswith(CHAMPION_NOT_LOADED)), "")
    age = now - r.updated_at
    stopped = bool(service_list) and all(s["state"] == "stopped" for s in service_list)
    return {"replica": r.replica, "updated_at": r.updated_at, "age": age,
            "heartbeat_state": "shut down" if stopped else age_state(age), "queue_depth": r.queue_depth,
            "events_written": r.events_written, "events_dropped": r.events_dropped,
            "events_dead_lettered": r.events_dead_lettered, "dead_letters_pruned": r.dead_letters_pruned,
            "flush_ms": round(r.flush_ms, 2),
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
                     if isinstance(success, (int, float)) else None,
                     "progress": s.get("progress") if isinstance(s.get("progress"), dict) else None})
    return rows


STEP_COST_WINDOW = timedelta(hours=1)  # the Health page's engine step costs: the last hour


def step_costs(session: Session, now: datetime | None = None,
               window: timedelta = STEP_COST_WINDOW) -> dict[str, Any] | None:
    """Each replica's per-minute engine step costs of the last `window` (storage.step_costs), one
    row per replica and minute, by replica and minute: steps, means, drafter steps, every part's
    p50 in ms ("<part>_p50_ms") and HVD's share of the step time in % (its summed ms over the
    steps' summed ms: exact for the minute, unlike a ratio of medians). `newest`: the newest minute
    stored at all, to say how old the data is when the window is empty. None: the database has no
    step_cost_minutes table (migrate it)."""
    if not inspect(session.get_bind()).has_table(StepCostMinute.__tablename__):
        return None
    now = utcnow() if now is None else now
    since = now - window
    rows = []
    for m in recent_minutes(session, since):
        row = {"replica": m.replica, "minute": m.minute, "steps": m.steps, "batch_mean": m.batch_mean,
               "query_tokens_mean": m.query_tokens_mean, "drafter_steps": m.drafter_steps,
               "hvd_share_pct": _ratio(100.0 * m.hvd_ms_sum, m.total_ms_sum)}
        row.update({f"{part}_p50_ms": getattr(m, column(part, "p50")) for part in STEP_PARTS})
        rows.append(row)
    return {"since": since, "newest": session.scalar(select(func.max(StepCostMinute.minute))), "minutes": rows}


def drift_events(session: Session, limit: int = 200) -> list[dict[str, Any]]:
    stmt = select(DriftEvent).order_by(DriftEvent.id.desc()).limit(limit)
    return [{"at": d.at, "workload": d.workload, "detector": d.detector, "version": d.predictor_version_id,
             "detail": d.detail, "words": drift_in_words(d)} for d in session.scalars(stmt)]


def drift_in_words(d: DriftEvent) -> str:
    """What a drift event means for an operator, in one sentence."""
    detail = d.detail if isinstance(d.detail, dict) else {}
    detector = "ADWIN" if d.detector == "adwin" else d.detector
    what = (f"{detector} saw the champion's prediction error on {d.workload} change"
            + (f" (mean absolute error now {detail['error_mean']:.2f} tokens)"
               if isinstance(detail.get("error_mean"), (int, float)) else ""))
    seen = (f" after {int(detail['events_seen']):,} labelled drafts"
            if isinstance(detail.get("events_seen"), (int, float)) else "")
    version = f" of version v{d.predictor_version_id}" if d.predictor_version_id is not None else ""
    return (f"{d.at:%Y-%m-%d %H:%M:%S} UTC: {what}{seen}{version}; the learner reset {d.workload}'s fast "
            "calibration, trains harder for a while and re-tunes its tau.")
