"""Operator overrides of tau: validation, audit trail, expiry, resolution precedence, and the CLI.

Storage tests run against SQLite and a real PostgreSQL (each PostgreSQL test in a throwaway
schema), as in tests/test_storage.py; HVD_SKIP_POSTGRES=1 skips PostgreSQL.
"""

from __future__ import annotations

import argparse
import ast
import math
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from controller.cli import overrides as cli_overrides
from storage.engine import make_engine, session_scope
from storage.migrate import upgrade
from storage.models import TauOverride
from storage.overrides import (
    MODES,
    TAU_MAX,
    TAU_MIN,
    ActiveOverride,
    EffectiveTau,
    OverrideError,
    OverrideSnapshot,
    OverrideSpec,
    clear_override,
    list_overrides,
    override_state,
    set_override,
    snapshot,
    validate_spec,
)
from storage.workloads import WORKLOADS

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)


def _spec(**kw) -> OverrideSpec:
    base = dict(tenant="acme", workload=None, mode="fixed", tau=3.0, author="alice", reason="incident 42")
    base.update(kw)
    return OverrideSpec(**base)


def _count(engine: Engine) -> int:
    with session_scope(engine) as s:
        return s.scalar(select(func.count()).select_from(TauOverride))


# --- validation ----------------------------------------------------------------------------------

BAD_SPECS = [
    (dict(tau=99.0), "tau = 99 is outside [-1, 24]"),
    (dict(tau=24.5), "tau = 24.5 is outside"),
    (dict(tau=-1.5), "tau = -1.5 is outside"),
    (dict(tau=math.nan), "tau is nan"),
    (dict(tau=math.inf), "tau is inf"),
    (dict(tau=-math.inf), "tau is -inf"),
    (dict(tau="3"), "tau must be a number"),
    (dict(tau=True), "tau must be a number"),
    (dict(tau=None), "tau is required for mode 'fixed'"),
    (dict(tau=3.0, tau_min=1.0), "only for mode 'bounds'"),
    (dict(mode="bounds", tau=None, tau_min=5.0, tau_max=2.0), "tau_min = 5 is greater than tau_max = 2"),
    (dict(mode="bounds", tau=None, tau_min=-2.0, tau_max=2.0), "tau_min = -2 is outside"),
    (dict(mode="bounds", tau=None, tau_min=1.0, tau_max=30.0), "tau_max = 30 is outside"),
    (dict(mode="bounds", tau=None, tau_min=math.nan, tau_max=3.0), "tau_min is nan"),
    (dict(mode="bounds", tau=None, tau_min=1.0), "needs both tau_min and tau_max"),
    (dict(mode="bounds", tau=None, tau_max=1.0), "needs both tau_min and tau_max"),
    (dict(mode="bounds", tau=2.0, tau_min=1.0, tau_max=3.0), "tau is not allowed for mode 'bounds'"),
    (dict(mode="off_model", tau=2.0), "tau is not allowed for mode 'off_model'"),
    (dict(mode="off_cache", tau=None, tau_min=1.0), "tau_min is not allowed for mode 'off_cache'"),
    (dict(mode="off_cache", tau=None, tau_max=1.0), "tau_max is not allowed for mode 'off_cache'"),
    (dict(mode="sometimes"), "mode 'sometimes' is unknown"),
    (dict(expires_at=NOW - timedelta(days=1)), "expires_at 2026-11-28T12:00:00+00:00 is not in the future"),
    (dict(expires_at=NOW), "is not in the future"),
    (dict(expires_at=datetime(2030, 1, 1)), "expires_at 2030-01-01T00:00:00 is naive"),
    (dict(workload="poetry"), "workload 'poetry' is unknown"),
    (dict(workload=""), "workload '' is unknown"),
    (dict(tenant=""), "tenant must not be empty"),
    (dict(tenant="   "), "tenant must not be empty"),
    (dict(author=""), "author must not be empty"),
    (dict(reason=""), "reason must not be empty"),
    (dict(tenant="t" * 129), "tenant is 129 characters long; at most 128"),
    (dict(author="a" * 129), "author is 129 characters long; at most 128"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_SPECS, ids=[m for _, m in BAD_SPECS])
def test_validate_spec_rejects(changes: dict, message: str) -> None:
    with pytest.raises(OverrideError) as info:
        validate_spec(_spec(**changes), WORKLOADS, NOW)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(tau=TAU_MIN),
        dict(tau=TAU_MAX),
        dict(tau=0),
        dict(workload="sql", expires_at=NOW + timedelta(seconds=1)),
        dict(mode="bounds", tau=None, tau_min=2.0, tau_max=2.0),
        dict(mode="bounds", tau=None, tau_min=TAU_MIN, tau_max=TAU_MAX),
        dict(mode="off_model", tau=None),
        dict(mode="off_cache", tau=None, workload="chat"),
        dict(tenant="t" * 128, author="a" * 128, reason="r" * 4000),
        dict(expires_at=datetime(2030, 1, 1, tzinfo=timezone(timedelta(hours=-5)))),
    ],
)
def test_validate_spec_accepts(changes: dict) -> None:
    validate_spec(_spec(**changes), WORKLOADS, NOW)


def test_known_workloads_are_a_parameter() -> None:
    validate_spec(_spec(workload="poetry"), ("poetry",), NOW)
    with pytest.raises(OverrideError, match="workload 'sql' is unknown"):
        validate_spec(_spec(workload="sql"), ("poetry",), NOW)


def test_storage_does_not_import_controller_or_predictor() -> None:
    tree = ast.parse((Path(__file__).resolve().parents[1] / "storage" / "overrides.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in modules if m.split(".")[0] in ("controller", "predictor")}


# --- set / replace / clear / list ----------------------------------------------------------------


def test_invalid_spec_stores_nothing(db: Engine) -> None:
    with pytest.raises(OverrideError, match="tau = 99"):
        with session_scope(db) as s:
            set_override(s, _spec(tau=99.0), WORKLOADS, now=NOW)
    assert _count(db) == 0


def test_set_replace_clear_audit_trail(db: Engine) -> None:
    with session_scope(db) as s:
        first = set_override(s, _spec(tau=3.0), WORKLOADS, now=NOW)
        other_wl = set_override(s, _spec(workload="sql", tau=5.0), WORKLOADS, now=NOW)
        other_tenant = set_override(s, _spec(tenant="globex", tau=7.0), WORKLOADS, now=NOW)
    later = NOW + timedelta(minutes=5)
    with session_scope(db) as s:
        second = set_override(s, _spec(mode="bounds", tau=None, tau_min=1.0, tau_max=4.0, author="bob"),
                              WORKLOADS, now=later)
    with session_scope(db) as s:
        rows = {r.id: r for r in list_overrides(s, include_inactive=True, now=later)}
    assert len(rows) == 4  # nothing deleted
    old = rows[first.id]
    assert old.cleared_at == later
    assert old.cleared_by == "bob"
    assert old.clear_reason == f"replaced by #{second.id}"
    assert (old.mode, old.tau, old.author, old.reason) == ("fixed", 3.0, "alice", "incident 42")
    new = rows[second.id]
    assert (new.mode, new.tau, new.tau_min, new.tau_max, new.cleared_at) == ("bounds", None, 1.0, 4.0, None)
    assert new.created_at == later
    # other keys untouched: the tenant-wide override does not replace the tenant+sql one, nor another tenant's
    assert rows[other_wl.id].cleared_at is None
    assert rows[other_tenant.id].cleared_at is None

    with session_scope(db) as s:
        active = list_overrides(s, now=later)
    assert [r.id for r in active] == sorted([other_wl.id, other_tenant.id, second.id])

    cleared_at = later + timedelta(hours=1)
    with session_scope(db) as s:
        assert clear_override(s, "acme", None, "carol", "incident over", now=cleared_at) == 1
    with session_scope(db) as s:
        rows = {r.id: r for r in list_overrides(s, include_inactive=True, now=cleared_at)}
        active = list_overrides(s, now=cleared_at)
    assert len(rows) == 4
    assert (rows[second.id].cleared_at, rows[second.id].cleared_by, rows[second.id].clear_reason) == (
        cleared_at, "carol", "incident over")
    assert rows[first.id].clear_reason == f"replaced by #{second.id}"  # earlier stamp kept
    assert [r.id for r in active] == sorted([other_wl.id, other_tenant.id])
    assert override_state(rows[second.id], cleared_at) == "cleared"
    assert override_state(rows[other_wl.id], cleared_at) == "active"

    with pytest.raises(OverrideError, match="no active override for tenant 'acme' \\(all workloads\\)"):
        with session_scope(db) as s:
            clear_override(s, "acme", None, "carol", "again", now=cleared_at)
    with pytest.raises(OverrideError, match="no active override for tenant 'acme' \\(workload 'chat'\\)"):
        with session_scope(db) as s:
            clear_override(s, "acme", "chat", "carol", "again", now=cleared_at)
    with session_scope(db) as s:
        assert clear_override(s, "acme", "sql", "carol", "done", now=cleared_at) == 1


@pytest.mark.parametrize(("field", "value", "message"), [
    ("author", "", "author must not be empty"),
    ("reason", "  ", "reason must not be empty"),
    ("tenant", "", "tenant must not be empty"),
])
def test_clear_validates_its_arguments(db: Engine, field: str, value: str, message: str) -> None:
    with session_scope(db) as s:
        set_override(s, _spec(), WORKLOADS, now=NOW)
    kwargs = dict(tenant="acme", workload=None, author="bob", reason="why")
    kwargs[field] = value
    with pytest.raises(OverrideError, match=message):
        with session_scope(db) as s:
            clear_override(s, now=NOW, **kwargs)


def test_expiry(db: Engine) -> None:
    with session_scope(db) as s:
        row = set_override(s, _spec(workload="coding", expires_at=NOW + timedelta(seconds=1)), WORKLOADS, now=NOW)
    assert row.expires_at == NOW + timedelta(seconds=1)
    with session_scope(db) as s:
        assert [r.id for r in list_overrides(s, now=NOW)] == [row.id]
        assert list_overrides(s, now=NOW + timedelta(seconds=2)) == []
        (stored,) = list_overrides(s, include_inactive=True, now=NOW + timedelta(seconds=2))
        assert override_state(stored, NOW + timedelta(seconds=2)) == "expired"
        assert override_state(stored, NOW) == "active"
        snap_now = snapshot(s, NOW)
        snap_later = snapshot(s, NOW + timedelta(seconds=2))
    assert len(snap_now) == 1 and len(snap_later) == 0
    # still in the snapshot taken at NOW, but resolve() honours its own `now`
    hit = snap_now.resolve("acme", "coding", 6.0, 8.0, NOW)
    assert (hit.source, hit.mode, hit.tau, hit.override_id) == ("override:tenant+workload", "fixed", 3.0, row.id)
    assert snap_now.resolve("acme", "coding", 6.0, 8.0, NOW + timedelta(seconds=2)) == EffectiveTau("auto", "auto", 6.0)

    # an expired override cannot be cleared (nothing active) and is not stamped when replaced
    with pytest.raises(OverrideError, match="no active override"):
        with session_scope(db) as s:
            clear_override(s, "acme", "coding", "bob", "late", now=NOW + timedelta(seconds=2))
    with session_scope(db) as s:
        new = set_override(s, _spec(workload="coding", tau=4.0), WORKLOADS, now=NOW + timedelta(seconds=2))
    with session_scope(db) as s:
        old = s.get(TauOverride, row.id)
        assert old.cleared_at is None and old.clear_reason is None
        assert [r.id for r in list_overrides(s, now=NOW + timedelta(seconds=2))] == [new.id]


def test_snapshot_from_database(db: Engine) -> None:
    with session_scope(db) as s:
        a = set_override(s, _spec(tau=2.0), WORKLOADS, now=NOW)
        b = set_override(s, _spec(workload="sql", mode="off_cache", tau=None), WORKLOADS, now=NOW)
        c = set_override(s, _spec(tenant="globex", mode="bounds", tau=None, tau_min=3.0, tau_max=5.0,
                                  expires_at=NOW + timedelta(hours=1)), WORKLOADS, now=NOW)
        set_override(s, _spec(tenant="initech", tau=9.0), WORKLOADS, now=NOW)
        clear_override(s, "initech", None, "bob", "not needed", now=NOW)
    with session_scope(db) as s:
        snap = snapshot(s, NOW)
    assert [o.id for o in snap.overrides] == [a.id, b.id, c.id]
    assert all(isinstance(o, ActiveOverride) for o in snap.overrides)
    assert snap.resolve("acme", "sql", 6.0, 8.0, NOW) == EffectiveTau(
        "override:tenant+workload", "off_cache", None, None, b.id)
    assert snap.resolve("acme", "chat", 6.0, 8.0, NOW) == EffectiveTau("override:tenant", "fixed", 2.0, None, a.id)
    assert snap.resolve("globex", "chat", 1.0, 8.0, NOW) == EffectiveTau(
        "override:tenant", "bounds", 3.0, NOW + timedelta(hours=1), c.id)
    assert snap.resolve("initech", "chat", None, 8.0, NOW) == EffectiveTau("default", "auto", 8.0)


# --- resolution ----------------------------------------------------------------------------------


def _ov(id: int, tenant: str, workload: str | None, mode: str, tau=None, tau_min=None, tau_max=None,
        expires_at=None) -> ActiveOverride:
    return ActiveOverride(tenant, workload, mode, tau, tau_min, tau_max, expires_at, id)


PRECEDENCE_SNAPSHOT = OverrideSnapshot([
    _ov(1, "acme", None, "fixed", tau=2.0),
    _ov(2, "acme", "sql", "fixed", tau=10.0),
    _ov(3, "acme", "chat", "bounds", tau_min=4.0, tau_max=6.0),
    _ov(4, "globex", None, "bounds", tau_min=4.0, tau_max=6.0),
    _ov(5, "globex", "agentic", "off_model"),
    _ov(6, "globex", "coding", "off_cache"),
    _ov(7, "initech", "sql", "fixed", tau=1.0, expires_at=NOW + timedelta(seconds=1)),
    _ov(8, "initech", None, "fixed", tau=0.5, expires_at=NOW + timedelta(seconds=1)),
])


@pytest.mark.parametrize(("tenant", "workload", "auto_tau", "at", "expected"), [
    # tenant+workload beats tenant
    ("acme", "sql", 7.0, NOW, ("override:tenant+workload", "fixed", 10.0, 2)),
    # tenant beats auto
    ("acme", "coding", 7.0, NOW, ("override:tenant", "fixed", 2.0, 1)),
    ("acme", None, 7.0, NOW, ("override:tenant", "fixed", 2.0, 1)),
    # bounds clip the automatic tau, or the default when there is none
    ("acme", "chat", 7.0, NOW, ("override:tenant+workload", "bounds", 6.0, 3)),
    ("acme", "chat", 1.0, NOW, ("override:tenant+workload", "bounds", 4.0, 3)),
    ("acme", "chat", 5.5, NOW, ("override:tenant+workload", "bounds", 5.5, 3)),
    ("acme", "chat", None, NOW, ("override:tenant+workload", "bounds", 6.0, 3)),  # default 8 clipped
    ("globex", "sql", 3.0, NOW, ("override:tenant", "bounds", 4.0, 4)),
    # off modes: no tau
    ("globex", "agentic", 3.0, NOW, ("override:tenant+workload", "off_model", None, 5)),
    ("globex", "coding", 3.0, NOW, ("override:tenant+workload", "off_cache", None, 6)),
    # auto beats default; default when no auto tau
    ("hooli", "sql", 7.0, NOW, ("auto", "auto", 7.0, None)),
    ("hooli", "sql", None, NOW, ("default", "auto", 8.0, None)),
    ("hooli", None, None, NOW, ("default", "auto", 8.0, None)),
    # expiry at resolve time: tenant+workload expired falls back to tenant, then to auto
    ("initech", "sql", 7.0, NOW, ("override:tenant+workload", "fixed", 1.0, 7)),
    ("initech", "chat", 7.0, NOW, ("override:tenant", "fixed", 0.5, 8)),
    ("initech", "sql", 7.0, NOW + timedelta(seconds=1), ("auto", "auto", 7.0, None)),
    ("initech", "sql", 7.0, NOW + timedelta(seconds=2), ("auto", "auto", 7.0, None)),
])
def test_precedence(tenant, workload, auto_tau, at, expected) -> None:
    got = PRECEDENCE_SNAPSHOT.resolve(tenant, workload, auto_tau, 8.0, at)
    assert (got.source, got.mode, got.tau, got.override_id) == expected


def test_precedence_expired_workload_override_falls_back_to_live_tenant_override() -> None:
    snap = OverrideSnapshot([
        _ov(1, "acme", "sql", "fixed", tau=1.0, expires_at=NOW + timedelta(seconds=1)),
        _ov(2, "acme", None, "off_model"),
    ])
    assert snap.resolve("acme", "sql", 7.0, 8.0, NOW).override_id == 1
    assert snap.resolve("acme", "sql", 7.0, 8.0, NOW + timedelta(seconds=2)) == EffectiveTau(
        "override:tenant", "off_model", None, None, 2)


def test_empty_snapshot_and_newest_duplicate_wins() -> None:
    assert OverrideSnapshot().resolve("a", "sql", 3.0, 8.0, NOW) == EffectiveTau("auto", "auto", 3.0)
    snap = OverrideSnapshot([_ov(9, "a", None, "fixed", tau=9.0), _ov(3, "a", None, "fixed", tau=3.0)])
    assert len(snap) == 1
    assert snap.resolve("a", "sql", 3.0, 8.0, NOW).tau == 9.0


def _reference(overrides: list[ActiveOverride], tenant, workload, auto_tau, default_tau, now) -> EffectiveTau:
    """Slow, obvious: scan every override, most specific live one wins."""
    def live(o: ActiveOverride) -> bool:
        return o.expires_at is None or o.expires_at > now

    chosen = None
    for o in overrides:
        if o.tenant == tenant and workload is not None and o.workload == workload and live(o):
            chosen = o
    if chosen is None:
        for o in overrides:
            if o.tenant == tenant and o.workload is None and live(o):
                chosen = o
    base = auto_tau if auto_tau is not None else default_tau
    if chosen is None:
        return EffectiveTau("auto" if auto_tau is not None else "default", "auto", base)
    source = "override:tenant" if chosen.workload is None else "override:tenant+workload"
    if chosen.mode == "fixed":
        tau = chosen.tau
    elif chosen.mode == "bounds":
        tau = min(max(base, chosen.tau_min), chosen.tau_max)
    else:
        tau = None
    return EffectiveTau(source, chosen.mode, tau, chosen.expires_at, chosen.id)


TENANTS = ["acme", "globex", "initech"]
WORKLOAD_OR_ALL = st.sampled_from([None, *WORKLOADS])
TAUS = st.floats(min_value=TAU_MIN, max_value=TAU_MAX, allow_nan=False)
OFFSETS = st.none() | st.integers(min_value=-5, max_value=5).map(lambda s: NOW + timedelta(seconds=s))


@st.composite
def _override_for(draw, key):
    mode = draw(st.sampled_from(MODES))
    tau = tau_min = tau_max = None
    if mode == "fixed":
        tau = draw(TAUS)
    elif mode == "bounds":
        tau_min, tau_max = sorted((draw(TAUS), draw(TAUS)))
    return key, mode, tau, tau_min, tau_max, draw(OFFSETS)


@st.composite
def _overrides(draw):
    keys = draw(st.lists(st.tuples(st.sampled_from(TENANTS), WORKLOAD_OR_ALL), unique=True, max_size=10))
    out = []
    for i, key in enumerate(keys, start=1):
        (tenant, workload), mode, tau, tau_min, tau_max, exp = draw(_override_for(key))
        out.append(ActiveOverride(tenant, workload, mode, tau, tau_min, tau_max, exp, i))
    return out


QUERY = st.tuples(
    st.sampled_from([*TENANTS, "hooli"]),
    WORKLOAD_OR_ALL,
    st.none() | TAUS,
    TAUS,
    st.integers(min_value=-6, max_value=6).map(lambda s: NOW + timedelta(seconds=s)),
)


@settings(max_examples=300, deadline=None)
@given(overrides=_overrides(), queries=st.lists(QUERY, min_size=1, max_size=20))
def test_resolve_matches_reference(overrides: list[ActiveOverride], queries) -> None:
    snap = OverrideSnapshot(overrides)
    for tenant, workload, auto_tau, default_tau, now in queries:
        assert snap.resolve(tenant, workload, auto_tau, default_tau, now) == _reference(
            overrides, tenant, workload, auto_tau, default_tau, now)


# --- CLI -----------------------------------------------------------------------------------------


@pytest.fixture
def cli_db(tmp_path: Path) -> Iterator[Engine]:
    eng = make_engine(f"sqlite:///{tmp_path / 'cli.db'}")
    try:
        upgrade(eng)
        yield eng
    finally:
        eng.dispose()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvd")
    sub = p.add_subparsers(dest="command", required=True)
    cli_overrides.add_parser(sub)
    return p


def hvd(engine: Engine, *argv: str, now: datetime | None = NOW) -> int:
    args = _parser().parse_args(list(argv))
    assert args.command == "override"
    return cli_overrides.run(args, engine, now=now)


def test_cli_set_list_clear(cli_db: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    assert hvd(cli_db, "override", "set", "--tenant", "acme", "--workload", "sql", "--tau", "4.5",
               "--expires", "2h", "--author", "alice", "--reason", "slow verifier") == 0
    out = capsys.readouterr().out
    assert "override #1 set for tenant acme workload sql: fixed 4.5, expires 2026-11-29 14:00:00Z" in out
    assert hvd(cli_db, "override", "set", "--tenant", "acme", "--bounds", "2", "6",
               "--author", "bob", "--reason", "cap it") == 0
    assert hvd(cli_db, "override", "set", "--tenant", "globex", "--off", "cache",
               "--expires", "2026-12-01T08:00:00+01:00", "--author", "bob", "--reason", "cache only") == 0
    assert "expires 2026-12-01 07:00:00Z" in capsys.readouterr().out
    assert hvd(cli_db, "override", "set", "--tenant", "acme", "--bounds", "1", "5",
               "--author", "carol", "--reason", "narrower") == 0
    assert "(replaces #2)" in capsys.readouterr().out

    assert hvd(cli_db, "override", "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["id", "tenant", "workload", "mode", "tau", "expires", "author", "reason", "state"]
    assert len(lines) == 4
    row1 = lines[1].split()
    assert row1[:5] == ["1", "acme", "sql", "fixed", "4.5"] and "slow verifier" in lines[1]
    assert lines[1].rstrip().endswith("active")
    assert lines[2].split()[:6] == ["3", "globex", "*", "off_cache", "-", "2026-12-01"]
    assert lines[3].split()[:6] == ["4", "acme", "*", "bounds", "[1,", "5]"] and "never" in lines[3]

    assert hvd(cli_db, "override", "clear", "--tenant", "acme", "--workload", "sql",
               "--author", "dave", "--reason", "fixed") == 0
    assert "cleared 1 override for tenant acme workload sql" in capsys.readouterr().out
    assert hvd(cli_db, "override", "list") == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["3", "4"]

    # --all: the audit trail, with the expired state evaluated at `now`
    assert hvd(cli_db, "override", "list", "--all", now=NOW + timedelta(days=30)) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"1", "2", "3", "4"}
    assert "cleared 2026-11-29 12:00:00Z by dave: fixed" in rows["1"]
    assert "by carol: replaced by #4" in rows["2"]
    assert rows["3"].rstrip().endswith("expired")
    assert rows["4"].rstrip().endswith("active")


def test_cli_list_empty(cli_db: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    assert hvd(cli_db, "override", "list") == 0
    assert "no active overrides" in capsys.readouterr().out
    assert hvd(cli_db, "override", "list", "--all") == 0
    assert capsys.readouterr().out.strip() == "no overrides"


@pytest.mark.parametrize(("argv", "message"), [
    (["--tau", "99"], "tau = 99 is outside [-1, 24]"),
    (["--tau", "nan"], "tau is nan"),
    (["--bounds", "6", "2"], "tau_min = 6 is greater than tau_max = 2"),
    (["--tau", "3", "--expires", "2020-01-01T00:00:00Z"], "--expires 2020-01-01T00:00:00+00:00 is not in the future"),
    (["--tau", "3", "--expires", "2030-01-01T00:00:00"], "has no timezone"),
    (["--tau", "3", "--expires", "soon"], "neither a duration"),
    (["--tau", "3", "--expires", "0m"], "is not in the future"),
    (["--tau", "3", "--workload", "poetry"], "workload 'poetry' is unknown"),
    (["--tau", "3", "--reason", ""], "reason must not be empty"),
])
def test_cli_set_rejects(cli_db: Engine, argv: list[str], message: str) -> None:
    base = ["override", "set", "--tenant", "acme", "--author", "alice", "--reason", "r"]
    with pytest.raises(OverrideError) as info:
        hvd(cli_db, *base, *argv)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)  # controller/cli/main.py main prints it and exits 2
    assert _count(cli_db) == 0


def test_cli_clear_rejects(cli_db: Engine) -> None:
    with pytest.raises(OverrideError, match="no active override for tenant 'acme' \\(all workloads\\)"):
        hvd(cli_db, "override", "clear", "--tenant", "acme", "--author", "a", "--reason", "r")
    with pytest.raises(OverrideError, match="workload 'poetry' is unknown"):
        hvd(cli_db, "override", "clear", "--tenant", "acme", "--workload", "poetry", "--author", "a", "--reason", "r")


@pytest.mark.parametrize("argv", [
    ["override", "set", "--tenant", "a", "--author", "a", "--reason", "r"],  # no tau/bounds/off
    ["override", "set", "--tenant", "a", "--tau", "1", "--off", "model", "--author", "a", "--reason", "r"],
    ["override", "set", "--tenant", "a", "--off", "sometimes", "--author", "a", "--reason", "r"],
    ["override", "set", "--tenant", "a", "--bounds", "1", "--author", "a", "--reason", "r"],
    ["override", "set", "--tenant", "a", "--tau", "1", "--reason", "r"],  # no author
    ["override"],
])
def test_cli_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2


def test_parse_expires() -> None:
    assert cli_overrides.parse_expires("30m", NOW) == NOW + timedelta(minutes=30)
    assert cli_overrides.parse_expires("2h", NOW) == NOW + timedelta(hours=2)
    assert cli_overrides.parse_expires("7d", NOW) == NOW + timedelta(days=7)
    assert cli_overrides.parse_expires("2026-12-01T00:00:00Z", NOW) == datetime(2026, 12, 1, tzinfo=timezone.utc)
    assert cli_overrides.parse_expires("2026-12-01T02:00:00+02:00", NOW) == datetime(2026, 12, 1, tzinfo=timezone.utc)


def test_spec_defaults_and_replace() -> None:
    spec = _spec()
    assert replace(spec, tau=4.0).tau == 4.0 and spec.expires_at is None
