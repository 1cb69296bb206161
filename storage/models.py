"""Typed ORM models.  Migration 0001 mirrors these exactly; a test enforces it."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names: required for SQLite batch migrations to find
# constraints later, and keeps names identical across backends.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


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
    created_by: Mapped[str] = mapped_column(String(128), nullable=False)

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
    actor: Mapped[str] = mapped_column(String(128), nullable=False)


class DecisionEvent(Base):
    """One labelled draft: what the gate knew and decided, and what verification (or hindsight)
    showed. The learner trains on these; statistics aggregate them."""

    __tablename__ = "decision_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False)
    workload: Mapped[str] = mapped_column(String(32), nullable=False)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    drafter: Mapped[str] = mapped_column(String(16), nullable=False)  # whose draft is labelled: cache | model
    decision: Mapped[str] = mapped_column(String(16), nullable=False)  # what was verified: cache | model | none
    draft_len: Mapped[int] = mapped_column(Integer, nullable=False)
    accepted: Mapped[int] = mapped_column(Integer, nullable=False)
    predicted: Mapped[float | None] = mapped_column(Float, nullable=True)
    tau: Mapped[float | None] = mapped_column(Float, nullable=True)
    predictor_version_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    features: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # float32 row
