"""Shared plumbing of the dashboard pages: the engine, the admin gate, empty-database handling."""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from dashboard.token_gate import Outcome, TokenGate, Verdict
from storage import dashboard_queries as q
from storage.engine import make_engine, masked_url, session_scope
from storage.env import EnvError, read_env, text, whole_seconds
from storage.errors import StorageError
from storage.settings import database_url

ADMIN_TOKEN_ENV = "HVD_ADMIN_TOKEN"
PRICED_BATCH = 8  # the Overview's default batch size for the cost profile
REFRESH_ENV = "HVD_DASHBOARD_REFRESH_S"
DEFAULT_REFRESH_S = 30
# Set by the entrypoint (dashboard/app.py), which renders the sidebar once for every page so the
# selection and the admin session survive page changes. A page run on its own renders it itself.
ENTRY_KEY = "_hvd_entry"
ALL_TENANTS, ALL_WORKLOADS = "(all tenants)", "(all workloads)"
# controller.settings' defaults of HVD_COST_PROFILE and HVD_DRAFTER_PROFILE (the dashboard may not import
# the controller; tests/test_dashboard.py keeps them equal).
SERVING_COST_PROFILE, SERVING_DRAFTER = "cpu-smollm2", "eagle3-smollm2"
# The default range is the last day of traffic (the day before the newest statistics bucket, not
# before now: an idle database still shows its last day): every page then reads about a day of
# buckets whatever the history kept (30 days: storage.stats.KEEP_STAT_DAYS); "all time" reads them all.
LAST_TRAFFIC_DAY = "last day of traffic"
TIME_RANGES: dict[str, timedelta | None] = {
    LAST_TRAFFIC_DAY: timedelta(days=1), "all time": None, "last 15 min": timedelta(minutes=15), "last hour": timedelta(hours=1),
    "last 6 hours": timedelta(hours=6), "last 24 hours": timedelta(hours=24), "last 7 days": timedelta(days=7)}
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
    token = read_env(ADMIN_TOKEN_ENV, text)
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
    """One per process, shared by every browser session (the limits per session and per client address)."""
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
    address = st.context.ip_address  # None on localhost (and not a string under AppTest): one shared "unknown"
    outcome = token_gate().attempt(session, typed, configured, client=address if isinstance(address, str) else "")
    if outcome.verdict is not Verdict.LOCKED:
        state["_hvd_token_ok" if outcome.verdict is Verdict.OK else "_hvd_token_wrong"] = digest
    return outcome


def _admin_inputs() -> tuple[str, str]:
    with st.sidebar:
        typed = st.text_input("Admin token", type="password", key="admin_token",
                              help="Needed to change overrides or versions; read-only without it. Kept for this "
                                   "browser session across pages, never put in the URL.")
        name = st.text_input("Admin name", key="admin_name", help="Recorded as the author of every change.")
    return typed, name


def admin_sidebar() -> Admin:
    """The admin session: the token and name typed in the sidebar (rendered once by the entrypoint,
    so they survive page changes); edits are allowed only with the right token."""
    if st.session_state.get(ENTRY_KEY):
        typed, name = st.session_state.get("admin_token", ""), st.session_state.get("admin_name", "")
    else:
        typed, name = _admin_inputs()
    configured = configured_token()
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


def refresh_seconds() -> int:
    """Auto-refresh interval (HVD_DASHBOARD_REFRESH_S, default 30; 0 turns it off). A bad value is
    named on the page and the default used."""
    try:
        return read_env(REFRESH_ENV, whole_seconds, DEFAULT_REFRESH_S)
    except EnvError as exc:  # names the variable and what it accepts
        st.sidebar.warning(f"{exc}; refreshing every {DEFAULT_REFRESH_S} s.")
        return DEFAULT_REFRESH_S


def _bound_choice(label: str, key: str, options: list[str], what: str, help: str) -> str:
    """A sidebar selectbox kept in the URL (?key=value), so a link reproduces the view. A value in the
    link that is not an option is named, not silently dropped."""
    linked = st.query_params.get(key)
    if linked is not None and linked not in options:
        st.sidebar.warning(f"The link names {what} {linked!r}, which this database does not know; showing "
                           f"{options[0]}.")
    return st.sidebar.selectbox(label, options, key=key, bind="query-params", help=help)


def tenant_options(session: Session, search: str, linked: str | None) -> list[str]:
    """What the tenant selection offers: the busiest tenants (at most q.TENANT_LIST_LIMIT), or those
    whose name starts with `search`; a tenant named in the link is added when it is known, so a link
    to a quiet tenant still shows it. Never every tenant: there can be tens of thousands."""
    names = q.tenants(session, search=search.strip())
    if linked and linked not in names and linked != ALL_TENANTS and q.tenant_known(session, linked):
        names.append(linked)
    return [ALL_TENANTS, *names]


def selection_sidebar(session: Session) -> q.Scope:
    """Tenant, workload and time range for every page, from the sidebar (kept in the URL)."""
    search = st.sidebar.text_input("Find a tenant", key="tenant_search", placeholder="name starts with…",
                                   help=f"The list below shows the {q.TENANT_LIST_LIMIT} busiest tenants of the "
                                        "last day of traffic; type the start of a name to list the others.")
    tenant = _bound_choice("Tenant", "tenant", tenant_options(session, search, st.query_params.get("tenant")),
                           "tenant", "Every page shows this tenant's traffic (or all).")
    workload = _bound_choice("Workload", "workload", [ALL_WORKLOADS, *q.workloads(session)], "workload",
                             "Every page shows this workload's traffic (or all).")
    span = _bound_choice("Time range", "range", list(TIME_RANGES), "time range",
                         "Statistics and events newer than this (UTC, from now; the last day of traffic: the "
                         "day before the newest statistics).")
    if span == LAST_TRAFFIC_DAY:
        newest = q.newest_bucket(session)
        since = None if newest is None else newest - TIME_RANGES[span]
    else:
        since = None if TIME_RANGES[span] is None else q.utcnow() - TIME_RANGES[span]
    return q.Scope(None if tenant == ALL_TENANTS else tenant, None if workload == ALL_WORKLOADS else workload, since)


def sidebar(session: Session | None) -> None:
    """The entrypoint's sidebar, shared by every page: database, selection, admin session, refresh."""
    st.session_state[ENTRY_KEY] = True
    st.sidebar.caption(f"Database: `{masked_url(database_url())}`")
    if session is not None:
        st.session_state["_hvd_scope"] = selection_sidebar(session)
    _admin_inputs()
    seconds = refresh_seconds()
    on = seconds > 0 and st.sidebar.toggle(f"Auto-refresh every {seconds} s", value=True, key="refresh",
                                           bind="query-params")
    st.session_state["_hvd_refresh"] = seconds if on else 0
    _auto_refresh(seconds if on else None)


def _auto_refresh(seconds: int | None) -> None:
    """Rerun the whole app every `seconds` (a fragment's timer; the full run itself does not rerun)."""
    import time

    st.session_state["_hvd_rendered"] = time.monotonic()

    @st.fragment(run_every=seconds)
    def tick() -> None:
        if seconds and time.monotonic() - st.session_state.get("_hvd_rendered", 0.0) >= seconds - 0.5:
            st.rerun(scope="app")

    tick()


def page_scope(session: Session) -> q.Scope:
    """The selection this page shows (from the shared sidebar, or its own when run on its own)."""
    if st.session_state.get(ENTRY_KEY) and "_hvd_scope" in st.session_state:
        return st.session_state["_hvd_scope"]
    return selection_sidebar(session)


# The characters that act inside a line of Streamlit's markdown: emphasis, code, links and images,
# HTML and entities, strikethrough, math and Streamlit's own directives (:red[...], :emoji:). A name is
# always shown mid-sentence, so the line-start ones (#, -, +, 1.) cannot act.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]()!<>~$:&])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a line break would end the markdown block the name is in


def plain(text: object) -> str:
    """A name that clients or operators chose (a tenant, a replica, a service), escaped for the
    markdown that Streamlit renders in captions, warnings and infos: it shows as written, never as a
    link, an image, a colour or markup."""
    return _CONTROL.sub(" ", _MARKDOWN_SPECIAL.sub(r"\\\1", str(text)))


def describe(scope: q.Scope) -> str:
    parts = [f"tenant {plain(scope.tenant)}" if scope.tenant else "all tenants",
             f"workload {scope.workload}" if scope.workload else "all workloads",
             f"since {fmt_ts(scope.since)}" if scope.since else "all time"]
    return ", ".join(parts)


def data_as_of(scope: q.Scope | None = None) -> None:
    """When the figures were read, and what they cover: the page's first caption."""
    seconds = st.session_state.get("_hvd_refresh", 0)
    refresh = f"refreshes every {seconds} s" if seconds else "auto-refresh off"
    covers = f" Showing {describe(scope)}." if scope is not None else ""
    st.caption(f"Data as of {fmt_ts(q.utcnow())} ({refresh}).{covers}")


def fmt_ts(at: datetime | None) -> str:
    return "never" if at is None else f"{at:%Y-%m-%d %H:%M:%S} UTC"


def fmt_age(age: timedelta | None) -> str:
    """A duration as an operator reads it: 42 s, 3 min 5 s, 2 h 10 min, 4 d 3 h."""
    if age is None:
        return "n/a"
    s = max(int(age.total_seconds()), 0)
    if s < 60:
        return f"{s} s"
    unit, major, sub, minor = ((60, "min", 1, "s") if s < 3600 else (3600, "h", 60, "min") if s < 86400
                               else (86400, "d", 3600, "h"))
    rest = s % unit // sub
    return f"{s // unit} {major}" + (f" {rest} {minor}" if rest else "")


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
