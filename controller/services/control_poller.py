"""Each replica's view of the control plane, refreshed in the background: the champion predictor,
the learned tau corrections and the active overrides. The decode path only ever reads the last
snapshot; if the database is unreachable the replica keeps deciding with what it has."""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.core.runtime import Controls, Runtime
from controller.services.lifecycle import BackgroundService
from predictor.champion import CHAMPION, load_gate
from predictor.mlp import BlobError
from storage.engine import session_scope
from storage.errors import StorageError
from storage.overrides import snapshot
from storage.versions import get_alias_version, latest_corrections


class ControlPoller(BackgroundService):
    name = "hvd-controls"

    def __init__(self, engine: Engine, runtime: Runtime, interval: float = 2.0) -> None:
        super().__init__(interval, max_backoff=interval)  # keep polling at the interval while it is down
        self.engine = engine
        self.runtime = runtime

    def poll_once(self) -> bool:
        """One refresh; False (and the old snapshot kept) if the database could not be read."""
        try:
            with session_scope(self.engine) as s:
                current = get_alias_version(s, CHAMPION)
                corrections = latest_corrections(s)
                overrides = snapshot(s, datetime.now(timezone.utc))
            if current is not None and current.id != self.runtime.version_id:
                version_id, gate = load_gate(self.engine, current.id)
                self.runtime.set_gate(gate, version_id)
        except (SQLAlchemyError, StorageError, BlobError) as exc:
            self.failed(exc)
            return False
        self.runtime.set_controls(Controls(corrections=corrections, overrides=overrides))
        self.succeeded()
        return True

    def round(self) -> float:
        return self.interval if self.poll_once() else self.retry.failed()

    def start(self) -> "ControlPoller":
        """Poll once now, so the runtime starts with the current control plane, then every interval."""
        self.poll_once()
        return super().start()
