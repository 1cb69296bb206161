"""Plugin configuration at the edge: off by default, a foreign vLLM refused, bad settings named."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from controller.engines import vllm_plugin
from controller.settings import SettingsError


def test_off_unless_enabled(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENV_ENABLE, raising=False)
    assert not vllm_plugin.enabled()
    for value in ("1", "true", "on", "YES"):
        monkeypatch.setenv(vllm_plugin.ENV_ENABLE, value)
        assert vllm_plugin.enabled()
    for value in ("0", "off", ""):
        monkeypatch.setenv(vllm_plugin.ENV_ENABLE, value)
        assert not vllm_plugin.enabled()
    monkeypatch.setenv(vllm_plugin.ENV_ENABLE, "maybe")
    with pytest.raises(SettingsError, match=r"HVD_HYBRID='maybe' is not valid: expected one of \('1', 'true'"):
        vllm_plugin.register()


def test_a_bad_setting_stops_registration(monkeypatch):
    monkeypatch.setenv(vllm_plugin.ENV_ENABLE, "1")
    monkeypatch.setenv("HVD_BACKOFF", "pause")
    with pytest.raises(SettingsError, match=r"HVD_BACKOFF='pause' is not valid: expected one of \('none', "):
        vllm_plugin.register()


def test_refuses_a_vllm_it_was_not_built_for(monkeypatch):
    import vllm

    monkeypatch.setenv(vllm_plugin.ENV_ENABLE, "1")
    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    with pytest.raises(SettingsError, match=r"built for vLLM 0\.32\.0 and this is vLLM 0\.99\.1"):
        vllm_plugin.register()


# What vLLM does in every process it starts: load the entry point and call it. With HVD_HYBRID unset
# that must cost nothing: none of HVD's heavy dependencies imported, vLLM's runner left alone.
OFF_PROCESS = """
import sys
from importlib.metadata import entry_points

(hvd,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "hvd_hybrid"]
hvd.load()()
heavy = ("torch", "river", "sqlalchemy", "arctic_inference", "numpy", "vllm")
print(sorted(m for m in heavy if m in sys.modules))
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
print(hasattr(GPUModelRunner.propose_draft_token_ids, "__wrapped__"))
"""


def test_register_when_off_imports_nothing_heavy_and_patches_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    run = subprocess.run([sys.executable, "-c", OFF_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["[]", "False"]


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


def test_per_request_opt_out():
    """`hvd_speculate` as JSON or as the flag strings; anything else speculates (a client's typo
    must not take the engine down)."""
    from controller.engines.vllm_hybrid import _speculate

    values = (True, False, 0, "false", "OFF", "0", "yes", "maybe")
    assert [_speculate("r", v) for v in values] == [True, False, False, False, False, False, True, True]
