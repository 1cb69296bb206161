"""Drains the event queue into SQL in batches (one transaction each), off the decode path.

Nothing is lost without a count. Every round moves what is queued into a bounded buffer (the
queue then has room again; beyond `max_buffered` the oldest are dropped and counted: 500k events,
~250 MB at most, hold a 60 s outage at the replay engine's ~7k events/s), and when the
database answers, a write pass writes what the buffer held when the pass began, in `batch_size`
chunks (5x bigger while catching up), at most PASS_MAX_CHUNKS of them; the next round follows at
once while a batch's worth is waiting, so a writer catches up right after an outage, yet under
sustained overload (events arriving faster than the database takes them) the retention still runs
on its schedule and `stop()` still ends on time.

A refused write is either an outage or bad rows, by the rules of storage.blame. An outage (the
database down, or an error every row would get: ids past their type, a sequence at its limit, a
full disk, a read-only database) is retried with back-off capped at `max_backoff`, the rows kept.
Rows the database can never store are set aside in `dead_letter_events` with the reason (or, if
that table refuses them too, in a JSON-lines file under `spill_dir`) and counted, and the rest of
their batch goes on: rows storage.events.split_storable already knows to be unstorable are never
sent, and a batch that still fails with a data error about its rows is bisected down to the rows
that poison it; when the error may be the table's instead (a number out of range, a duplicate id,
or SQLite's, which name no SQLSTATE), a known-good event is tried first and, refused as well, the
failure is an outage. The dead-letter table keeps the newest `keep_dead_letters` letters (every
replica's; storage.events.KEEP_DEAD_LETTERS, 100,000), pruned with the raw sample below;
`letters_pruned` counts what this writer deleted, and its heartbeat row carries it.

Nothing is stored twice either. A chunk's transaction also records a receipt (the writer's id and
the sequence number of the chunk's first event, storage.events.record_receipt); when a write fails
for a reason other than the rows, the database may have committed it and lost only the answer, so
before writing again the writer asks whether its receipt names that chunk, and if so forgets it.

`tally()` accounts for every event the runtime produced: written + dropped + dead-lettered + lost
(still queued or buffered; after `stop()`, what its drain time did not write), exactly. The decode path never sees any of this: it only touches the
queue, whose `put` never waits.

With a `stats` writer (controller.services.stats_writer.StatsWriter), every event taken off the
queue is also aggregated into statistics buckets (before any raw-sample buffering or drop), and the
queue's drop count is recorded as it grows. With `keep_events`, the raw sample is pruned to the
newest `keep_events` rows every `prune_every` successful write passes, and once more when it stops
(if its drain time allows).
"""
from __future__ import annotations

import json
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from controller import settings
from controller.core.events import EventQueue, LabelledEvent
from controller.services.lifecycle import BackgroundService, Health, first_line
from storage.blame import Blame, accepts_known_good_row, blame, sqlstate
from storage.engine import session_scope
from storage.events import (
    KEEP_DEAD_LETTERS,
    chunk_committed,
    event_json,
    insert_dead_letters,
    insert_events,
    prune_dead_letters,
    record_health,
    record_receipt,
    split_storable,
)
from storage.models import DecisionEvent
from storage.stats import prune_events

if TYPE_CHECKING:
    from controller.services.stats_writer import StatsWriter

DEAD_LETTER_FILE = "dead_letter_events.jsonl"
HEARTBEAT_S = 10.0  # an idle replica still writes its heartbeat row this often (the Health page ages it)
PASS_MAX_CHUNKS = 10  # chunks per write pass: under overload, retention and stop() get their turn between passes


def default_spill_dir() -> Path:
    """Where rows go that not even the dead-letter table takes."""
    return Path(settings.read("HVD_SPILL_DIR"))


def known_good_row() -> dict[str, Any]:
    """A decision event any healthy decision_events table stores: what the writer tries when a
    refusal may be the table's rather than the rows' (storage.blame, rule 5)."""
    return LabelledEvent(at=time.time(), tenant="hvd-known-good", workload="chat", request_id="hvd-known-good",
                         position=0, drafter="cache", decision="none", draft_len=0, accepted=0, predicted=None,
                         tau=None, predictor_version_id=None, features=None).to_row()


@dataclass(frozen=True)
class Tally:
    """Where every event the runtime produced went. `lost`: queued but neither written nor set
    aside when counted (at exit: lost for good, and reported)."""

    produced: int
    written: int
    dropped: int
    dead_lettered: int
    lost: int

    @property
    def balanced(self) -> bool:
        return self.produced == self.written + self.dropped + self.dead_lettered + self.lost

    def line(self) -> str:
        return (f"events produced {self.produced}, written {self.written}, dropped {self.dropped}, "
                f"dead-lettered {self.dead_lettered}, lost {self.lost}")

    def to_json(self) -> dict:
        return asdict(self)


class EventWriter(BackgroundService):
    name = "hvd-event-writer"

    def __init__(self, engine: Engine, events: EventQueue, batch_size: int = 2000, flush_interval: float = 0.5,
                 max_buffered: int = 500_000, stats: "StatsWriter | None" = None, keep_events: int | None = None,
                 prune_every: int = 20, replica: str | None = None, max_backoff: float = 1.0,
                 spill_dir: Path | None = None, services: Callable[[], list[Health]] | None = None,
                 keep_dead_letters: int | None = KEEP_DEAD_LETTERS) -> None:
        if keep_dead_letters is not None and keep_dead_letters < 0:
            raise ValueError(f"keep_dead_letters must be >= 0 (or None: no limit), got {keep_dead_letters}")
        super().__init__(flush_interval, max_backoff=max_backoff)
        self.engine = engine
        self.replica = replica  # when set, a heartbeat row (queue depth, flush latency) goes with each batch
        self.services = services  # when set, the heartbeat row carries every service's state
        self.events = events
        self.batch_size = batch_size
        self.max_buffered = max_buffered
        self.spill_dir = spill_dir if spill_dir is not None else default_spill_dir()
        self.written = 0
        self.dropped = 0  # buffer overflow (the queue counts its own)
        self.on_dropped: Callable[[int], None] | None = None  # told of each overflow (the Prometheus metrics)
        self.dead_lettered = 0
        self.spilled = 0  # of the dead-lettered: into the file, not the table
        self.peak_buffered = 0
        self.last_flush_seconds = 0.0
        self.stats = stats
        self.keep_events = keep_events
        self.prune_every = max(1, prune_every)
        self.pruned = 0
        self.keep_dead_letters = keep_dead_letters  # the dead-letter table's cap (every replica's letters)
        self.letters_pruned = 0  # dead letters this writer deleted to keep the table within the cap
        self._letters_seen: int | None = None  # dead_lettered at the last pruning of the letters (None: never)
        self._unpruned = 0  # successful write passes since the last prune
        self._stop_by = float("inf")  # monotonic time after which no chunk starts (set by stop())
        self._dropped_seen = 0  # queue drops already recorded into the stats
        # (sequence number, event): a chunk is named by its first event's number in its receipt
        self._buffer: deque[tuple[int, LabelledEvent]] = deque()
        self._next_seq = 0
        self.writer_id = secrets.token_hex(16)
        self._in_doubt: tuple[int, frozenset[int]] | None = None  # a chunk whose commit's answer was lost
        self._retry_at = 0.0  # monotonic time before which a round only drains the queue
        self._beat_at = float("-inf")  # monotonic time of the last heartbeat row

    def round(self) -> float:
        # Batch by time: one wake-up per interval, not one per event. On a CPU-bound host the
        # engine's main thread shares its core with this one (threads inherit its binding), and a
        # wake-up plus a commit per decode step cost it ~1 ms a step.
        # While backing off after a failure, rounds still move the queue into the buffer every
        # interval: the back-off paces the database, never the decode path's queue.
        self._drain_queue()
        if time.monotonic() < self._retry_at:
            return self.interval
        if self._buffer:
            if self._write(len(self._buffer)) is None:
                self._retry_at = time.monotonic() + self.retry.failed()
                return self.interval
            if self._unpruned >= self.prune_every and time.monotonic() < self._stop_by:  # not past stop()'s deadline
                self.prune()
        elif self.replica is not None and time.monotonic() - self._beat_at >= HEARTBEAT_S:
            try:
                with session_scope(self.engine) as session:
                    self._heartbeat(session, 0)
            except Exception as exc:  # an outage: logged once, retried with back-off like a write
                self.failed(exc)
                self._retry_at = time.monotonic() + self.retry.failed()
                return self.interval
        self.succeeded()
        behind = len(self._buffer) + self.events.depth()  # a pass's bound left some: go on at once
        return 0.0 if behind >= self.batch_size else self.interval

    def flush(self) -> bool:
        """Write what is queued and buffered now, pass after pass (what arrives meanwhile waits for
        the next round); False (kept, bounded) if the database refused. Past stop()'s deadline no
        chunk starts: the rest stays held (and counted)."""
        with self._round_lock:
            self._drain_queue()
            self._note([])
            left = len(self._buffer)
            while left > 0 and self._buffer:
                handled = self._write(left)
                if handled is None:
                    return False
                if handled == 0:  # out of time
                    break
                left -= handled
            self.succeeded()
            return True

    def stop(self, timeout: float = 30.0, drain_seconds: float = 10.0) -> bool:
        """Stop the thread, then write what is held, retrying a refusing database, until
        `drain_seconds` from now: no chunk starts later (the thread's pass ends by then too), so it
        returns within the drain time plus one chunk's commit (each bounded by the connect and
        statement timeouts); then, if time is left, the retention. False if anything is left
        unwritten: `tally().lost` counts it (events that came after, with the producer still running, too)."""
        self._stop_by = time.monotonic() + drain_seconds
        try:
            ok = super().stop(timeout)
            while not ok and time.monotonic() < self._stop_by:
                time.sleep(min(self.retry.failed(), max(0.0, self._stop_by - time.monotonic())))
                ok = self.flush()
            if ok and self._unpruned and time.monotonic() < self._stop_by:
                self.prune()
            return ok and not self._buffer and not self.events.depth()
        finally:
            self._stop_by = float("inf")

    def tally(self) -> Tally:
        return Tally(produced=self.events.queued + self.events.dropped, written=self.written,
                     dropped=self.events.dropped + self.dropped, dead_lettered=self.dead_lettered,
                     lost=len(self._buffer) + self.events.depth())

    def _drain_queue(self) -> None:
        """What is queued now into the buffer, so the queue has room for the decode path; not what
        arrives meanwhile (a producer outpacing the writer would keep it here for ever)."""
        left = self.events.depth()
        while left > 0 and (got := self.events.get_batch(min(self.batch_size, left))):
            self._take(got)
            left -= len(got)

    def _take(self, events: list[LabelledEvent]) -> None:
        """Into the statistics, then into the bounded buffer (oldest dropped and counted)."""
        self._note(events)
        self._buffer.extend(enumerate(events, self._next_seq))
        self._next_seq += len(events)
        excess = len(self._buffer) - self.max_buffered
        for _ in range(max(0, excess)):
            self._buffer.popleft()
        if excess > 0:
            self.dropped += excess
            if self.on_dropped is not None:
                self.on_dropped(excess)
        self.peak_buffered = max(self.peak_buffered, len(self._buffer))

    def _note(self, events: list[LabelledEvent]) -> None:
        """Aggregate `events` into the stats and record queue drops since the last call."""
        if self.stats is None:
            return
        if events:
            self.stats.add(events)
        dropped = self.events.dropped
        if dropped > self._dropped_seen:
            self.stats.add_dropped(time.time(), dropped - self._dropped_seen)
            self._dropped_seen = dropped

    def prune(self) -> int:
        """Apply the retention limits: the raw sample to `keep_events`, and the dead letters to
        `keep_dead_letters` at the first prune and after this writer dead-lettered more. Returns the
        events pruned; 0 if disabled or the database refused (tried again at the next prune)."""
        self._unpruned = 0
        self._prune_letters()
        if self.keep_events is None:
            return 0
        try:
            with session_scope(self.engine) as session:
                n = prune_events(session, self.keep_events)
        except SQLAlchemyError as exc:
            self.failed(exc)
            return 0
        self.pruned += n
        return n

    def _prune_letters(self) -> None:
        """Keep the dead-letter table within its cap; a transaction of its own, so a database
        without that table (before migration 0006) still prunes the events."""
        if self.keep_dead_letters is None or self._letters_seen == self.dead_lettered:
            return
        seen = self.dead_lettered
        try:
            with session_scope(self.engine) as session:
                n = prune_dead_letters(session, self.keep_dead_letters)
        except SQLAlchemyError as exc:
            if not _missing_table(exc):
                self.failed(exc)
            return
        self._letters_seen = seen
        self.letters_pruned += n

    # ---------------------------------------------------------------- writing
    def _write(self, limit: int) -> int | None:
        """One write pass: at most `limit` of the oldest buffered events, in at most PASS_MAX_CHUNKS
        chunks, none started after stop()'s deadline. Returns how many it wrote or set aside, or None
        if the database is down or refuses every row (the rest kept, retried later)."""
        handled = 0
        try:
            self._settle()
        except SQLAlchemyError as exc:
            self.failed(exc)
            return None
        for _ in range(PASS_MAX_CHUNKS):
            if handled >= limit or not self._buffer or time.monotonic() >= self._stop_by:
                break
            # after an outage, bigger transactions: fewer round trips while catching up
            n = min(self.batch_size * (5 if len(self._buffer) > 5 * self.batch_size else 1), len(self._buffer),
                    limit - handled)
            done: set[int] = set()
            rows = [(i, self._buffer[i][1].to_row()) for i in range(n)]
            start = time.perf_counter()
            try:
                self._store_chunk(rows, done)
            except Exception as exc:  # an outage: keep what is not done, retry later
                if not isinstance(exc, SQLAlchemyError):
                    raise
                self.failed(exc)
                return None
            finally:
                self._forget(n, done)
            self.last_flush_seconds = time.perf_counter() - start
            self.succeeded()  # the database answers again, even if catching up takes a while
            handled += n
            self._drain_queue()  # catching up may take a while: keep the queue from filling
        self._unpruned += handled > 0
        return handled

    def _settle(self) -> None:
        """Find out whether the chunk in doubt was committed (its receipt is the writer's last) and
        if so, forget its events as written; a database still down propagates."""
        if self._in_doubt is None:
            return
        first_seq, seqs = self._in_doubt
        with session_scope(self.engine) as session:
            committed = chunk_committed(session, self.writer_id, first_seq)
        self._in_doubt = None
        if committed:
            before = len(self._buffer)
            self._buffer = deque(item for item in self._buffer if item[0] not in seqs)
            self.written += before - len(self._buffer)

    def _forget(self, n: int, done: set[int]) -> None:
        """Remove the `done` indices among the first `n` buffered events, keeping the order."""
        if not done:
            return
        kept = [self._buffer[i] for i in range(n) if i not in done]
        for _ in range(n):
            self._buffer.popleft()
        self._buffer.extendleft(reversed(kept))

    def _store_chunk(self, rows: list[tuple[int, dict]], done: set[int]) -> None:
        good, bad = split_storable([row for _, row in rows])
        bad_ids = {id(row) for row, _ in bad}
        self._store(([(i, r) for i, r in rows if id(r) not in bad_ids]), done)
        index = {id(r): i for i, r in rows}
        self._dead_letter([(index[id(row)], row, reason) for row, reason in bad], done)

    def _store(self, rows: list[tuple[int, dict]], done: set[int]) -> None:
        """Insert `rows` in one transaction; on an error about the rows, bisect to the rows that
        cause it. An outage (an error not about the rows, storage.blame) propagates: the caller
        retries later."""
        if not rows:
            return
        first_seq = self._buffer[rows[0][0]][0]
        try:
            with session_scope(self.engine) as session:
                insert_events(session, [row for _, row in rows])
                record_receipt(session, self.writer_id, first_seq, len(rows))
                self._heartbeat(session, len(rows))
        except Exception as exc:
            if self._blame(exc) is Blame.STORAGE:
                self._in_doubt = (first_seq, frozenset(self._buffer[i][0] for i, _ in rows))
                raise
            if len(rows) == 1:
                (i, row), = rows
                self._dead_letter([(i, row, f"refused by the database: {first_line(exc)}")], done)
                return
            mid = len(rows) // 2
            self._store(rows[:mid], done)
            self._store(rows[mid:], done)
            return
        done.update(i for i, _ in rows)
        self.written += len(rows)

    def _blame(self, exc: BaseException) -> Blame:
        """ROWS or STORAGE (storage.blame); an UNSURE error is the rows' only if the table still
        takes a known-good event (a database gone meanwhile propagates, as an outage)."""
        verdict = blame(exc)
        if verdict is Blame.UNSURE:
            good = accepts_known_good_row(self.engine, DecisionEvent.__table__, known_good_row())
            verdict = Blame.ROWS if good else Blame.STORAGE
        return verdict

    def _heartbeat(self, session, batch: int) -> None:
        if self.replica is None:
            return
        self._beat_at = time.monotonic()
        services = None if self.services is None else json.dumps([h.to_json() for h in self.services()])
        record_health(session, replica=self.replica, queue_depth=self.events.depth(),
                      events_written=self.written + batch, events_dropped=self.events.dropped + self.dropped,
                      events_dead_lettered=self.dead_lettered, flush_ms=1000.0 * self.last_flush_seconds,
                      services=services, dead_letters_pruned=self.letters_pruned)

    def _dead_letter(self, letters: list[tuple[int, dict, str]], done: set[int]) -> None:
        """Set rows aside in the dead-letter table, else (the table refuses them, whatever the reason)
        in the file; a database that cannot be reached propagates (the rows stay buffered and are
        tried again)."""
        if not letters:
            return
        pairs = [(row, reason) for _, row, reason in letters]
        try:
            with session_scope(self.engine) as session:
                insert_dead_letters(session, pairs, self.replica)
        except Exception as exc:
            if _unreachable(exc):
                raise
            self._spill(pairs)
            self.spilled += len(letters)
        done.update(i for i, _, _ in letters)
        self.dead_lettered += len(letters)

    def _spill(self, pairs: list[tuple[dict[str, Any], str]]) -> None:
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        with open(self.spill_dir / DEAD_LETTER_FILE, "a", encoding="ascii") as fh:
            for row, reason in pairs:
                fh.write(json.dumps({"replica": self.replica, "reason": reason, "event": event_json(row)},
                                    ensure_ascii=True) + "\n")


def _unreachable(exc: BaseException) -> bool:
    """The database could not be asked (connection lost or refused, locked, shutting down), as
    opposed to a database that answered and refused: rows set aside wait for it in the buffer."""
    if not isinstance(exc, SQLAlchemyError) or _missing_table(exc):
        return False  # a driver refusing a value, or no dead-letter table: the file takes the row
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    code = sqlstate(exc)
    if code is not None:
        return code[:2] == "08" or code in ("57P01", "57P02", "57P03")  # connection; shutdown, cannot connect now
    return isinstance(exc, (OperationalError, InterfaceError))  # SQLite locked or unopenable; no SQLSTATE


def _missing_table(exc: BaseException) -> bool:
    """A database not yet migrated to 0006 has no dead-letter table: the file takes the rows."""
    return isinstance(exc, DBAPIError) and "dead_letter_events" in str(exc)
