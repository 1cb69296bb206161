"""Plugin configuration at the edge: off by default, a foreign vLLM refused, bad settings named."""
from __future__ import annotations

import pytest

from controller.engines import vllm_plugin


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


def test_rule_and_drafter_settings(monkeypatch):
    for name in ("HVD_RULE", "HVD_EAGLE_WARM", "HVD_DRAFTER_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    s = vllm_plugin.PluginSettings.from_env()
    assert (s.rule, s.eagle_warm, s.drafter_profile) == ("gate", False, "eagle3-smollm2")
    monkeypatch.setenv("HVD_RULE", "arctic")
    monkeypatch.setenv("HVD_EAGLE_WARM", "1")
    s = vllm_plugin.PluginSettings.from_env()
    assert (s.rule, s.eagle_warm) == ("arctic", True)
    monkeypatch.setenv("HVD_RULE", "oracle")
    with pytest.raises(vllm_plugin.PluginConfigError, match=r"HVD_RULE='oracle' is not one of \('gate', 'arctic'\)"):
        vllm_plugin.PluginSettings.from_env()


def test_benchmarked_methods_configure_engine_and_plugin():
    from controller.engines import vllm_engine as ve

    assert ve.speculative_config("none") is None
    eagle = ve.speculative_config("eagle3")
    assert eagle == {"method": "eagle3", "model": str(ve.EAGLE_HEAD), "num_speculative_tokens": ve.MODEL_DRAFT_LEN}
    assert ve.speculative_config("hvd")["num_speculative_tokens"] == ve.K_MAX
    assert ve.method_env("eagle3")["HVD_HYBRID"] is None
    assert ve.method_env("arctic") == {"HVD_HYBRID": "1", "HVD_RULE": "arctic", "HVD_MODEL_DRAFT_LEN": "3"}
    assert ve.method_env("hvd")["HVD_RULE"] is None
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        ve.method_env("medusa")
    with pytest.raises(FileNotFoundError, match="make eagle3"):
        ve.speculative_config("hvd", head=ve.MODELS / "missing")
