"""Thresholds: automatic tau per workload over time, effective tau per tenant, overrides (edit + audit)."""
from __future__ import annotations

from datetime import timedelta

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.common import admin_sidebar, engine_or_stop, read_session
from storage.workloads import WORKLOADS
from storage import dashboard_queries as q
from storage.engine import session_scope
from storage.models import utcnow
from storage.overrides import MODES, OverrideError, OverrideSpec, clear_override, set_override

ALL = "(all workloads)"
st.title("Thresholds")
admin = admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    history = q.tau_history(s)
    live = q.latest_tau(s)
    effective = q.effective_taus(s, WORKLOADS)
    audit = q.overrides_audit(s)

m = st.columns(max(len(live), 1))
for col, (wl, tau) in zip(m, sorted(live.items())):
    col.metric(f"Live tau: {wl}", f"{tau:.3f}")
if history:
    hdf = pd.DataFrame(history)
    hdf["at"] = pd.to_datetime(hdf["at"], utc=True)
    st.subheader("Automatic tau per workload")
    st.altair_chart(alt.Chart(hdf).mark_line(point=True, interpolate="step-after").encode(
        x=alt.X("at:T", title="Time (UTC)"),
        y=alt.Y("tau:Q", title="tau (predicted accepted tokens)"),
        color=alt.Color("workload:N", title="Workload"),
        tooltip=["at:T", "workload:N", "tau:Q", "rule_tau:Q", "correction:Q", "reason:N"]), width="stretch")
    st.caption("Good: tau moves smoothly with load and acceptance; oscillation or a pinned extreme needs a look.")
else:
    st.info("No automatic tau recorded yet: the learner writes tau_history while `hvd serve` runs.")

st.subheader("Effective tau per tenant and workload")
if effective:
    st.dataframe(pd.DataFrame(effective), hide_index=True, width="stretch")
    st.caption("source: override:tenant+workload > override:tenant > auto (latest tau_history) > default "
               "(the goodput rule per step); the same resolution the controller runs.")
else:
    st.info("No tenants seen yet.")

st.subheader("Set or clear an override")
if not admin.can_edit:
    st.info(admin.why_not)
disabled = not admin.can_edit
with st.form("set_override"):
    c = st.columns(3)
    tenant = c[0].text_input("Tenant", key="set_tenant", disabled=disabled)
    workload = c[1].selectbox("Workload", [ALL, *WORKLOADS], key="set_workload", disabled=disabled)
    mode = c[2].selectbox("Mode", MODES, key="set_mode", disabled=disabled)
    c = st.columns(4)
    tau = c[0].number_input("tau (fixed)", key="set_tau", value=2.0, step=0.5, disabled=disabled)
    tau_min = c[1].number_input("tau min (bounds)", key="set_tau_min", value=0.0, step=0.5, disabled=disabled)
    tau_max = c[2].number_input("tau max (bounds)", key="set_tau_max", value=6.0, step=0.5, disabled=disabled)
    hours = c[3].number_input("Expires in (hours, 0 = never)", key="set_hours", value=0.0, min_value=0.0, step=1.0, disabled=disabled)
    reason = st.text_input("Reason", key="set_reason", disabled=disabled)
    submitted = st.form_submit_button("Set override", disabled=disabled)
if submitted:
    if admin.refusal:
        st.error(admin.refusal)
    else:
        now = utcnow()
        spec = OverrideSpec(
            tenant=tenant.strip(), workload=None if workload == ALL else workload, mode=mode,
            tau=float(tau) if mode == "fixed" else None,
            tau_min=float(tau_min) if mode == "bounds" else None,
            tau_max=float(tau_max) if mode == "bounds" else None,
            expires_at=now + timedelta(hours=float(hours)) if hours > 0 else None,
            author=admin.name, reason=reason.strip())
        try:
            with session_scope(engine) as s:
                row = set_override(s, spec, WORKLOADS, now=now)
                new_id = row.id
        except OverrideError as exc:
            st.error(f"Override refused, nothing changed: {exc}")
        else:
            st.success(f"Override #{new_id} set for tenant {spec.tenant!r} by {admin.name}.")

with st.form("clear_override"):
    c = st.columns(3)
    c_tenant = c[0].text_input("Tenant", key="clear_tenant", disabled=disabled)
    c_workload = c[1].selectbox("Workload", [ALL, *WORKLOADS], key="clear_workload", disabled=disabled)
    c_reason = c[2].text_input("Reason", key="clear_reason", disabled=disabled)
    cleared = st.form_submit_button("Clear override", disabled=disabled)
if cleared:
    if admin.refusal:
        st.error(admin.refusal)
    else:
        try:
            with session_scope(engine) as s:
                n = clear_override(s, c_tenant.strip(), None if c_workload == ALL else c_workload, admin.name,
                                   c_reason.strip())
        except OverrideError as exc:
            st.error(f"Clear refused, nothing changed: {exc}")
        else:
            st.success(f"Cleared {n} override(s) for tenant {c_tenant!r} by {admin.name}.")

st.subheader("Override audit (newest first)")
with read_session(engine) as s:
    audit = q.overrides_audit(s)
if audit:
    st.dataframe(pd.DataFrame(audit), hide_index=True, width="stretch")
else:
    st.info("No overrides yet.")
