"""Each replica's view of the control plane, refreshed in the background: the champion predictor,
the learned tau corrections and the active overrides. The decode path only ever reads the last
snapshot; if the database is unreachable the replica keeps deciding with what it has.

A champion that will not load does not hold back the rest: the replica keeps its last good gate,
says so once per new failure (log and `champion_problem`), and still applies overrides and
corrections, which are what an operator reaches for when the model misbehaves. Likewise an
override row this version cannot apply (say, a mode a newer HVD wrote during a rolling upgrade) is
left out, named by id once (log and `unreadable_overrides`), and every other override applies."""
from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timezone

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from controller.core.runtime import Runtime
from controller.core.snapshot import Controls
from controller.services.lifecycle import BackgroundService, Health
from predictor.gate.calibration import Calibration, CalibrationError
from predictor.gate.mlp import BlobError
from predictor.gate.registry import CHAMPION, load_gate, workload_alias, workload_champions
from storage.calibrations import calibrations_for
from storage.engine import session_scope
from storage.errors import StorageError
from storage.overrides import snapshot
from storage.versions import get_alias_version, latest_corrections
from storage.workloads import WORKLOADS

log = logging.getLogger("hvd.controls")


class ControlPoller(BackgroundService):
    name = "hvd-controls"

    def __init__(self, engine: Engine, runtime: Runtime, interval: float = 2.0) -> None:
        super().__init__(interval, max_backoff=interval)  # keep polling at the interval while it is down
        self.engine = engine
        self.runtime = runtime
        # "v7: <why>" while the champion cannot be loaded here and the last good gate is served; else None
        self.champion_problem: str | None = None
        self._bad_calibrations: set[tuple[str, str | None]] = set()
        # (override id, why) of the rows the last poll could not apply
        self.unreadable_overrides: tuple[tuple[int, str], ...] = ()

    def poll_once(self) -> bool:
        """One refresh; False (and the old snapshot kept) if the database could not be read."""
        try:
            with session_scope(self.engine) as s:
                current = get_alias_version(s, CHAMPION)
                champion_id = current.id if current is not None else None
                corrections = latest_corrections(s)
                own = workload_champions(s)
                served = {w: own.get(w, champion_id) for w in WORKLOADS}
                stored_calibrations = calibrations_for(s, served)
                overrides = snapshot(s, datetime.now(timezone.utc))
        except (SQLAlchemyError, StorageError) as exc:
            self.failed(exc)
            return False
        self._report_unreadable(overrides.unreadable)
        controls = Controls(corrections=corrections, overrides=overrides,
                            calibrations=self._calibrations(stored_calibrations))
        champion = None
        if champion_id is not None and champion_id != self.runtime.version_id:
            champion = self._load_champion(champion_id)
        elif champion_id == self.runtime.version_id:
            self.champion_problem = None  # e.g. the alias went back to the gate this replica serves
        gates = self._load_workload_champions(own)
        # one snapshot: a step sees all of this poll or none of it
        self.runtime.publish(gate=None if champion is None else champion[1],
                             version_id=None if champion is None else champion[0],
                             workload_gates=gates, controls=controls)
        self.succeeded()
        return True

    def _report_unreadable(self, rows: tuple[tuple[int, str], ...]) -> None:
        told = {i for i, _ in self.unreadable_overrides}
        for override_id, why in rows:
            if override_id not in told:
                log.error("override #%d cannot be applied by this replica and is skipped (the others apply): %s",
                          override_id, why)
        self.unreadable_overrides = rows

    def _calibrations(self, stored: dict[tuple[str, str | None], dict]) -> dict[tuple[str, str | None], Calibration]:
        """The stored corrections that parse; one that does not is skipped and said once."""
        out = {}
        for scope, params in stored.items():
            try:
                out[scope] = Calibration.from_json(params)
            except CalibrationError as exc:
                if scope not in self._bad_calibrations:
                    log.error("survival calibration for %s is unusable, serving without it: %s", scope, exc)
                self._bad_calibrations.add(scope)
        return out

    def _load_workload_champions(self, own: dict[str, int]) -> dict[str, tuple] | None:
        """Workloads with their own champion get its gate (loaded once per version); one that will
        not load leaves that workload on what it had, said once."""
        current = self.runtime.workload_gates
        gates = {}
        for workload, version_id in own.items():
            have = current.get(workload)
            if have is not None and have[1] == version_id:
                gates[workload] = have
                continue
            loaded = next((g for g in current.values() if g[1] == version_id), None)
            if loaded is None:
                try:
                    loaded = tuple(reversed(load_gate(self.engine, version_id)))
                except (SQLAlchemyError, StorageError, BlobError) as exc:
                    problem = f"{workload_alias(workload)} v{version_id}: {exc}"
                    if problem != self.champion_problem:
                        log.error("workload champion cannot be loaded on this replica: %s", problem)
                    self.champion_problem = problem
                    if have is not None:
                        gates[workload] = have
                    continue
            gates[workload] = loaded
        changed = {w: v for w, (_, v) in gates.items()} != {w: v for w, (_, v) in current.items()}
        return gates if changed else None

    def _load_champion(self, version_id: int) -> tuple | None:
        """(version, gate) of the new champion, or None (said once) if it will not load here."""
        try:
            loaded_id, gate = load_gate(self.engine, version_id)
        except (SQLAlchemyError, StorageError, BlobError) as exc:
            problem = f"v{version_id}: {exc}"
            if problem != self.champion_problem:
                log.error("champion %s cannot be loaded on this replica; still serving v%s with current overrides: %s",
                          f"v{version_id}", self.runtime.version_id, exc)
            self.champion_problem = problem
            return None
        if self.champion_problem is not None:
            log.warning("champion v%s loaded; the earlier load failure is over", loaded_id)
        self.champion_problem = None
        return loaded_id, gate

    def health(self) -> Health:
        """As every service's, with the champion that did not load as the last error while it lasts."""
        h = super().health()
        return h if self.champion_problem is None else replace(h, last_error=f"champion not loaded: {self.champion_problem}")

    def round(self) -> float:
        return self.interval if self.poll_once() else self.retry.failed()

    def start(self) -> "ControlPoller":
        """Poll once now, so the runtime starts with the current control plane, then every interval."""
        self.poll_once()
        return super().start()
