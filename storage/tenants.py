"""Tenant (and author) names: one canonical spelling, or a refusal naming the field.

" acme ", "acme\\u200b" and "a\\nb" must not become three tenants that look alike on a dashboard:
names are NFC-normalised and stripped of surrounding whitespace; control, format (zero-width),
line/paragraph separator, surrogate, private-use and unassigned characters, and any whitespace
inside other than a plain space, are refused; so are empty and over-long names.
"""
from __future__ import annotations

import unicodedata

from storage.errors import FieldError
from storage.limits import MAX_AUTHOR_LEN, MAX_REASON_LEN, MAX_TENANT_LEN

# Cc control, Cf format (zero-width, bidi overrides), Cs surrogate, Co private use, Cn unassigned,
# Zl/Zp line/paragraph separators.
_REFUSED_CATEGORIES = {"Cc": "a control character", "Cf": "an invisible (format) character",
                       "Cs": "a surrogate", "Co": "a private-use character", "Cn": "an unassigned code point",
                       "Zl": "a line separator", "Zp": "a paragraph separator"}


def _describe(ch: str) -> str:
    return f"U+{ord(ch):04X}" + (f" {unicodedata.name(ch)}" if unicodedata.name(ch, "") else "")


def normalise_name(value: object, field: str, max_len: int) -> str:
    """``value`` NFC-normalised and stripped, or :class:`FieldError` naming ``field`` and the reason."""
    if not isinstance(value, str):
        raise FieldError(field, f"{field} must be a string, got {type(value).__name__}")
    if value.isascii() and value.isprintable() and 0 < len(value) <= max_len and value.strip() == value != "":
        return value  # the usual case, per request: printable ASCII is already canonical
    for ch in value:  # before NFC: normalize() itself rejects nothing, but surrogates cannot be encoded
        if unicodedata.category(ch) == "Cs":
            raise FieldError(field, f"{field} contains a surrogate ({_describe(ch)}) at position {value.index(ch)}")
    name = unicodedata.normalize("NFC", value).strip()
    if not name:
        raise FieldError(field, f"{field} must not be empty or only whitespace")
    for i, ch in enumerate(name):
        category = unicodedata.category(ch)
        what = _REFUSED_CATEGORIES.get(category)
        if what is None and ch != " " and (category == "Zs" or ch.isspace()):
            what = "whitespace other than a plain space"
        if what is not None:
            raise FieldError(field, f"{field} contains {what} ({_describe(ch)}) at position {i}")
    if len(name) > max_len:
        raise FieldError(field, f"{field} is {len(name)} characters long; at most {max_len} allowed")
    return name


def normalise_tenant(value: object, field: str = "tenant") -> str:
    """The canonical tenant name (see the module docstring), at most MAX_TENANT_LEN characters."""
    return normalise_name(value, field, MAX_TENANT_LEN)


def normalise_author(value: object, field: str = "author") -> str:
    """Who made a change, held to the same rules as tenants, at most MAX_AUTHOR_LEN characters."""
    return normalise_name(value, field, MAX_AUTHOR_LEN)


def check_free_text(value: object, field: str, max_len: int = MAX_REASON_LEN) -> str:
    """Free text (a reason): newlines allowed, but not NUL or surrogates (PostgreSQL stores
    neither), not empty and not longer than ``max_len``. Returned stripped."""
    if not isinstance(value, str):
        raise FieldError(field, f"{field} must be a string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        raise FieldError(field, f"{field} must not be empty or only whitespace")
    for i, ch in enumerate(text):
        if ch == "\x00" or unicodedata.category(ch) == "Cs":
            raise FieldError(field, f"{field} contains {_describe(ch)} at position {i}, which cannot be stored")
    if len(text) > max_len:
        raise FieldError(field, f"{field} is {len(text)} characters long; at most {max_len} allowed")
    return text
