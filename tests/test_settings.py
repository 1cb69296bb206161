"""The settings table: one parser, every bad value named with what is allowed, defaults as
documented, and docs/reference/settings.md listing exactly the variables the table has (and no page
of the docs naming one it lacks)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from controller.settings import SETTINGS, ServingSettings, SettingsError, markdown, read

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_DOC = ROOT / "docs" / "reference" / "settings.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NAME = re.compile(r"\bHVD_[A-Z0-9_]+\b")


def test_defaults():
    s = ServingSettings.from_env({})
    assert s == ServingSettings(
        database_url=None, fallback=None, model_draft_len=3, cost_profile="cpu-smollm2", live_cost=True, live_cost_floor=False,
        drafter_profile="eagle3-smollm2", max_running=None, backoff="none", fixed_tau=None, rule="allocator",
        on_policy=True, eagle_warm=False, default_workload="chat", default_tenant="default", learn=False, record=None,
        record_max_requests=10000, oracle=None, step_log=None,
        metrics_max_tenants=20)


def test_values_are_parsed():
    env = {"HVD_MODEL_DRAFT_LEN": "5", "HVD_MAX_RUNNING": "4", "HVD_BACKOFF": "cache_only", "HVD_FIXED_TAU": "2.5",
           "HVD_RULE": "arctic", "HVD_EAGLE_WARM": "on", "HVD_LEARN": "1", "HVD_FALLBACK": "none",
           "HVD_DEFAULT_WORKLOAD": "sql", "HVD_DATABASE_URL": "", "HVD_COST_PROFILE": "gpu-8b"}
    s = ServingSettings.from_env(env)
    assert (s.model_draft_len, s.max_running, s.backoff, s.fixed_tau, s.rule, s.eagle_warm, s.learn, s.fallback,
            s.default_workload, s.database_url, s.cost_profile) == \
        (5, 4, "cache_only", 2.5, "arctic", True, True, "none", "sql", None, "gpu-8b")


@pytest.mark.parametrize("name, raw, allowed", [
    ("HVD_MODEL_DRAFT_LEN", "three", "an integer >= 1"),
    ("HVD_MAX_RUNNING", "0", "an integer >= 1"),
    ("HVD_FIXED_TAU", "high", "a number"),
    ("HVD_BACKOFF", "pause", "one of ('none', 'cache_only')"),
    ("HVD_RULE", "oracle", "one of ('allocator', 'binary', 'arctic', 'vllm-adaptive', 'sglang-hybrid', 'trtllm')"),
    ("HVD_RULE", "gate", "one of ('allocator', 'binary', 'arctic', 'vllm-adaptive', 'sglang-hybrid', 'trtllm')"),  # the old name of binary: refused
    ("HVD_FALLBACK", "eagle", "one of ('model', 'none')"),
    ("HVD_DEFAULT_WORKLOAD", "mail", "one of ('agentic', 'code_edit', 'coding', 'sql', 'chat')"),
    ("HVD_LEARN", "sometimes", "one of ('1', 'true', 'yes', 'on', '0', 'false', 'no', 'off')"),
    ("HVD_COST_PROFILE", "tpu", "one of ("),
])
def test_a_bad_value_names_the_variable_and_what_it_accepts(name, raw, allowed):
    with pytest.raises(SettingsError) as info:
        read(name, {name: raw})
    assert str(info.value).startswith(f"{name}={raw!r} is not valid: expected {allowed}")


def test_docs_list_exactly_the_table():
    name = SETTINGS_DOC.relative_to(ROOT)
    doc = SETTINGS_DOC.read_text()
    # the list, defaults and docs as the table has them
    assert markdown() in doc, (f"{name}: the list is not what `python -m controller.settings` prints "
                               "(controller/settings.py): paste its output into the page")
    found = set(NAME.findall(doc))
    assert found == set(SETTINGS), (f"{name} names {sorted(found - set(SETTINGS))} that controller/settings.py "
                                    f"lacks and lacks {sorted(set(SETTINGS) - found)}")
    for path in DOCS:  # and no page names a variable the table lacks
        unknown = set(NAME.findall(path.read_text())) - set(SETTINGS)
        assert not unknown, f"{path.relative_to(ROOT)} names {sorted(unknown)}, not in controller/settings.py"


def test_every_variable_the_code_reads_is_in_the_table():
    used = set()
    for folder in ("controller", "predictor", "storage", "dashboard", "eagle3_training", "bench", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(NAME.findall(path.read_text()))
    assert used == set(SETTINGS)
