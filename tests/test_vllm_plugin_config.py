"""Plugin configuration at the edge: off by default, a foreign vLLM refused, bad settings named."""
from __future__ import annotations

import pytest

from controller import vllm_plugin


def test_off_unless_enabled(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENV_ENABLE, raising=False)
    assert not vllm_plugin.enabled()
    for value in ("1", "true", "on", "YES"):
        monkeypatch.setenv(vllm_plugin.ENV_ENABLE, value)
        assert vllm_plugin.enabled()
    monkeypatch.setenv(vllm_plugin.ENV_ENABLE, "0")
    assert not vllm_plugin.enabled()


def test_refuses_a_vllm_it_was_not_built_for(monkeypatch):
    import vllm

    monkeypatch.setenv(vllm_plugin.ENV_ENABLE, "1")
    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    with pytest.raises(vllm_plugin.PluginConfigError, match=r"built for vLLM 0\.32\.0 and this is vLLM 0\.99\.1"):
        vllm_plugin.register()


def test_bad_numeric_setting_is_named(monkeypatch):
    monkeypatch.setenv("HVD_MODEL_DRAFT_LEN", "three")
    with pytest.raises(vllm_plugin.PluginConfigError, match="HVD_MODEL_DRAFT_LEN='three'"):
        vllm_plugin.PluginSettings.from_env()


def test_settings_defaults(monkeypatch):
    for name in ("HVD_DATABASE_URL", "HVD_FALLBACK", "HVD_MODEL_DRAFT_LEN", "HVD_COST_PROFILE", "HVD_MAX_RUNNING",
                 "HVD_FIXED_TAU"):
        monkeypatch.delenv(name, raising=False)
    s = vllm_plugin.PluginSettings.from_env()
    assert (s.model_draft_len, s.cost_profile, s.max_running, s.fixed_tau, s.default_workload) == \
        (3, "cpu-smollm2", None, None, "chat")
