"""Loading a stored predictor version back into the numpy gate."""
from __future__ import annotations

from sqlalchemy import Engine

from predictor.features import schema_hash
from predictor.mlp import BlobError, GatePredictor
from storage.engine import session_scope
from storage.errors import CorruptBlobError, StorageError
from storage.versions import CHAMPION, get_alias_version, get_version, verify_blob


class NoChampionError(LookupError):
    pass


def load_gate(engine: Engine, version_id: int | None = None) -> tuple[int, GatePredictor]:
    """The champion (or the given version) as a GatePredictor; a corrupt or mismatched blob is an error."""
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
        return version.id, GatePredictor.from_bytes(blob, expected_schema_hash=schema_hash())


__all__ = ["CHAMPION", "NoChampionError", "load_gate", "StorageError"]
