"""The running dashboard in a real browser: Debian Chromium driven by Playwright (no browser download).
Loads each page of `streamlit run dashboard/app.py` on a database filled by a real short serve, waits for
it to render, asserts key elements and saves screenshots to var/screenshots/<page>-<width>x<height>.png;
checks the per-workload figures against the raw decision events, the admin session across pages, the
shared selection in the URL, and an override made through the form with its confirmation."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from predictor.drafting.token_classes import token_classes

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "var" / "screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# url path -> text that must be on the rendered page. The default page (Overview) lives at "/":
# st.navigation serves no "/overview", it shows "Page not found" and then runs the main page.
PAGES = {
    "": ["Overview", "Tokens per cycle", "Speedup vs no speculation", "Suffix cache alone",
         "Data as of"],
    "quality": ["Predictor quality", "Precision at accepted ≥ 6", "Per workload, at accepted length ≥ 6",
                "Calibration"],
    "thresholds": ["Thresholds", "Live tau", "Set or clear an override", "Override audit"],
    "versions": ["Versions", "Champion version", "Promotion log", "Learner checks", "Room to learn"],
    "health": ["Health", "Decision events stored", "Ages", "Database size"],
}
VIEWPORTS = [(1440, 900), (390, 844)]
TOKEN = "browser-token"

if not CHROMIUM.exists():
    if os.environ.get("HVD_REQUIRE_BROWSER"):
        pytest.fail(f"{CHROMIUM} is missing and HVD_REQUIRE_BROWSER is set: `apt-get install -y chromium`",
                    pytrace=False)
    pytest.skip(f"{CHROMIUM} is absent (install Debian's chromium: `apt-get install -y chromium`; "
                "set HVD_REQUIRE_BROWSER=1 to make this a failure)", allow_module_level=True)
pytest.importorskip("streamlit")
sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    from test_dashboard import fill_database

    db = fill_database(tmp_path_factory.mktemp("browser"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    env["HVD_DATABASE_URL"] = db
    env["HVD_ADMIN_TOKEN"] = TOKEN
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard" / "app.py"),
             "--server.headless", "true", "--server.port", str(port), "--server.address", "127.0.0.1",
             "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"streamlit did not come up:\n{log.read_text()}", pytrace=False)
            time.sleep(0.3)
        yield base, db
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def open_page(page, url: str, text: str) -> None:
    """Load `url`, wait for `text` to show and the script run to finish."""
    page.goto(url, wait_until="domcontentloaded")
    page.get_by_text(text).first.wait_for(timeout=60_000)
    rendered(page)


def rendered(page, timeout: int = 60_000) -> None:
    """Wait for the script run to finish (Streamlit streams elements while it runs, and keeps the
    previous run's elements, marked stale, until the new run has replaced or dropped them)."""
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"
                           " && !document.querySelector('[data-stale=\"true\"]')", timeout=timeout)


@pytest.mark.parametrize("viewport", VIEWPORTS, ids=[f"{w}x{h}" for w, h in VIEWPORTS])
@pytest.mark.parametrize("path", list(PAGES), ids=[p or "overview" for p in PAGES])
def test_page_renders_in_chromium(app_url, browser, path, viewport):
    base, _ = app_url
    width, height = viewport
    page = browser.new_page(viewport={"width": width, "height": height})
    try:
        page.goto(f"{base}/{path}", wait_until="domcontentloaded")
        page.wait_for_selector('[data-testid="stMetric"]', timeout=60_000)
        for needle in PAGES[path]:
            page.get_by_text(needle).first.wait_for(timeout=60_000)
        rendered(page)
        text = page.inner_text("body")
        assert "Page not found" not in text, text[:2000]
        assert page.query_selector('[data-testid="stException"]') is None, text[:2000]
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{path or 'overview'}-{width}x{height}.png"), full_page=True)
    finally:
        page.close()


def raw_quality(db: str) -> dict[str, tuple[str, str, int]]:
    """Precision, recall (as shown, 3 decimals) and scored drafts per workload, from the raw decision
    events with sqlite3: the dashboard's own queries are not used."""
    import sqlite3

    counts: dict[str, list[int]] = {}
    with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
        for workload, predicted, accepted in conn.execute(
                "SELECT workload, predicted, accepted FROM decision_events WHERE drafter = 'cache' "
                "AND predicted IS NOT NULL"):
            c = counts.setdefault(workload, [0, 0, 0, 0])
            c[(0 if accepted >= 6 else 1) if predicted >= 6 else (2 if accepted >= 6 else 3)] += 1
    fmt = (lambda n, d: "n/a" if not d else f"{n / d:.3f}")
    return {w: (fmt(tp, tp + fp), fmt(tp, tp + fn), tp + fp + fn + tn) for w, (tp, fp, fn, tn) in counts.items()}


def shown_table(page) -> dict[str, dict[str, str]]:
    """The first st.table on the page: row label -> column -> text."""
    table = page.locator('[data-testid="stTable"] table').first
    table.wait_for(timeout=60_000)
    headers = [h.strip() for h in table.locator("thead th").all_inner_texts()]
    out = {}
    for row in table.locator("tbody tr").all():
        cells = [c.strip() for c in row.locator("th, td").all_inner_texts()]
        out[cells[0]] = dict(zip(headers[1:], cells[1:]))
    return out


def test_per_workload_precision_recall_equals_the_raw_events(app_url, browser):
    base, db = app_url
    expected = raw_quality(db)
    assert len(expected) >= 2, expected  # the serve covered several workloads
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        open_page(page, f"{base}/quality", "Per workload, at accepted length ≥ 6")
        table = shown_table(page)
        assert {w: (r["Precision"], r["Recall"], int(r["Scored drafts"].replace(",", ""))) for w, r in table.items()} \
            == expected
        # A link with the selection reproduces the view: one workload, its own figures.
        workload = max(expected, key=lambda w: expected[w][2])
        open_page(page, f"{base}/quality?workload={workload}", "Per workload, at accepted length ≥ 6")
        assert list(shown_table(page)) == [workload]
        assert f"workload {workload}" in page.inner_text("body")
    finally:
        page.close()


def login(page) -> None:
    page.get_by_label("Admin token", exact=True).fill(TOKEN)
    page.get_by_label("Admin token", exact=True).press("Enter")
    rendered(page)
    page.get_by_label("Admin name", exact=True).fill("carol")
    page.get_by_label("Admin name", exact=True).press("Enter")
    rendered(page)


def main(page):
    """The page's own content (the sidebar has a Tenant and a Workload selectbox too)."""
    return page.get_by_test_id("stMainBlockContainer")


def field(page, label: str):
    """The page's live input labelled `label`: a rerun can briefly leave the previous run's input,
    disabled (read-only before the admin logged in), beside the new one."""
    return main(page).get_by_label(label, exact=True).and_(page.locator(":enabled"))


def choose(page, label: str, option: str) -> None:
    """Pick `option` in the page's selectbox labelled `label`."""
    box = field(page, label)
    box.click()
    page.get_by_role("option", name=option, exact=True).click()
    rendered(page)


def test_admin_session_survives_a_page_change(app_url, browser):
    base, _ = app_url
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        open_page(page, f"{base}/thresholds", "Set or clear an override")
        login(page)
        sync_api.expect(page.get_by_role("button", name="Review change")).to_be_enabled(timeout=60_000)
        page.get_by_role("link", name="Versions").click()  # in-app navigation: the same session
        page.get_by_text("Promotion log").wait_for(timeout=60_000)
        rendered(page)
        assert page.get_by_label("Admin token", exact=True).input_value() == TOKEN
        assert page.get_by_label("Admin name", exact=True).input_value() == "carol"
        sync_api.expect(page.get_by_role("button", name="Promote to champion")).to_be_enabled(timeout=60_000)
        assert "Read-only" not in page.inner_text("body")
    finally:
        page.close()


def test_override_set_through_the_form_with_confirmation(app_url, browser):
    from controller.core.decision import DecisionConfig
    from controller.core.runtime import Runtime
    from controller.services.control_poller import ControlPoller
    from support.gates import random_survival_gate
    from predictor.data.tokens import TraceTokenizer
    from storage.engine import make_engine, session_scope
    from storage.models import TauOverride

    base, db = app_url
    page = browser.new_page(viewport={"width": 1440, "height": 1600})
    try:
        open_page(page, f"{base}/thresholds", "Set or clear an override")
        login(page)
        sync_api.expect(page.get_by_role("button", name="Review change")).to_be_enabled(timeout=60_000)
        choose(page, "Tenant", "➕ a new tenant…")
        field(page, "New tenant name").fill("browser-tenant")
        field(page, "New tenant name").press("Enter")
        rendered(page)
        choose(page, "Workload", "sql")
        field(page, "tau").fill("4.5")
        field(page, "tau").press("Enter")
        rendered(page)
        field(page, "Reason").fill("browser test")
        field(page, "Reason").press("Enter")
        rendered(page)
        page.get_by_role("button", name="Review change").click()
        page.get_by_text("Confirm: effective tau of tenant 'browser-tenant'").wait_for(timeout=60_000)
        rendered(page)
        confirmation = shown_table(page)
        assert confirmation["sql"]["Effective tau after"] == "4.50 (override:tenant+workload)"
        assert confirmation["sql"]["Changes"] == "yes" and confirmation["chat"]["Changes"] == ""
        engine = make_engine(db)
        with session_scope(engine) as s:  # nothing written before the confirmation
            assert not s.query(TauOverride).filter_by(tenant="browser-tenant").count()
        page.get_by_role("button", name="Confirm change").click()
        page.get_by_text("set for tenant 'browser-tenant' by carol").wait_for(timeout=60_000)
        rendered(page)
        with session_scope(engine) as s:
            row = s.query(TauOverride).filter_by(tenant="browser-tenant").one()
            assert (row.workload, row.mode, row.tau, row.author, row.reason) == ("sql", "fixed", 4.5, "carol",
                                                                                  "browser test")
        runtime = Runtime(random_survival_gate(), token_classes(TraceTokenizer()), DecisionConfig())
        assert ControlPoller(engine, runtime).poll_once()  # what a serving replica resolves
        eff = runtime.controls.overrides.resolve("browser-tenant", "sql", 1.0, 1.0, row.created_at)
        assert (eff.source, eff.mode, eff.tau) == ("override:tenant+workload", "fixed", 4.5)
        engine.dispose()
    finally:
        page.close()


def test_pages_refresh_themselves(app_url, browser):
    """The 'Data as of' time moves on without a click (HVD_DASHBOARD_REFRESH_S, 30 s by default)."""
    import re

    base, _ = app_url
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        open_page(page, f"{base}/health", "Data as of")
        first = re.search(r"Data as of ([0-9: -]+) UTC", page.inner_text("body")).group(1)
        page.wait_for_function(
            "(first) => { const m = document.body.innerText.match(/Data as of ([0-9: -]+) UTC/);"
            " return m && m[1] !== first; }", arg=first, timeout=90_000)
    finally:
        page.close()


def test_thresholds_page_renders_with_10000_tenants(tmp_path, browser):
    """10,000 tenants (2 days of statistics at bench/tenants_at_scale.py's density): the Thresholds page,
    which lists tenants, renders with the busiest 100 and a search that finds a quiet one. No timing
    here: bench/tenants_at_scale.py measures it."""
    from tenants_at_scale import fill_sqlite, render_page, streamlit_app

    url, rows, _ = fill_sqlite(tmp_path / "tenants.db", 10_000, 2, 60.0)
    assert rows > 150_000
    with streamlit_app(url) as base:
        assert render_page(browser, base, "thresholds", timeout_ms=180_000) > 0
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        try:
            open_page(page, f"{base}/thresholds?tenant=tenant-09999", "Override audit")
            # a quiet tenant (not among the busiest 100) named in a link is known, and shown
            assert "The link names tenant" not in page.inner_text("body")
            assert "Showing tenant tenant-09999" in page.inner_text("body")
            search = page.get_by_label("Find a tenant", exact=True)
            search.fill("tenant-0999")
            search.press("Enter")
            rendered(page, 180_000)
            assert "Showing tenant tenant-09999" in page.inner_text("body")
        finally:
            page.close()
