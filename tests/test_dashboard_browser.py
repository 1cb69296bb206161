"""The running dashboard in a real browser: Debian Chromium driven by Playwright (no browser download).
Loads each page of `streamlit run dashboard/app.py` on a database filled by a real short serve, waits for
it to render, asserts key elements and saves screenshots to var/screenshots/<page>.png."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "var" / "screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# url path -> text that must be on the rendered page. The default page (Overview) lives at "/":
# st.navigation serves no "/overview", it shows "Page not found" and then runs the main page.
PAGES = {
    "": ["Overview", "Tokens per cycle", "Estimated speedup vs no speculation"],
    "quality": ["Predictor quality", "Precision at accepted ≥ 6", "Calibration"],
    "thresholds": ["Thresholds", "Live tau", "Set or clear an override", "Override audit"],
    "versions": ["Versions", "Champion version", "Promotion log"],
    "health": ["Health", "Decision events stored", "Dropped events", "Database size"],
}

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
        yield base
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


@pytest.mark.parametrize("path", list(PAGES), ids=[p or "overview" for p in PAGES])
def test_page_renders_in_chromium(app_url, browser, path):
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    try:
        page.goto(f"{app_url}/{path}", wait_until="domcontentloaded")
        page.wait_for_selector('[data-testid="stMetric"]', timeout=60_000)
        # Elements stream in while the script runs; wait for each one rather than for a quiet page.
        for needle in PAGES[path]:
            page.get_by_text(needle).first.wait_for(timeout=60_000)
        page.wait_for_function(
            "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
        text = page.inner_text("body")
        assert "Page not found" not in text, text[:2000]
        assert page.query_selector('[data-testid="stException"]') is None, text[:2000]
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{path or 'overview'}.png"), full_page=True)
    finally:
        page.close()
