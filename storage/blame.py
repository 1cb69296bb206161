"""Whose fault a refused write is: the rows' own values, or the storage.

A writer that sets aside ("dead-letters") the rows the database refuses must never do so for a
refusal every row would get: ids past their type, a sequence at its limit, a full disk, a read-only
database, a missing table. Taken for bad rows, such an error once sent every event of a healthy
stream to `dead_letter_events` (issue 28). Those are outages: the writer keeps the rows and retries
(past its buffer's bound it drops the oldest, counted), and they go in once the storage is fixed.

The rules, first match wins (`blame`):

1. BEFORE_SQL: refused before the database saw the rows (the driver or the parameter binding
   refused a value: NUL, a lone surrogate, an int too large for the driver): the rows.
2. STORAGE_WIDE_SQLSTATES, STORAGE_WIDE_CLASSES: the storage, whatever the exception class says
   (psycopg2 files 2200H, the sequence limit, under DataError).
3. Not a DataError or IntegrityError: the storage (connection, lock, timeout, schema, permissions).
4. ROW_VALUE_SQLSTATES: the database names a value of the row (too long, not in the encoding, not
   a number, NULL where one is needed, a failed CHECK or foreign key): the rows.
5. Any other data or integrity error: UNSURE. 22003 (numeric value out of range) is either a row's
   value or the id column's type; 23505 (unique violation) on a table whose only key is its serial
   id is a sequence behind the stored rows; SQLite's errors carry no SQLSTATE. The writer settles
   it with `accepts_known_good_row`: a row known to be storable, inserted and rolled back. Refused
   as well: the storage. Accepted: the rows.
"""
from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import Engine, Table, insert
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

STORAGE_WIDE_SQLSTATES = frozenset({
    "2200H",  # sequence_generator_limit_exceeded: no row can get an id
})
STORAGE_WIDE_CLASSES = frozenset({
    "08",  # connection exception
    "25",  # invalid transaction state (25006: read-only transaction)
    "40",  # transaction rollback (serialization failure, deadlock)
    "42",  # syntax or access rule (missing table or column, permission denied)
    "53",  # insufficient resources (53100: disk full, 53200: out of memory)
    "54",  # program limit exceeded
    "55",  # object not in prerequisite state (lock not available)
    "57",  # operator intervention (shutdown, statement timeout)
    "58",  # system error (I/O)
    "F0",  # configuration file error
    "XX",  # internal error (data corrupted)
})
ROW_VALUE_SQLSTATES = frozenset({
    "22001",  # string data right truncation: a value longer than its VARCHAR
    "22002",  # null value, no indicator parameter
    "22004",  # null value not allowed
    "22007",  # invalid datetime format
    "22008",  # datetime field overflow
    "22021",  # character not in repertoire (not valid in the encoding)
    "22P02",  # invalid text representation
    "22P05",  # untranslatable character
    "23502",  # not null violation
    "23503",  # foreign key violation
    "23514",  # check violation
})
BEFORE_SQL = (ValueError, TypeError, OverflowError)  # what drivers raise for a value they cannot send


class Blame(enum.Enum):
    ROWS = "rows"  # the same rows will always fail: set them aside
    STORAGE = "storage"  # every row would fail: an outage, keep the rows and retry
    UNSURE = "unsure"  # a data error that may be either: ask `accepts_known_good_row`


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE the database reported with `exc` (PostgreSQL's pgcode), or None."""
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    return code if isinstance(code, str) and len(code) == 5 else None


def blame(exc: BaseException) -> Blame:
    """Whose fault the refused write `exc` is, by the rules in the module's docstring."""
    if isinstance(exc, BEFORE_SQL):
        return Blame.ROWS
    if isinstance(exc, StatementError) and not isinstance(exc, DBAPIError):
        return Blame.ROWS  # refused while binding parameters, before the database saw them
    code = sqlstate(exc)
    if code is not None and (code in STORAGE_WIDE_SQLSTATES or code[:2] in STORAGE_WIDE_CLASSES):
        return Blame.STORAGE
    if not isinstance(exc, (DataError, IntegrityError)):
        return Blame.STORAGE
    if code in ROW_VALUE_SQLSTATES:
        return Blame.ROWS
    return Blame.UNSURE


def accepts_known_good_row(engine: Engine, table: Table, row: dict[str, Any]) -> bool:
    """Whether `table` takes `row`, a row known to be storable, in a transaction rolled back (so
    nothing stays; PostgreSQL keeps only the sequence value it took). False: the table refuses even
    a good row, so a refusal of other rows was never about them. An error that is not a refusal of
    the row (the database down) propagates."""
    try:
        with engine.connect() as conn:
            with conn.begin() as tx:
                conn.execute(insert(table), [row])
                tx.rollback()
    except Exception as exc:
        if blame(exc) is Blame.STORAGE:
            raise
        return False
    return True
