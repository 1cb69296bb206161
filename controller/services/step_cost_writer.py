"""Folds the engine's step timings into per-minute summaries in memory and adds them to
`step_cost_minutes`, off the decode path.

`add(timing)` is all the engine calls: it takes a lock held only while the timing is counted in
the open minute (controller.core.step_costs.MinuteAggregator; O(1)) and never touches SQL. Closed
minutes wait in a bounded map (at most `max_pending_minutes`; beyond that the oldest are dropped
and counted in `dropped_minutes`); every `flush_interval` seconds a round closes the open minute
if its time is up (an idle engine sends no later step to close it) and writes every closed minute
with one additive upsert (storage.step_costs.record_minutes). If the database refuses, the minutes
are kept and retried with exponential backoff. `stop()` closes the open minute too and writes it.
The table is pruned to its newest `keep_minutes` rows at the first write and every `prune_every`
successful writes after.

A write whose commit went through but whose answer was lost with the connection is not counted
twice: the batch's receipt tells (controller.services.batch_writer).
"""
from __future__ import annotations

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from controller.core.step_costs import MAX_SAMPLES, MinuteAggregator, MinuteSummary, StepTiming, merge_summaries
from controller.services.batch_writer import BatchWriter
from storage.step_costs import KEEP_STEP_COST_MINUTES, prune_step_cost_minutes, record_minutes


class StepCostWriter(BatchWriter):
    name = "hvd-step-costs"

    def __init__(self, engine: Engine, replica: str, flush_interval: float = 10.0, max_pending_minutes: int = 1440,
                 max_backoff: float = 30.0, max_samples: int = MAX_SAMPLES, keep_minutes: int | None =
                 KEEP_STEP_COST_MINUTES, prune_every: int = 30) -> None:
        if max_pending_minutes < 1:
            raise ValueError(f"max_pending_minutes must be >= 1, got {max_pending_minutes}")
        super().__init__(engine, flush_interval, max_backoff, None if keep_minutes is None else max(1, prune_every))
        self.replica = replica
        self.max_pending_minutes = max_pending_minutes
        self.keep_minutes = keep_minutes
        self.steps = 0  # timings added
        self.dropped_minutes = 0
        self.written_minutes = 0  # rows written (a minute written in two pieces counts twice)
        self._aggregator = MinuteAggregator(max_samples)
        self._pending: dict[int, MinuteSummary] = {}  # closed minutes by start; insertion order: oldest first

    # --- the engine (any thread) -------------------------------------------------------------------

    def add(self, timing: StepTiming) -> None:
        """Count one step; never waits for the database."""
        with self._lock:
            self.steps += 1
            closed = self._aggregator.add(timing)
            if closed:
                self._keep(closed)

    def pending_minutes(self) -> int:
        """Closed minutes not yet written (the open one not counted)."""
        with self._lock:
            return len(self._pending) + self.in_doubt()

    def _keep(self, summaries: list[MinuteSummary]) -> None:
        for s in summaries:
            old = self._pending.get(s.minute)
            self._pending[s.minute] = s if old is None else merge_summaries(old, s)
        excess = len(self._pending) - self.max_pending_minutes
        if excess > 0:
            for minute in list(self._pending)[:excess]:
                del self._pending[minute]
            self.dropped_minutes += excess

    # --- writing (controller.services.batch_writer) ------------------------------------------------

    def write(self, session: Session, batch: dict[int, MinuteSummary]) -> None:
        self.written_minutes += record_minutes(session, self.replica, batch.values())

    def put_back(self, batch: dict[int, MinuteSummary]) -> None:
        pending, self._pending = self._pending, batch
        self._keep(list(pending.values()))

    def close_open(self) -> None:
        """Every round writes the open minute's steps so far too (as a piece the next pieces of the
        same minute add to): vLLM's shutdown kills its worker process without running its exit
        handlers, and a minute kept open until it ends would be lost with it."""
        self._keep(self._aggregator.drain())

    def prune_rows(self, session: Session) -> int:
        return prune_step_cost_minutes(session, self.keep_minutes)
