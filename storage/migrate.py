"""Programmatic Alembic: schema upgrades from code/tests without an alembic.ini.

Every serving replica upgrades at start-up; replicas starting together must not race each other
through the same migration. Each run holds the deployment's migration lock (a PostgreSQL advisory
lock; on SQLite a lock file beside the database) and Alembic, once it has the lock, finds the
schema already at head and does nothing: the migrations run once per deployment."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine

from storage.engine import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    """Config pointing at the package's migrations, independent of the working directory."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


MIGRATION_LOCK_KEY = 0x48564431  # "HVD1": the advisory lock every HVD process migrates under


@contextlib.contextmanager
def _migration_lock(conn: Connection) -> Iterator[None]:
    """A file-backed SQLite database: an exclusive lock on `<database>.migrate.lock` while
    migrating (PostgreSQL takes its advisory lock inside the transaction instead)."""
    database = conn.engine.url.database if conn.dialect.name == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    with open(f"{database}.migrate.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(engine_or_url: Engine | str, fn_name: str, revision: str) -> None:
    owned = isinstance(engine_or_url, str)
    engine = make_engine(engine_or_url) if isinstance(engine_or_url, str) else engine_or_url
    try:
        config = alembic_config()
        with engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            if sqlite:
                # Batch mode recreates a table (drop, rename); with foreign keys on, dropping a table
                # that other rows reference fails. SQLite ignores this pragma inside a transaction.
                conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                conn.commit()
            try:
                with _migration_lock(conn), conn.begin():
                    if conn.dialect.name == "postgresql":  # held to the transaction's end
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
                    config.attributes["connection"] = conn
                    getattr(command, fn_name)(config, revision)
                    if sqlite and conn.exec_driver_sql("PRAGMA foreign_key_check").first() is not None:
                        raise RuntimeError(f"{fn_name} to {revision} left rows whose foreign keys do not match")
            finally:
                if sqlite:
                    conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                    conn.commit()
    finally:
        if owned:
            engine.dispose()


def upgrade(engine_or_url: Engine | str, revision: str = "head") -> None:
    """Bring the schema forward; idempotent, so safe to call at every service start."""
    _run(engine_or_url, "upgrade", revision)


def downgrade(engine_or_url: Engine | str, revision: str) -> None:
    """Roll the schema back (``"base"`` drops every HVD table).  Destroys data."""
    _run(engine_or_url, "downgrade", revision)


def current_revision(engine: Engine) -> str | None:
    """Revision stamped in the database, or None if never migrated."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
