"""Engine and session construction with the connection policy HVD relies on."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from storage.errors import StorageError

SQLITE_BUSY_TIMEOUT_MS = 5000


def masked_url(url: str | Engine) -> str:
    """Render a URL safe for logs and error messages (password replaced by ***)."""
    parsed = url.url if isinstance(url, Engine) else make_url(url)
    return parsed.render_as_string(hide_password=True)


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


def make_engine(url: str) -> Engine:
    """Create an engine and prove it can connect, so misconfiguration fails early and legibly."""
    try:
        engine = create_engine(
            url,
            # NaN/Infinity are not JSON; PostgreSQL rejects them and SQLite would
            # store text other tools cannot parse.  Fail loudly instead.
            json_serializer=functools.partial(json.dumps, allow_nan=False),
            pool_pre_ping=True,
        )
    except (SQLAlchemyError, ImportError, ValueError) as exc:
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
