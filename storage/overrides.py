"""Operator overrides of tau, per tenant and optionally per workload.

HVD verifies a suffix-cache draft iff the predicted accepted length exceeds tau. tau is normally
automatic per workload; an operator can override it for a tenant (all its workloads, or one):

* ``fixed``      use ``tau`` as is;
* ``bounds``     clip the automatic (or default) tau into ``[tau_min, tau_max]``;
* ``off_model``  no hybrid: always the model drafter;
* ``off_cache``  no hybrid: always the cache draft when there is one.

Rows are never deleted: clearing or replacing an override stamps ``cleared_at``/``cleared_by``/
``clear_reason``, so the table is its own audit trail. Repository functions take a caller-owned
Session and only flush, never commit (as in ``storage.versions``).

The hot path does not touch SQL: :func:`snapshot` loads the active overrides once into an
:class:`OverrideSnapshot` of plain data, whose :meth:`OverrideSnapshot.resolve` is two dict lookups.
Storage imports nothing from controller/predictor, so the known workloads are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from numbers import Real
from typing import NamedTuple

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from storage.errors import FieldError, StorageError
from storage.limits import MAX_OVERRIDE_LIFETIME
from storage.models import TauOverride, utcnow
from storage.tenants import check_free_text, normalise_author, normalise_tenant

MODES: tuple[str, ...] = ("fixed", "bounds", "off_model", "off_cache")
TAU_MIN = -1.0  # below every prediction: always verify
TAU_MAX = 24.0  # the longest draft: never verify
MAX_UTC_OFFSET = timedelta(hours=14)  # the widest offset in use (UTC+14, Kiribati); beyond is a typo

SOURCE_TENANT_WORKLOAD = "override:tenant+workload"
SOURCE_TENANT = "override:tenant"
SOURCE_AUTO = "auto"
SOURCE_DEFAULT = "default"
MODE_AUTO = "auto"  # EffectiveTau.mode when no override applies


class OverrideError(StorageError, ValueError):
    """An override the storage layer refuses, with a message naming the offending field."""


@dataclass(frozen=True)
class OverrideSpec:
    """What an operator asks for; validated by :func:`validate_spec` before it is stored."""

    tenant: str
    workload: str | None
    mode: str
    tau: float | None = None
    tau_min: float | None = None
    tau_max: float | None = None
    expires_at: datetime | None = None
    author: str = ""
    reason: str = ""


def _name(field: str, value: object) -> str:
    """The canonical tenant/author (storage.tenants), or OverrideError naming the field."""
    try:
        return normalise_tenant(value, field) if field == "tenant" else normalise_author(value, field)
    except FieldError as exc:
        raise OverrideError(str(exc)) from None


def _reason(field: str, value: object) -> str:
    try:
        return check_free_text(value, field)
    except FieldError as exc:
        raise OverrideError(str(exc)) from None


def _check_tau(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise OverrideError(f"{field} must be a number, got {type(value).__name__}")
    try:
        v = float(value)
    except (OverflowError, ValueError):
        raise OverrideError(f"{field} = {value!r:.40} is outside [{TAU_MIN:g}, {TAU_MAX:g}]") from None
    if not math.isfinite(v):
        raise OverrideError(f"{field} is {v!r}; tau must be a finite number")
    if not TAU_MIN <= v <= TAU_MAX:
        raise OverrideError(f"{field} = {v:g} is outside [{TAU_MIN:g}, {TAU_MAX:g}]")


def _check_aware(field: str, value: datetime) -> None:
    if not isinstance(value, datetime):
        raise OverrideError(f"{field} must be a datetime, got {type(value).__name__}")
    offset = value.utcoffset()
    if offset is None:
        raise OverrideError(f"{field} {value.isoformat()} is naive; a timezone-aware datetime is required")
    if abs(offset) > MAX_UTC_OFFSET:
        raise OverrideError(f"{field} {value.isoformat()} has a UTC offset beyond +-14:00")


def _utc_naive(value: datetime) -> datetime | None:
    """``value`` as naive UTC; None if that falls outside datetime's range (year 1 or 9999 plus an offset)."""
    try:
        return value.replace(tzinfo=None) - value.utcoffset()
    except OverflowError:
        return None


def check_expiry(expires_at: datetime, now: datetime, field: str = "expires_at") -> None:
    """An expiry must be aware, in the future and at most MAX_OVERRIDE_LIFETIME (~10 years) ahead:
    a far-future date is a typo, and would overflow date arithmetic on the way to the database."""
    _check_aware(field, expires_at)
    _check_aware("now", now)
    at, start = _utc_naive(expires_at), _utc_naive(now)
    if at is None or start is None:
        raise OverrideError(f"{field} {expires_at.isoformat()} is out of range (now is {now.isoformat()})")
    if at <= start:
        raise OverrideError(f"{field} {expires_at.isoformat()} is not in the future (now is {now.isoformat()})")
    if at - start > MAX_OVERRIDE_LIFETIME:
        raise OverrideError(f"{field} {expires_at.isoformat()} is more than {MAX_OVERRIDE_LIFETIME.days} days "
                            f"ahead of now ({now.isoformat()}); an override lasts at most ~10 years")


def _check_mode_fields(mode: str, tau: object, tau_min: object, tau_max: object) -> None:
    """The tau fields a known mode needs and allows (OverrideError naming the first wrong one)."""
    if mode == "fixed":
        if tau is None:
            raise OverrideError("tau is required for mode 'fixed'")
        _check_tau("tau", tau)
        if tau_min is not None or tau_max is not None:
            raise OverrideError("tau_min/tau_max are only for mode 'bounds', not 'fixed'")
    elif mode == "bounds":
        if tau_min is None or tau_max is None:
            raise OverrideError("mode 'bounds' needs both tau_min and tau_max")
        _check_tau("tau_min", tau_min)
        _check_tau("tau_max", tau_max)
        if tau_min > tau_max:
            raise OverrideError(f"tau_min = {float(tau_min):g} is greater than tau_max = {float(tau_max):g}")
        if tau is not None:
            raise OverrideError("tau is not allowed for mode 'bounds' (use tau_min/tau_max)")
    else:
        for field, value in (("tau", tau), ("tau_min", tau_min), ("tau_max", tau_max)):
            if value is not None:
                raise OverrideError(f"{field} is not allowed for mode {mode!r}: it turns the gate off")


def validate_spec(spec: OverrideSpec, known_workloads: Sequence[str], now: datetime) -> OverrideSpec:
    """The spec with tenant, author and reason in canonical form (storage.tenants), or
    :class:`OverrideError` naming the first bad field."""
    tenant = _name("tenant", spec.tenant)
    if spec.workload is not None and (not isinstance(spec.workload, str) or spec.workload not in known_workloads):
        raise OverrideError(
            f"workload {spec.workload!r:.60} is unknown; expected one of {', '.join(known_workloads)} "
            "(or none for every workload of the tenant)"
        )
    if not isinstance(spec.mode, str) or spec.mode not in MODES:
        raise OverrideError(f"mode {spec.mode!r:.60} is unknown; expected one of {', '.join(MODES)}")
    _check_mode_fields(spec.mode, spec.tau, spec.tau_min, spec.tau_max)
    if spec.expires_at is not None:
        check_expiry(spec.expires_at, now)
    return replace(spec, tenant=tenant, author=_name("author", spec.author), reason=_reason("reason", spec.reason))


def _active_clause(now: datetime):
    return (TauOverride.cleared_at.is_(None)) & or_(TauOverride.expires_at.is_(None), TauOverride.expires_at > now)


def _key_clause(tenant: str, workload: str | None):
    wl = TauOverride.workload.is_(None) if workload is None else TauOverride.workload == workload
    return (TauOverride.tenant == tenant) & wl


def _where(tenant: str, workload: str | None) -> str:
    return f"tenant {tenant!r}" + (f" (workload {workload!r})" if workload is not None else " (all workloads)")


def set_override(
    session: Session, spec: OverrideSpec, known_workloads: Sequence[str], now: datetime | None = None
) -> TauOverride:
    """Validate and store ``spec``, replacing (clearing) any active override for the same key."""
    now = utcnow() if now is None else now
    _check_aware("now", now)
    spec = validate_spec(spec, known_workloads, now)
    # Lock the rows we replace on PostgreSQL, so two concurrent replacements serialise.
    previous = list(
        session.scalars(
            select(TauOverride)
            .where(_key_clause(spec.tenant, spec.workload), _active_clause(now))
            .order_by(TauOverride.id)
            .with_for_update()
        )
    )
    row = TauOverride(
        tenant=spec.tenant,
        workload=spec.workload,
        mode=spec.mode,
        tau=None if spec.tau is None else float(spec.tau),
        tau_min=None if spec.tau_min is None else float(spec.tau_min),
        tau_max=None if spec.tau_max is None else float(spec.tau_max),
        expires_at=spec.expires_at,
        author=spec.author,
        reason=spec.reason,
        created_at=now,
    )
    session.add(row)
    session.flush()
    for old in previous:
        old.cleared_at = now
        old.cleared_by = spec.author
        old.clear_reason = f"replaced by #{row.id}"
    session.flush()
    return row


def clear_override(
    session: Session,
    tenant: str,
    workload: str | None,
    author: str,
    reason: str,
    now: datetime | None = None,
) -> int:
    """Clear the active override for (tenant, workload); returns how many rows were cleared (>= 1)."""
    now = utcnow() if now is None else now
    _check_aware("now", now)
    tenant, author, reason = _name("tenant", tenant), _name("author", author), _reason("reason", reason)
    rows = list(
        session.scalars(
            select(TauOverride).where(_key_clause(tenant, workload), _active_clause(now)).with_for_update()
        )
    )
    if not rows:
        raise OverrideError(f"no active override for {_where(tenant, workload)}")
    for row in rows:
        row.cleared_at = now
        row.cleared_by = author
        row.clear_reason = reason
    session.flush()
    return len(rows)


def list_overrides(
    session: Session, include_inactive: bool = False, now: datetime | None = None
) -> list[TauOverride]:
    """Overrides oldest first; only active ones (not cleared, not expired) unless ``include_inactive``."""
    now = utcnow() if now is None else now
    stmt = select(TauOverride).order_by(TauOverride.id)
    if not include_inactive:
        _check_aware("now", now)
        stmt = stmt.where(_active_clause(now))
    return list(session.scalars(stmt))


def override_state(row: TauOverride, now: datetime) -> str:
    """'active', 'expired' or 'cleared' (clearing wins over expiry)."""
    if row.cleared_at is not None:
        return "cleared"
    if row.expires_at is not None and row.expires_at <= now:
        return "expired"
    return "active"


# --- resolution: plain data, no SQL ------------------------------------------------------------


@dataclass(frozen=True)
class ActiveOverride:
    tenant: str
    workload: str | None
    mode: str
    tau: float | None
    tau_min: float | None
    tau_max: float | None
    expires_at: datetime | None
    id: int

    @classmethod
    def from_row(cls, row: TauOverride) -> ActiveOverride:
        return cls(row.tenant, row.workload, row.mode, row.tau, row.tau_min, row.tau_max, row.expires_at, row.id)


class EffectiveTau(NamedTuple):
    """The tau a request uses and why. ``source``: override:tenant+workload | override:tenant | auto |
    default. ``mode``: an override mode, or 'auto' when no override applies. ``tau`` is None for the
    off_* modes (the gate is bypassed). A NamedTuple (immutable) because it is built per decoding
    step and is ~4x cheaper to construct than a frozen dataclass."""

    source: str
    mode: str
    tau: float | None
    expires_at: datetime | None = None
    override_id: int | None = None


def row_problem(o: ActiveOverride) -> str | None:
    """Why a stored override cannot be applied (e.g. a mode written by a newer HVD during a rolling
    upgrade, or a row edited by hand), else None."""
    if o.mode not in MODES:
        return f"mode {o.mode!r:.60} is unknown here (known: {', '.join(MODES)})"

    # Only what makes a row unusable: the setter's range limits (_check_mode_fields) are not re-applied
    # to rows already stored, which the snapshot has always served.
    def finite(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if o.mode == "fixed" and not finite(o.tau):
        return f"mode 'fixed' without a finite tau ({o.tau!r:.40})"
    if o.mode == "bounds" and not (finite(o.tau_min) and finite(o.tau_max) and o.tau_min <= o.tau_max):
        return f"mode 'bounds' without finite tau_min <= tau_max ({o.tau_min!r:.40}, {o.tau_max!r:.40})"
    return None


class OverrideSnapshot:
    """Active overrides as plain data, resolved with dict lookups (per request, per decoding step).

    If several overrides share a (tenant, workload) key (only possible through a concurrent write
    race), the newest (highest id) wins. A row that cannot be applied (`row_problem`) is left out and
    listed in `unreadable` as (id, why): the others still apply, so one bad row never freezes the
    control plane.
    """

    __slots__ = ("_by_key", "_fixed", "unreadable")

    def __init__(self, overrides: Iterable[ActiveOverride] = ()) -> None:
        by_key: dict[tuple[str, str | None], ActiveOverride] = {}
        unreadable: list[tuple[int, str]] = []
        for o in overrides:
            problem = row_problem(o)
            if problem is not None:
                unreadable.append((o.id, problem))
                continue
            key = (o.tenant, o.workload)
            if key not in by_key or by_key[key].id < o.id:
                by_key[key] = o
        self._by_key = by_key
        self.unreadable: tuple[tuple[int, str], ...] = tuple(unreadable)
        # Results that do not depend on auto/default tau, built once.
        self._fixed: dict[int, EffectiveTau] = {}
        for (_, workload), o in by_key.items():
            if o.mode != "bounds":
                source = SOURCE_TENANT if workload is None else SOURCE_TENANT_WORKLOAD
                tau = o.tau if o.mode == "fixed" else None
                self._fixed[o.id] = EffectiveTau(source, o.mode, tau, o.expires_at, o.id)

    @property
    def overrides(self) -> tuple[ActiveOverride, ...]:
        return tuple(sorted(self._by_key.values(), key=lambda o: o.id))

    def __len__(self) -> int:
        return len(self._by_key)

    def resolve(
        self, tenant: str, workload: str | None, auto_tau: float | None, default_tau: float, now: datetime
    ) -> EffectiveTau:
        """tenant+workload override > tenant override > automatic tau of the workload > default.

        Overrides that have expired by ``now`` are skipped even though still in the snapshot.
        """
        by_key = self._by_key
        if by_key:
            o = by_key.get((tenant, workload)) if workload is not None else None
            if o is None or (o.expires_at is not None and o.expires_at <= now):
                o = by_key.get((tenant, None))
                if o is not None and o.expires_at is not None and o.expires_at <= now:
                    o = None
            if o is not None:
                fixed = self._fixed.get(o.id)
                if fixed is not None:
                    return fixed
                base = default_tau if auto_tau is None else auto_tau
                tau = o.tau_min if base < o.tau_min else (o.tau_max if base > o.tau_max else base)
                source = SOURCE_TENANT if o.workload is None else SOURCE_TENANT_WORKLOAD
                return EffectiveTau(source, "bounds", tau, o.expires_at, o.id)
        if auto_tau is not None:
            return EffectiveTau(SOURCE_AUTO, MODE_AUTO, auto_tau)
        return EffectiveTau(SOURCE_DEFAULT, MODE_AUTO, default_tau)


def snapshot(session: Session, now: datetime | None = None) -> OverrideSnapshot:
    """Load the overrides active at ``now`` as plain data (reload periodically; resolve checks expiry)."""
    return OverrideSnapshot(ActiveOverride.from_row(r) for r in list_overrides(session, now=now))
