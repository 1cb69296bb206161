"""Health: ingest volume, dropped events, drift, last learner update, database size."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.common import admin_sidebar, engine_or_stop, fmt, fmt_bytes, read_session, stop_if_empty
from storage import dashboard_queries as q

st.title("Health")
admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    h = q.health(s)
    drifts = q.drift_events(s)

m = st.columns(5)
m[0].metric("Decision events stored", fmt(h["decision_events"]))
m[1].metric("Dropped events", fmt(h["dropped_events"]))
m[2].metric("Drift events", fmt(h["drift_events"]))
m[3].metric("Database size", fmt_bytes(h["database_bytes"]))
m[4].metric("Last learner update", h["last_learner_update"].strftime("%Y-%m-%d %H:%M:%S UTC")
            if h["last_learner_update"] else "never")
st.caption("Good: dropped events stays 0 (the event queue never filled), the last learner update is recent "
           "while serving, and drift events are rare.")
st.write(f"Last decision event: {h['last_event_at'] or 'none'}; last statistics bucket: {h['last_bucket_at'] or 'none'}.")
st.subheader("Champion")
c = h["champion"]
if c["version"] is None:
    st.info("No champion predictor: run `make warmstart`.")
else:
    if c["problem"]:
        st.error(f"Champion v{c['version']} is unloadable: {c['problem']}. Replicas keep serving their last good "
                 "version; roll back (Versions page or `hvd rollback`).")
    if c["stale"]:
        others = ", ".join(f"v{v} ({fmt(n)} events)" for v, n in sorted(c["stale"].items()))
        st.error(f"Since {c['since']:%Y-%m-%d %H:%M:%S} UTC decisions came from {others}, not champion "
                 f"v{c['version']}: a replica could not load the champion (its log says why) and serves its last "
                 "good version; overrides and corrections still apply there.")
    for r in h["replicas"]:
        if r["champion_not_loaded"]:
            st.error(f"Replica {r['replica']} could not load the champion ({r['champion_not_loaded']}); it serves its "
                     "last good version and still applies overrides.")
    if not (c["stale"] or c["problem"] or any(r["champion_not_loaded"] for r in h["replicas"])):
        st.success(f"Champion v{c['version']}: every decision since {c['since']:%Y-%m-%d %H:%M:%S} UTC came from it.")
st.subheader("Serving replicas")
if h["replicas"]:
    worst = max(h["replicas"], key=lambda r: r["queue_depth"])
    r = st.columns(2)
    r[0].metric("Event queue depth (deepest replica)", fmt(worst["queue_depth"]))
    r[1].metric("Writer flush latency (ms, slowest replica)", f"{max(x['flush_ms'] for x in h['replicas']):.1f}")
    st.dataframe(pd.DataFrame(h["replicas"]), hide_index=True, width="stretch")
    st.caption("Good: queue depth near 0 and flush latency in milliseconds; a growing queue means the writer "
               "cannot keep up and events will be dropped (counted above).")
else:
    st.info("No replica has reported yet: heartbeats arrive with the first written events.")
st.subheader("Drift events (newest first)")
if drifts:
    st.dataframe(pd.DataFrame(drifts), hide_index=True, width="stretch")
else:
    st.info("No drift detected.")
