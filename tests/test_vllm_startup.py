"""HVD starts with the engine, and refuses there, clearly, what it cannot serve: a database it
cannot reach, no champion to serve, tensor or pipeline parallelism. (The runner is a stand-in with
the attributes HybridState reads; the real engine's start-up is covered by the vLLM tests.)"""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from controller.engines.vllm_hybrid import HvdStartupError, HybridState, cache_config, check_parallelism
from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.features import schema_hash
from storage.migrate import upgrade


def _runner(tp: int = 1, pp: int = 1) -> SimpleNamespace:
    spec = SimpleNamespace(num_speculative_tokens=16, method="suffix", suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_cached_requests=100, suffix_decoding_max_spec_factor=1.0,
                           suffix_decoding_min_token_prob=0.1)
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                           speculative_config=spec,
                           model_config=SimpleNamespace(tokenizer="/nonexistent", served_model_name="m", model="m"))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (4, 2)])
def test_parallel_engines_are_refused_naming_the_sizes(tp, pp):
    with pytest.raises(HvdStartupError, match=f"tensor_parallel_size {tp} and pipeline_parallel_size {pp}"):
        check_parallelism(SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    check_parallelism(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def test_a_database_that_is_down_stops_the_engine_at_start_up(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HVD_DATABASE_URL", f"postgresql+psycopg2://hvd:secret@127.0.0.1:{port}/hvd")
    monkeypatch.setenv("HVD_DB_CONNECT_TIMEOUT", "2")
    with pytest.raises(HvdStartupError) as info:
        HybridState(_runner())
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "secret" not in message and "unset HVD_HYBRID" in message


def test_no_champion_stops_the_engine_at_start_up(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path / 'hvd.db'}"
    upgrade(url)
    monkeypatch.setenv("HVD_DATABASE_URL", url)
    with pytest.raises(HvdStartupError, match="hvd warmstart"):
        HybridState(_runner())


def test_parallelism_is_refused_before_the_database_is_touched(monkeypatch):
    monkeypatch.setenv("HVD_DATABASE_URL", "postgresql+psycopg2://nobody@127.0.0.1:1/none")
    with pytest.raises(HvdStartupError, match="tensor_parallel_size 2"):
        HybridState(_runner(tp=2))


def test_the_cache_drafts_at_the_shape_the_predictor_was_trained_on():
    """vLLM's speculative config sizes the trees; its suffix proposer's draft shape does not reach
    HVD's cache, whose shape is in the feature schema the champion was checked against."""
    spec = _runner().speculative_config
    spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob = 2.5, 0.3
    config = cache_config(spec, 24)
    assert (config.max_tree_depth, config.max_cached_requests, config.num_speculative_tokens) == (24, 100, 24)
    assert (config.max_spec_factor, config.min_token_prob) == (SuffixConfig().max_spec_factor, 0.1) == (4.0, 0.1)


def test_the_draft_shape_is_part_of_the_feature_schema(monkeypatch):
    from predictor.drafting import cache_drafter

    before = schema_hash()
    monkeypatch.setattr(cache_drafter.SuffixConfig.__init__, "__defaults__",
                        (24, 10000, 1.0, 0.1, 24))  # vLLM's shape: a gate trained on it is another schema
    assert cache_drafter.SuffixConfig().max_spec_factor == 1.0
    assert schema_hash() != before


def test_hvds_log_lines_go_where_vllms_go(monkeypatch):
    """The plugin hands the `hvd` logger vLLM's handlers (else Python shows warnings only and the
    hybrid's start-up and live-cost lines are lost); a deployment's own handler is kept."""
    import logging

    from controller.engines.vllm_plugin import route_logs

    hvd, vllm_log = logging.getLogger("hvd"), logging.getLogger("vllm")
    for logger in (hvd, vllm_log):
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "level", logging.NOTSET)
        monkeypatch.setattr(logger, "propagate", True)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name} {record.getMessage()}")

    vllm_log.addHandler(Collect())
    vllm_log.setLevel(logging.INFO)
    route_logs()
    logging.getLogger("hvd.vllm").info("HVD prices steps with this engine's own step times (%d steps)", 200)
    logging.getLogger("hvd.vllm").debug("not at INFO")
    assert seen == ["hvd.vllm HVD prices steps with this engine's own step times (200 steps)"]
    assert hvd.propagate is False
    own = logging.NullHandler()
    monkeypatch.setattr(hvd, "handlers", [own])
    route_logs()
    assert hvd.handlers == [own]
