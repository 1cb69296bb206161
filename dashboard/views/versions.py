"""Versions: lineage, metrics, promotion log; promote and roll back (as `hvd rollback`); each champion
alias's pin, pinned, unpinned and rolled back (as `hvd pin`, `hvd unpin`, `hvd rollback --workload`)."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.common import admin_sidebar, data_as_of, engine_or_stop, plain, read_session, stop_if_empty
from dashboard.pins import pins_section
from storage import dashboard_queries as q
from storage.engine import session_scope
from storage.versions import (CHAMPION, AliasMovedError, AliasPinnedError, NoOpAliasMove, UnloadableVersionError,
                              get_alias_version, set_alias)

FLASH, SHOWN = "_hvd_versions_flash", "_hvd_versions_champion_shown"
DATETIME = st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")


def metrics_text(metrics: dict | None) -> str:
    """A version's stored metrics as one readable line: numbers rounded, nested values skipped."""
    if not isinstance(metrics, dict) or not metrics:
        return ""
    parts = []
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        parts.append(f"{key.replace('_', ' ')} {value:,.3f}" if isinstance(value, float) else
                     f"{key.replace('_', ' ')} {value:,}")
    return "; ".join(parts[:8]) + (" …" if len(parts) > 8 else "")

st.title("Versions")
admin = admin_sidebar()
engine = engine_or_stop()
with read_session(engine) as s:
    stop_if_empty(s)
    rows = q.versions(s)
    events = q.alias_events(s)
    champ = get_alias_version(s, CHAMPION)
    champ_id, champ_parent = (champ.id, champ.parent_id) if champ is not None else (None, None)
# A click reruns the page, which reads the champion again: the one the operator saw is the previous
# run's. A move compares-and-sets against that, so it never lands on a champion moved meanwhile.
shown_champion = st.session_state.get(SHOWN, champ_id)
st.session_state[SHOWN] = champ_id
data_as_of()
if FLASH in st.session_state:
    st.success(st.session_state.pop(FLASH))

m = st.columns(3)
m[0].metric("Champion version", f"v{champ_id}" if champ_id is not None else "none")
m[1].metric("Versions", str(len(rows)))
m[2].metric("Alias moves", str(len(events)))

st.subheader("Lineage")
if rows:
    df = pd.DataFrame(rows)
    df["metrics"] = df["metrics"].map(metrics_text)
    st.dataframe(df.rename(columns={"id": "Version", "parent_id": "Trained from", "created_at": "Created (UTC)",
                                    "kind": "Kind", "aliases": "Live as", "unloadable": "Unloadable because",
                                    "metrics": "Metrics", "reason": "Why created", "created_by": "Created by"}),
                 hide_index=True, width="stretch", column_config={"Created (UTC)": DATETIME})
    st.caption("Trained from links each version to the one it was trained from; Live as shows the aliases naming it "
               "(champion, or champion/<workload> for a workload's own champion); Unloadable names a version whose "
               "stored blob no longer matches its checksum or whose feature schema is not the champion's (never "
               "promoted from here).")
else:
    st.info("No predictor versions: run `make warmstart`.")

st.subheader("Promote or roll back")
if not admin.can_edit:
    st.info(admin.why_not)
disabled = not admin.can_edit
reason = st.text_input("Reason (required)", key="version_reason", disabled=disabled)
c = st.columns(2)
ids = [r["id"] for r in rows]
target = c[0].selectbox("Version to promote", ids, index=len(ids) - 1 if ids else None, disabled=disabled, key="promote_version",
                        format_func=lambda v: f"v{v}" + (" (the champion now)" if v == champ_id else ""))
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
            with session_scope(engine) as s:  # checksum and served feature schema: versions were scored when stored
                set_alias(s, CHAMPION, int(to_version), reason=f"{why}: {reason.strip()}", actor=admin.name,
                          expected=shown_champion, serving_schema=True)
        except NoOpAliasMove:
            st.error(f"v{to_version} already is the champion; nothing changed.")
            return
        except UnloadableVersionError as exc:
            st.error(f"{exc}; nothing changed.")
            return
        except AliasMovedError as exc:  # says that nothing changed, and to read it again
            st.error(str(exc))
            return
        except AliasPinnedError as exc:  # names who pinned it and why: operators' text, escaped
            st.error(plain(str(exc)))
            return
        st.session_state[FLASH] = (f"champion: v{champ_id} -> v{to_version} ({why}, by {admin.name}). Replicas pick "
                                   "it up within seconds.")
        st.rerun()  # the lineage and the log show the move


if promote and target is not None:
    move(target, "promote (dashboard)")
if rollback and champ_parent is not None:
    move(champ_parent, "rollback")

pins_section(engine, admin, ids, DATETIME)

st.subheader("Promotion log (newest first)")
with read_session(engine) as s:
    events = q.alias_events(s)
    fitted = q.calibrations(s)
st.dataframe(pd.DataFrame(events).rename(columns={
    "id": "#", "at": "At (UTC)", "alias": "Alias", "from_version": "From version", "to_version": "To version",
    "actor": "By", "reason": "Why"}), hide_index=True, width="stretch", column_config={"At (UTC)": DATETIME})
st.caption("champion/<workload> is a workload's own champion: the learner promotes per workload where its challenger "
           "wins a counterfactual replay of the newest held-back drafts, and rolls back automatically when the next "
           "window shows a regression.")

st.subheader("Learner checks (newest first)")
with read_session(engine) as s:
    checks = q.learner_checks(s)
if checks:
    st.dataframe(pd.DataFrame(checks).rename(columns={
        "at": "At (UTC)", "workload": "Workload", "tenant": "Tenant", "subject": "Subject", "outcome": "Outcome",
        "gain_pct": "Gain %", "drafts": "Drafts judged", "version": "Serving version", "reason": "Why",
        "replica": "By replica"}), hide_index=True, width="stretch", column_config={"At (UTC)": DATETIME})
    st.caption("Why the learner did (or did not) change what serves: a challenger that wins a check waits for a "
               "window of later drafts before it is promoted (won, then promoted or refused); a promotion is "
               "looked at again on its probation (kept or rolled back); a workload's first paying calibration is "
               "on trial until a later window confirms or refuses it. A promotion or rollback an operator's pin held is "
               "recorded as held, one whose alias was moved meanwhile as moved meanwhile. Checks the challenger "
               "simply lost are not recorded.")
else:
    st.info("No learner checks yet: the learner records a challenger's win, its confirmation or refusal, probation "
            "looks and calibration trials as they happen.")

st.subheader("Room to learn (each workload's newest check)")
with read_session(engine) as s:
    room = q.learning_room(s)
if room:
    st.dataframe(pd.DataFrame(room).rename(columns={
        "workload": "Workload", "version": "Serving version", "headroom_pct": "Perfect predictor %",
        "challenger_pct": "Challenger %", "drafts": "Drafts replayed", "at": "At (UTC)", "replica": "By replica"}),
        hide_index=True, width="stretch", column_config={"At (UTC)": DATETIME})
    st.caption("At every check the learner replays, on the workload's newest held-back drafts, a perfect predictor "
               "(each draft's true accepted length as its curve) beside the challenger: its goodput over the serving "
               "version is about the most any predictor could win there. A challenger far below it has not learned what is "
               "learnable, or the drafts' outcomes are not predictable from what is known before verification: on "
               "sources left out of the warm start, gates trained on the source itself win between none and half "
               "of it (docs/results/unseen-sources.md). Challenger % is empty on a probation look, where no challenger "
               "is tried.")
else:
    st.info("No checks yet: the learner measures the room to learn every 1,000 drafts of a workload, once its "
            "window of held-back drafts is full.")

st.subheader("Fast calibrations")
if fitted:
    st.dataframe(pd.DataFrame(fitted).rename(columns={
        "workload": "Workload", "tenant": "Tenant", "version": "Corrects version", "drafts": "Fitted on drafts",
        "mean_bias": "Mean bias", "mean_slope": "Mean slope", "updated": "Updated (UTC)", "reason": "Why"}),
        hide_index=True, width="stretch", column_config={"Updated (UTC)": DATETIME})
    st.caption("Per-position logistic corrections of the serving champion's survival curves, refitted every few "
               "hundred labelled drafts per workload (and per tenant with enough traffic), reset on drift and when "
               "the workload's champion changes.")
else:
    st.info("No calibrations yet: the learner fits one per workload after a few hundred labelled drafts.")
