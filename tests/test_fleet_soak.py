"""Fleet soak: 3 `hvd serve --engine replay` replicas and 2 `hvd learn` processes (a leader and a
standby) on one PostgreSQL, as real processes, with kill -9 and SIGTERM of replicas and of the
leading learner, a PostgreSQL restart, a partitioned leader (its TCP proxy drops the traffic
silently, no reset) and an operator's pins, at 21 seeded points.

Then the books: every replica that stopped cleanly balances its tally (produced = written +
dropped + dead-lettered + lost) and exits non-zero iff it lost events; the committed learner rounds
form one unbroken chain over every stored event, each round's count matching the events in its
range (every written event learned exactly once); every term (epoch) wrote under one holder only;
every alias move starts from where the previous one left it (compare-and-set) and names a version
that loads; the operator's pin holds; a standby led within the stated takeover bound after the
partition.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import func, select, tuple_

from predictor.gate.registry import CHAMPION, load_gate
from storage.engine import make_engine, session_scope
from storage.events import events_end
from storage.leader import FENCED_IDLE_S
from storage.learner_log import list_rounds, read_cursor
from storage.models import DecisionEvent, Lease
from storage.pins import list_pins
from storage.versions import create_version, get_alias_version, list_alias_events
from support.trace_subset import champion_database, copy_champion
from tcp_proxy import ProxyProcess

pytestmark = pytest.mark.postgres
HVD = Path(sys.executable).with_name("hvd")
SEED = 20261204
LEASE_TTL = 3.0
INTERVAL = 0.2
TAKEOVER_BOUND = LEASE_TTL + FENCED_IDLE_S + INTERVAL  # storage.leader's bound
KINDS = ("kill -9 replica", "SIGTERM replica", "kill -9 learner", "SIGTERM learner", "PostgreSQL restart",
         "partition leader", "operator pin")
TALLY = re.compile(r"events produced (\d+), written (\d+), dropped (\d+), dead-lettered (\d+), lost (\d+)")


def _env(tmp: Path, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")}
    env["HVD_SPILL_DIR"] = str(tmp / f"spill-{name}")
    return env


class Fleet:
    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp
        self.engine = make_engine(url)
        self.replicas: dict[str, subprocess.Popen] = {}
        self.learners: list[tuple[subprocess.Popen, ProxyProcess]] = []
        self.runs = 0
        self.problems: list[str] = []
        self.clean_written = 0
        self.points: list[str] = []
        self.takeovers: list[float] = []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.problems.append(what)

    # ------------------------------------------------------------- processes
    def start_replica(self, name: str) -> None:
        self.runs += 1
        log = open(self.tmp / f"{name}-{self.runs}.log", "w")
        self.replicas[name] = subprocess.Popen(
            [str(HVD), "--db", self.url, "serve", "--engine", "replay", "--no-learn", "--replica", name,
             "--max-requests", "24", "--batch-size", "4", "--seed", str(self.runs)],
            stdout=log, stderr=subprocess.STDOUT, env=_env(self.tmp, name))
        self.replicas[name].log_path = log.name  # type: ignore[attr-defined]

    def keep_learners_running(self) -> None:
        """A learner that exited on its own (started while PostgreSQL restarted: refused at start-up,
        exit 2, as a supervisor would see) is started again, as a supervisor would."""
        for proc, proxy in list(self.learners):
            code = proc.poll()
            if code is None:
                continue
            text = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
            self.check(code == 2 and "hvd learn: error: " in text and "database" in text,
                       f"a learner exited by itself with {code}: {text[-800:]}")
            self.learners.remove((proc, proxy))
            proxy.close()
            self.start_learner()

    def standby_ready(self, leader_index: int, timeout: float = 120.0) -> bool:
        """Another learner is up and standing by (it said so), so a takeover has someone to take over."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.keep_learners_running()
            for i, (proc, _) in enumerate(self.learners):
                if i != leader_index and proc.poll() is None and \
                        "standby: the learner lock is held" in Path(proc.log_path).read_text():  # type: ignore[attr-defined]
                    return True
            time.sleep(0.2)
        return False

    def start_learner(self) -> None:
        proxy = ProxyProcess(self.url)
        log = self.tmp / f"learner-{proxy.port}.log"
        proc = subprocess.Popen([str(HVD), "--db", proxy.url(self.url), "learn", "--interval", str(INTERVAL),
                                 "--lease-ttl", str(LEASE_TTL)],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, env=_env(self.tmp, "learner"))
        proc.log_path = str(log)  # type: ignore[attr-defined]
        self.learners.append((proc, proxy))

    def settle_replica(self, name: str, proc: subprocess.Popen, code: int | None, killed: bool) -> None:
        """A replica run that ended: its tally checked unless it was killed (its count died with it)."""
        if killed:
            return
        text = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
        if code == 2 and re.search(r"^hvd serve: error: (cannot reach )?database ", text, re.M) and \
                ("serving " not in text or "start-up failed: nothing was served" in text):
            return  # started while PostgreSQL restarted: refused at start-up (before or after its banner), nothing produced
        m = TALLY.search(text)
        self.check(m is not None, f"{name}: no tally printed: {text[-1500:]}")
        if m is None:
            return
        produced, written, dropped, dead, lost = map(int, m.groups())
        self.check(produced == written + dropped + dead + lost, f"{name}: tally does not balance: {m.group(0)}")
        # A SIGTERM that lands after the run printed its tally, while Python tears down (which puts
        # the default handlers back), ends it with -15: the run itself had finished, books balanced.
        late_signal = code == -signal.SIGTERM and "SIGTERM: stopping" not in text
        self.check(code == (1 if lost else 0) or late_signal, f"{name}: exit code {code} with {lost} lost")
        self.clean_written += written

    def serving(self, proc: subprocess.Popen, timeout: float = 90.0) -> bool:
        """Wait until the run says it serves (a signal before that finds no handler to stop cleanly)."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if "serving " in Path(proc.log_path).read_text():  # type: ignore[attr-defined]
                return True
            time.sleep(0.1)
        return proc.poll() is None

    def keep_replicas_running(self) -> None:
        for name, proc in list(self.replicas.items()):
            code = proc.poll()
            if code is not None:  # served its requests
                self.settle_replica(name, proc, code, killed=False)
                self.start_replica(name)

    def leader(self, timeout: float = 30.0) -> tuple[int, str] | None:
        """(index into learners, holder) of the learner holding a live lease."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.keep_replicas_running()
            self.keep_learners_running()
            with session_scope(self.engine) as s:
                lease = s.get(Lease, "learner")
                live = lease is not None and s.scalar(select(func.now() < lease.expires_at))
                holder = lease.holder if lease is not None else ""
            for i, (proc, _) in enumerate(self.learners):
                if live and proc.poll() is None and holder.endswith(f"-{proc.pid}"):
                    return i, holder
            time.sleep(0.2)
        return None

    # ------------------------------------------------------------- points
    def point(self, kind: str, rng: random.Random) -> None:
        self.points.append(kind)
        if kind in ("kill -9 replica", "SIGTERM replica"):
            name = rng.choice(sorted(self.replicas))
            proc = self.replicas[name]
            self.serving(proc)
            killed = kind.startswith("kill")
            proc.send_signal(signal.SIGKILL if killed else signal.SIGTERM)
            code = proc.wait(90)
            self.settle_replica(name, proc, code, killed)
            self.start_replica(name)
        elif kind in ("kill -9 learner", "SIGTERM learner"):
            found = self.leader()
            self.check(found is not None, f"{kind}: no leader")
            if found is None:
                return
            proc, proxy = self.learners.pop(found[0])
            proc.send_signal(signal.SIGKILL if kind.startswith("kill") else signal.SIGTERM)
            code = proc.wait(90)
            self.check(kind.startswith("kill") or code == 0, f"learner exit code {code} after SIGTERM")
            proxy.close()
            self.start_learner()
        elif kind == "PostgreSQL restart":
            subprocess.run(["pg_ctlcluster", "15", "main", "restart", "-m", "fast"], check=True, timeout=120)
        elif kind == "partition leader":
            found = self.leader()
            self.check(found is not None, "partition: no leader")
            if found is None:
                return
            self.check(self.standby_ready(found[0]), "partition: no standby came up")
            found = self.leader()
            if found is None:
                return
            proc, proxy = self.learners[found[0]]
            proxy.partition()
            cut = time.monotonic()
            try:
                while True:
                    now = self.leader(timeout=TAKEOVER_BOUND + 30)
                    if now is None or now[1] != found[1]:
                        break
                    time.sleep(0.2)
                took = time.monotonic() - cut
                self.takeovers.append(took)
                if now is None:
                    with session_scope(self.engine) as s:
                        lease = s.get(Lease, "learner")
                        row = (lease.holder, lease.epoch, lease.expires_at, s.scalar(select(func.now())))
                    states = [(p.pid, p.poll(), Path(p.log_path).read_text().splitlines()[-3:])  # type: ignore[attr-defined]
                              for p, _ in self.learners]
                    self.check(False, f"partition of {found[1]}: no standby took over; lease {row}; learners {states}")
                # the bound, plus the follower's own round (its learning) and this 2-core machine's slack
                self.check(took <= TAKEOVER_BOUND + 10, f"takeover after {took:.1f} s (bound {TAKEOVER_BOUND} s)")
                time.sleep(rng.uniform(0.5, 2.0))  # the new leader writes while the old one is cut off
            finally:
                proxy.heal()
        elif kind == "operator pin":
            with session_scope(self.engine) as s:
                current = get_alias_version(s, CHAMPION).id
            target = 1 if current == 2 else 2
            out = subprocess.run([str(HVD), "--db", self.url, "pin", "--version", str(target), "--author", "soak",
                                  "--reason", f"soak point {len(self.points)}"], capture_output=True, text=True,
                                 timeout=120, env=_env(self.tmp, "operator"))
            self.check(out.returncode == 0, f"hvd pin: {out.stdout}{out.stderr}")
            self.pinned = target

    def finish(self) -> None:
        replicas, self.replicas = self.replicas, {}
        for name, proc in replicas.items():
            if self.serving(proc):
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(90)
            self.settle_replica(name, proc, code, killed=False)
        with session_scope(self.engine) as s:
            end = events_end(s)
        deadline = time.monotonic() + 180
        while True:  # the leader catches up with every stored event
            if self.leader(timeout=60) is None:
                self.start_learner()
            with session_scope(self.engine) as s:
                if read_cursor(s) == end:
                    break
            assert time.monotonic() < deadline, "the learners never caught up"
            time.sleep(0.5)
        for proc, proxy in self.learners:
            proc.send_signal(signal.SIGTERM)
            self.check(proc.wait(90) == 0, "learner exit code after SIGTERM")
            proxy.close()


def test_fleet_soak(tmp_path):
    from conftest import postgres_schema_url

    pg_urls = postgres_schema_url()
    url = next(pg_urls)
    fleet = None
    try:
        copy_champion(champion_database(tmp_path), url)
        engine = make_engine(url)
        with session_scope(engine) as s:  # a second version for the operator to pin
            v1 = get_alias_version(s, CHAMPION)
            create_version(s, blob=v1.blob, kind=v1.kind, feature_schema_hash=v1.feature_schema_hash, metrics={},
                           training_summary={}, reason="soak: the operator's other version", created_by="soak")
        fleet = Fleet(url, tmp_path)
        fleet.pinned = None
        for _ in range(2):
            fleet.start_learner()
        assert fleet.leader(timeout=120) is not None, "no learner ever led"
        for i in range(3):
            fleet.start_replica(f"replica-{i}")
        rng = random.Random(SEED)
        points = [k for k in KINDS for _ in range(3)]
        rng.shuffle(points)
        for kind in points:
            deadline = time.monotonic() + rng.uniform(1.0, 3.0)
            while time.monotonic() < deadline:
                fleet.keep_replicas_running()
                time.sleep(0.2)
            fleet.point(kind, rng)
        fleet.finish()

        with session_scope(engine) as s:
            events = s.scalar(select(func.count()).select_from(DecisionEvent))
            rounds = list_rounds(s)
            counts = [s.scalar(select(func.count()).select_from(DecisionEvent).where(
                tuple_(DecisionEvent.txid, DecisionEvent.id) > tuple_(r.after_txid, r.after_id),
                tuple_(DecisionEvent.txid, DecisionEvent.id) <= tuple_(r.last_txid, r.last_id))) for r in rounds]
            moves = defaultdict(list)
            for e in list_alias_events(s):
                moves[e.alias_name].append(e)
            pins = {name: p.version_id for name, p in list_pins(s).items()}
            champion = get_alias_version(s, CHAMPION).id
        # every event written (what clean runs printed, plus what killed runs wrote) was learned once
        fleet.check(events >= fleet.clean_written > 0, f"{events} events stored, clean runs wrote {fleet.clean_written}")
        fleet.check((rounds[0].after_txid, rounds[0].after_id) == (0, 0), "the first round did not start at the beginning")
        for a, b in zip(rounds, rounds[1:]):
            fleet.check((a.last_txid, a.last_id) == (b.after_txid, b.after_id), f"rounds {a.id} and {b.id} leave a gap")
            fleet.check(a.epoch <= b.epoch, f"round {b.id} ran in an older term than round {a.id}")
        fleet.check(counts == [r.events for r in rounds], "a round's count differs from the events in its range")
        fleet.check(sum(r.events for r in rounds) == events, f"{sum(r.events for r in rounds)} learned of {events}")
        holders = defaultdict(set)
        for r in rounds:
            holders[r.epoch].add(r.holder)
        fleet.check(all(len(h) == 1 for h in holders.values()), f"terms with two writers: {dict(holders)}")
        fleet.check(len(holders) >= 4, f"leadership changed hands only {len(holders) - 1} times")
        for name, history in moves.items():
            for a, b in zip(history, history[1:]):
                fleet.check(b.from_version_id == a.to_version_id, f"{name}: move {b.id} did not start from {a.to_version_id}")
            for e in history:
                fleet.check(load_gate(engine, e.to_version_id)[1] is not None, f"{name}: v{e.to_version_id} does not load")
        fleet.check(fleet.pinned is not None and champion == fleet.pinned == pins.get(CHAMPION),
                    f"the operator pinned v{fleet.pinned}; champion v{champion}, pins {pins}")
        assert fleet.problems == [], "\n".join(fleet.problems)
        assert len(fleet.points) >= 20 and set(fleet.points) == set(KINDS)
        print(f"fleet soak: {len(fleet.points)} points, {events} events, {len(rounds)} rounds in {len(holders)} terms, "
              f"takeovers after a partition {[round(t, 1) for t in fleet.takeovers]} s (bound {TAKEOVER_BOUND} s)")
    finally:
        if fleet is not None:
            for proc in [*fleet.replicas.values(), *(p for p, _ in fleet.learners)]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            for _, proxy in fleet.learners:
                try:
                    proxy.close()
                except Exception:  # noqa: BLE001 - cleanup
                    pass
        next(pg_urls, None)
