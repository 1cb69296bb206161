"""Engine and session construction with the connection policy HVD relies on."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session

from storage.errors import StorageError
from storage.settings import Timeouts

SQLITE_BUSY_TIMEOUT_MS = 5000
KEEPALIVE_USER_TIMEOUT_S = 60


def masked_url(url: str | Engine) -> str:
    """Render a URL safe for logs and error messages (password replaced by ***)."""
    try:
        parsed = url.url if isinstance(url, Engine) else make_url(url)
    except (ArgumentError, ValueError, TypeError):
        return repr(str(url).rsplit("@", 1)[-1][:200])  # not a URL: show no credentials, no control characters
    return parsed.render_as_string(hide_password=True)


def connect_args(url: URL, timeouts: Timeouts) -> dict[str, Any]:
    """Driver arguments that bound every wait: connect timeout everywhere, statement timeout and
    dead-connection detection on PostgreSQL. Settings already in the URL win; PostgreSQL ``options`` from the URL
    (e.g. ``-csearch_path=...``) are kept, since connect_args would replace them."""
    if url.get_backend_name() == "sqlite":
        return {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    if url.get_backend_name() != "postgresql" or url.get_driver_name() not in ("psycopg2", "psycopg"):
        return {}
    args: dict[str, Any] = {}
    if "connect_timeout" not in url.query:
        args["connect_timeout"] = max(2, math.ceil(timeouts.connect_s))  # libpq: whole seconds, 1 means 2
    # A server or network that vanishes mid-session: TCP keepalives find a dead idle peer in about a
    # minute, and tcp_user_timeout drops a connection whose sent data goes unacknowledged, instead of
    # the kernel's ~15 minutes of retransmissions.
    for name, value in (("keepalives", 1), ("keepalives_idle", 30), ("keepalives_interval", 10),
                        ("keepalives_count", 3), ("tcp_user_timeout", round(KEEPALIVE_USER_TIMEOUT_S * 1000))):
        if name not in url.query:
            args[name] = value
    options = url.query.get("options", "")
    options = " ".join(options) if isinstance(options, tuple) else options
    if timeouts.statement_s > 0 and "statement_timeout" not in options:
        args["options"] = f"{options} -c statement_timeout={round(timeouts.statement_s * 1000)}".strip()
    return args


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets the predictor read while the controller writes; foreign keys are
    # off by default in SQLite; busy_timeout turns lock contention into waiting.
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cur.close()


def make_engine(url: str, timeouts: Timeouts | None = None) -> Engine:
    """Create an engine and prove it can connect, so misconfiguration fails early and legibly.

    ``timeouts`` default to :meth:`Timeouts.from_env` ($HVD_DB_CONNECT_TIMEOUT,
    $HVD_DB_STATEMENT_TIMEOUT, in seconds).
    """
    timeouts = Timeouts.from_env() if timeouts is None else timeouts
    try:
        engine = create_engine(
            url,
            # NaN/Infinity are not JSON; PostgreSQL rejects them and SQLite would
            # store text other tools cannot parse.  Fail loudly instead.
            json_serializer=functools.partial(json.dumps, allow_nan=False),
            pool_pre_ping=True,
            connect_args=connect_args(make_url(url), timeouts),
        )
    except (SQLAlchemyError, ImportError, ValueError, TypeError) as exc:
        raise StorageError(f"invalid database URL {masked_url(url)}: {exc}") from exc
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_on_connect)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        engine.dispose()
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise StorageError(
            f"cannot reach database {masked_url(url)}: {reason}"
        ) from exc
    return engine


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any exception.

    expire_on_commit=False so objects returned from the block stay readable
    after it closes (callers typically want the version they just created).
    """
    session = Session(engine, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def upsert_insert(session: Session, what: str):
    """The `insert` construct with ON CONFLICT DO UPDATE of the session's database (the additive
    upserts of statistics and step costs); `what` names the caller in the refusal of any other
    database."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise NotImplementedError(f"{what} supports postgresql and sqlite, not {dialect}")
    return insert
