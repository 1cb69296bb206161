"""Where the database lives and how long to wait for it, resolved in one place so CLI, tests and
services agree, and refused with one clear line when unusable."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from storage.env import read_env, seconds_between, stripped
from storage.errors import StorageError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# Relative on purpose: resolved against the working directory at connect time,
# so running from a checkout keeps the data next to it.
DEFAULT_DATABASE_URL = "sqlite:///var/hvd.db"
ENV_VAR = "HVD_DATABASE_URL"
CONNECT_TIMEOUT_ENV = "HVD_DB_CONNECT_TIMEOUT"
STATEMENT_TIMEOUT_ENV = "HVD_DB_STATEMENT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_STATEMENT_TIMEOUT_S = 120.0  # long enough for a dashboard query over a busy table
MAX_TIMEOUT_S = 86400.0
# The timeouts' parsers (controller/settings.py's table reads the variables with them too).
parse_connect_timeout = seconds_between(1.0, MAX_TIMEOUT_S)
parse_statement_timeout = seconds_between(0.0, MAX_TIMEOUT_S)  # 0: no limit


class DatabaseUrlError(StorageError, ValueError):
    """A database URL that cannot be used; the message is one line naming where it came from."""


@dataclass(frozen=True)
class Timeouts:
    """How long a connection attempt (every backend) and one statement (PostgreSQL) may take, so a
    frozen database makes commands fail instead of hanging. 0 disables the statement timeout."""

    connect_s: float = DEFAULT_CONNECT_TIMEOUT_S
    statement_s: float = DEFAULT_STATEMENT_TIMEOUT_S

    @classmethod
    def from_env(cls) -> Timeouts:
        """From $HVD_DB_CONNECT_TIMEOUT and $HVD_DB_STATEMENT_TIMEOUT (storage.env.EnvError, a
        StorageError, for a bad value)."""
        return cls(read_env(CONNECT_TIMEOUT_ENV, parse_connect_timeout, DEFAULT_CONNECT_TIMEOUT_S),
                   read_env(STATEMENT_TIMEOUT_ENV, parse_statement_timeout, DEFAULT_STATEMENT_TIMEOUT_S))


def database_url(explicit: str | None = None) -> str:
    """Pick the URL (explicit > $HVD_DATABASE_URL > default) and validate it (:func:`check_database_url`).

    An explicit URL that is empty is refused, not replaced by the default: ``--db ""`` silently
    writing to ./var/hvd.db is how data ends up in the wrong place. An empty environment variable
    counts as unset, as for every HVD_* variable (storage.env).
    """
    if explicit is not None:
        return check_database_url(explicit, "database URL")
    env = read_env(ENV_VAR, stripped)
    if env:
        return check_database_url(env, f"${ENV_VAR}")
    return check_database_url(DEFAULT_DATABASE_URL, "default database URL")


def check_database_url(url: str, source: str = "database URL") -> str:
    """``url`` if it can be used: parseable, a dialect and driver that are installed, and for a
    SQLite file a directory that exists (created if missing) and is writable. Otherwise
    :class:`DatabaseUrlError` with one line naming ``source``."""
    from sqlalchemy.engine import make_url  # here: controller/settings.py reads this module's constants, cheaply
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    if not isinstance(url, str) or not url.strip():
        raise DatabaseUrlError(f"{source} is empty; give a SQLAlchemy URL such as {DEFAULT_DATABASE_URL}")
    try:
        parsed = make_url(url.strip())
    except (ArgumentError, ValueError, TypeError):
        raise DatabaseUrlError(f"{source} {_shown(url)} is not a SQLAlchemy URL "
                               f"(expected e.g. {DEFAULT_DATABASE_URL} or postgresql+psycopg2://user@host/db)") from None
    shown = parsed.render_as_string(hide_password=True)
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        raise DatabaseUrlError(f"{source} {shown}: unknown database dialect {parsed.drivername!r}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise DatabaseUrlError(f"{source} {shown}: the driver for {parsed.drivername!r} is not installed "
                               f"({exc}); e.g. postgresql+psycopg2:// uses psycopg2") from None
    if dialect.name == "sqlite":
        _check_sqlite_file(parsed, source, shown)
    return url.strip()


def _shown(url: str) -> str:
    """A refused URL for an error message: repr (no control characters), credentials hidden."""
    text = url if "@" not in url else "***@" + url.rsplit("@", 1)[1]
    return repr(text[:200])


def _check_sqlite_file(parsed: URL, source: str, shown: str) -> None:
    db = parsed.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return
    path = Path(db).expanduser()
    if path.is_dir():
        raise DatabaseUrlError(f"{source} {shown}: {path} is a directory, not a database file")
    # SQLite reports a missing directory as the unhelpful "unable to open database file".
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
        reason = f"{blocker} is not a directory" if blocker is not None and not blocker.is_dir() else exc.strerror
        raise DatabaseUrlError(f"{source} {shown}: cannot create directory {path.parent}: {reason or exc}") from None
    # SQLite also writes a -wal and a -shm file next to the database: the directory must be writable.
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise DatabaseUrlError(f"{source} {shown}: directory {path.parent} is not writable")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise DatabaseUrlError(f"{source} {shown}: {path} is not readable and writable")
