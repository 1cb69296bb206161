"""Every HVD_* environment variable in one table (name, parser, default, one line of doc), read
through one parser, as vLLM's `envs.py` keeps its own.

Values are checked where they are read: a bad value raises `SettingsError` naming the variable and
what it accepts, before any engine state is built. An unset or empty variable takes its default.
The reading and parsing is storage/env.py's, the one mechanism every layer uses.
The list in docs/reference/settings.md is checked against this table by tests/test_settings.py.
Some variables are also read below the controller, which those layers cannot import
(`HVD_DATABASE_URL`, `HVD_DB_CONNECT_TIMEOUT` and `HVD_DB_STATEMENT_TIMEOUT` in storage/settings.py, `HVD_TOKENIZER` in predictor/data/tokens.py,
`HVD_ADMIN_TOKEN` in the dashboard); they are listed here so the table stays the one list of what
can be set.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

# The parsing machinery is storage's (the lowest layer, so storage, predictor and dashboard read
# their variables the same way).
from storage.env import (
    EnvError,
    number,
    one_of,
    parse_flag,
    positive_int,
    read_env,
    text,
    whole_seconds,
)
from storage.settings import (
    CONNECT_TIMEOUT_ENV,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_DATABASE_URL,
    DEFAULT_STATEMENT_TIMEOUT_S,
    ENV_VAR as DATABASE_URL_ENV,
    STATEMENT_TIMEOUT_ENV,
    parse_connect_timeout,
    parse_statement_timeout,
)


class SettingsError(ValueError):
    """A setting (environment or engine configuration) that HVD cannot run with."""


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("HVD_HYBRID", parse_flag, False, "the vLLM plugin on (off: it imports and patches nothing)"),
    Setting(DATABASE_URL_ENV, text, None, f"SQLAlchemy URL of the database (default {DEFAULT_DATABASE_URL})"),
    Setting(CONNECT_TIMEOUT_ENV, parse_connect_timeout, DEFAULT_CONNECT_TIMEOUT_S,
            "seconds a database connection attempt may take"),
    Setting(STATEMENT_TIMEOUT_ENV, parse_statement_timeout, DEFAULT_STATEMENT_TIMEOUT_S,
            "seconds one PostgreSQL statement may run (0: no limit)"),
    Setting("HVD_FALLBACK", one_of("controller.core.decision:FALLBACKS"), None,
            "model | none; default from the speculative method"),
    Setting("HVD_MODEL_DRAFT_LEN", positive_int, 3,
            "the longest EAGLE3 draft (the allocator picks k up to it per step; at most the method's K)"),
    Setting("HVD_COST_PROFILE", one_of("predictor.decision.profiles:cost_profiles"), "cpu-smollm2",
            "step-cost profile of the allocator and the goodput rule"),
    Setting("HVD_LIVE_COST", parse_flag, True,
            "price steps with this engine's own step times (a live fit from the 50th decode step, refitted "
            "every 200 on its own thread, `hvd-live-cost`; the cost profile is its prior)"),
    Setting("HVD_LIVE_COST_FLOOR", parse_flag, False,
            "let the live fit add a compute floor (ms per query token) where the steps show one "
            "(0: a line, the cost profile's floor kept)"),
    Setting("HVD_DRAFTER_PROFILE", one_of("predictor.decision.profiles:drafter_profiles"), "eagle3-smollm2",
            "model-drafter profile: the prior of its live per-workload survival curve"),
    Setting("HVD_PROFILES_FILE", text, None,
            "this deployment's own profiles (`hvd profile` writes them), read after the bundled ones "
            "(default var/profiles.toml, if it exists)"),
    Setting("HVD_MAX_RUNNING", positive_int, None, "back off speculation above this many running requests"),
    Setting("HVD_BACKOFF", one_of("controller.core.decision:BACKOFFS"), "none",
            "what backing off means: no speculation, or cache drafts only"),
    Setting("HVD_FIXED_TAU", number, None,
            "hold every request to this tau: its whole cache draft iff the predicted length beats it"),
    Setting("HVD_RULE", one_of("controller.core.decision:RULES"), "allocator",
            "allocator: HVD (per-step plan over cache prefixes, model draft length, none); binary: the "
            "predicted length against tau, whole drafts; arctic: ArcticInference's score rule (the baseline); "
            "vllm-adaptive, sglang-hybrid, trtllm: those engines' own rules on HVD's drafts and costs"),
    Setting("HVD_ON_POLICY", parse_flag, True,
            "the gate's on_policy feature for served requests: their output is the served model's own (off: "
            "read as text other models wrote, as the bundled traces are; for measuring what the feature buys)"),
    Setting("HVD_EAGLE_WARM", parse_flag, False, "EAGLE drafts one token even in steps without a model draft"),
    Setting("HVD_DEFAULT_WORKLOAD", one_of("storage.workloads:WORKLOADS"), "chat",
            "workload of requests that name none"),
    Setting("HVD_DEFAULT_TENANT", text, "default", "tenant of requests that name none"),
    Setting("HVD_LEARN", parse_flag, False,
            "a vLLM replica also runs the online learner in its own process (off: `hvd learn` learns, beside the servers)"),
    Setting("HVD_RECORD", text, None,
            "record every finished request as a trace line (prompt, output, workload, tenant) in this .jsonl file"),
    Setting("HVD_RECORD_MAX_REQUESTS", positive_int, 10000, "requests HVD_RECORD records per serving process"),
    Setting("HVD_ORACLE", text, None,
            "a measurement, not a serving mode: a file HVD_RECORD wrote of the same prompts; each cache draft is "
            "planned with its true accepted length, read from the recorded output (the served upper bound of a "
            "better predictor)"),
    Setting("HVD_STEP_LOG", text, None,
            "write every engine step HVD timed as a JSON line to this .jsonl file (phase, running requests, query "
            "tokens, model draft length, each part's ms: what the live cost fit is fitted to, step by step)"),
    Setting("HVD_METRICS_MAX_TENANTS", positive_int, 20,
            "tenants the hvd_* Prometheus metrics name (the first seen); later ones are counted as \"other\""),
    Setting("HVD_TOKENIZER", text, None, "tokenizer.json (or its folder) of the trace tokenizer"),
    Setting("HVD_ADMIN_TOKEN", text, None, "the dashboard's admin token (edits are refused without it)"),
    Setting("HVD_DASHBOARD_REFRESH_S", whole_seconds, 30,
            "seconds between the dashboard's automatic refreshes (0: off)"),
    Setting("HVD_SPILL_DIR", text, "var", "folder of dead_letter_events.jsonl: events not even the dead-letter table takes"),
    Setting("HVD_TEST_POSTGRES_URL", text, "postgresql+psycopg2://postgres@127.0.0.1:5432/test",
            "PostgreSQL server of the tests and bench/outage.py (each uses a throwaway schema)"),
)}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of one setting, or its default when unset or empty."""
    setting = SETTINGS[name]
    try:
        return read_env(name, setting.parse, setting.default, environ)
    except EnvError as exc:  # the message names the variable and what it accepts
        raise SettingsError(str(exc)) from None


@dataclass(frozen=True)
class ServingSettings:
    """What the vLLM plugin runs with: the table's serving rows, each field named for its variable
    (`model_draft_len` is HVD_MODEL_DRAFT_LEN)."""

    database_url: str | None
    fallback: str | None
    model_draft_len: int
    cost_profile: str
    live_cost: bool
    live_cost_floor: bool
    drafter_profile: str
    max_running: int | None
    backoff: str
    fixed_tau: float | None
    rule: str
    on_policy: bool
    eagle_warm: bool
    default_workload: str
    default_tenant: str
    learn: bool
    record: str | None
    record_max_requests: int
    oracle: str | None
    step_log: str | None
    metrics_max_tenants: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServingSettings":
        return cls(**{f.name: read(f"HVD_{f.name.upper()}", environ) for f in fields(cls)})


def markdown() -> str:
    """The table as a Markdown list (`python -m controller.settings`), for docs/reference/settings.md."""

    def shown(value: Any) -> str:
        return "unset" if value is None else str(int(value)) if isinstance(value, bool) else str(value)

    return "\n".join(f"- `{s.name}` ({shown(s.default)}): {s.doc}" for s in SETTINGS.values())


if __name__ == "__main__":
    print(markdown())
