"""Thresholds: automatic tau per workload over time, effective tau per tenant, overrides (edit with a
confirmation that shows the effective tau before and after, and an audit)."""
from __future__ import annotations

from datetime import timedelta

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.charts import segments, tooltip, workload_color
from dashboard.common import admin_sidebar, data_as_of, engine_or_stop, page_scope, plain, read_session
from storage import dashboard_queries as q
from storage.engine import session_scope
from storage.models import utcnow
from storage.overrides import MODES, OverrideError, OverrideSpec, clear_override, set_override
from storage.workloads import WORKLOADS

ALL = "(all workloads)"
NEW_TENANT = "➕ a new tenant…"
IDLE_GAP = timedelta(minutes=5)  # tau rows further apart than this are separate runs: drawn apart
MODE_HELP = {"fixed": "hold tau at one value", "bounds": "keep the automatic tau within [min, max]",
             "off_model": "gate off: always draft with the model drafter",
             "off_cache": "gate off: always verify the whole cache draft"}
PENDING, FLASH = "_hvd_pending_edit", "_hvd_flash"

st.title("Thresholds")
admin = admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    scope = page_scope(s) if not q.is_empty(s) else q.ALL_TIME
    history = q.tau_history(s, since=scope.since, workload=scope.workload)
    live = q.latest_tau(s)
    tenants = q.tenants(s)  # the busiest and those with an active override: at most q.TENANT_LIST_LIMIT
    shown = tenants if scope.tenant is None or scope.tenant in tenants else [*tenants, scope.tenant]
    effective = q.effective_taus(s, WORKLOADS, names=shown)
    active = [o for o in q.overrides_audit(s) if o["state"] == "active"]
data_as_of(scope)
if FLASH in st.session_state:
    st.success(st.session_state.pop(FLASH))

m = st.columns(max(len(live), 1))
for col, (wl, tau) in zip(m, sorted(live.items())):
    col.metric(f"Live tau: {wl}", f"{tau:.3f}")
if history:
    hdf = pd.DataFrame(history)
    hdf["at"] = pd.to_datetime(hdf["at"], utc=True)
    hdf = segments(hdf, "at", IDLE_GAP, by="workload")
    st.subheader("Automatic tau per workload")
    st.altair_chart(alt.Chart(hdf).mark_line(point=True, interpolate="step-after").encode(
        x=alt.X("at:T", title="Time (UTC)"),
        y=alt.Y("tau:Q", title="tau (predicted accepted tokens)"),
        color=workload_color(), detail="segment:N",
        tooltip=[tooltip("at:T", "Time (UTC)"), tooltip("workload:N", "Workload"), tooltip("tau:Q", "tau", ".3f"),
                 tooltip("rule_tau:Q", "Rule tau", ".3f"), tooltip("correction:Q", "Learned correction", "+.3f"),
                 tooltip("reason:N", "Why")]), width="stretch")
    st.caption("Good: tau moves smoothly with load and acceptance; oscillation or a pinned extreme needs a look. "
               f"Rows more than {int(IDLE_GAP.total_seconds() // 60)} min apart are drawn as separate runs"
               + (f"; the newest {q.TAU_HISTORY_LIMIT:,} changes of the selection are drawn"
                  if len(history) >= q.TAU_HISTORY_LIMIT else "") + ". The history is kept 30 days.")
else:
    st.info("No automatic tau recorded yet: the learner writes tau_history while `hvd serve` runs.")

st.subheader("Effective tau per tenant and workload")
if effective:
    edf = pd.DataFrame(effective)
    if scope.tenant:
        edf = edf[edf["tenant"] == scope.tenant]
    if scope.workload:
        edf = edf[edf["workload"] == scope.workload]
    st.dataframe(edf.rename(columns={"tenant": "Tenant", "workload": "Workload", "tau": "Effective tau",
                                     "source": "Source", "mode": "Mode", "expires_at": "Expires (UTC)",
                                     "override_id": "Override #"}),
                 hide_index=True, width="stretch",
                 column_config={"Effective tau": st.column_config.NumberColumn(format="%.3f"),
                                "Expires (UTC)": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")})
    st.caption("Source: override:tenant+workload > override:tenant > auto (latest tau_history) > default "
               "(the allocator's per-step plan); the same resolution the controller runs. Tenants: the "
               f"{q.TENANT_LIST_LIMIT} busiest of the last day of traffic, those with an active override and the "
               "one selected in the sidebar (find any other there).")
else:
    st.info("No tenants seen yet.")

st.subheader("Set or clear an override")
if not admin.can_edit:
    st.info(admin.why_not)
disabled = not admin.can_edit

action = st.radio("Change", ["Set an override", "Clear an override"], horizontal=True, key="edit_action",
                  disabled=disabled)
c = st.columns(3)
if action == "Set an override":
    choice = c[0].selectbox("Tenant", [*shown, NEW_TENANT], key="set_tenant_pick", disabled=disabled,
                            help=f"The {q.TENANT_LIST_LIMIT} busiest tenants, those with an override and the one "
                                 "selected in the sidebar; any other by name through the last choice.")
    new_name = (c[0].text_input("New tenant name", key="set_tenant", disabled=disabled,
                                help="A tenant not listed: a quiet one, or one that has not sent traffic yet.")
                if choice == NEW_TENANT else "")
    tenant = new_name if choice == NEW_TENANT else choice
    workload = c[1].selectbox("Workload", [ALL, *WORKLOADS], key="set_workload", disabled=disabled)
    mode = c[2].selectbox("Mode", MODES, key="set_mode", disabled=disabled, format_func=lambda m: f"{m}: {MODE_HELP[m]}")
    c = st.columns(3)
    tau = tau_min = tau_max = None
    if mode == "fixed":
        tau = c[0].number_input("tau", key="set_tau", value=2.0, step=0.5, disabled=disabled)
    elif mode == "bounds":
        tau_min = c[0].number_input("tau min", key="set_tau_min", value=0.0, step=0.5, disabled=disabled)
        tau_max = c[1].number_input("tau max", key="set_tau_max", value=6.0, step=0.5, disabled=disabled)
    hours = c[2].number_input("Expires in (hours, 0 = never)", key="set_hours", value=0.0, min_value=0.0, step=1.0,
                              disabled=disabled)
    reason = st.text_input("Reason", key="set_reason", disabled=disabled)
else:
    keys = sorted({(o["tenant"], o["workload"]) for o in active})
    picked = c[0].selectbox("Active override", keys, key="clear_pick", disabled=disabled or not keys,
                            format_func=lambda k: f"{k[0]} / {k[1]}")
    reason = c[1].text_input("Reason", key="clear_reason", disabled=disabled)
    if not keys:
        st.caption("No active override to clear.")

if st.button("Review change", key="review", disabled=disabled):
    now = utcnow()
    st.session_state.pop(PENDING, None)
    if admin.refusal:
        st.error(admin.refusal)
    elif action == "Set an override":
        spec = OverrideSpec(
            tenant=tenant.strip(), workload=None if workload == ALL else workload, mode=mode,
            tau=None if tau is None else float(tau), tau_min=None if tau_min is None else float(tau_min),
            tau_max=None if tau_max is None else float(tau_max),
            expires_at=now + timedelta(hours=float(hours)) if hours > 0 else None,
            author=admin.name, reason=reason.strip())
        if choice == NEW_TENANT and spec.tenant in shown:
            st.info(f"Tenant '{plain(spec.tenant)}' is already known; the override applies to it.")
        try:
            with read_session(engine) as s:
                rows = q.tau_change(s, spec.tenant, WORKLOADS, set_spec=spec, now=now)
        except OverrideError as exc:
            st.error(f"Override refused, nothing changed: {plain(exc)}")
        else:
            st.session_state[PENDING] = {"kind": "set", "spec": spec, "rows": rows}
    elif picked is None:
        st.error("Nothing to clear: there is no active override.")
    else:
        with read_session(engine) as s:
            rows = q.tau_change(s, picked[0], WORKLOADS, clear_workload=None if picked[1] == q.TENANT_WIDE else picked[1], now=now)
        st.session_state[PENDING] = {"kind": "clear", "key": picked, "reason": reason.strip(), "rows": rows}

pending = st.session_state.get(PENDING)
if pending is not None:
    who = pending["spec"].tenant if pending["kind"] == "set" else pending["key"][0]
    st.warning(f"Confirm: effective tau of tenant '{plain(who)}' before and after this change.")
    confirm_rows = pd.DataFrame(pending["rows"])
    confirm_rows["changes"] = confirm_rows["changes"].map({True: "yes", False: ""})
    st.table(confirm_rows.rename(columns={"workload": "Workload", "before": "Effective tau before",
                                          "after": "Effective tau after", "changes": "Changes"}).set_index("Workload"))
    c = st.columns(2)
    confirm = c[0].button("Confirm change", key="confirm", type="primary", disabled=disabled)
    if c[1].button("Cancel", key="cancel"):
        st.session_state.pop(PENDING, None)
        st.rerun()
    if confirm:
        try:
            with session_scope(engine) as s:
                if pending["kind"] == "set":
                    spec = pending["spec"]
                    new_id = set_override(s, spec, WORKLOADS, now=utcnow()).id
                    done = f"Override #{new_id} set for tenant {spec.tenant!r} by {admin.name}."
                else:
                    tenant_, wl = pending["key"]
                    n = clear_override(s, tenant_, None if wl == q.TENANT_WIDE else wl, admin.name, pending["reason"])
                    done = f"Cleared {n} override(s) for tenant {tenant_!r} ({wl}) by {admin.name}."
        except OverrideError as exc:
            st.error(f"Refused, nothing changed: {plain(exc)}")
        else:
            st.session_state.pop(PENDING, None)
            st.session_state[FLASH] = done + " Replicas apply it from their next poll."
            st.rerun()  # every table on the page shows the change

st.subheader("Override audit (newest first)")
with read_session(engine) as s:
    audit = q.overrides_audit(s)
if audit:
    st.dataframe(pd.DataFrame(audit).rename(columns={
        "id": "#", "state": "State", "tenant": "Tenant", "workload": "Workload", "mode": "Mode", "tau": "tau",
        "tau_min": "tau min", "tau_max": "tau max", "expires_at": "Expires (UTC)", "author": "Author",
        "reason": "Reason", "created_at": "Created (UTC)", "cleared_at": "Cleared (UTC)", "cleared_by": "Cleared by",
        "clear_reason": "Clear reason"}), hide_index=True, width="stretch")
else:
    st.info("No overrides yet.")
