"""Override inputs under hypothesis (derandomized, quick): tenant names, expiry strings and tau values,
from the library and through `hvd override set`. No input raises anything but a refusal (a
ValueError: OverrideError / FieldError / argparse's exit 2), and every refusal names its field."""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import unicodedata
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controller.cli import overrides as cli_overrides
from storage.engine import make_engine
from storage.errors import FieldError
from storage.limits import MAX_OVERRIDE_LIFETIME, MAX_TENANT_LEN
from storage.migrate import upgrade
from storage.overrides import TAU_MAX, TAU_MIN, OverrideError, OverrideSpec, validate_spec
from storage.tenants import normalise_tenant
from storage.workloads import WORKLOADS

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)


def fast(max_examples: int) -> settings:
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# Text with the characters that matter here well represented: controls, zero-width, separators,
# combining marks, surrogates, wide and plain letters.
SPECIAL = st.sampled_from(["\x00", "\n", "\t", "\x1b", "\x7f", "\u200b", "\u200d", "\u202e", "\ufeff", "\u00a0",
                           "\u2028", "\u3000", "\u0301", "\ud800", "\udfff", "\ue000", " ", "a", "é", "租"])
NAMES = st.one_of(st.text(max_size=40), st.lists(SPECIAL, max_size=12).map("".join),
                  st.text(min_size=MAX_TENANT_LEN - 2, max_size=MAX_TENANT_LEN + 2, alphabet="ab "))


@fast(400)
@given(NAMES)
def test_normalise_tenant_canonical_or_refused_naming_the_field(raw: str) -> None:
    try:
        name = normalise_tenant(raw)
    except FieldError as exc:
        assert exc.field == "tenant" and str(exc).startswith("tenant ")
        return
    assert name == name.strip() and name and len(name) <= MAX_TENANT_LEN
    assert unicodedata.normalize("NFC", name) == name
    assert all(ch == " " or (ch.isprintable() and not ch.isspace()) for ch in name)
    assert normalise_tenant(name) == name  # idempotent: one spelling
    assert normalise_tenant(f"  {raw}\t") == name


DURATIONS = st.builds(lambda n, u, pad: f"{pad}{n}{u}{pad}", st.integers(0, 10**13),
                      st.sampled_from("smhdwxS"), st.sampled_from(["", " ", "\t"]))
OFFSETS = st.sampled_from(["Z", "+00:00", "-05:00", "+14:00", "-14:00", "+14:01", "+23:59", "-23:59", "", "+5", "+99:00"])
ISO = st.builds(lambda d, off: d.isoformat() + off, st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)),
                OFFSETS)
EXPIRES = st.one_of(DURATIONS, ISO, st.text(max_size=30), st.lists(SPECIAL, max_size=6).map("".join),
                    st.just("1" * 5000 + "s"))


@fast(500)
@given(EXPIRES)
def test_parse_expires_bounded_or_refused_naming_the_field(text: str) -> None:
    try:
        when = cli_overrides.parse_expires(text, NOW)
    except OverrideError as exc:
        assert str(exc).startswith("--expires ") and "\n" not in str(exc)
        return
    assert when.tzinfo is not None and when.utcoffset() == timedelta(0)
    assert NOW < when <= NOW + MAX_OVERRIDE_LIFETIME


TAUS = st.one_of(st.none(), st.booleans(), st.floats(), st.integers(-10**400, 10**400), st.integers(-3, 30),
                 st.fractions(), st.decimals(), st.text(max_size=5), st.just(Fraction(10**400, 3)))


@fast(400)
@given(mode=st.one_of(st.sampled_from(["fixed", "bounds", "off_model", "off_cache"]), st.text(max_size=5)),
       tau=TAUS, tau_min=TAUS, tau_max=TAUS)
def test_validate_spec_taus_refused_naming_the_field(mode: str, tau: object, tau_min: object, tau_max: object) -> None:
    spec = OverrideSpec("acme", None, mode, tau, tau_min, tau_max, author="alice", reason="r")
    try:
        validate_spec(spec, WORKLOADS, NOW)
    except OverrideError as exc:
        assert any(field in str(exc) for field in ("tau", "mode"))
        return
    for value in (tau, tau_min, tau_max):
        assert value is None or (math.isfinite(float(value)) and TAU_MIN <= float(value) <= TAU_MAX)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvd", exit_on_error=False)
    sub = p.add_subparsers(dest="command", required=True)
    cli_overrides.add_parser(sub)
    return p


FIELDS = ("--tenant", "tenant", "--expires", "expires_at", "tau", "--tau", "author", "reason", "workload")


def test_cli_override_set_any_input(tmp_path) -> None:
    """`hvd override set` with hostile tenants, expiries and taus: stored, or refused with a message
    naming the field (argparse's own refusals exit 2). One SQLite database for all examples."""
    engine = make_engine(f"sqlite:///{tmp_path / 'hvd.db'}")
    upgrade(engine)
    outcomes = {"stored": 0, "refused": 0}

    @fast(150)
    @given(tenant=NAMES, expires=EXPIRES,
           tau=st.one_of(st.floats(TAU_MIN, TAU_MAX).map(repr), st.floats().map(repr), st.text(max_size=6)),
           author=NAMES)
    @example(tenant=" acme ", expires="2h", tau="3.0", author="bob")
    def run(tenant: str, expires: str, tau: str, author: str) -> None:
        argv = ["override", "set", "--tenant", tenant, "--tau", tau, "--expires", expires, "--author", author,
                "--reason", "fuzz"]
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = _parser().parse_args(argv)
        except (argparse.ArgumentError, SystemExit):
            return  # argparse's usage error (exit 2), e.g. --tau "abc" or a value starting with "-"
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                assert cli_overrides.run(args, engine, now=NOW) == 0
        except ValueError as exc:  # OverrideError, FieldError: main() prints them and exits 2
            assert any(field in str(exc) for field in FIELDS), str(exc)
            assert "\n" not in str(exc)
            outcomes["refused"] += 1
            return
        assert out.getvalue().isprintable() or out.getvalue().endswith("\n")
        assert "\x1b" not in out.getvalue()
        outcomes["stored"] += 1

    try:
        run()
    finally:
        engine.dispose()
    assert outcomes["stored"] > 0 and outcomes["refused"] > 0
