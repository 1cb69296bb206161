"""Overview: throughput per decode cycle and where the cycles go, per time bucket."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.common import admin_sidebar, engine_or_stop, fmt, read_session, stop_if_empty
from storage import dashboard_queries as q

ALL = "(all)"
st.title("Overview")
admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    c1, c2 = st.columns(2)
    tenant = c1.selectbox("Tenant", [ALL] + q.tenants(s), key="tenant")
    workload = c2.selectbox("Workload", [ALL] + q.workloads(s), key="workload")
    tenant = None if tenant == ALL else tenant
    workload = None if workload == ALL else workload
    totals = q.overview_totals(s, tenant, workload)
    rows = q.overview_by_bucket(s, tenant, workload)

m = st.columns(4)
m[0].metric("Tokens per cycle", fmt(totals["tokens_per_cycle"]))
m[1].metric("Cycles per 1000 tokens", fmt(totals["cycles_per_1k"], 1))
m[2].metric("Estimated speedup vs no speculation", fmt(totals["speedup"], 2) + ("x" if totals["speedup"] else ""))
m[3].metric("Tokens generated", fmt(totals["tokens"]))
if not rows:
    st.info("No statistics for this selection yet: serve some traffic (`hvd serve --engine replay`).")
    st.stop()

df = pd.DataFrame(rows)
df["bucket_start"] = pd.to_datetime(df["bucket_start"], utc=True)
st.subheader("Tokens per decode cycle")
st.altair_chart(alt.Chart(df).mark_line(point=True).encode(
    x=alt.X("bucket_start:T", title="Time bucket start (UTC, 1-minute buckets)"),
    y=alt.Y("tokens_per_cycle:Q", title="Tokens per decode cycle (tokens/cycle)"),
    tooltip=["bucket_start:T", "tokens_per_cycle:Q", "tokens:Q", "cycles:Q"]), width="stretch")
st.caption("Good: well above 1 token/cycle and steady; 1.0 means speculation buys nothing (this is also the "
           "estimated speedup vs no speculation).")

paths = df.melt(id_vars=["bucket_start"], value_vars=["cycles_per_1k_cache", "cycles_per_1k_model", "cycles_per_1k_none"],
                var_name="path", value_name="cycles_per_1k_tokens")
paths["path"] = paths["path"].map({"cycles_per_1k_cache": "cache draft verified", "cycles_per_1k_model": "model drafter",
                                   "cycles_per_1k_none": "no draft"})
st.subheader("Decode cycles per 1000 tokens by decision path")
st.altair_chart(alt.Chart(paths).mark_bar().encode(
    x=alt.X("bucket_start:T", title="Time bucket start (UTC)"),
    y=alt.Y("cycles_per_1k_tokens:Q", stack=True, title="Decode cycles per 1000 tokens (cycles)"),
    color=alt.Color("path:N", title="Decision path"),
    tooltip=["bucket_start:T", "path:N", "cycles_per_1k_tokens:Q"]), width="stretch")
st.caption("Good: a low total stack (1000 would be plain decoding) with the cache path taking the cycles where "
           "its drafts are long.")
st.dataframe(df[["bucket_start", "tokens", "cycles", "cache_verified", "model_drafts", "no_draft", "tokens_per_cycle",
                 "speedup"]], hide_index=True, width="stretch")
