"""The Versions page's champions-and-pins section: every champion alias (`champion`, and each
workload's own `champion/<workload>`, which decides that workload before `champion` does), what
serves, any pin holding it, and an admin's pin, unpin and roll back.

Every move is storage.versions.set_alias with serving_schema (the blob's checksum, and the feature
schema the champion serves: every version was loaded and scored when stored; compares and sets
against the version this page showed, refused while pinned). Names and reasons operators typed are
shown through dashboard.common.plain, never as markdown.
"""
from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from dashboard.common import Admin, plain, read_session
from storage.engine import session_scope
from storage.errors import StorageError
from storage.pins import list_pins, unpin_alias
from storage.versions import CHAMPION, get_alias_version, rollback_destination, set_alias
from storage.workloads import WORKLOADS

FLASH, SHOWN = "_hvd_pins_flash", "_hvd_pins_shown"
ALIASES = [CHAMPION] + [f"{CHAMPION}/{w}" for w in WORKLOADS]  # as predictor.gate.registry.workload_alias names them


def _state(s: Session) -> dict[str, dict]:
    """Per alias: the version it names (None: the workload follows `champion`), its pin, and where a
    roll back would take it (None: nowhere known)."""
    out = {}
    for name in ALIASES:
        version = get_alias_version(s, name)
        try:
            back = rollback_destination(s, name)[1]
        except LookupError:
            back = None
        out[name] = {"version": None if version is None else version.id, "back": back}
    for name, pin in list_pins(s).items():
        if name in out:
            out[name]["pin"] = (pin.version_id, pin.actor, pin.reason, pin.at)
    return out


def _table(state: dict[str, dict]) -> pd.DataFrame:
    champion = state[CHAMPION]["version"]
    rows = []
    for name, a in state.items():
        pin = a.get("pin")
        serving = (f"v{a['version']}" if a["version"] is not None else
                   f"v{champion} (follows {CHAMPION})" if champion is not None else "none")
        rows.append({"Alias": name, "Serving": serving,
                     "Pinned to": f"v{pin[0]}" if pin else "", "Pinned by": pin[1] if pin else "",
                     "Pinned at (UTC)": pin[3] if pin else None, "Why pinned": pin[2] if pin else "",
                     "Roll back to": f"v{a['back']}" if a["back"] is not None else ""})
    return pd.DataFrame(rows)


def pins_section(engine: Engine, admin: Admin, version_ids: list[int], datetime_column) -> None:
    """Render the section; `version_ids`: the versions an operator may pin."""
    st.subheader("Champions and pins")
    with read_session(engine) as s:
        state = _state(s)
    # What the operator saw is the previous run's (a click reruns the page): moves compare-and-set against it.
    shown = st.session_state.get(SHOWN, {n: a["version"] for n, a in state.items()})
    shown_pins = st.session_state.get(SHOWN + "_pins", {n: a.get("pin", (None,))[0] for n, a in state.items()})
    st.session_state[SHOWN] = {n: a["version"] for n, a in state.items()}
    st.session_state[SHOWN + "_pins"] = {n: a.get("pin", (None,))[0] for n, a in state.items()}
    if FLASH in st.session_state:
        st.success(st.session_state.pop(FLASH))
    st.dataframe(_table(state), hide_index=True, width="stretch", column_config={"Pinned at (UTC)": datetime_column})
    st.caption("A pin holds its alias at a version against the learner: its promotions and rollbacks of it are "
               "refused (and recorded as held) until an operator unpins it; while pinned, the alias moves only by "
               "a pin to another version. Roll back takes a workload's champion to the version before the "
               "learner's last move of it, the champion to its parent.")
    disabled = not admin.can_edit
    c = st.columns(3)
    name = c[0].selectbox("Alias", ALIASES, key="pin_alias", disabled=disabled)
    target = c[1].selectbox("Version to pin", version_ids, index=len(version_ids) - 1 if version_ids else None,
                            key="pin_version", disabled=disabled, format_func=lambda v: f"v{v}")
    why = c[2].text_input("Reason (required)", key="pin_reason", disabled=disabled)
    b = st.columns(3)
    pin = b[0].button("Pin", key="pin_button", disabled=disabled or not version_ids)
    unpin = b[1].button("Unpin", key="unpin_button", disabled=disabled)
    back = b[2].button("Roll back", key="alias_rollback", disabled=disabled or name is None
                       or state[name]["back"] is None)
    if not (pin or unpin or back) or name is None:
        return

    def pin_it(s: Session) -> str:
        set_alias(s, name, int(target), reason=why.strip(), actor=admin.name, expected=shown.get(name), pin=True,
                  serving_schema=True)
        return f"{name} pinned to v{target} by {admin.name}."

    def unpin_it(s: Session) -> str:
        held = unpin_alias(s, name, reason=why.strip(), actor=admin.name, expected=shown_pins.get(name))
        return f"{name} unpinned (it stays at v{held}; the learner may move it again), by {admin.name}."

    def roll_back(s: Session) -> str:
        before, after = rollback_destination(s, name)
        set_alias(s, name, after, reason=f"rollback: {why.strip()}", actor=admin.name, expected=shown.get(name),
                  serving_schema=True)
        return f"{name}: {'no version' if before is None else f'v{before}'} -> v{after} (rollback, by {admin.name})."

    _act(engine, admin, why, pin_it if pin else unpin_it if unpin else roll_back)


def _act(engine: Engine, admin: Admin, why: str, do: Callable[[Session], str]) -> None:
    """Run one operator action in its own transaction; a refusal says why and that nothing changed."""
    if admin.refusal:
        st.error(admin.refusal)
        return
    if not why.strip():
        st.error("A reason is required; nothing changed.")
        return
    try:
        with session_scope(engine) as s:
            done = do(s)
    except (StorageError, LookupError, ValueError) as exc:
        text = str(exc)
        st.error(plain(text if "nothing changed" in text else f"{text}; nothing changed."))
        return
    st.session_state[FLASH] = plain(done + " Replicas pick it up within seconds.")
    st.rerun()
