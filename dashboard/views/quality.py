"""Predictor quality: precision/recall at accepted length >= 6, PR curve across tau, calibration."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.common import admin_sidebar, engine_or_stop, fmt, read_session, stop_if_empty
from storage import dashboard_queries as q
from storage.stats import LONG

st.title("Predictor quality")
admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    totals = q.quality_totals(s)
    by_bucket = q.quality_by_bucket(s)
    by_version = q.quality_by_version(s)
    hist = q.accepted_histograms(s)
    calib = q.calibration(s)
    curve = q.pr_curve(s)
    live = q.latest_tau(s)

m = st.columns(3)
m[0].metric(f"Precision at accepted ≥ {LONG}", fmt(totals["precision"]))
m[1].metric(f"Recall at accepted ≥ {LONG}", fmt(totals["recall"]))
m[2].metric("Long cache drafts (TP + FN)", fmt(totals["tp"] + totals["fn"]))

if by_bucket:
    df = pd.DataFrame(by_bucket)
    df["bucket_start"] = pd.to_datetime(df["bucket_start"], utc=True)
    long = df.melt(id_vars=["bucket_start"], value_vars=["precision", "recall"], var_name="metric").dropna()
    st.subheader("Precision and recall over time")
    st.altair_chart(alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("bucket_start:T", title="Time bucket start (UTC)"),
        y=alt.Y("value:Q", title=f"Fraction of cache drafts (0-1, long = accepted >= {LONG})",
                scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("metric:N", title="Metric")), width="stretch")
    st.caption("Good: both high and flat; a drop in either after a promotion or a traffic change means drift.")

st.subheader("Per predictor version")
st.dataframe(pd.DataFrame(by_version), hide_index=True, width="stretch")

if curve:
    cdf = pd.DataFrame(curve).dropna(subset=["precision", "recall"])
    st.subheader("Precision/recall across tau")
    base = alt.Chart(cdf).mark_line(point=True).encode(
        x=alt.X("recall:Q", title=f"Recall (0-1, accepted >= {LONG})", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("precision:Q", title="Precision (0-1)", scale=alt.Scale(domain=[0, 1])),
        order="tau:Q", tooltip=["tau:Q", "precision:Q", "recall:Q"])
    layers = [base]
    if live and not cdf.empty:
        marks = []
        for wl, tau in sorted(live.items()):
            near = cdf.iloc[(cdf["tau"] - tau).abs().argsort()[:1]]
            marks.append({"workload": wl, "live_tau": tau, "precision": float(near["precision"].iloc[0]),
                          "recall": float(near["recall"].iloc[0])})
        layers.append(alt.Chart(pd.DataFrame(marks)).mark_point(size=120, shape="diamond", filled=True).encode(
            x="recall:Q", y="precision:Q", color=alt.Color("workload:N", title="Live tau of workload"),
            tooltip=["workload:N", "live_tau:Q", "precision:Q", "recall:Q"]))
    st.altair_chart(alt.layer(*layers), width="stretch")
    st.caption("Good: the curve hugs the top right, and each workload's live tau (diamonds) sits at the knee; "
               "computed from the newest cache-drafter decision events.")
    if live:
        st.write("Live tau per workload: " + ", ".join(f"{w} {t:.2f}" for w, t in sorted(live.items())))

if calib:
    kdf = pd.DataFrame(calib)
    st.subheader("Calibration")
    top = float(max(kdf["mean_predicted"].max(), kdf["mean_accepted"].max(), 1.0))
    diag = alt.Chart(pd.DataFrame({"x": [0.0, top], "y": [0.0, top]})).mark_line(strokeDash=[4, 4], color="gray").encode(
        x="x:Q", y="y:Q")
    pts = alt.Chart(kdf).mark_circle().encode(
        x=alt.X("mean_predicted:Q", title="Mean predicted accepted length (tokens)"),
        y=alt.Y("mean_accepted:Q", title="Mean observed accepted length (tokens)"),
        size=alt.Size("events:Q", title="Events"), tooltip=["bin:Q", "mean_predicted:Q", "mean_accepted:Q", "events:Q"])
    st.altair_chart(diag + pts, width="stretch")
    st.caption("Good: points on the dashed diagonal (predicted = observed) in every 1-token bin of the prediction.")

if hist:
    hdf = pd.DataFrame(hist)
    st.subheader("Accepted length of cache drafts by workload")
    st.altair_chart(alt.Chart(hdf).mark_bar().encode(
        x=alt.X("accepted:O", title="Accepted length (tokens; 24 = 24 or more)"),
        y=alt.Y("drafts:Q", title="Labelled cache drafts (count)"),
        color=alt.Color("workload:N", title="Workload"),
        row=alt.Row("workload:N", title=None)).properties(height=120), width="stretch")
    st.caption("Good: mass at long lengths for repetitive workloads (code edits, agents); chat is mostly 0-2.")
