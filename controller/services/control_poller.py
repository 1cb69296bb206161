"""Each replica's view of the control plane, refreshed in the background: the champion predictor,
the learned tau corrections and the active overrides. The decode path only ever reads the last
snapshot; if the database is unreachable the replica keeps deciding with what it has."""
from __future__ import annotations

import threading
from datetime import datetime, timezone

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.core.runtime import Controls, Runtime
from predictor.champion import CHAMPION, load_gate
from predictor.mlp import BlobError
from storage.engine import session_scope
from storage.errors import StorageError
from storage.overrides import snapshot
from storage.versions import get_alias_version, latest_corrections


class ControlPoller:
    def __init__(self, engine: Engine, runtime: Runtime, interval: float = 2.0) -> None:
        self.engine = engine
        self.runtime = runtime
        self.interval = interval
        self.failures = 0
        self.last_error: str | None = None
        self.last_success: datetime | None = None
        self.reloads = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
                self.reloads += 1
        except (SQLAlchemyError, StorageError, BlobError) as exc:
            self.failures += 1
            self.last_error = str(exc).splitlines()[0]
            return False
        self.runtime.set_controls(Controls(corrections=corrections, overrides=overrides))
        self.last_success = datetime.now(timezone.utc)
        return True

    def start(self) -> "ControlPoller":
        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.poll_once()

        self.poll_once()
        self._thread = threading.Thread(target=loop, name="hvd-controls", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
