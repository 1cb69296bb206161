"""HVD dashboard: `streamlit run dashboard/app.py` (database from HVD_DATABASE_URL, else sqlite:///var/hvd.db).

The sidebar (selection, admin session, auto-refresh) is rendered here, once for every page: widgets of
the entrypoint keep their state across page changes, and the selection is kept in the URL."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run` puts dashboard/ first, not the checkout
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from dashboard.common import engine_or_stop, read_session, sidebar  # noqa: E402
from storage import dashboard_queries as q  # noqa: E402

HERE = Path(__file__).resolve().parent
st.set_page_config(page_title="HVD", layout="wide")
PAGES = [
    st.Page(str(HERE / "views" / "overview.py"), title="Overview", url_path="overview", default=True),
    st.Page(str(HERE / "views" / "quality.py"), title="Predictor quality", url_path="quality"),
    st.Page(str(HERE / "views" / "thresholds.py"), title="Thresholds", url_path="thresholds"),
    st.Page(str(HERE / "views" / "versions.py"), title="Versions", url_path="versions"),
    st.Page(str(HERE / "views" / "health.py"), title="Health", url_path="health"),
]
page = st.navigation(PAGES)
engine = engine_or_stop()
with read_session(engine) as session:
    sidebar(None if q.is_empty(session) else session)
page.run()
