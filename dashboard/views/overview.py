"""Overview: what speculation bought in time (cost profile), against the suffix cache alone and the
model drafter alone on the same traffic, and where the decode cycles went."""
from __future__ import annotations

import os

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.charts import bin_words, segments, tooltip
from dashboard.common import (PRICED_BATCH, SERVING_COST_PROFILE, SERVING_DRAFTER, admin_sidebar, data_as_of,
                              engine_or_stop, fmt, page_scope, read_session, stop_if_empty)
from predictor.decision.profiles import cost_profiles, drafter_profiles
from predictor.evaluation.baselines import model_alone, no_speculation, path_cost, suffix_alone
from storage import dashboard_queries as q

# What the serving replicas price with: what is set, else their defaults.
DEFAULT_COST_PROFILE = os.environ.get("HVD_COST_PROFILE") or SERVING_COST_PROFILE
DEFAULT_DRAFTER = os.environ.get("HVD_DRAFTER_PROFILE") or SERVING_DRAFTER

st.title("Overview")
admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    scope = page_scope(s)
    totals = q.overview_totals(s, scope)
    resolution = q.bucket_resolution(s, scope)
    rows = q.overview_by_bucket(s, scope, resolution)
    counts = q.served_counts(s, scope)
    drafts = q.cache_drafts(s, scope)
data_as_of(scope)

profiles, drafters = cost_profiles(), drafter_profiles()
c = st.columns(3)
names = sorted(profiles)
if DEFAULT_COST_PROFILE not in profiles:
    st.warning(f"HVD_COST_PROFILE={DEFAULT_COST_PROFILE!r} is not a cost profile ({', '.join(names)}); showing "
               f"{SERVING_COST_PROFILE}, the serving default.")
if DEFAULT_DRAFTER not in drafters:
    st.warning(f"HVD_DRAFTER_PROFILE={DEFAULT_DRAFTER!r} is not a drafter profile; using {SERVING_DRAFTER}.")
shown = DEFAULT_COST_PROFILE if DEFAULT_COST_PROFILE in profiles else SERVING_COST_PROFILE
profile = profiles[c[0].selectbox("Cost profile", names, index=names.index(shown), key="cost_profile",
                                  help="How one engine step is priced (predictor/decision/profiles.toml); the serving default "
                                       "is HVD_COST_PROFILE.")]
batch = int(c[1].number_input("Batch size priced", min_value=1, max_value=512, value=PRICED_BATCH, key="cost_batch",
                              help="Running requests per step: each request pays its share of the step."))
drafter = drafters.get(DEFAULT_DRAFTER, drafters[SERVING_DRAFTER])
c[2].caption(f"Cost profile **{profile.name}** at batch {batch}: {profile.description.split('. ')[0].rstrip('.')}.")

served = path_cost("HVD as served", profile, batch, counts.tokens, counts.cycles, counts.draft_tokens,
                   counts.model_drafts, counts.model_positions)
plain = no_speculation(profile, batch, counts.tokens)
suffix = suffix_alone(drafts, profile, batch) if drafts else None
model, model_source = model_alone(counts.tokens_by_workload, counts.model_by_workload, drafter, profile, batch)

m = st.columns(4)
m[0].metric("Speedup vs no speculation", fmt(served.speedup_over(plain), 2) + "x"
            if served.speedup_over(plain) else "n/a",
            help="Priced by the cost profile: simulated time per token without speculation divided by HVD's, "
                 "verification and drafting counted (not tokens per cycle).")
m[1].metric("Suffix cache alone, same traffic", fmt(suffix.speedup_over(plain), 2) + "x"
            if suffix is not None and suffix.speedup_over(plain) else "n/a",
            help="Counterfactual from the hindsight labels: every cache draft verified whole.")
m[2].metric("Model drafter alone, same traffic", fmt(model.speedup_over(plain), 2) + "x"
            if model.speedup_over(plain) else "n/a",
            help=f"{drafter.name} at k = {drafter.draft_len} on every step, at its observed acceptance per workload.")
m[3].metric("Tokens generated", fmt(totals["tokens"]))
m = st.columns(4)
m[0].metric("Tokens per cycle", fmt(totals["tokens_per_cycle"]))
m[1].metric("Cycles per 1000 tokens", fmt(totals["cycles_per_1k"], 1))
m[2].metric("Simulated ms per 1000 tokens", fmt(served.ms_per_1k, 1))
m[3].metric("Decode cycles", fmt(totals["cycles"]))

st.subheader("HVD against the single-drafter baselines")
table = pd.DataFrame([{
    "Method": p.name, "Speedup vs no speculation": p.speedup_over(plain), "Simulated ms / 1000 tokens": p.ms_per_1k,
    "Tokens": p.tokens, "Decode cycles": p.cycles, "Tokens per cycle": p.tokens_per_cycle,
    "Tokens verified (1 + draft per cycle)": p.query_tokens, "Model drafter calls": p.model_calls}
    for p in (served, suffix, model, plain) if p is not None])
st.dataframe(table, hide_index=True, width="stretch", column_config={
    "Speedup vs no speculation": st.column_config.NumberColumn(format="%.2fx"),
    "Simulated ms / 1000 tokens": st.column_config.NumberColumn(format="%.1f"),
    "Tokens per cycle": st.column_config.NumberColumn(format="%.3f"),
    "Tokens": st.column_config.NumberColumn(format="localized"),
    "Decode cycles": st.column_config.NumberColumn(format="localized"),
    "Tokens verified (1 + draft per cycle)": st.column_config.NumberColumn(format="localized"),
    "Model drafter calls": st.column_config.NumberColumn(format="localized")})
st.caption(
    f"Priced with cost profile {profile.name} at batch {batch}: each cycle pays its request's share of a step that "
    "verifies 1 + its draft tokens, and each model-drafter call its share of the call. HVD as served: the exact counts "
    f"of the statistics. Suffix cache alone: the newest {len(drafts):,} cache drafts of the selection walked request "
    "by request, verifying each whole draft (hindsight labels give every draft's accepted length). Model drafter "
    "alone: " + ", ".join(f"{w} {src}" for w, src in sorted(model_source.items()))
    + ". Good: HVD's speedup at or above both baselines.")

if not rows:
    st.info("No statistics for this selection yet: serve some traffic (`hvd serve --engine replay`).")
    st.stop()

df = pd.DataFrame(rows)
df["bucket_start"] = pd.to_datetime(df["bucket_start"], utc=True)
df = segments(df, "bucket_start", resolution)
st.subheader("Tokens per decode cycle")
st.altair_chart(alt.Chart(df).mark_line(point=True).encode(
    x=alt.X("bucket_start:T", title=f"Time bucket start (UTC, {bin_words(resolution)} buckets)"),
    y=alt.Y("tokens_per_cycle:Q", title="Tokens per decode cycle (tokens/cycle)"),
    detail="segment:N",
    tooltip=[tooltip("bucket_start:T", "Bucket start (UTC)"), tooltip("tokens_per_cycle:Q", "Tokens per cycle", ".3f"),
             tooltip("tokens:Q", "Tokens", ",d"), tooltip("cycles:Q", "Cycles", ",d")]), width="stretch")
st.caption("Good: well above 1 token/cycle and steady; 1.0 means speculation buys nothing. Idle buckets are gaps; "
           "the statistics' 1-minute buckets are summed into longer ones when the selection spans more than a day.")

paths = df.melt(id_vars=["bucket_start"], value_vars=["cycles_per_1k_cache", "cycles_per_1k_model", "cycles_per_1k_none"],
                var_name="path", value_name="cycles_per_1k_tokens")
paths["path"] = paths["path"].map({"cycles_per_1k_cache": "cache draft verified", "cycles_per_1k_model": "model drafter",
                                   "cycles_per_1k_none": "no draft"})
st.subheader("Decode cycles per 1000 tokens by decision path")
st.altair_chart(alt.Chart(paths).mark_bar().encode(
    x=alt.X("bucket_start:T", title="Time bucket start (UTC)"),
    y=alt.Y("cycles_per_1k_tokens:Q", stack=True, title="Decode cycles per 1000 tokens (cycles)"),
    color=alt.Color("path:N", title="Decision path"),
    tooltip=[tooltip("bucket_start:T", "Bucket start (UTC)"), tooltip("path:N", "Decision path"),
             tooltip("cycles_per_1k_tokens:Q", "Cycles per 1000 tokens", ".1f")]), width="stretch")
st.caption("Good: a low total stack (1000 would be plain decoding) with the cache path taking the cycles where "
           "its drafts are long.")
st.dataframe(df[["bucket_start", "tokens", "cycles", "cache_verified", "model_drafts", "no_draft", "tokens_per_cycle"]]
             .rename(columns={"bucket_start": "Bucket start (UTC)", "tokens": "Tokens", "cycles": "Decode cycles",
                              "cache_verified": "Cache drafts verified", "model_drafts": "Model drafts",
                              "no_draft": "Cycles without a draft", "tokens_per_cycle": "Tokens per cycle"}),
             hide_index=True, width="stretch",
             column_config={"Tokens per cycle": st.column_config.NumberColumn(format="%.3f"),
                            "Bucket start (UTC)": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")})
