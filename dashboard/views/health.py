"""Health: ingest volume, dropped and dead-lettered events, drift, last learner update, database size,
each replica's background services and what its engine steps cost."""
from __future__ import annotations

from datetime import timedelta

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.charts import segments, tooltip
from dashboard.common import (admin_sidebar, data_as_of, engine_or_stop, fmt, fmt_age, fmt_bytes, fmt_ts,
                              plain, read_session, stop_if_empty)
from storage import dashboard_queries as q
from storage.stats import KEEP_STAT_DAYS
from storage.tau_history import KEEP_TAU_DAYS, KEEP_TAU_ROWS

STATE_MARK = {"ok": "ok", "stale": "STALE", "down": "DOWN", "shut down": "shut down"}
# The parts of a step drawn and tabled, in storage.step_costs.STEP_PARTS order, each with one colour.
STEP_PART_NAMES = {"target": "Target", "hvd": "HVD", "drafter": "Drafter", "rest": "Rest"}
STEP_PART_COLORS = ("#4e79a7", "#e15759", "#f28e2b", "#bab0ac")
STEP_COLUMNS = {"minute": "Minute (UTC)", "steps": "Steps", "batch_mean": "Batch mean",
                **{f"{p}_p50_ms": f"{name} p50 (ms)" for p, name in STEP_PART_NAMES.items()},
                "hvd_share_pct": "HVD share (%)"}

st.title("Health")
admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    h = q.health(s)
    drifts = q.drift_events(s)
    costs = q.step_costs(s, now=h["now"])
data_as_of()
now = h["now"]

m = st.columns(4)
m[0].metric("Decision events stored", fmt(h["decision_events"]))
m[1].metric("Dropped events", fmt(h["dropped_events"]))
m[2].metric("Drift events", fmt(h["drift_events"]))
m[3].metric("Database size", fmt_bytes(h["database_bytes"]))

st.subheader("Ages")
lag = h["learner"]
promo = h["last_promotion"]
newest_beat = max((r["updated_at"] for r in h["replicas"]), default=None)
all_shut = bool(h["replicas"]) and all(r["heartbeat_state"] == "shut down" for r in h["replicas"])
beat_state = "shut down" if all_shut else q.age_state(None if newest_beat is None else now - newest_beat)
ages = [
    {"What": "Newest replica heartbeat", "State": STATE_MARK[beat_state],
     "Age": fmt_age(None if newest_beat is None else now - newest_beat), "At": fmt_ts(newest_beat),
     "Detail": f"ok within {fmt_age(q.STALE_AFTER)}, down after {fmt_age(q.DOWN_AFTER)}"},
    {"What": "Learner", "State": STATE_MARK[lag["state"]],
     "Age": "n/a" if lag["lag_seconds"] is None else f"{fmt_age(timedelta(seconds=lag['lag_seconds']))} of traffic behind",
     "At": fmt_ts(lag["cursor_at"]),
     "Detail": (f"replica {lag['replica']}: {lag['why']} (cursor at event {lag['cursor']:,}; stale beyond "
                f"{q.LEARNER_STALE_EVENTS:,})") if lag["replica"] else lag["why"]},
    {"What": "Last learner update (tau or alias)", "State": "",
     "Age": fmt_age(None if h["last_learner_update"] is None else now - h["last_learner_update"]),
     "At": fmt_ts(h["last_learner_update"]), "Detail": ""},
    {"What": "Last promotion or rollback", "State": "", "Age": fmt_age(None if promo is None else promo["age"]),
     "At": fmt_ts(None if promo is None else promo["at"]),
     "Detail": "none yet" if promo is None else
     (f"{promo['alias']}: v{promo['from_version']} -> v{promo['to_version']} by {promo['actor']} ({promo['reason']})"
      if promo["from_version"] is not None else f"{promo['alias']}: v{promo['to_version']} by {promo['actor']}")},
    {"What": "Last decision event", "State": "",
     "Age": fmt_age(None if h["last_event_at"] is None else now - h["last_event_at"]),
     "At": fmt_ts(h["last_event_at"]), "Detail": ""},
    {"What": "Last statistics bucket", "State": "",
     "Age": fmt_age(None if h["last_bucket_at"] is None else now - h["last_bucket_at"]),
     "At": fmt_ts(h["last_bucket_at"]), "Detail": "1-minute buckets"},
]
st.dataframe(pd.DataFrame(ages), hide_index=True, width="stretch")
if lag["state"] in ("stale", "down"):
    st.warning(f"Learner {lag['state']}: {lag['why']}.")
st.caption("Good: heartbeats seconds old, the learner ok and a few events behind. Stale: late or far behind; "
           "down: no heartbeat for minutes, or no running learner.")
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
            st.error(f"Replica {plain(r['replica'])} could not load the champion ({r['champion_not_loaded']}); it serves its "
                     "last good version and still applies overrides.")
    if not (c["stale"] or c["problem"] or any(r["champion_not_loaded"] for r in h["replicas"])):
        st.success(f"Champion v{c['version']}: every decision since {c['since']:%Y-%m-%d %H:%M:%S} UTC came from it.")
st.subheader("Serving replicas")
REPLICA_COLUMNS = {"replica": "Replica", "state": "State", "age": "Heartbeat age", "updated_at": "Last heartbeat (UTC)",
                   "queue_depth": "Queue depth",
                   "events_written": "Events written", "events_dropped": "Events dropped",
                   "events_dead_lettered": "Events dead-lettered",
                   "dead_letters_pruned": "Dead letters pruned", "flush_ms": "Flush latency (ms)",
                   "services": "Services"}
SERVICE_COLUMNS = {"name": "Service", "state": "State", "failing": "Consecutive failures",
                   "failures": "Failures in all", "last_error": "Last error", "last_success": "Last success (UTC)"}
if h["replicas"]:
    worst = max(h["replicas"], key=lambda r: r["queue_depth"])
    r = st.columns(3)
    r[0].metric("Event queue depth (deepest replica)", fmt(worst["queue_depth"]))
    r[1].metric("Writer flush latency (ms, slowest replica)", f"{max(x['flush_ms'] for x in h['replicas']):.1f}")
    r[2].metric("Dead-lettered events (all replicas)", fmt(sum(x["events_dead_lettered"] for x in h["replicas"])))
    table = pd.DataFrame(h["replicas"])
    table["state"] = table["heartbeat_state"].map(STATE_MARK)
    table["age"] = table["age"].map(fmt_age)
    st.dataframe(table[list(REPLICA_COLUMNS)].rename(columns=REPLICA_COLUMNS), hide_index=True, width="stretch",
                 column_config={"Last heartbeat (UTC)": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")})
    st.caption("Good: queue depth near 0 and flush latency in milliseconds; a growing queue means the writer "
               "cannot keep up and events will be dropped (counted above). Dead-lettered events are ones the "
               "database refused: set aside in `dead_letter_events` (or the spill file) with the reason; the "
               "table keeps the newest 100,000, and the letters pruned beyond them are counted.")
    st.subheader("Background services")
    for rep in h["replicas"]:
        services = rep["service_list"]
        if not services:
            continue
        if all(x["state"] == "stopped" for x in services):
            st.info(f"Replica {plain(rep['replica'])}: every service was stopped at its last heartbeat "
                    f"({rep['updated_at']:%Y-%m-%d %H:%M:%S} UTC): it has shut down or runs without threads.")
        else:
            for x in services:
                since = f"{x['last_success']:%Y-%m-%d %H:%M:%S} UTC" if x["last_success"] else "never"
                if x["state"] == "stopped":
                    st.error(f"Replica {plain(rep['replica'])}: service {plain(x['name'])} has stopped while the others run "
                             f"(last success {since}; last error: {x['last_error'] or 'none'}). Restart the replica.")
                elif x["state"] == "retrying":
                    st.warning(f"Replica {plain(rep['replica'])}: service {plain(x['name'])} is retrying with back-off after "
                               f"{x['failing']} consecutive failures (last success {since}; last error: "
                               f"{x['last_error'] or 'none'}).")
        st.markdown(f"**Replica {plain(rep['replica'])}**")
        st.dataframe(pd.DataFrame(services)[list(SERVICE_COLUMNS)].rename(columns=SERVICE_COLUMNS),
                     hide_index=True, width="stretch")
    st.caption("Good: every service ok. Retrying means database errors, retried with back-off since the last "
               "success; the replica keeps serving and catches up when the database answers.")
else:
    st.info("No replica has reported yet: heartbeats arrive with the first written events.")
st.subheader("Engine step costs")
if costs is None:
    st.caption("This database has no `step_cost_minutes` table yet: run `hvd migrate`.")
elif not costs["minutes"]:
    newest = costs["newest"]
    st.caption("No engine step costs in the last hour"
               + ("" if newest is None else f" (the newest stored minute began {newest:%Y-%m-%d %H:%M} UTC)")
               + ": an engine that times its steps (the vLLM plugin) writes one row per replica and minute; "
               "the replay engine does not.")
else:
    steps = pd.DataFrame(costs["minutes"])
    steps["minute"] = pd.to_datetime(steps["minute"], utc=True)
    for replica, rows in steps.groupby("replica", sort=True):
        st.markdown(f"**Replica {plain(replica)}**")
        long = rows.melt(id_vars=["minute"], value_vars=[f"{p}_p50_ms" for p in STEP_PART_NAMES], var_name="part",
                         value_name="p50_ms")
        long["part"] = long["part"].str.removesuffix("_p50_ms").map(STEP_PART_NAMES)
        long = segments(long, "minute", timedelta(minutes=1), by="part")
        st.altair_chart(alt.Chart(long).mark_line(point=True).encode(
            x=alt.X("minute:T", title="Minute (UTC)"),
            y=alt.Y("p50_ms:Q", title="Median per step (ms)"),
            color=alt.Color("part:N", title="Part", scale=alt.Scale(domain=list(STEP_PART_NAMES.values()),
                                                                     range=list(STEP_PART_COLORS))),
            detail="segment:N",
            tooltip=[tooltip("minute:T", "Minute (UTC)"), tooltip("part:N", "Part"),
                     tooltip("p50_ms:Q", "Median (ms)", ".2f")]), width="stretch")
        last = rows.sort_values("minute", ascending=False).head(10)[list(STEP_COLUMNS)].round(
            {"batch_mean": 2, **{f"{p}_p50_ms": 2 for p in STEP_PART_NAMES}, "hvd_share_pct": 1})
        st.dataframe(last.rename(columns=STEP_COLUMNS), hide_index=True, width="stretch",
                     column_config={"Minute (UTC)": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm")})
    st.caption("Each minute's median per step of each part: the target model's forward and sampling, HVD's own "
               "runtime, the model drafter (EAGLE3; 0 in steps that did not run it) and the rest of the step. "
               "HVD share: HVD's summed time over the steps' summed time in that minute. Good: HVD a few percent "
               "of the step and flat; a rising HVD share means its overhead eats the tokens speculation buys. "
               "Idle minutes are gaps.")
st.subheader("Drift events (newest first)")
if drifts:
    for d in drifts[:20]:
        st.markdown(f"- {d['words']}")
    if len(drifts) > 20:
        st.caption(f"... and {len(drifts) - 20:,} older drift events.")
else:
    st.info("No drift detected.")

st.subheader("Per-tenant state")
scopes = lag.get("tenant_scopes")
st.dataframe(pd.DataFrame([
    {"What": "Calibration tenant scopes (leading learner)",
     "Held": "n/a" if scopes is None else fmt(scopes["scopes"]),
     "Bound": "n/a" if scopes is None else f"at most {fmt(scopes['scope_cap'])}",
     "Forgotten": "n/a" if scopes is None else f"{fmt(scopes['scopes_evicted'])} evicted (longest unseen first)"},
    {"What": "Statistics buckets", "Held": "", "Bound": f"{KEEP_STAT_DAYS} days",
     "Forgotten": "older buckets deleted by each replica's statistics writer"},
    {"What": "Automatic tau history", "Held": "", "Bound": f"{KEEP_TAU_DAYS} days, at most {fmt(KEEP_TAU_ROWS)} rows",
     "Forgotten": "older rows deleted by the learner"},
]), hide_index=True, width="stretch")
st.caption("Tenant names come from clients: every structure that grows with them is bounded. Prometheus: "
           "hvd_calibration_tenant_scopes, hvd_calibration_tenant_scopes_evicted_total, hvd_metric_tenants.")
