"""Plugin configuration at the edge: off by default, a foreign vLLM refused, bad settings named."""
from __future__ import annotations

import json
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
    assert eagle == {"method": "eagle3", "model": str(ve.EAGLE_HEAD), "num_speculative_tokens": ve.MODEL_DRAFT_LEN,
                     "use_local_argmax_reduction": True}
    assert ve.speculative_config("hvd")["num_speculative_tokens"] == ve.K_MAX
    assert ve.method_env("eagle3")["HVD_HYBRID"] is None
    assert ve.method_env("arctic") == {"HVD_HYBRID": "1", "HVD_RULE": "arctic", "HVD_MODEL_DRAFT_LEN": "3",
                                       "HVD_ON_POLICY": None, "HVD_LIVE_COST_FLOOR": None}
    assert ve.method_env("hvd")["HVD_RULE"] is None
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        ve.method_env("medusa")
    with pytest.raises(FileNotFoundError, match="make eagle3"):
        ve.speculative_config("hvd", head=ve.MODELS / "missing")


# The request check as the OpenAI server and the offline API meet it, in a process of its own
# (it patches vLLM's SamplingParams and request models).
CHECK_PROCESS = """
import json
from controller.engines import vllm_plugin
vllm_plugin.register()
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
out = []
for extra in ({"hvd_workload": "poetry"}, {"hvd_speculate": "maybe"}, {"hvd_speculate": 2}, {"hvd_speculate": [1, 2]},
              {"hvd_tenant": "a\\nb"}, {"hvd_workload": "sql", "hvd_speculate": False, "other": 1}, None):
    try:
        SamplingParams(extra_args=extra)
        out.append("ok")
    except VLLMValidationError as exc:
        out.append(exc.parameter)
req = CompletionRequest.model_validate({"model": "m", "prompt": "p", "vllm_xargs": {"hvd_speculate": False, "n": 1}})
out.append(req.vllm_xargs)
print(json.dumps(out))
"""


def test_bad_request_metadata_is_a_validation_error_naming_the_field():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")} | {vllm_plugin.ENV_ENABLE: "1"}
    run = subprocess.run([sys.executable, "-c", CHECK_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == [
        "hvd_workload", "hvd_speculate", "hvd_speculate", "hvd_speculate", "hvd_tenant", "ok", "ok",
        {"hvd_speculate": False, "n": 1}]  # a JSON false stays a boolean (vLLM's own types make it 0)


def test_metadata_refused_once_per_request_in_the_runner(caplog):
    """A bad value that reaches the runner (extra_args changed after validation) is refused once:
    one log line, and the request decodes without speculation under the defaults."""
    from types import SimpleNamespace

    from controller.core.request_metadata import RequestMetadata
    from controller.engines.vllm_hybrid import HybridState
    from controller.settings import ServingSettings

    state = object.__new__(HybridState)
    state.settings, state._meta = ServingSettings.from_env(), {}
    params = {"bad": {"hvd_workload": "poetry"}, "good": {"hvd_tenant": "acme", "hvd_speculate": False}}
    runner = SimpleNamespace(requests={r: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=x))
                                       for r, x in params.items()})
    with caplog.at_level("ERROR", logger="hvd.vllm"):
        seen = [state._metadata(runner, r) for _ in range(5) for r in params]
    assert seen[:2] == [RequestMetadata(state.settings.default_tenant, state.settings.default_workload, False),
                        RequestMetadata("acme", state.settings.default_workload, False)]
    assert seen == seen[:2] * 5
    assert [r.getMessage() for r in caplog.records] == [
        "request 'bad': refused HVD metadata (hvd_workload must be one of agentic, code_edit, coding, sql, chat; "
        "got 'poetry'); decoding it without speculation"]
