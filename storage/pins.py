"""Pins: an operator holds an alias (`champion`, `champion/<workload>`) at a version against the
learner until the pin is lifted. Every pin and unpin is audited in alias_pin_events with who and why.

The pin is set by the move itself (storage.versions.set_alias with pin=True), so the move and the
pin share one transaction and one row lock on the alias; a move of a pinned alias is refused under
that lock (AliasPinnedError), so a pin committed meanwhile cannot be overtaken. Functions take a
caller-owned Session and only flush, as in storage.versions.
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.errors import StorageError
from storage.limits import MAX_AUTHOR_LEN, MAX_REASON_LEN
from storage.models import Alias, AliasPin, AliasPinEvent, utcnow

PIN, UNPIN = "pin", "unpin"

# `unpin_alias(expected=...)` default: lift whatever pin holds the alias now.
UNREAD = object()


class AliasPinnedError(StorageError, ValueError):
    """A move of a pinned alias: refused for everyone, operators included, so a pin holds until it is
    lifted (unpin) or replaced by an explicit pin to another version."""

    def __init__(self, name: str, pin: AliasPin) -> None:
        self.name, self.version_id, self.actor, self.reason = name, pin.version_id, pin.actor, pin.reason
        super().__init__(f"{name} is pinned to v{pin.version_id} by {pin.actor} ({pin.reason}); nothing changed "
                         "(unpin it, or pin another version)")


class PinError(StorageError, ValueError):
    """A pin or unpin that would change nothing, or was asked of a pin that changed meanwhile."""


def check_audit(actor: str, reason: str) -> None:
    """Who and why are kept with every pin and unpin: both required, both bounded."""
    if not actor.strip() or len(actor) > MAX_AUTHOR_LEN:
        raise PinError(f"a pin needs an actor of 1..{MAX_AUTHOR_LEN} characters, got {len(actor.strip())}")
    if not reason.strip() or len(reason) > MAX_REASON_LEN:
        raise PinError(f"a pin needs a reason of 1..{MAX_REASON_LEN} characters, got {len(reason.strip())}")


def current_pin(session: Session, name: str) -> AliasPin | None:
    """The pin holding `name`, read from the database (never the session's cache: a pin committed
    by another transaction while this one waited for the alias's row lock must be seen)."""
    stmt = select(AliasPin).where(AliasPin.alias_name == name).execution_options(populate_existing=True)
    return session.scalars(stmt).one_or_none()


def record_pin(session: Session, name: str, version_id: int, *, actor: str, reason: str, now: datetime) -> None:
    """Hold `name` at `version_id` (replacing any pin), audited. Called by set_alias(pin=True) once
    the alias names the version; not a way to pin on its own."""
    held = current_pin(session, name)
    if held is None:
        session.add(AliasPin(alias_name=name, version_id=version_id, actor=actor, reason=reason, at=now))
    else:
        held.version_id, held.actor, held.reason, held.at = version_id, actor, reason, now
    session.add(AliasPinEvent(alias_name=name, action=PIN, version_id=version_id, at=now, reason=reason, actor=actor))
    session.flush()


def unpin_alias(session: Session, name: str, *, reason: str, actor: str,
                expected: int | None | object = UNREAD) -> int:
    """Lift the pin on `name`, audited; returns the version it held. The alias stays where it is: the
    learner may move it again from its next round. With `expected` (the pinned version the caller
    saw), a pin changed meanwhile is refused."""
    check_audit(actor, reason)
    session.get(Alias, name, with_for_update=True, populate_existing=True)  # serialise with moves and pins
    held = current_pin(session, name)
    if held is None:
        raise PinError(f"{name} is not pinned; nothing changed")
    if expected is not UNREAD and held.version_id != expected:
        raise PinError(f"{name}'s pin changed meanwhile: it holds v{held.version_id}, not v{expected} as read; "
                       "nothing changed (read it again)")
    version_id = held.version_id
    session.delete(held)
    session.add(AliasPinEvent(alias_name=name, action=UNPIN, version_id=version_id, at=utcnow(), reason=reason,
                              actor=actor))
    session.flush()
    return version_id


def list_pins(session: Session) -> dict[str, AliasPin]:
    """{alias name: its pin} of every pinned alias."""
    return {p.alias_name: p for p in session.scalars(select(AliasPin).order_by(AliasPin.alias_name))}


def list_pin_events(session: Session, name: str | None = None) -> list[AliasPinEvent]:
    """Every pin and unpin, oldest first."""
    stmt = select(AliasPinEvent).order_by(AliasPinEvent.id)
    if name is not None:
        stmt = stmt.where(AliasPinEvent.alias_name == name)
    return list(session.scalars(stmt))
