"""Repository functions for predictor versions and aliases.

They take a caller-owned Session and only flush, never commit, so several
operations (e.g. create a version and promote it) can share one transaction.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.errors import CorruptBlobError, StorageError
from storage.models import Alias, AliasEvent, PredictorVersion, utcnow
from storage.pins import AliasPinnedError, PinError, check_audit, current_pin, record_pin

CHAMPION = "champion"  # the alias of the version the controller serves
LEARNER_ACTOR = "learner@"  # how the learner's moves are signed: learner@<replica>
_MAX_HASH_LEN = 64

BlobCheck = Callable[[bytes], None]
"""Loads and scores a model's bytes, raising ValueError that says what is wrong. Storage cannot
load a model itself (it imports no predictor code), so whoever knows the model passes one."""


class NoOpAliasMove(StorageError, ValueError):
    """A move of an alias to the version it already names: refused, so the audit log records only
    real changes."""

    def __init__(self, name: str, version_id: int) -> None:
        self.name, self.version_id = name, version_id
        super().__init__(f"{name} already is v{version_id}; nothing changed")


class AliasMovedError(StorageError, ValueError):
    """The alias no longer names the version the caller read (another operator, the CLI or the
    learner moved it meanwhile): refused, so no move silently overwrites another."""

    def __init__(self, name: str, expected: int | None, found: int | None) -> None:
        self.name, self.expected, self.found = name, expected, found

        def shown(v: int | None) -> str:
            return "no version" if v is None else f"v{v}"

        super().__init__(f"{name} moved meanwhile: it names {shown(found)}, not {shown(expected)} as read; "
                         "nothing changed (read it again)")


# `set_alias(expected=...)` default: move whatever the alias names now (no compare-and-set).
UNREAD = object()


class UnloadableVersionError(StorageError, ValueError):
    """A version whose blob does not load or score; no alias may point at it."""

    def __init__(self, version_id: int, problem: str) -> None:
        self.version_id = version_id
        self.problem = problem
        super().__init__(f"predictor version v{version_id} is unloadable: {problem}")


class UnloadableBlobError(StorageError, ValueError):
    """A blob refused before it was stored: it does not load or score."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"predictor blob refused, nothing stored: {problem}")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_plain_json(value: Any, path: str) -> None:
    """Reject anything that would not round-trip through strict JSON unchanged.

    Done up front (rather than letting the driver fail) so the error names the
    offending key, e.g. ``metrics.val.loss``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise StorageError(f"{path} is {value!r}; NaN/Infinity are not valid JSON")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise StorageError(
                    f"{path} has non-string key {key!r}; JSON object keys must be str"
                )
            check_plain_json(item, f"{path}.{key}")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_plain_json(item, f"{path}[{i}]")
        return
    raise StorageError(
        f"{path} has type {type(value).__name__}, which is not plain JSON "
        "(use dict/list/str/int/float/bool/None)"
    )


def get_version(session: Session, version_id: int) -> PredictorVersion:
    """Fetch a version or fail loudly; a missing id is always a caller bug or stale reference."""
    version = session.get(PredictorVersion, version_id)
    if version is None:
        raise StorageError(f"unknown predictor version id {version_id}")
    return version


def create_version(
    session: Session,
    *,
    blob: bytes,
    kind: str,
    feature_schema_hash: str,
    metrics: dict[str, Any],
    training_summary: dict[str, Any],
    reason: str,
    created_by: str,
    parent_id: int | None = None,
    check: BlobCheck | None = None,
) -> PredictorVersion:
    """Store a trained model; the checksum is computed here so it can't disagree with the bytes.
    With ``check`` (what the serving code loads and scores a blob with) a blob that fails it is
    refused (UnloadableBlobError) and nothing is stored: every version the product stores loaded and
    scored once, so a process without the predictor (the dashboard) can move an alias to it on its
    checksum and feature schema alone (set_alias(serving_schema=True))."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise StorageError(f"blob must be bytes, got {type(blob).__name__}")
    data = bytes(blob)
    if check is not None:
        try:
            check(data)
        except ValueError as exc:
            raise UnloadableBlobError(str(exc) or type(exc).__name__) from exc
    if not feature_schema_hash or len(feature_schema_hash) > _MAX_HASH_LEN:
        raise StorageError(
            f"feature_schema_hash must be 1..{_MAX_HASH_LEN} chars, got {feature_schema_hash!r}"
        )
    for name, value in (("metrics", metrics), ("training_summary", training_summary)):
        if not isinstance(value, dict):
            raise StorageError(f"{name} must be a dict, got {type(value).__name__}")
        check_plain_json(value, name)
    if parent_id is not None:
        get_version(session, parent_id)

    version = PredictorVersion(
        created_at=utcnow(),
        parent_id=parent_id,
        kind=kind,
        feature_schema_hash=feature_schema_hash,
        blob=data,
        blob_sha256=sha256_hex(data),
        metrics=metrics,
        training_summary=training_summary,
        reason=reason,
        created_by=created_by,
    )
    session.add(version)
    session.flush()
    return version


def set_alias(session: Session, name: str, version_id: int, *, reason: str, actor: str,
              check: BlobCheck | None = None, expected: int | None | object = UNREAD, pin: bool = False,
              serving_schema: bool = False) -> None:
    """Point ``name`` at a version and record the move, so promotions are auditable. The blob is
    verified first (its checksum here, loading and scoring through ``check``): an alias at a
    version no replica can load would stop every replica following it. A move to the version the
    alias already names is refused (NoOpAliasMove). With ``expected`` (the version id the caller
    read, None for no alias yet) the move is a compare-and-set: if the alias names another version
    now, AliasMovedError and nothing changes. A pinned alias (storage.pins) is refused to everyone
    (AliasPinnedError), checked under the same row lock as the compare-and-set, so a pin committed
    meanwhile holds; ``pin`` makes this move an operator's pin (moving the alias if it names another
    version, then holding it there), the one way to move a pinned alias.

    ``serving_schema``: for a process that cannot load a blob (the dashboard imports no predictor
    code), the version must also have the feature schema the champion's has, the one the replicas
    serve (versions were loaded and scored when stored: create_version(check=...)). Production code
    moves aliases only through predictor.gate.registry.move_alias, which passes the load check, or,
    without the predictor, with ``serving_schema`` (tests/test_architecture.py keeps it so)."""
    # Row lock on PostgreSQL so concurrent promotions and pins serialise; no-op on SQLite
    # (whose writers are already serialised by the database lock).
    alias = session.get(Alias, name, with_for_update=True, populate_existing=True)
    previous = alias.version_id if alias is not None else None
    if expected is not UNREAD and previous != expected:
        raise AliasMovedError(name, expected, previous)
    held = current_pin(session, name)
    if pin:
        check_audit(actor, reason)
        if held is not None and held.version_id == version_id:
            raise PinError(f"{name} already is pinned to v{version_id}; nothing changed")
    elif held is not None:
        raise AliasPinnedError(name, held)
    if previous == version_id and not pin:
        raise NoOpAliasMove(name, version_id)
    version = get_version(session, version_id)
    problem = version_problem(version, check) or (
        serving_schema_problem(version, get_alias_version(session, CHAMPION)) if serving_schema else None)
    if problem is not None:
        raise UnloadableVersionError(version_id, problem)
    now = utcnow()
    if previous != version_id:
        if alias is None:
            session.add(Alias(name=name, version_id=version_id, updated_at=now))
        else:
            alias.version_id = version_id
            alias.updated_at = now
        session.add(AliasEvent(alias_name=name, from_version_id=previous, to_version_id=version_id, at=now,
                               reason=f"pin: {reason}" if pin else reason, actor=actor))
        session.flush()
    if pin:
        record_pin(session, name, version_id, actor=actor, reason=reason, now=now)


def get_alias_version(session: Session, name: str) -> PredictorVersion | None:
    """The version an alias points at, or None if the alias was never set."""
    stmt = (
        select(PredictorVersion)
        .join(Alias, Alias.version_id == PredictorVersion.id)
        .where(Alias.name == name)
    )
    return session.scalars(stmt).one_or_none()


def rollback_target(session: Session, name: str) -> tuple[int, AliasEvent]:
    """Where rolling ``name`` (a workload's champion) back goes: the version it named before the
    learner's last move of it, and that move. A move that created the alias (the workload followed
    ``champion`` until then) goes back to the version ``champion`` named at that time, as the
    learner's own rollback does. LookupError if the learner never moved it."""
    moves = [e for e in list_alias_events(session, name) if e.actor.startswith(LEARNER_ACTOR)]
    if not moves:
        raise LookupError(f"{name} was never moved by the learner: nothing to roll back (give --to VERSION)")
    last = moves[-1]
    if last.from_version_id is not None:
        return last.from_version_id, last
    before = [e for e in list_alias_events(session, CHAMPION) if e.id < last.id]
    if not before:
        raise LookupError(f"{name} had no version before the learner's move #{last.id}, and {CHAMPION} none "
                          "either: give --to VERSION")
    return before[-1].to_version_id, last


def rollback_destination(session: Session, name: str) -> tuple[int | None, int]:
    """(the version ``name`` names now, where rolling it back goes): ``champion`` to its champion's
    parent, ``champion/<workload>`` to the version before the learner's last move of it
    (rollback_target). LookupError, saying what to do instead, when there is nowhere to go."""
    current = get_alias_version(session, name)
    current_id = current.id if current is not None else None
    if name != CHAMPION:
        return current_id, rollback_target(session, name)[0]
    if current is None:
        raise LookupError("no champion to roll back: run `hvd warmstart`")
    if current.parent_id is None:
        raise LookupError(f"champion v{current.id} has no parent: give --to VERSION")
    return current_id, current.parent_id


def serving_schema_problem(version: PredictorVersion, champion: PredictorVersion | None) -> str | None:
    """Why the replicas serving ``champion`` could not load ``version``: its feature schema is not
    the champion's (None: it is, or there is no champion to compare with)."""
    if champion is None or champion.feature_schema_hash == version.feature_schema_hash:
        return None
    return (f"predictor blob was trained on feature schema {version.feature_schema_hash[:12]}, the champion "
            f"v{champion.id} on {champion.feature_schema_hash[:12]}: the replicas that serve the champion could not "
            "load it")


def list_alias_events(session: Session, name: str | None = None) -> list[AliasEvent]:
    """Audit trail, oldest first."""
    stmt = select(AliasEvent).order_by(AliasEvent.id)
    if name is not None:
        stmt = stmt.where(AliasEvent.alias_name == name)
    return list(session.scalars(stmt))


def list_versions(session: Session) -> list[PredictorVersion]:
    """All versions, oldest first (ids are monotonic)."""
    return list(session.scalars(select(PredictorVersion).order_by(PredictorVersion.id)))


def verify_blob(version: PredictorVersion) -> bytes:
    """Return the model bytes only if they still match the recorded checksum."""
    data = bytes(version.blob)
    actual = sha256_hex(data)
    if actual != version.blob_sha256:
        raise CorruptBlobError(version.id, version.blob_sha256, actual)
    return data


def version_problem(version: PredictorVersion, check: BlobCheck | None = None) -> str | None:
    """Why the version cannot be served, or None if its blob verifies (and passes ``check``)."""
    try:
        data = verify_blob(version)
        if check is not None:
            check(data)
    except CorruptBlobError:
        return f"blob sha256 mismatch (recorded {version.blob_sha256[:12]}, computed {sha256_hex(bytes(version.blob))[:12]})"
    except ValueError as exc:
        return str(exc) or type(exc).__name__
    return None


def add_drift_event(session: Session, *, at, workload: str, detector: str, detail: dict,
                    predictor_version_id: int | None) -> None:
    from storage.models import DriftEvent

    check_plain_json(detail, "detail")
    session.add(DriftEvent(at=at, workload=workload, detector=detector, detail=detail,
                           predictor_version_id=predictor_version_id))
    session.flush()


def add_tau_history(session: Session, *, at, workload: str, tau: float, rule_tau: float, correction: float,
                    model_mean_accepted: float, reason: str, replica: str) -> None:
    from storage.models import TauHistory

    session.add(TauHistory(at=at, workload=workload, tau=tau, rule_tau=rule_tau, correction=correction,
                           model_mean_accepted=model_mean_accepted, reason=reason, replica=replica))
    session.flush()


def latest_corrections(session: Session) -> dict[str, float]:
    """The learned tau correction per workload, from the newest tau-history row of each."""
    from storage.models import TauHistory

    newest = select(TauHistory.workload, func.max(TauHistory.id).label("id")).group_by(TauHistory.workload).subquery()
    rows = session.execute(select(TauHistory.workload, TauHistory.correction).join(newest, TauHistory.id == newest.c.id))
    return {w: float(c) for w, c in rows}
