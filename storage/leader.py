"""Leader election for the learner, with fencing: exactly one replica sharing a database writes as
the learner at a time, and a leader that lost its lease cannot write at all.

A row in `leases` (name, holder, expires_at, epoch), on every database. It is taken with one atomic
``UPDATE ... WHERE name = :name AND (expires_at < now OR holder = me)`` (``INSERT`` if absent),
renewed every ttl/3 by a daemon thread, and lapses `ttl` seconds after its last renewal. Time is the
database's (``clock_timestamp()`` on PostgreSQL; on SQLite, a file on this host, the host's clock),
so the replicas' clocks do not matter. Each change of hands (or a lapse) starts a new term: `epoch`
goes up by one.

Fencing: every transaction the leader writes (`transaction()`) ends with `fence(session)`, an ``UPDATE`` of its own
lease row that matches only while the row still holds this leader's epoch and has not lapsed. It
fails the transaction otherwise (LeadershipLost), and while it holds the row lock no one can take
the lease, so a leader's writes commit inside its own term or not at all. On PostgreSQL a leader's
transaction also bounds how long it can sit idle (`FENCED_IDLE_S`): the server ends a session that
went silent (a partitioned leader), which releases the rows it locked.

Takeover bound: a follower polling every `interval` seconds leads at most
ttl + FENCED_IDLE_S + interval after the old leader's last renewal (10 + 5 + 0.5 s by default), and
at once after a clean `release()`.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, case, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from storage.engine import session_scope
from storage.models import Lease, utcnow

# How long a fenced transaction may sit idle on PostgreSQL before the server ends its session: a
# leader cut off mid-transaction holds its lease row (and so the takeover) at most this long.
FENCED_IDLE_S = 5.0


class LeadershipLost(RuntimeError):
    """This process's lease lapsed or changed hands: the transaction it fenced is not committed."""


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaderLock:
    """Interface: `try_acquire()`, `renew()`, `release()`, `is_leader`, `epoch`, `fence(session)`."""

    name: str
    holder: str
    epoch: int

    def try_acquire(self) -> bool:
        raise NotImplementedError

    def renew(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def fence(self, session: Session) -> None:
        raise NotImplementedError

    def transaction(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    @property
    def is_leader(self) -> bool:
        raise NotImplementedError

    def __enter__(self) -> "LeaderLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _db_now(dialect: str) -> Any:
    """Now, by the database's clock where it has one that every replica shares."""
    return func.clock_timestamp() if dialect == "postgresql" else utcnow()


def _db_later(dialect: str, seconds: float) -> Any:
    if dialect == "postgresql":
        return func.clock_timestamp() + func.make_interval(0, 0, 0, 0, 0, 0, seconds)
    return utcnow() + timedelta(seconds=seconds)


class LeaseLeaderLock(LeaderLock):
    def __init__(self, engine: Engine, name: str, holder: str | None = None, ttl: float = 10.0,
                 auto_renew: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the monotonic seconds the lease's local validity is measured in (tests pass a fake
        one to expire a lease without waiting for it). The row's expires_at is the database's time."""
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        self.engine = engine
        self.name = name
        self.holder = holder or default_holder()
        self.ttl = ttl
        self.auto_renew = auto_renew
        self.clock = clock
        self.epoch = 0  # the term this process holds (0: none yet)
        self._dialect = engine.dialect.name
        self._valid_until = 0.0  # on self.clock; the lease is surely ours before this
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.clock() < self._valid_until

    def _take(self) -> bool:
        """One atomic statement per step, each committed as it runs (AUTOCOMMIT): a process cut off
        from the database mid-renewal leaves no transaction holding the lease row."""
        started = self.clock()  # conservative: the lease runs from before the statement
        now, expires = _db_now(self._dialect), _db_later(self._dialect, self.ttl)
        ours = (Lease.holder == self.holder) & (Lease.epoch == self.epoch) & (Lease.expires_at >= now)
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                epoch = conn.execute(
                    update(Lease)
                    .where(Lease.name == self.name, (Lease.expires_at < now) | (Lease.holder == self.holder))
                    .values(holder=self.holder, expires_at=expires,
                            epoch=case((ours, Lease.epoch), else_=Lease.epoch + 1))  # a new term unless renewing ours
                    .returning(Lease.epoch)).scalar()
                if epoch is None and conn.scalar(select(Lease.name).where(Lease.name == self.name)) is None:
                    conn.execute(insert(Lease).values(name=self.name, holder=self.holder, expires_at=expires, epoch=1))
                    epoch = 1
        except (IntegrityError, SQLAlchemyError):  # IntegrityError: another process inserted the row first
            epoch = None
        self.epoch = 0 if epoch is None else int(epoch)
        self._valid_until = started + self.ttl if epoch is not None else 0.0
        return epoch is not None

    def try_acquire(self) -> bool:
        with self._lock:
            taken = self._take()
        if taken and self.auto_renew and (self._thread is None or not self._thread.is_alive()):
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, name=f"hvd-lease-{self.name}", daemon=True)
            self._thread.start()
        return taken

    def renew(self) -> bool:
        """Extend the lease if still ours; False (no longer leader) if it lapsed and was taken."""
        with self._lock:
            if self._valid_until == 0.0:
                return False
            return self._take()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One write transaction of the leader, committed only inside its term (`fence` at its end).

        On PostgreSQL it may sit idle at most FENCED_IDLE_S between statements: a leader cut off
        mid-transaction (its rows locked: the cursor, an alias) is ended by the server then, so the
        next leader's writes wait that long at most."""
        with session_scope(self.engine) as session:
            if self._dialect == "postgresql":
                session.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {round(FENCED_IDLE_S * 1000)}"))
            yield session
            self.fence(session)

    def fence(self, session: Session) -> None:
        """End a leader's write transaction with this: it commits only inside this leader's term.

        Locks the lease row until the transaction ends, so the lease cannot change hands between the
        check and the commit; raises LeadershipLost (the caller's transaction rolls back) if the term
        is over, by the database's clock."""
        if not self.is_leader:
            raise LeadershipLost(f"{self.holder} is not the {self.name!r} leader (its lease lapsed or was released)")
        held = session.execute(
            update(Lease).where(Lease.name == self.name, Lease.holder == self.holder, Lease.epoch == self.epoch,
                                Lease.expires_at > _db_now(self._dialect))
            .values(epoch=Lease.epoch)).rowcount
        if held != 1:
            self._valid_until = 0.0
            raise LeadershipLost(f"{self.holder} lost the {self.name!r} lease (term {self.epoch} is over)")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            if not self.renew():
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.ttl)
        self._thread = None
        with self._lock:
            was = self._valid_until != 0.0
            self._valid_until = 0.0
            if not was:
                return
            try:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    # Lapse it now (only if still ours) so a follower need not wait for the ttl.
                    conn.execute(update(Lease).where(Lease.name == self.name, Lease.holder == self.holder,
                                                     Lease.epoch == self.epoch)
                                 .values(expires_at=_db_later(self._dialect, -1.0)))
            except SQLAlchemyError:
                pass


def make_leader_lock(engine: Engine, name: str, holder: str | None = None, ttl: float = 10.0) -> LeaderLock:
    """The learner's lock: a fenced lease in `leases` (see the module docstring)."""
    return LeaseLeaderLock(engine, name, holder, ttl)
