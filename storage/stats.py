"""Acceptance statistics: a pure in-memory aggregator and an additive upsert into `stat_buckets`.

Rows are only ever *added to*: each writer aggregates its events into per-key deltas and upserts
them with ``INSERT ... ON CONFLICT (key) DO UPDATE SET col = col + excluded.col``; the JSON
histogram is merged elementwise inside the same statement (``json_build_array`` on PostgreSQL,
``json_array`` on SQLite), so several writers (threads, processes, replicas) can share one table
without read-modify-write races.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from typing import Protocol

from sqlalchemy import delete, literal_column
from sqlalchemy.orm import Session

from storage.engine import upsert_insert
from storage.limits import MAX_TENANT_LEN, MAX_WORKLOAD_LEN, text_problem
from storage.models import DecisionEvent, StatBucket, StatHour
from storage.retention import keep_newest

BUCKET_SECONDS = 60
LONG = 6  # a "long" draft accepts >= LONG tokens: the positive class of the gate's precision/recall
HIST_BINS = 25  # accepted_hist labels 0..24 (24 = 24 or more)
ALL = "*"  # tenant/workload of rows that are not about one tenant (dropped events)
UNSTORABLE = "(unstorable)"  # tenant/workload of counts whose own name the database cannot hold
UPSERT_CHUNK = 500  # rows per statement (SQLite's bound-parameter limit)
KEEP_STAT_DAYS = 30  # the statistics writers prune stat_buckets that started longer ago than this

KEY_COLUMNS = ("bucket_start", "tenant", "workload", "predictor_version_id")
HOUR_KEY_COLUMNS = ("bucket_start", "workload", "predictor_version_id")  # stat_hours: every tenant summed

BucketKey = tuple[datetime, str, str, int]


class EventLike(Protocol):
    at: float
    tenant: str
    workload: str
    drafter: str
    decision: str
    draft_len: int
    accepted: int
    predicted: float | None
    predictor_version_id: int | None
    verified_len: int | None  # None: the whole draft, when its decision was cache
    promised: float | None  # what the plan expected of the verified tokens; None: no promise


@dataclass
class BucketDelta:
    cache_drafts: int = 0
    cache_verified: int = 0
    model_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0
    tokens: int = 0
    cycles: int = 0
    dropped_events: int = 0
    # The plan's promises (events with one), per drafter: expected accepted tokens in thousandths of a
    # token (kept an integer like every counter), and the tokens accepted among those verified.
    cache_promised_milli: int = 0
    cache_promise_kept: int = 0
    model_promised_milli: int = 0
    model_promise_kept: int = 0
    accepted_hist: list[int] = field(default_factory=lambda: [0] * HIST_BINS)

    def merge(self, other: "BucketDelta") -> "BucketDelta":
        """Add `other` into self (in place); returns self."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist = [a + b for a, b in zip(self.accepted_hist, other.accepted_hist)]
        return self

    def copy(self) -> "BucketDelta":
        return replace(self, accepted_hist=list(self.accepted_hist))

    def is_zero(self) -> bool:
        return not any(getattr(self, name) for name in COUNTERS) and not any(self.accepted_hist)


COUNTERS = tuple(f.name for f in fields(BucketDelta) if f.name != "accepted_hist")  # the additive int columns


def bucket_start(at: float, bucket_seconds: int = BUCKET_SECONDS) -> datetime:
    """Start (UTC, aware) of the bucket containing unix time `at`."""
    return datetime.fromtimestamp(math.floor(at / bucket_seconds) * bucket_seconds, tz=timezone.utc)


def _delta(deltas: dict[BucketKey, BucketDelta], key: BucketKey) -> BucketDelta:
    d = deltas.get(key)
    if d is None:
        d = deltas[key] = BucketDelta()
    return d


GATE_OUTCOMES = ("tp", "fp", "fn", "tn")


def gate_outcome(e: EventLike) -> str | None:
    """The event's cell of the gate's confusion matrix at >= LONG (a long draft is the positive
    class), or None: a model draft, or a cache draft the gate was not consulted on. One definition
    for the stored statistics and the live Prometheus counters."""
    if e.drafter != "cache" or e.predicted is None:
        return None
    actual = e.accepted >= LONG
    if e.predicted >= LONG:
        return "tp" if actual else "fp"
    return "fn" if actual else "tn"


def verified_tokens(e: EventLike) -> tuple[int, int]:
    """(draft tokens the engine verified, accepted among them) of the event: a model draft's whole
    draft; a cache draft's verified prefix when the step verified it (the whole draft when the
    event names no prefix), else nothing. Shared by the stored statistics and the live counters."""
    if e.drafter == "model":
        return e.draft_len, e.accepted
    if e.decision != "cache":
        return 0, 0
    if e.verified_len is None:  # the whole draft
        return e.draft_len, e.accepted
    return e.verified_len, min(e.accepted, e.verified_len)


def aggregate_into(deltas: dict[BucketKey, BucketDelta], events: Iterable[EventLike],
                   bucket_seconds: int = BUCKET_SECONDS) -> dict[BucketKey, BucketDelta]:
    """Add `events` into an existing delta map (in place); returns it."""
    for e in events:
        key = (bucket_start(e.at, bucket_seconds), e.tenant, e.workload, e.predictor_version_id or 0)
        d = _delta(deltas, key)
        if e.drafter == "cache":
            d.cache_drafts += 1
            d.accepted_hist[min(max(int(e.accepted), 0), HIST_BINS - 1)] += 1
            outcome = gate_outcome(e)
            if outcome is not None:
                setattr(d, outcome, getattr(d, outcome) + 1)
            if e.decision == "cache":
                d.cache_verified += 1
        elif e.drafter == "model":
            d.model_drafts += 1
        else:
            raise ValueError(f"unknown drafter {e.drafter!r}")
        draft, accepted = verified_tokens(e)
        d.draft_tokens += draft
        d.accepted_tokens += accepted
        if e.promised is not None and draft:
            milli = round(1000.0 * e.promised)
            if e.drafter == "cache":
                d.cache_promised_milli += milli
                d.cache_promise_kept += accepted
            else:
                d.model_promised_milli += milli
                d.model_promise_kept += accepted
    return deltas


def aggregate(events: Iterable[EventLike], bucket_seconds: int = BUCKET_SECONDS) -> dict[BucketKey, BucketDelta]:
    """Per (bucket_start, tenant, workload, predictor_version_id or 0) counters of `events`."""
    return aggregate_into({}, events, bucket_seconds)


def add_steps(deltas: dict[BucketKey, BucketDelta], at: float, tenant: str, workload: str, version: int | None,
              tokens: int, cycles: int, bucket_seconds: int = BUCKET_SECONDS) -> None:
    """Add a step's emitted tokens and verification cycles for one (tenant, workload)."""
    d = _delta(deltas, (bucket_start(at, bucket_seconds), tenant, workload, version or 0))
    d.tokens += tokens
    d.cycles += cycles


def add_dropped(deltas: dict[BucketKey, BucketDelta], at: float, count: int,
                bucket_seconds: int = BUCKET_SECONDS) -> None:
    """Record `count` events dropped before aggregation, under tenant "*" and workload "*"."""
    if count:
        _delta(deltas, (bucket_start(at, bucket_seconds), ALL, ALL, 0)).dropped_events += count


def merge_deltas(into: dict[BucketKey, BucketDelta], other: Mapping[BucketKey, BucketDelta]) -> dict[BucketKey, BucketDelta]:
    """Sum `other` into `into` (in place; `other`'s deltas are copied, never aliased)."""
    for key, d in other.items():
        if key in into:
            into[key].merge(d)
        else:
            into[key] = d.copy()
    return into


def _hist_merge_sql(dialect: str, t: str) -> str:
    if dialect == "postgresql":
        parts = [f"COALESCE(({t}.accepted_hist->>{i})::bigint, 0) + COALESCE((excluded.accepted_hist->>{i})::bigint, 0)"
                 for i in range(HIST_BINS)]
        return f"json_build_array({', '.join(parts)})"
    if dialect == "sqlite":
        parts = [f"COALESCE(json_extract({t}.accepted_hist, '$[{i}]'), 0) + "
                 f"COALESCE(json_extract(excluded.accepted_hist, '$[{i}]'), 0)" for i in range(HIST_BINS)]
        return f"json_array({', '.join(parts)})"
    raise NotImplementedError(f"upsert_buckets supports postgresql and sqlite, not {dialect}")


def storable_keys(deltas: Mapping[BucketKey, BucketDelta]) -> dict[BucketKey, BucketDelta]:
    """``deltas`` with every tenant/workload the database cannot hold (too long, NUL, surrogate)
    renamed UNSTORABLE and merged: the counts are kept and visible, and one bad name cannot make
    every upsert fail forever. The edges normalise names first (storage.tenants), so this is rare."""
    if all(text_problem("tenant", k[1], MAX_TENANT_LEN) is None and text_problem("workload", k[2], MAX_WORKLOAD_LEN)
           is None for k in deltas):
        return dict(deltas)
    out: dict[BucketKey, BucketDelta] = {}
    for (start, tenant, workload, version), d in deltas.items():
        tenant = tenant if text_problem("tenant", tenant, MAX_TENANT_LEN) is None else UNSTORABLE
        workload = workload if text_problem("workload", workload, MAX_WORKLOAD_LEN) is None else UNSTORABLE
        merge_deltas(out, {(start, tenant, workload, version): d})
    return out


def upsert_buckets(session: Session, deltas: Mapping[BucketKey, BucketDelta]) -> int:
    """Add `deltas` to their rows (creating missing ones) in the session's transaction.

    One INSERT ... ON CONFLICT DO UPDATE statement per chunk of rows; keys are sorted so concurrent
    writers lock rows in the same order (no deadlock between them on PostgreSQL). Returns the number
    of keys written. Atomic per row on both backends, so concurrent writers never lose an update.
    """
    deltas = storable_keys(deltas)
    rows = []
    for key in sorted(deltas, key=lambda k: (k[0], k[1], k[2], k[3])):
        d = deltas[key]
        if d.is_zero():
            continue
        if len(d.accepted_hist) != HIST_BINS:
            raise ValueError(f"accepted_hist must have {HIST_BINS} bins, got {len(d.accepted_hist)}")
        row = dict(zip(KEY_COLUMNS, key))
        row.update({name: int(getattr(d, name)) for name in COUNTERS})
        row["accepted_hist"] = [int(x) for x in d.accepted_hist]
        rows.append(row)
    if not rows:
        return 0
    _add_rows(session, StatBucket, KEY_COLUMNS, rows)
    _add_rows(session, StatHour, HOUR_KEY_COLUMNS, hours_of(rows))
    return len(rows)


def hours_of(rows: Iterable[dict]) -> list[dict]:
    """Minute rows summed over tenants into their hours (stat_hours' rows), in key order."""
    summed: dict[tuple, dict] = {}
    for r in rows:
        start = r["bucket_start"]
        key = (start.replace(minute=0, second=0, microsecond=0), r["workload"], r["predictor_version_id"])
        acc = summed.get(key)
        if acc is None:
            summed[key] = {**dict(zip(HOUR_KEY_COLUMNS, key)), **{c: r[c] for c in COUNTERS},
                           "accepted_hist": list(r["accepted_hist"])}
            continue
        for c in COUNTERS:
            acc[c] += r[c]
        acc["accepted_hist"] = [a + b for a, b in zip(acc["accepted_hist"], r["accepted_hist"])]
    return [summed[k] for k in sorted(summed)]


def _add_rows(session: Session, model: type, keys: tuple[str, ...], rows: list[dict]) -> None:
    """INSERT ... ON CONFLICT (keys) DO UPDATE adding the counters and the histogram, per chunk."""
    insert = upsert_insert(session, "upsert_buckets")
    table = model.__table__
    hist_sql = literal_column(_hist_merge_sql(session.get_bind().dialect.name, table.name))
    for i in range(0, len(rows), UPSERT_CHUNK):
        stmt = insert(table).values(rows[i:i + UPSERT_CHUNK])
        set_ = {name: table.c[name] + stmt.excluded[name] for name in COUNTERS}
        set_["accepted_hist"] = hist_sql
        session.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=set_))


def prune_buckets(session: Session, older_than: datetime) -> int:
    """Delete the statistics buckets that start before `older_than` (stat_buckets' retention: one
    row per minute, tenant, workload and version grows without bound otherwise); returns the count."""
    if older_than.tzinfo is None:
        raise ValueError(f"older_than {older_than.isoformat()} is naive; a timezone-aware datetime is required")
    hour = older_than.replace(minute=0, second=0, microsecond=0)  # an hour goes once all its minutes went
    session.execute(delete(StatHour).where(StatHour.bucket_start < hour))
    return session.execute(delete(StatBucket).where(StatBucket.bucket_start < older_than)).rowcount or 0


def prune_events(session: Session, keep_last: int) -> int:
    """Delete the oldest decision events beyond the newest `keep_last` (by id); returns the count."""
    return keep_newest(session, DecisionEvent, keep_last)
