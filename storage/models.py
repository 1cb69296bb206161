"""Typed ORM models.  The migrations mirror these exactly; a test enforces it.

Column lengths: see storage.limits (TEXT where the value has no natural bound)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from storage.limits import MAX_AUTHOR_LEN, MAX_TENANT_LEN, MAX_WORKLOAD_LEN

# Deterministic constraint names: required for SQLite batch migrations to find
# constraints later, and keeps names identical across backends.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# A 64-bit serial id: BIGINT (BIGSERIAL) on PostgreSQL, where a fleet's events pass 2^31 in days; on
# SQLite an INTEGER PRIMARY KEY is already the 64-bit rowid, and a BIGINT one would stop being its
# alias and lose autoincrement (migration 0013).
BigId = BigInteger().with_variant(Integer, "sqlite")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    SQLite drops tzinfo on the way back; without this, comparisons between
    fresh and loaded timestamps raise TypeError (naive vs aware).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}; storage requires timezone-aware UTC")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class PredictorVersion(Base):
    """An immutable trained model: weights plus the evidence for why it exists."""

    __tablename__ = "predictor_versions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)
    parent_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("predictor_versions.id"), nullable=True
    )
    kind: Mapped[str] = mapped_column(String(32), nullable=False)
    feature_schema_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    blob: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    blob_sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    training_summary: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    created_by: Mapped[str] = mapped_column(Text, nullable=False)  # e.g. learner@<host>-<pid>

    def __repr__(self) -> str:
        return (
            f"PredictorVersion(id={self.id!r}, kind={self.kind!r}, "
            f"parent_id={self.parent_id!r}, blob_sha256={self.blob_sha256!r})"
        )


class Alias(Base):
    """A movable name (e.g. "champion") for the version currently serving that role."""

    __tablename__ = "aliases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("predictor_versions.id"), nullable=False
    )
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)


class AliasEvent(Base):
    """Append-only audit trail so every promotion/rollback can be explained later."""

    __tablename__ = "alias_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    alias_name: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    from_version_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("predictor_versions.id"), nullable=True
    )
    to_version_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("predictor_versions.id"), nullable=False
    )
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    actor: Mapped[str] = mapped_column(Text, nullable=False)


class AliasPin(Base):
    """An operator's pin: the alias holds this version against the learner until unpinned. One row per
    pinned alias (deleted on unpin); every pin and unpin is in alias_pin_events."""

    __tablename__ = "alias_pins"

    alias_name: Mapped[str] = mapped_column(String(64), ForeignKey("aliases.name"), primary_key=True)
    version_id: Mapped[int] = mapped_column(Integer, ForeignKey("predictor_versions.id"), nullable=False)
    actor: Mapped[str] = mapped_column(Text, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)


class AliasPinEvent(Base):
    """Append-only audit of pins and unpins (action "pin" or "unpin", the version pinned), beside
    alias_events, which records the moves themselves."""

    __tablename__ = "alias_pin_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    alias_name: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    action: Mapped[str] = mapped_column(String(8), nullable=False)
    version_id: Mapped[int] = mapped_column(Integer, ForeignKey("predictor_versions.id"), nullable=False)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    actor: Mapped[str] = mapped_column(Text, nullable=False)


class DecisionEvent(Base):
    """One labelled draft: what the gate knew and decided, and what verification (or hindsight)
    showed. The learner trains on these; statistics aggregate them."""

    __tablename__ = "decision_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    tenant: Mapped[str] = mapped_column(String(MAX_TENANT_LEN), nullable=False)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    request_id: Mapped[str] = mapped_column(Text, nullable=False)  # from the client or trace: no bound
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    drafter: Mapped[str] = mapped_column(String(16), nullable=False)  # whose draft is labelled: cache | model
    decision: Mapped[str] = mapped_column(String(16), nullable=False)  # what was verified: cache | model | none
    draft_len: Mapped[int] = mapped_column(Integer, nullable=False)
    accepted: Mapped[int] = mapped_column(Integer, nullable=False)
    predicted: Mapped[float | None] = mapped_column(Float, nullable=True)
    tau: Mapped[float | None] = mapped_column(Float, nullable=True)
    predictor_version_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    features: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # float32 row
    # Draft tokens verified (a cache draft's prefix when the allocator cut it); NULL: none verified,
    # or an event from before migration 0007 (its whole draft, when its decision was cache).
    verified_len: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # What the allocator's plan expected the target to accept of the verified tokens (migration 0018);
    # NULL: nothing verified, no allocator planned the step, or an event from before it.
    promised: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The inserting transaction's id on PostgreSQL (0 on SQLite, and for rows from before migration
    # 0014): the learner reads in (txid, id) order below the oldest running transaction, so a chunk
    # that commits after a later one was read is still read (storage.events.events_after).
    txid: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")

    __table_args__ = (Index("ix_decision_events_txid_id", "txid", "id"),)


class DeadLetterEvent(Base):
    """A decision event the database can never store (a NUL, an over-long tenant, a value the
    driver refuses), set aside by the event writer with the reason, so one bad row neither
    blocks the rows behind it nor disappears uncounted. `event` is the row as ASCII-escaped JSON."""

    __tablename__ = "dead_letter_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)
    replica: Mapped[str | None] = mapped_column(Text, nullable=True)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    event: Mapped[str] = mapped_column(Text, nullable=False)


class EventReceipt(Base):
    """A writer's last committed chunk (the event writer's, and the statistics and step-cost
    writers' batches), written in that chunk's transaction. When a commit's answer is lost with the
    connection, the writer looks here before retrying: the chunk is in the database iff this row
    names it, so nothing is stored (or, for additive writes, counted) twice."""

    __tablename__ = "event_receipts"

    writer: Mapped[str] = mapped_column(String(40), primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger, nullable=False)  # the writer's sequence number of its first event
    rows: Mapped[int] = mapped_column(Integer, nullable=False)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)


class TauOverride(Base):
    """An operator's override of tau for a tenant (optionally one workload of it). Never deleted:
    clearing stamps cleared_at, so the table is its own audit trail."""

    __tablename__ = "tau_overrides"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(MAX_TENANT_LEN), nullable=False, index=True)
    workload: Mapped[str | None] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=True)  # None: every workload of the tenant
    mode: Mapped[str] = mapped_column(String(16), nullable=False)  # fixed | bounds | off_model | off_cache
    tau: Mapped[float | None] = mapped_column(Float, nullable=True)
    tau_min: Mapped[float | None] = mapped_column(Float, nullable=True)
    tau_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    author: Mapped[str] = mapped_column(String(MAX_AUTHOR_LEN), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)
    cleared_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cleared_by: Mapped[str | None] = mapped_column(String(MAX_AUTHOR_LEN), nullable=True)
    clear_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class SurvivalCalibration(Base):
    """The fast per-position correction of the champion's survival curves for one workload (tenant
    "": every tenant of it; else that tenant's traffic of it), fitted by the leader every few hundred
    labelled drafts and read by every replica's control poller. One row per scope, replaced."""

    __tablename__ = "survival_calibrations"
    __table_args__ = (UniqueConstraint("workload", "tenant"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    tenant: Mapped[str] = mapped_column(String(MAX_TENANT_LEN), nullable=False)  # "": the whole workload
    predictor_version_id: Mapped[int] = mapped_column(Integer, nullable=False)  # the outputs it corrects
    params: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)  # predictor.gate.calibration.Calibration.to_json
    events: Mapped[int] = mapped_column(Integer, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, default=utcnow)


class LearnerCheck(Base):
    """A judgement of the online learner that changed (or kept) what serves: a challenger's win
    awaiting confirmation, its confirmation or refusal, a look during a promotion's probation, a
    fast calibration put on trial and its outcome. Plain losses are not stored (one per check).
    Append-only: it says why the learner promoted, rolled back, or did not."""

    __tablename__ = "learner_checks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    tenant: Mapped[str] = mapped_column(String(MAX_TENANT_LEN), nullable=False)  # "": the whole workload
    subject: Mapped[str] = mapped_column(String(16), nullable=False)  # storage.learner_checks.SUBJECTS
    outcome: Mapped[str] = mapped_column(String(16), nullable=False)  # storage.learner_checks.OUTCOMES
    gain: Mapped[float] = mapped_column(Float, nullable=False)  # counterfactual goodput, candidate over incumbent - 1
    drafts: Mapped[int] = mapped_column(Integer, nullable=False)  # the window it was judged on
    predictor_version_id: Mapped[int] = mapped_column(Integer, nullable=False)  # serving the workload then
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    replica: Mapped[str] = mapped_column(Text, nullable=False)


class LearningRoom(Base):
    """What a workload's serving could still gain, measured at each of the learner's checks on the
    workload's held-back window: a perfect predictor's counterfactual goodput over the serving
    version's (the headroom: no predictor can gain more) beside the challenger's (what learning has
    found), so a user can see whether learning has anything left to win. Append-only."""

    __tablename__ = "learning_room"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    predictor_version_id: Mapped[int] = mapped_column(Integer, nullable=False)  # serving the workload then
    drafts: Mapped[int] = mapped_column(Integer, nullable=False)  # the window replayed
    headroom: Mapped[float] = mapped_column(Float, nullable=False)  # perfect predictor over serving - 1
    # the challenger over serving - 1; NULL on a probation look (no challenger is tried then)
    challenger_gain: Mapped[float | None] = mapped_column(Float, nullable=True)
    replica: Mapped[str] = mapped_column(Text, nullable=False)


class TauHistory(Base):
    """Every change of a workload's automatic tau: the goodput-rule value, the learned correction,
    and the live estimates it came from."""

    __tablename__ = "tau_history"
    # each workload's newest row in one index probe (migration 0016)
    __table_args__ = (Index("ix_tau_history_workload_id", "workload", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    tau: Mapped[float] = mapped_column(Float, nullable=False)  # what the runtime uses (rule + correction)
    rule_tau: Mapped[float] = mapped_column(Float, nullable=False)
    correction: Mapped[float] = mapped_column(Float, nullable=False)
    model_mean_accepted: Mapped[float] = mapped_column(Float, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    replica: Mapped[str] = mapped_column(Text, nullable=False)


class StatBucket(Base):
    """Acceptance statistics per time bucket x tenant x workload x predictor version; rows are
    added to (upsert), never rewritten, so several writers can share one table."""

    __tablename__ = "stat_buckets"
    # migration 0016's indexes: a tenant's or a workload's buckets, the dropped rows (tenant "*"), the tenant
    # search and the list of workloads read index ranges, never every bucket
    __table_args__ = (UniqueConstraint("bucket_start", "tenant", "workload", "predictor_version_id"),
                      Index("ix_stat_buckets_tenant_start", "tenant", "bucket_start"),
                      Index("ix_stat_buckets_workload_start", "workload", "bucket_start"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    bucket_start: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    tenant: Mapped[str] = mapped_column(String(MAX_TENANT_LEN), nullable=False)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    predictor_version_id: Mapped[int] = mapped_column(Integer, nullable=False)  # 0: none
    cache_drafts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)  # labelled cache drafts
    cache_verified: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    model_drafts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    draft_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)  # verified draft tokens
    accepted_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    accepted_hist: Mapped[list[int]] = mapped_column(JSON, nullable=False)  # cache drafts by label 0..24
    tp: Mapped[int] = mapped_column(Integer, nullable=False, default=0)  # at accepted length >= 6
    fp: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    fn: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    tn: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    cycles: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    dropped_events: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    # The plan's promises on what it verified (migration 0018), per drafter: the tokens it expected the
    # target to accept, in thousandths of a token, and the tokens accepted among those verified drafts.
    cache_promised_milli: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cache_promise_kept: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    model_promised_milli: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    model_promise_kept: Mapped[int] = mapped_column(Integer, nullable=False, default=0)


class StatHour(Base):
    """stat_buckets summed over tenants into hours: what the dashboard reads for all tenants over
    days (30 days of 10,000 tenants' minutes is millions of rows; this is a few per hour). Written by
    the same upsert, in the same transaction, as the minutes (storage.stats.upsert_buckets)."""

    __tablename__ = "stat_hours"
    __table_args__ = (UniqueConstraint("bucket_start", "workload", "predictor_version_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    bucket_start: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)  # the hour
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    predictor_version_id: Mapped[int] = mapped_column(Integer, nullable=False)  # 0: none
    cache_drafts: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cache_verified: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    model_drafts: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    draft_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    accepted_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    accepted_hist: Mapped[list[int]] = mapped_column(JSON, nullable=False)
    tp: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    fp: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    fn: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    tn: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cycles: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    dropped_events: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cache_promised_milli: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cache_promise_kept: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    model_promised_milli: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    model_promise_kept: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class DriftEvent(Base):
    __tablename__ = "drift_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    workload: Mapped[str] = mapped_column(String(MAX_WORKLOAD_LEN), nullable=False)
    detector: Mapped[str] = mapped_column(String(32), nullable=False)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    predictor_version_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Lease(Base):
    """A named lease (the learner's leadership), on every database, timed by the database's clock."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(Text, nullable=False)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)
    # The term: one more each time the lease changes hands (or lapses); a leader's writes check it
    # in their own transaction (storage.leader.LeaseLeaderLock.fence).
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")


class ReplicaHealth(Base):
    """Each serving replica's latest pipeline health, written by its event writer after a flush."""

    __tablename__ = "replica_health"

    replica: Mapped[str] = mapped_column(Text, primary_key=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)
    queue_depth: Mapped[int] = mapped_column(Integer, nullable=False)
    events_written: Mapped[int] = mapped_column(BigInteger, nullable=False)  # 64-bit: migration 0013
    events_dropped: Mapped[int] = mapped_column(BigInteger, nullable=False)
    events_dead_lettered: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    # dead letters this replica's writer deleted to keep the table within storage.events.KEEP_DEAD_LETTERS
    dead_letters_pruned: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    services: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: each background service's state
    flush_ms: Mapped[float] = mapped_column(Float, nullable=False)


class StepCostMinute(Base):
    """What one replica's engine steps cost in one minute, by part (storage.step_costs.STEP_PARTS:
    target, hvd, drafter, rest and the whole step): the sum, median and 90th percentile in
    milliseconds. Rows are added to (upsert): steps, sums and drafter steps add, the means are
    weighted by steps, and the quantiles are those of the larger of the two summaries."""

    __tablename__ = "step_cost_minutes"
    __table_args__ = (UniqueConstraint("replica", "minute"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    replica: Mapped[str] = mapped_column(Text, nullable=False)
    minute: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)  # the minute's start
    steps: Mapped[int] = mapped_column(Integer, nullable=False)
    batch_mean: Mapped[float] = mapped_column(Float, nullable=False)  # running requests per step
    query_tokens_mean: Mapped[float] = mapped_column(Float, nullable=False)  # tokens the target processed per step
    drafter_steps: Mapped[int] = mapped_column(Integer, nullable=False)  # steps that ran the model drafter
    target_ms_sum: Mapped[float] = mapped_column(Float, nullable=False)
    target_ms_p50: Mapped[float] = mapped_column(Float, nullable=False)
    target_ms_p90: Mapped[float] = mapped_column(Float, nullable=False)
    hvd_ms_sum: Mapped[float] = mapped_column(Float, nullable=False)
    hvd_ms_p50: Mapped[float] = mapped_column(Float, nullable=False)
    hvd_ms_p90: Mapped[float] = mapped_column(Float, nullable=False)
    drafter_ms_sum: Mapped[float] = mapped_column(Float, nullable=False)
    drafter_ms_p50: Mapped[float] = mapped_column(Float, nullable=False)
    drafter_ms_p90: Mapped[float] = mapped_column(Float, nullable=False)
    rest_ms_sum: Mapped[float] = mapped_column(Float, nullable=False)
    rest_ms_p50: Mapped[float] = mapped_column(Float, nullable=False)
    rest_ms_p90: Mapped[float] = mapped_column(Float, nullable=False)
    total_ms_sum: Mapped[float] = mapped_column(Float, nullable=False)
    total_ms_p50: Mapped[float] = mapped_column(Float, nullable=False)
    total_ms_p90: Mapped[float] = mapped_column(Float, nullable=False)


class LearnerCursor(Base):
    """Where the fleet's learning stands: the last event a committed learner round consumed, in
    (txid, id) order. Moved only by a compare-and-set in the round's own fenced transaction, so each
    committed event is in exactly one committed round, whichever replica leads."""

    __tablename__ = "learner_cursor"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    txid: Mapped[int] = mapped_column(BigInteger, nullable=False)
    event_id: Mapped[int] = mapped_column(BigInteger, nullable=False)
    events: Mapped[int] = mapped_column(BigInteger, nullable=False)  # consumed since the cursor was made
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)  # the leader's term that moved it last
    holder: Mapped[str] = mapped_column(Text, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)


class LearnerRound(Base):
    """One committed learner round: the events it consumed (after the start, up to and including
    the end, in (txid, id) order) and the term it ran in. The audit of exactly-once learning."""

    __tablename__ = "learner_rounds"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)
    holder: Mapped[str] = mapped_column(Text, nullable=False)
    after_txid: Mapped[int] = mapped_column(BigInteger, nullable=False)
    after_id: Mapped[int] = mapped_column(BigInteger, nullable=False)
    last_txid: Mapped[int] = mapped_column(BigInteger, nullable=False)
    last_id: Mapped[int] = mapped_column(BigInteger, nullable=False)
    events: Mapped[int] = mapped_column(Integer, nullable=False)
