"""Predictor quality: precision/recall at accepted length >= 6 per workload, each workload's PR curve,
calibration, the plan's promises kept on what it verified, accepted-length histograms."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.charts import bin_words, segments, tooltip, workload_color
from dashboard.common import (admin_sidebar, data_as_of, engine_or_stop, fmt, page_scope, read_session,
                              stop_if_empty)
from storage import dashboard_queries as q
from storage.stats import LONG

st.title("Predictor quality")
admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    scope = page_scope(s)
    totals = q.quality_totals(s, scope)
    per_workload = q.quality_by_workload(s, scope)
    promises = q.promises_by_workload(per_workload)
    resolution = q.bucket_resolution(s, scope)
    by_bucket = q.quality_by_bucket(s, scope, resolution)
    by_version = q.quality_by_version(s, scope)
    hist = q.accepted_histograms(s, scope)
    calib = q.calibration(s, scope)
    curves = q.pr_curves(s, scope)
data_as_of(scope)

m = st.columns(4)
m[0].metric(f"Precision at accepted ≥ {LONG}", fmt(totals["precision"]))
m[1].metric(f"Recall at accepted ≥ {LONG}", fmt(totals["recall"]))
m[2].metric("Long cache drafts (TP + FN)", fmt(totals["tp"] + totals["fn"]))
m[3].metric("Scored cache drafts", fmt(totals["labelled"]))
st.caption(f"A cache draft is long when it accepts ≥ {LONG} tokens (hindsight label); the predictor calls it long "
           f"when its predicted accepted length is ≥ {LONG}. Precision: of the drafts called long, the share that "
           "were; recall: of the long drafts, the share called long.")

CONFUSION = {"workload": "Workload", "precision": "Precision", "recall": "Recall", "tp": "True positives",
             "fp": "False positives", "fn": "False negatives", "tn": "True negatives", "labelled": "Scored drafts"}
st.subheader(f"Per workload, at accepted length ≥ {LONG}")
if per_workload:
    table = pd.DataFrame(per_workload)[list(CONFUSION)]
    table[["precision", "recall"]] = table[["precision", "recall"]].map(lambda v: fmt(None if pd.isna(v) else v))
    for count in ("tp", "fp", "fn", "tn", "labelled"):
        table[count] = table[count].map(fmt)
    st.table(table.rename(columns=CONFUSION).set_index("Workload"))
    st.caption("Exact counts from the statistics of the selection. Good: precision and recall both high for the "
               "workloads with long drafts (code edits, agents); n/a where no draft was called long or none was.")
else:
    st.info("No scored cache drafts in this selection.")

if by_bucket:
    df = pd.DataFrame(by_bucket)
    df["bucket_start"] = pd.to_datetime(df["bucket_start"], utc=True)
    long = df.melt(id_vars=["bucket_start"], value_vars=["precision", "recall"], var_name="metric").dropna()
    long = segments(long, "bucket_start", resolution, by="metric")
    st.subheader("Precision and recall over time")
    st.altair_chart(alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("bucket_start:T", title=f"Time bucket start (UTC, {bin_words(resolution)} buckets)"),
        y=alt.Y("value:Q", title=f"Fraction of cache drafts (0-1, long = accepted ≥ {LONG})",
                scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("metric:N", title="Metric"), detail="segment:N",
        tooltip=[tooltip("bucket_start:T", "Bucket start (UTC)"), tooltip("metric:N", "Metric"),
                 tooltip("value:Q", "Value", ".3f")]), width="stretch")
    st.caption("Good: both high and flat; a drop in either after a promotion or a traffic change means drift. "
               "Idle buckets are gaps.")

if curves:
    cdf = pd.DataFrame(curves).dropna(subset=["precision", "recall"])
    st.subheader("Precision/recall across the threshold, per workload")
    base = alt.Chart(cdf).mark_line(point=True).encode(
        x=alt.X("recall:Q", title=f"Recall (0-1, accepted ≥ {LONG})", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("precision:Q", title="Precision (0-1)", scale=alt.Scale(domain=[0, 1])),
        color=workload_color(), order="threshold:Q",
        tooltip=[tooltip("workload:N", "Workload"), tooltip("threshold:Q", "Called long if predicted ≥", ".1f"),
                 tooltip("precision:Q", "Precision", ".3f"), tooltip("recall:Q", "Recall", ".3f"),
                 tooltip("tp:Q", "True positives", ",d"), tooltip("fp:Q", "False positives", ",d"),
                 tooltip("fn:Q", "False negatives", ",d")])
    points = cdf[cdf["threshold"] == float(LONG)]
    marks = alt.Chart(points).mark_point(size=160, shape="diamond", filled=True, stroke="black").encode(
        x="recall:Q", y="precision:Q", color=workload_color(),
        tooltip=[tooltip("workload:N", "Workload"), tooltip("precision:Q", f"Precision at ≥ {LONG}", ".3f"),
                 tooltip("recall:Q", f"Recall at ≥ {LONG}", ".3f")])
    st.altair_chart(alt.layer(base, marks), width="stretch")
    st.caption(f"Each workload's own curve: precision and recall if cache drafts predicted to accept ≥ t tokens were "
               f"called long, for t from -1 to 24; diamonds mark t = {LONG}, the table's operating point. Computed "
               f"from the newest {q.DEFAULT_SAMPLE:,} scored cache drafts of the selection, so a diamond can differ a "
               "little from the table (all statistics). Serving does not cut at one threshold: the allocator weighs "
               "each draft's whole survival curve against the step's cost. Good: curves that hug the top right.")

if calib:
    kdf = pd.DataFrame(calib)
    st.subheader("Calibration")
    top = float(max(kdf["mean_predicted"].max(), kdf["mean_accepted"].max(), 1.0))
    diag = alt.Chart(pd.DataFrame({"x": [0.0, top], "y": [0.0, top]})).mark_line(strokeDash=[4, 4], color="gray").encode(
        x="x:Q", y="y:Q")
    pts = alt.Chart(kdf).mark_circle().encode(
        x=alt.X("mean_predicted:Q", title="Mean predicted accepted length (tokens)"),
        y=alt.Y("mean_accepted:Q", title="Mean observed accepted length (tokens)"),
        size=alt.Size("events:Q", title="Drafts"),
        tooltip=[tooltip("bin:Q", "Predicted bin (tokens)"), tooltip("mean_predicted:Q", "Mean predicted", ".2f"),
                 tooltip("mean_accepted:Q", "Mean observed", ".2f"), tooltip("events:Q", "Drafts", ",d")])
    st.altair_chart(diag + pts, width="stretch")
    st.caption("Good: points on the dashed diagonal (predicted = observed) in every 1-token bin of the prediction.")

PROMISES = {"workload": "Workload", "cache_promised": "Cache: promised", "cache_kept": "Cache: accepted",
            "cache_share": "Cache: kept", "model_promised": "Model: promised", "model_kept": "Model: accepted",
            "model_share": "Model: kept"}
st.subheader("Promises kept on the verified drafts")
if promises:
    table = pd.DataFrame(promises)[list(PROMISES)]
    table["workload"] = table["workload"].fillna("all")
    for col in ("cache_promised", "model_promised"):
        table[col] = table[col].map(lambda v: fmt(float(v), 1))
    for col in ("cache_share", "model_share"):
        table[col] = table[col].map(lambda v: fmt(None if pd.isna(v) else float(v)))
    for col in ("cache_kept", "model_kept"):
        table[col] = table[col].map(lambda v: fmt(int(v)))
    st.table(table.rename(columns=PROMISES).set_index("Workload"))
    st.caption("Of the draft tokens the engine verified: the tokens the allocator's plan expected the target to "
               "accept (each draft's survival curve, or the model drafter's, summed over what was verified), the "
               "tokens it accepted, and their ratio. Good: kept near 1. Below it the plan over-promises on the "
               "drafts it acts on (it picks those its curves rate highest, so it is where they overrate), which "
               "the calibration above, over every draft, cannot show; above it, it under-promises. Steps planned "
               "by a fixed tau or a competitor's rule promise nothing.")
else:
    st.info("No verified draft with a plan's promise in this selection.")

st.subheader("Per predictor version")
if by_version:
    st.dataframe(pd.DataFrame(by_version)[["version", *list(CONFUSION)[1:]]]
                 .rename(columns={"version": "Version", **CONFUSION}), hide_index=True, width="stretch",
                 column_config={"Precision": st.column_config.NumberColumn(format="%.3f"),
                                "Recall": st.column_config.NumberColumn(format="%.3f")})

if hist:
    hdf = pd.DataFrame(hist)
    st.subheader("Accepted length of cache drafts by workload")
    st.altair_chart(alt.Chart(hdf).mark_bar().encode(
        x=alt.X("accepted:O", title="Accepted length (tokens; 24 = 24 or more)"),
        y=alt.Y("drafts:Q", title="Labelled cache drafts (count)"),
        color=workload_color(),
        row=alt.Row("workload:N", title=None),
        tooltip=[tooltip("workload:N", "Workload"), tooltip("accepted:O", "Accepted length"),
                 tooltip("drafts:Q", "Drafts", ",d")]).properties(height=120), width="stretch")
    st.caption("Good: mass at long lengths for repetitive workloads (code edits, agents); chat is mostly 0-2.")
