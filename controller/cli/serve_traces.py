"""`hvd serve --engine replay`: long-running serving on the trace replay engine.

Requests from the traces arrive interleaved (batch_size at a time per deployment) as from several
tenants; the "target model" is the recorded continuation (greedy verification); the model drafter
is simulated. The runtime, the event and statistics writers, the control poller and the learner
(leader only) all run live, exactly as next to a real engine. Ctrl-C stops after the current step;
everything already queued is written before exit.

`synchronous=True` runs the writers, learner and poller in the serving loop every `sync_every`
steps instead of in threads: slower, but the whole run is then a deterministic function of the
traces and the seed (used by the shift scenario and the tests).
"""
from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Engine

from controller.services.control_poller import ControlPoller
from controller.core.decision import DecisionConfig
from controller.services.event_writer import EventWriter
from controller.services.learner_service import LearnerService
from controller.engines.trace_engine import ReplayRun, run_replay
from controller.core.runtime import Runtime
from controller.services.stats_writer import StatsWriter
from predictor.champion import load_gate
from predictor.online import LearnerConfig
from predictor.profiles import cost_profiles, drafter_profiles, pick
from predictor.tokens import TraceTokenizer
from predictor.traces import TraceRecord
from storage.leader import make_leader_lock


@dataclass
class ReplayServeOptions:
    batch_size: int = 8
    tenants: int = 3
    seed: int = 0
    learn: bool = True
    drafter: str = "eagle3-1.75"
    cost_profile: str = "gpu-8b"
    replica: str = "replica-0"
    synchronous: bool = False
    sync_every: int = 50  # steps between synchronous learner rounds
    progress_seconds: float = 5.0
    oracle: bool = False  # decide with the true accepted lengths (the upper bound); learning off
    learner: LearnerConfig = field(default_factory=LearnerConfig)


@dataclass
class ServeResult:
    run: ReplayRun
    promotions: list[int]
    drifts: list[tuple[str, int]]
    events_written: int
    events_dropped: int
    interrupted: bool
    seconds: float


def tenant_of(tenants: int) -> Callable[[TraceRecord], str]:
    """A stable tenant per session, so a tenant's traffic is a mix of whole sessions."""
    names = [f"tenant-{chr(ord('a') + i)}" for i in range(tenants)]

    def pick_tenant(record: TraceRecord) -> str:
        digest = hashlib.sha256(record.session_id.encode()).digest()
        return names[digest[0] % len(names)]

    return pick_tenant


def round_robin_sources(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """Whole sessions taken from each source in turn (order kept within a source), so a bounded
    run sees every workload rather than the first source only."""
    sessions: dict[str, list[list[TraceRecord]]] = {}
    index: dict[tuple[str, str], list[TraceRecord]] = {}
    for r in records:
        key = (r.source, r.session_id)
        if key not in index:
            index[key] = []
            sessions.setdefault(r.source, []).append(index[key])
        index[key].append(r)
    out: list[TraceRecord] = []
    queues = [list(v) for v in sessions.values()]
    while any(queues):
        for q in queues:
            if q:
                out.extend(q.pop(0))
    return out


def serve_replay(engine: Engine, records: Sequence[TraceRecord], opts: ReplayServeOptions,
                 log: Callable[[str], None] = print, on_step: Callable[[ReplayRun, Runtime], None] | None = None,
                 ) -> ServeResult:
    (drafter,) = pick(drafter_profiles(), [opts.drafter], "drafter")
    (cost,) = pick(cost_profiles(), [opts.cost_profile], "cost")
    decision = DecisionConfig(cost=cost, model_draft_len=drafter.draft_len, initial_model_accepted=drafter.mean_accepted)
    version_id, gate = load_gate(engine)
    tokenizer = TraceTokenizer()
    stats = StatsWriter(engine, flush_interval=2.0)
    runtime = Runtime(gate, tokenizer.classes, decision, version_id=version_id, stats_sink=stats)
    writer = EventWriter(engine, runtime.events, stats=stats, keep_events=2_000_000, replica=opts.replica)
    poller = ControlPoller(engine, runtime, interval=1.0)
    learner = None
    if opts.learn:
        lock = None if opts.synchronous else make_leader_lock(engine, "learner", opts.replica)
        learner = LearnerService(engine, decision, opts.learner, replica=opts.replica, lock=lock, start_at_end=True)
    if not opts.synchronous:
        writer.start()
        poller.start()
        if learner is not None:
            learner.start()
    else:
        poller.poll_once()

    interrupted = False

    def on_sigint(signum, frame) -> None:
        nonlocal interrupted
        interrupted = True
        log("stopping after the current step (Ctrl-C again to force)")
        signal.signal(signal.SIGINT, previous)

    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread: no Ctrl-C handling
        previous = None
    start = last = time.monotonic()
    steps = 0

    def step_hook(run: ReplayRun) -> None:
        nonlocal last, steps
        steps += 1
        if opts.synchronous and steps % opts.sync_every == 0:
            _sync_round(writer, learner, poller)
        if on_step is not None:
            on_step(run, runtime)
        now = time.monotonic()
        if now - last >= opts.progress_seconds:
            last = now
            t = run.total()
            log(f"  {t.tokens} tokens, {t.cycles_per_1k:.1f} cycles/1k, cache {t.cache_cycles / max(t.cycles, 1):.0%} "
                f"of cycles, predictor v{runtime.version_id}, events {runtime.events.accepted} "
                f"(dropped {runtime.events.dropped}), learner {learner.stats.events if learner else 0} events / "
                f"{len(learner.stats.promotions) if learner else 0} promotions")

    try:
        run = run_replay(runtime, records, tokenizer, drafter, batch_size=opts.batch_size, seed=opts.seed,
                         tenant_of=tenant_of(opts.tenants), on_step=step_hook, stop=lambda: interrupted,
                         oracle=opts.oracle)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if opts.synchronous:
            _sync_round(writer, learner, poller)
        else:
            if learner is not None:
                learner.stop()
            poller.stop()
            writer.stop()
    return ServeResult(run, learner.stats.promotions if learner else [], learner.stats.drifts if learner else [],
                       writer.written, runtime.events.dropped + writer.dropped, interrupted, time.monotonic() - start)


def _sync_round(writer: EventWriter, learner: LearnerService | None, poller: ControlPoller) -> None:
    writer.drain_now()
    if learner is not None:
        while learner.run_once():
            pass
    poller.poll_once()
