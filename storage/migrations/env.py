"""Alembic environment.

Prefers a connection handed in via ``config.attributes["connection"]`` (what
storage.migrate does) so migrations run inside the caller's engine/transaction
and need no alembic.ini.  Falls back to $HVD_DATABASE_URL for CLI use.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from storage.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode recreates tables instead.
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    from storage.settings import database_url

    context.configure(
        url=config.get_main_option("sqlalchemy.url") or database_url(),
        target_metadata=target_metadata,
        render_as_batch=True,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from storage.engine import make_engine
    from storage.settings import database_url

    engine = make_engine(config.get_main_option("sqlalchemy.url") or database_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
