"""Where the database lives, resolved in one place so CLI, tests and services agree."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import make_url

# Relative on purpose: resolved against the working directory at connect time,
# so running from a checkout keeps the data next to it.
DEFAULT_DATABASE_URL = "sqlite:///var/hvd.db"
ENV_VAR = "HVD_DATABASE_URL"


def database_url(explicit: str | None = None) -> str:
    """Pick the URL (explicit > $HVD_DATABASE_URL > default).

    For SQLite files the parent directory is created, because SQLite reports a
    missing directory as the unhelpful "unable to open database file".
    """
    url = explicit or os.environ.get(ENV_VAR) or DEFAULT_DATABASE_URL
    _ensure_sqlite_parent(url)
    return url


def _ensure_sqlite_parent(url: str) -> None:
    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite"):
        return
    db = parsed.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return
    Path(db).expanduser().parent.mkdir(parents=True, exist_ok=True)
