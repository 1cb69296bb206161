"""Loading a stored predictor version back into the numpy gate, and moving the champion aliases
only to versions that load (move_alias: every move by a process with the predictor goes through
it). Every version is checked when stored too (`check_blob`, passed to create_version), so the
dashboard, which has no predictor, moves aliases on the checksum and feature schema in storage."""
from __future__ import annotations

import numpy as np
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from predictor.drafting.features import schema_hash
from predictor.gate.mlp import DRAFT_LEN_COLUMN, SURVIVAL_K, BlobError, GatePredictor
from storage.engine import session_scope
from storage.errors import CorruptBlobError, StorageError
from storage.versions import (CHAMPION, UNREAD, PredictorVersion, UnloadableVersionError, create_version,
                              get_alias_version, get_version, rollback_destination, set_alias, verify_blob,
                              version_problem)


class NoChampionError(LookupError):
    pass


# Version kinds in storage (predictor_versions.kind), by the gate's own kind.
VERSION_KINDS = {"point": "mlp", "survival": "survival"}


def version_kind(gate: GatePredictor) -> str:
    """What a stored version of ``gate`` is called: "survival" or "mlp" (the seed's point gate)."""
    return VERSION_KINDS[gate.kind]


def _probe(num_features: int) -> np.ndarray:
    """A small fixed input: zeros, ones and seeded normal rows, so a blob whose weights overflow on
    ordinary inputs is refused before any replica serves it. Every row but the zeros one has a
    draft length in 1..SURVIVAL_K, so a survival gate's whole curve is exercised."""
    rows = np.random.default_rng(0).normal(0.0, 3.0, size=(6, num_features))
    probe = np.vstack([np.zeros(num_features), np.ones(num_features), rows]).astype(np.float32)
    probe[2:, DRAFT_LEN_COLUMN] = np.linspace(2, SURVIVAL_K, len(probe) - 2).round()
    return probe


def gate_from_blob(blob: bytes) -> GatePredictor:
    """The gate in ``blob`` if it is for this code's feature schema and scores the probe to finite
    values (a survival gate: finite logits and a curve in [0, 1]); BlobError saying what is wrong
    otherwise."""
    gate = GatePredictor.from_bytes(blob, expected_schema_hash=schema_hash())
    probe = _probe(gate.num_features)
    with np.errstate(all="ignore"):
        scores = gate.predict(probe)
        logits = gate.logits(probe)
        curve = gate.survival(probe) if gate.kind == "survival" else np.zeros(0)
    if not (np.all(np.isfinite(scores)) and np.all(np.isfinite(logits))):
        raise BlobError("predictor blob scores a fixed probe input to non-finite values")
    if not (np.all(np.isfinite(curve)) and np.all((curve >= 0.0) & (curve <= 1.0))):
        raise BlobError("predictor blob gives a fixed probe input a survival curve outside [0, 1]")
    return gate


def check_blob(blob: bytes) -> None:
    """storage's BlobCheck: the blob loads for this code's feature schema and scores the probe."""
    gate_from_blob(blob)


def unloadable_reason(version: PredictorVersion) -> str | None:
    """Why this version cannot be served (corrupt, wrong schema, non-finite scores), or None."""
    return version_problem(version, check_blob)


def move_alias(session: Session, name: str, version_id: int, *, reason: str, actor: str,
               expected: int | None | object, pin: bool = False) -> None:
    """The one way an alias moves, from the dashboard, the CLI or the learner: ``name`` (``champion``
    or ``champion/<workload>``) is pointed at ``version_id`` only if its blob loads and scores
    (UnloadableVersionError), only if the alias still names ``expected``, the version the caller read
    (AliasMovedError; UNREAD: whatever it names), and only if it is not pinned (AliasPinnedError),
    all in the caller's transaction under one row lock. ``pin``: an operator's pin, which moves the
    alias if need be and holds it there against the learner until unpinned (storage.pins)."""
    if name != CHAMPION and not name.startswith(f"{CHAMPION}/"):
        raise ValueError(f"alias {name!r} is not {CHAMPION} or {CHAMPION}/<workload>")
    set_alias(session, name, version_id, reason=reason, actor=actor, check=check_blob, expected=expected, pin=pin)


def promote(session: Session, version_id: int, *, reason: str, actor: str,
            expected: int | None | object = UNREAD) -> None:
    """Make ``version_id`` the champion (move_alias on ``champion``)."""
    move_alias(session, CHAMPION, version_id, reason=reason, actor=actor, expected=expected)


def workload_alias(workload: str) -> str:
    """The alias of `workload`'s own champion: set when the learner promotes a challenger for that
    workload only; workloads without one are decided by `champion`."""
    return f"{CHAMPION}/{workload}"


def workload_champions(session: Session) -> dict[str, int]:
    """{workload: version id} of the workloads that have their own champion."""
    from storage.workloads import WORKLOADS

    out = {}
    for w in WORKLOADS:
        version = get_alias_version(session, workload_alias(w))
        if version is not None:
            out[w] = version.id
    return out


def promote_for_workload(session: Session, workload: str, version_id: int, *, reason: str, actor: str,
                         expected: int | None | object = UNREAD) -> None:
    """Make ``version_id`` the champion of ``workload`` only (move_alias on ``champion/<workload>``)."""
    move_alias(session, workload_alias(workload), version_id, reason=reason, actor=actor, expected=expected)


def alias_of(workload: str | None) -> str:
    """The alias an operator names by workload: its own champion's, or ``champion`` for None. An
    unknown workload is refused, naming the known ones."""
    from storage.workloads import WORKLOADS

    if workload is None:
        return CHAMPION
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
    return workload_alias(workload)


def rollback_alias(session: Session, name: str, *, reason: str, actor: str, to: int | None = None,
                   expected: int | None | object = UNREAD) -> tuple[int | None, int]:
    """Roll ``name`` back (move_alias, so checked, compare-and-set and refused while pinned):
    ``champion`` to its champion's parent, ``champion/<workload>`` to the version before the
    learner's last move of it (storage.versions.rollback_destination), or either to ``to``. ``expected``:
    the version the caller showed (default: the one read here). Returns (from, to)."""
    if to is None:
        current_id, to = rollback_destination(session, name)
    else:
        current = get_alias_version(session, name)
        current_id = current.id if current is not None else None
    move_alias(session, name, to, reason=f"rollback: {reason}", actor=actor,
               expected=current_id if expected is UNREAD else expected)
    return current_id, to


def store_champion(session: Session, gate: GatePredictor, *, reason: str, actor: str) -> int:
    """Store ``gate`` as a new version and promote it (benchmarks and tests that need a champion)."""
    version = create_version(session, blob=gate.to_bytes(), kind=version_kind(gate),
                             feature_schema_hash=gate.schema_hash, metrics={}, training_summary={}, reason=reason,
                             created_by=actor, check=check_blob)
    current = get_alias_version(session, CHAMPION)
    promote(session, version.id, reason=reason, actor=actor, expected=None if current is None else current.id)
    return version.id


def load_gate(engine: Engine, version_id: int | None = None) -> tuple[int, GatePredictor]:
    """The champion (or the given version) as a GatePredictor; a corrupt or mismatched blob is a BlobError."""
    with session_scope(engine) as session:
        if version_id is None:
            version = get_alias_version(session, CHAMPION)
            if version is None:
                raise NoChampionError("no champion predictor in the database: run `hvd warmstart` (make warmstart)")
        else:
            version = get_version(session, version_id)
        try:
            blob = verify_blob(version)
        except CorruptBlobError as exc:
            raise BlobError(str(exc)) from exc
        return version.id, gate_from_blob(blob)


__all__ = ["CHAMPION", "NoChampionError", "UnloadableVersionError", "alias_of", "load_gate", "move_alias", "promote",
           "promote_for_workload", "rollback_alias",
           "store_champion", "unloadable_reason", "StorageError", "VERSION_KINDS", "version_kind", "workload_alias",
           "workload_champions"]
