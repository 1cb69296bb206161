"""Programmatic Alembic: schema upgrades from code/tests without an alembic.ini."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

from storage.engine import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config() -> Config:
    """Config pointing at the package's migrations, independent of the working directory."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


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
                with conn.begin():
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
