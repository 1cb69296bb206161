"""Leader election for the learner: exactly one replica sharing a database runs it.

PostgreSQL: a session-level advisory lock (`pg_try_advisory_lock`) held on a dedicated connection
kept open for the leader's lifetime (key: a hash of the name and the current schema). The lock dies with the connection, so when the leader process
dies the server releases it and a follower's next `try_acquire` succeeds: takeover is automatic.

Other databases (SQLite): a row in `leases` (name, holder, expires_at) taken with one atomic
``UPDATE ... WHERE name = :name AND (expires_at < now OR holder = me)`` (``INSERT`` if absent),
renewed every ttl/3 by a daemon thread, and expiring after `ttl` seconds, so a dead leader is
replaced at most `ttl` seconds after its last renewal.

Followers call `try_acquire()` periodically; the leader checks `is_leader` (or `renew()`) before
acting on its leadership.
"""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Connection, Engine, insert, text, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from storage.engine import session_scope
from storage.models import Lease, utcnow


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def advisory_key(name: str, scope: str = "") -> int:
    """A stable signed 64-bit key for `name` within `scope` (pg advisory locks take a bigint)."""
    return int.from_bytes(hashlib.sha256(f"hvd-leader:{scope}:{name}".encode()).digest()[:8], "big", signed=True)


class LeaderLock:
    """Interface: `try_acquire()`, `renew()`, `release()`, `is_leader`."""

    name: str
    holder: str

    def try_acquire(self) -> bool:
        raise NotImplementedError

    def renew(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    @property
    def is_leader(self) -> bool:
        raise NotImplementedError

    def __enter__(self) -> "LeaderLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PgAdvisoryLeaderLock(LeaderLock):
    def __init__(self, engine: Engine, name: str, holder: str | None = None) -> None:
        self.engine = engine
        self.name = name
        self.holder = holder or default_holder()
        self.key: int | None = None  # advisory_key(name, current schema); set on first connection
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def is_leader(self) -> bool:
        return self._conn is not None

    def try_acquire(self) -> bool:
        """Take the lock if free (non-blocking); True if this process is (now) the leader."""
        with self._lock:
            if self._conn is not None:
                return self._check_locked()
            conn = None
            try:
                # AUTOCOMMIT: the lock is session-level, so no transaction is left idle (and open
                # to idle_in_transaction_session_timeout) while it is held.
                conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                if self.key is None:
                    # Advisory locks are database-wide: scope the key by schema so deployments in
                    # different schemas of one database do not block each other.
                    self.key = advisory_key(self.name, str(conn.execute(text("SELECT current_schema()")).scalar()))
                got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar())
            except SQLAlchemyError:
                if conn is not None:
                    self._discard(conn)
                return False
            if not got:
                conn.close()
                return False
            self._conn = conn
            return True

    def renew(self) -> bool:
        """Confirm the lock is still held (its connection alive); drops leadership if not."""
        with self._lock:
            if self._conn is None:
                return False
            return self._check_locked()

    def _check_locked(self) -> bool:
        assert self._conn is not None
        try:
            held = bool(self._conn.execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
                     "AND granted AND ((classid::bigint << 32) | objid::bigint) = :k"),
                {"k": self.key}).scalar())
        except SQLAlchemyError:
            held = False
        if not held:
            self._discard(self._conn)
            self._conn = None
        return held

    def release(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
                conn.close()
            except SQLAlchemyError:
                self._discard(conn)

    @staticmethod
    def _discard(conn: Connection) -> None:
        # Never hand a connection that may still hold the lock back to the pool: close it for real.
        try:
            conn.invalidate()
        except Exception:
            pass
        try:
            conn.close()
        except Exception:
            pass


class LeaseLeaderLock(LeaderLock):
    def __init__(self, engine: Engine, name: str, holder: str | None = None, ttl: float = 10.0,
                 auto_renew: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the monotonic seconds the lease's local validity is measured in (tests pass a fake
        one to expire a lease without waiting for it). The row's expires_at is wall-clock UTC."""
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.engine = engine
        self.name = name
        self.holder = holder or default_holder()
        self.ttl = ttl
        self.auto_renew = auto_renew
        self.clock = clock
        self._valid_until = 0.0  # on self.clock; the lease is surely ours before this
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.clock() < self._valid_until

    def _take(self) -> bool:
        started = self.clock()  # conservative: the lease runs from before the statement
        now = utcnow()
        expires = now + timedelta(seconds=self.ttl)
        try:
            with session_scope(self.engine) as session:
                result = session.execute(
                    update(Lease)
                    .where(Lease.name == self.name, (Lease.expires_at < now) | (Lease.holder == self.holder))
                    .values(holder=self.holder, expires_at=expires))
                taken = result.rowcount == 1
                if not taken and session.get(Lease, self.name) is None:
                    session.execute(insert(Lease).values(name=self.name, holder=self.holder, expires_at=expires))
                    taken = True
        except IntegrityError:  # another process inserted the row first
            taken = False
        except SQLAlchemyError:
            taken = False
        self._valid_until = started + self.ttl if taken else 0.0
        return taken

    def try_acquire(self) -> bool:
        with self._lock:
            taken = self._take()
        if taken and self.auto_renew and (self._thread is None or not self._thread.is_alive()):
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, name=f"hvd-lease-{self.name}", daemon=True)
            self._thread.start()
        return taken

    def renew(self) -> bool:
        """Extend the lease if still ours; False (no longer leader) if it expired and was taken."""
        with self._lock:
            if self._valid_until == 0.0:
                return False
            return self._take()

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
                with session_scope(self.engine) as session:
                    # Expire it now (only if still ours) so a follower need not wait for the ttl.
                    session.execute(update(Lease).where(Lease.name == self.name, Lease.holder == self.holder)
                                    .values(expires_at=utcnow() - timedelta(seconds=1)))
            except SQLAlchemyError:
                pass


def make_leader_lock(engine: Engine, name: str, holder: str | None = None, ttl: float = 10.0) -> LeaderLock:
    """An advisory-lock leader lock on PostgreSQL, a lease in `leases` elsewhere."""
    if engine.dialect.name == "postgresql":
        return PgAdvisoryLeaderLock(engine, name, holder)
    return LeaseLeaderLock(engine, name, holder, ttl)
