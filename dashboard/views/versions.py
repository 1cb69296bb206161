"""Versions: lineage, metrics, promotion log; promote and roll back (as `hvd rollback`)."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.common import admin_sidebar, engine_or_stop, read_session, stop_if_empty
from storage import dashboard_queries as q
from storage.engine import session_scope
from storage.versions import CHAMPION, UnloadableVersionError, get_alias_version, set_alias

st.title("Versions")
admin = admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    rows = q.versions(s)
    events = q.alias_events(s)
    champ = get_alias_version(s, CHAMPION)
    champ_id, champ_parent = (champ.id, champ.parent_id) if champ is not None else (None, None)

m = st.columns(3)
m[0].metric("Champion version", f"v{champ_id}" if champ_id is not None else "none")
m[1].metric("Versions", str(len(rows)))
m[2].metric("Alias moves", str(len(events)))

st.subheader("Lineage")
if rows:
    df = pd.DataFrame(rows)
    df["metrics"] = df["metrics"].map(lambda m: str(m)[:200])
    st.dataframe(df, hide_index=True, width="stretch")
    st.caption("parent_id links each version to the one it was trained from; aliases shows what is live; "
               "unloadable names a version whose stored blob no longer matches its checksum (never promoted).")
else:
    st.info("No predictor versions: run `make warmstart`.")

st.subheader("Promote or roll back")
if not admin.can_edit:
    st.info(admin.why_not)
disabled = not admin.can_edit
reason = st.text_input("Reason (required)", key="version_reason", disabled=disabled)
c = st.columns(2)
ids = [r["id"] for r in rows]
target = c[0].selectbox("Version to promote", ids, index=len(ids) - 1 if ids else None, disabled=disabled)
promote = c[0].button("Promote to champion", disabled=disabled or not ids)
c[1].write(f"Roll back: champion v{champ_id} -> parent "
           + (f"v{champ_parent}" if champ_parent is not None else "(none: the champion has no parent)"))
rollback = c[1].button("Roll back champion", disabled=disabled or champ_parent is None)


def move(to_version: int, why: str) -> None:
    if admin.refusal:
        st.error(admin.refusal)
    elif not reason.strip():
        st.error("A reason is required; nothing changed.")
    else:
        try:
            with session_scope(engine) as s:
                set_alias(s, CHAMPION, int(to_version), reason=f"{why}: {reason.strip()}", actor=admin.name)
        except UnloadableVersionError as exc:
            st.error(f"{exc}; nothing changed.")
            return
        st.success(f"champion: v{champ_id} -> v{to_version} ({why}, by {admin.name}). Replicas pick it up within seconds.")


if promote and target is not None:
    move(target, "promote (dashboard)")
if rollback and champ_parent is not None:
    move(champ_parent, "rollback")

st.subheader("Promotion log (newest first)")
with read_session(engine) as s:
    events = q.alias_events(s)
    fitted = q.calibrations(s)
st.dataframe(pd.DataFrame(events), hide_index=True, width="stretch")
st.caption("champion/<workload> is a workload's own champion: the learner promotes per workload where its challenger "
           "wins a counterfactual replay of the newest held-back drafts, and rolls back automatically when the next "
           "window shows a regression.")

st.subheader("Fast calibrations")
if fitted:
    st.dataframe(pd.DataFrame(fitted), hide_index=True, width="stretch")
    st.caption("Per-position logistic corrections of the serving champion's survival curves, refitted every few "
               "hundred labelled drafts per workload (and per tenant with enough traffic), reset on drift and when "
               "the workload's champion changes.")
else:
    st.info("No calibrations yet: the learner fits one per workload after a few hundred labelled drafts.")
