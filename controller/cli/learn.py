"""`hvd learn`: the online learner as a process of its own, one per deployment.

A serving replica that learns (HVD_LEARN) runs the LearnerService (controller/services/
learner_service.py) inside vLLM's worker, where its rounds compete with the decode step for the
cores and the GIL. `hvd learn` runs the same service beside the servers instead, against the same
database (`--db`, else HVD_DATABASE_URL), leader-locked the same way: `storage.leader.
make_leader_lock(engine, "learner", replica)`, a fenced lease row in the database.
Of several `hvd learn` processes (and serving replicas that still learn), the lock holder learns and
the others wait as standbys, trying for the lock every `--interval`, and take over when it goes.

Its decision configuration (cost profile, model-drafter prior, rule, longest model draft, fixed
tau...) is built from the HVD_* settings as the vLLM plugin builds its own
(controller/engines/vllm_hybrid.py): run it with the servers' settings.

Long-running (the default): a leader goes on from the fleet's learning cursor (`learner_cursor`,
moved by every committed round of whichever learner led: storage.learner_log), as a serving
replica's learner does when it takes over; the first learner of a database starts at the end of
the stored events. It prints a line when it leads or stands by, one per
round that learned, and one per promotion, rollback and drift; it writes a heartbeat row
(`replica_health`, named `hvd-learn-<host>-<pid>`) every HEARTBEAT_S with its cursor, which the
dashboard's Health page shows as the learner's lag. SIGINT or SIGTERM stops the service (the round
in progress finishes), releases the lock and writes a last heartbeat.

`--once` (tests, cron): take the lock once (if another learner holds it: say so, learn nothing, exit
0), learn from the stored events after the fleet's cursor (else from the first stored event) until
caught up, write the heartbeat, release the lock and exit; the next `--once` resumes at the cursor.

This module imports nothing heavy at import time: `hvd --help` reads DEFAULT_INTERVAL.
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

DEFAULT_INTERVAL = 0.5  # seconds; LearnerService's own (the rounds' pace once caught up)
DEFAULT_LEASE_TTL = 10.0  # seconds; storage.leader.make_leader_lock's
FENCED_IDLE_S = 5.0  # storage.leader.FENCED_IDLE_S, named here for --help without importing SQLAlchemy
LOCK_NAME = "learner"  # the lock every learner takes (controller/services/stack.py)


@dataclass(frozen=True)
class LearnOptions:
    once: bool = False
    interval: float = DEFAULT_INTERVAL
    lease_ttl: float = DEFAULT_LEASE_TTL  # storage.leader: the takeover bound is ttl + FENCED_IDLE_S + interval
    replica: str | None = None  # default: hvd-learn-<host>-<pid>


def default_replica() -> str:
    return f"hvd-learn-{socket.gethostname()}-{os.getpid()}"


def decision_from_settings(settings):
    """The DecisionConfig a vLLM replica decides with, from the same HVD_* settings
    (controller/engines/vllm_hybrid.py, HybridState): here no speculative config says which
    fallback the servers run, so HVD_FALLBACK, else `hvd serve`'s default (model), and the longest
    model draft is bounded by the K that `hvd serve` configures (vllm_engine.K_MAX)."""
    from controller.engines.vllm_engine import K_MAX
    from controller.services.stack import decision_config
    from predictor.decision.profiles import cost_profiles, drafter_profiles

    return decision_config(
        drafter_profiles()[settings.drafter_profile], cost_profiles()[settings.cost_profile],
        model_draft_len=min(settings.model_draft_len, K_MAX), fallback=settings.fallback or "model",
        max_running_for_speculation=settings.max_running, backoff=settings.backoff,
        fixed_tau=settings.fixed_tau, rule=settings.rule)


def lock_holder(engine) -> str | None:
    """Who holds the learner lock (its live lease row); None when no lease is live."""
    from storage.engine import session_scope
    from storage.models import Lease, utcnow

    with session_scope(engine) as session:
        lease = session.get(Lease, LOCK_NAME)
        return lease.holder if lease is not None and lease.expires_at > utcnow() else None


def _learner_class():
    """LearnerService with a line per round that learned, per promotion, rollback and drift, and per
    change of leadership, through `say` (imported here: the service pulls in numpy and torch)."""
    from controller.services.learner_service import LearnerService

    class ReportingLearner(LearnerService):
        def __init__(self, *args, say: Callable[[str], None], **kwargs) -> None:
            self.say = lambda line: say(f"hvd learn: {line}")
            self._said_leading: bool | None = None
            super().__init__(*args, **kwargs)

        def run_once(self) -> int:
            s = self.stats
            before = (len(s.promotions), len(s.rollbacks), len(s.drifts), s.updates, s.calibrations)
            read = super().run_once()
            if read:
                at = "" if s.cursor_at is None else \
                    f", stored {datetime.fromtimestamp(s.cursor_at, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
                self.say(f"learned from {read} events (to #{s.cursor}{at}): {s.updates - before[3]} updates, "
                         f"{s.calibrations - before[4]} calibrations refitted; champion v{self.champion_id}")
            for version in s.promotions[before[0]:]:
                self.say(f"promoted v{version}: {self._reason(version)}")
            for workload, promoted, back in s.rollbacks[before[1]:]:
                self.say(f"rolled back {workload}: v{promoted} -> v{back}")
            for workload, seen in s.drifts[before[2]:]:
                self.say(f"drift in {workload} after {seen} events: its corrections are reset")
            return read

        def _reason(self, version_id: int) -> str:
            from storage.engine import session_scope
            from storage.versions import get_version

            try:
                with session_scope(self.engine) as session:
                    return get_version(session, version_id).reason
            except Exception:  # only the line loses its detail
                return "see `hvd versions --log`"

        def round(self) -> float:
            delay = super().round()
            leading = bool(self.progress()["leading"])
            if leading != self._said_leading:
                self._said_leading = leading
                self.say(f"leading: learning from the events after #{self.stats.cursor}" if leading else
                         f"standby: the learner lock is held by {lock_holder(self.engine) or 'another learner'}; "
                         f"trying again every {self.interval:g} s")
            return delay

    return ReportingLearner


def _heartbeat(engine, replica: str, service) -> None:
    """This learner's `replica_health` row: its service state and cursor (the dashboard's learner
    lag). A database that is down is the service's to report; the next heartbeat retries."""
    from sqlalchemy.exc import SQLAlchemyError

    from storage.engine import session_scope
    from storage.events import record_health

    try:
        with session_scope(engine) as session:
            record_health(session, replica=replica, queue_depth=0, events_written=0, events_dropped=0, flush_ms=0.0,
                          services=json.dumps([service.health().to_json()]))
    except SQLAlchemyError:
        pass


class _Stop:
    """SIGINT and SIGTERM set `event` (and only that) while in use; the previous handlers come back."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict = {}

    def __enter__(self) -> threading.Event:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self.event.set())
        return self.event

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _print(line: str) -> None:
    print(line, flush=True)  # a line as it happens, also into a pipe or a log file


def run_learn(engine, opts: LearnOptions, say: Callable[[str], None] = _print) -> int:
    """`hvd learn`: see the module docstring. Returns the exit status."""
    from controller.settings import ServingSettings
    from predictor.gate.registry import load_gate
    from storage.engine import masked_url
    from storage.leader import make_leader_lock

    if not (opts.interval > 0 and math.isfinite(opts.interval)):
        raise ValueError(f"--interval must be a number of seconds > 0, got {opts.interval!r}")
    if not (opts.lease_ttl >= 1 and math.isfinite(opts.lease_ttl)):
        raise ValueError(f"--lease-ttl must be a number of seconds >= 1, got {opts.lease_ttl!r}")
    replica = opts.replica or default_replica()
    decision = decision_from_settings(ServingSettings.from_env())
    try:
        load_gate(engine)  # a database without a usable champion: one line naming it, before any lock
    except LookupError as exc:
        raise LookupError(f"database {masked_url(engine)}: {exc}") from None
    lock = make_leader_lock(engine, LOCK_NAME, replica, ttl=opts.lease_ttl)
    say(f"hvd learn: learner {replica} on {masked_url(engine)} ({LOCK_NAME!r} lease; rule {decision.rule}, "
        f"cost profile {decision.cost.name}); " + ("once, until caught up" if opts.once else
                                                    "Ctrl-C or SIGTERM stops it"))
    learner = _learner_class()
    with _Stop() as stop:
        if opts.once:
            return _once(engine, lock, learner, decision, replica, stop, say)
        service = learner(engine, decision, None, replica=replica, lock=lock, start_at_end=True,
                          interval=opts.interval, max_backoff=max(2.0, opts.interval), say=say)
        return _serve(engine, service, replica, stop, say)


def _serve(engine, service, replica: str, stop: threading.Event, say: Callable[[str], None]) -> int:
    from controller.services.event_writer import HEARTBEAT_S

    service.start()
    try:
        _heartbeat(engine, replica, service)
        while not stop.wait(HEARTBEAT_S):
            _heartbeat(engine, replica, service)
    finally:
        service.stop()  # the round in progress finishes; the lock is released
        _heartbeat(engine, replica, service)
    s = service.stats
    say(f"hvd learn: stopped: {s.events} events learned, {len(s.promotions)} promotions, {len(s.rollbacks)} "
        f"rollbacks; lock released")
    return 0


def _once(engine, lock, learner, decision, replica: str, stop: threading.Event, say: Callable[[str], None]) -> int:
    if not lock.try_acquire():
        say(f"hvd learn: standby: the learner lock is held by {lock_holder(engine) or 'another learner'}; "
            "not learning (--once)")
        return 0
    try:
        # the lock is taken here, for the whole run (its rounds are fenced by it); the service learns
        # in this thread, from the fleet's cursor, else from the first stored event
        service = learner(engine, decision, None, replica=replica, lock=lock, start_at_end=False, say=say)
        placed = service.resumes
        say(f"hvd learn: leading: learning from the stored events after #{service.stats.cursor} "
            + ("(the fleet's learning cursor)" if placed else "(the first stored event: no learner placed a cursor yet)"))
        state = "caught up"
        while True:
            if stop.is_set():
                state = "interrupted"
                break
            if not lock.renew():  # another learner took the lease over (this one stalled past its ttl)
                state = "lost the learner lock"
                break
            if service.run_once() < service.batch_events:  # a short round: caught up with what is stored
                break
        service.stop()
        _heartbeat(engine, replica, service)
    finally:
        lock.release()
    s = service.stats
    say(f"hvd learn: {state} at #{s.cursor}: {s.events} events learned, {len(s.promotions)} promotions, "
        f"{len(s.rollbacks)} rollbacks; lock released")
    return 1 if state == "lost the learner lock" else 0
