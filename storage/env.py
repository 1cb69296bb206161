"""Reading HVD_* environment variables: the one mechanism every layer reads them through.

`read_env(name, parse, default)`: an unset or blank variable takes the default; otherwise `parse`
gets the raw text and either returns the value or raises ValueError saying what it accepts ("an
integer >= 1"), which becomes an `EnvError` naming the variable, the value and that:
`HVD_MAX_RUNNING='0' is not valid: expected an integer >= 1`. The parsers below are the shared ones.

It lives in the lowest layer so that storage (the database URL and timeouts), the predictor (the
tokenizer) and the dashboard read their variables the way controller/settings.py, the table of
every HVD_* variable, reads the rest. It imports nothing but the standard library and storage.errors.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from storage.errors import StorageError

T = TypeVar("T")
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvError(StorageError, ValueError):
    """An environment variable set to a value that cannot be used; the message names the variable,
    the value and what it accepts."""


def raw_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, or None when it is unset or blank (an empty variable counts as unset)."""
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw


def read_env(name: str, parse: Callable[[str], T], default: Any = None,
             environ: Mapping[str, str] | None = None) -> T | Any:
    """The parsed value of `name`, or `default` when it is unset or blank; EnvError if `parse` refuses it."""
    raw = raw_env(name, environ)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise EnvError(f"{name}={raw!r} is not valid: expected {exc}") from None


# ------------------------------------------------------------------ parsers: the value, or ValueError(what is accepted)
def parse_flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"one of {TRUE + FALSE}")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A parser of whole numbers >= `minimum` (its error says what is accepted)."""
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"an integer >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"an integer >= {minimum}")
        return value
    return parse


positive_int = int_at_least(1)
whole_seconds = int_at_least(0)


def number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("a number") from None


def seconds_between(minimum: float, maximum: float) -> Callable[[str], float]:
    """A parser of a number of seconds in [minimum, maximum] (nan and inf refused)."""
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not minimum <= value <= maximum:
            raise ValueError(f"a number of seconds between {minimum:g} and {maximum:g}")
        return value
    return parse


def text(raw: str) -> str:
    return raw


def stripped(raw: str) -> str:
    return raw.strip()


def one_of(where: str) -> Callable[[str], str]:
    """A parser accepting the names at `where` ("module:attribute": a tuple of names, or a function
    returning a dict of them), imported when a value is read so the table that uses it stays light."""

    def parse(raw: str) -> str:
        module, attribute = where.split(":")
        found = getattr(importlib.import_module(module), attribute)
        names = tuple(found() if callable(found) else found)
        if raw not in names:
            raise ValueError(f"one of {names}")
        return raw

    return parse
