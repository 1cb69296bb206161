"""Shared plumbing of the dashboard pages: the engine, the admin gate, empty-database handling."""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from dashboard.token_gate import Outcome, TokenGate, Verdict
from storage import dashboard_queries as q
from storage.engine import make_engine, masked_url, session_scope
from storage.errors import StorageError
from storage.settings import database_url

ADMIN_TOKEN_ENV = "HVD_ADMIN_TOKEN"
EMPTY_HELP = ("The database holds no predictor, statistics or decisions yet. Fill it with "
              "`make warmstart` (trains the first champion), then `hvd serve --engine replay` "
              "(serves the bundled traces and records what the gate decided).")


@st.cache_resource
def _engine(url: str) -> Engine:
    return make_engine(url)


def engine_or_stop() -> Engine:
    """The engine for the configured database, or a helpful message and st.stop()."""
    url = database_url()
    try:
        engine = _engine(url)
    except StorageError as exc:
        st.error(f"Cannot open the database: {exc}")
        st.stop()
    missing = q.missing_tables(engine)
    if missing:
        st.warning(f"The database {masked_url(url)} has no HVD tables yet ({', '.join(missing)}). "
                   "The dashboard does not create them: run `hvd migrate` (or `make warmstart`, which "
                   "migrates first), then `hvd serve --engine replay`.")
        st.stop()
    return engine


@contextmanager
def read_session(engine: Engine) -> Iterator[Session]:
    with session_scope(engine) as session:
        yield session
        session.rollback()  # read-only: never commit anything a page might have touched


def stop_if_empty(session: Session) -> None:
    if q.is_empty(session):
        st.info(EMPTY_HELP)
        st.stop()


def configured_token() -> str | None:
    token = os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        return token
    try:
        token = st.secrets["admin_token"]
    except Exception:  # no secrets file, or no such key
        return None
    return str(token) if token else None


@dataclass(frozen=True)
class Admin:
    can_edit: bool
    name: str
    why_not: str

    @property
    def refusal(self) -> str:
        """Why an edit is refused, or "" when it may go ahead."""
        if not self.can_edit:
            return self.why_not
        return "" if self.name else "Enter your admin name in the sidebar: every change records who made it."


@st.cache_resource
def token_gate() -> TokenGate:
    """One per process, shared by every browser session (the process-wide limit on wrong tries)."""
    return TokenGate()


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def check_token(typed: str, configured: str) -> Outcome:
    """The gate's verdict on what this session typed. Streamlit reruns the page on every click with
    the token still in its box: the same token is one try, not one per rerun, and a session that
    typed the right one stays admitted through a lockout others caused."""
    state = st.session_state
    session = state.setdefault("_hvd_gate_session", secrets.token_hex(16))
    digest = _digest(typed)
    if state.get("_hvd_token_ok") == digest and hmac.compare_digest(digest, _digest(configured)):
        return Outcome(Verdict.OK)
    if state.get("_hvd_token_wrong") == digest:
        return Outcome(Verdict.WRONG)
    outcome = token_gate().attempt(session, typed, configured)
    if outcome.verdict is not Verdict.LOCKED:
        state["_hvd_token_ok" if outcome.verdict is Verdict.OK else "_hvd_token_wrong"] = digest
    return outcome


def admin_sidebar() -> Admin:
    """Sidebar inputs for the admin token and name; edits are allowed only with the right token."""
    configured = configured_token()
    with st.sidebar:
        st.caption(f"Database: `{masked_url(database_url())}`")
        typed = st.text_input("Admin token", type="password", key="admin_token",
                              help="Needed to change overrides or versions; read-only without it.")
        name = st.text_input("Admin name", key="admin_name", help="Recorded as the author of every change.")
    if configured is None:
        why = (f"Read-only: no admin token is configured (set {ADMIN_TOKEN_ENV} or "
               "`admin_token` in Streamlit secrets to allow edits).")
        return Admin(False, name.strip(), why)
    if not typed:
        return Admin(False, name.strip(), "Read-only: enter the admin token in the sidebar to make changes.")
    outcome = check_token(typed, configured)
    if outcome.verdict is Verdict.LOCKED:
        return Admin(False, name.strip(), "Read-only: too many wrong admin tokens; tokens are checked again in "
                                          f"{max(1, round(outcome.retry_after_s / 60))} min.")
    if outcome.verdict is Verdict.WRONG:
        return Admin(False, name.strip(), "Read-only: the admin token is wrong.")
    return Admin(True, name.strip(), "")


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
