"""`hvd serve --engine replay`: long-running serving on the trace replay engine.

Requests from the traces arrive interleaved (batch_size at a time per deployment) as from several
tenants; the "target model" is the recorded continuation (greedy verification); the model drafter
is simulated. The runtime, the event and statistics writers, the control poller and the learner
(leader only) all run live, exactly as next to a real engine. SIGINT (Ctrl-C) and SIGTERM alike
stop it after the current step; what is queued is then written within a bounded time
(`drain_seconds`), and the result's tally says where every event went: written, dropped,
dead-lettered, or lost (still queued at exit; the CLI then exits non-zero).

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

from controller.cli.replay_options import ReplayServeOptions  # defined there for `hvd --help`; imported from here too
from controller.core.metrics import HvdMetrics
from controller.core.runtime import Runtime
from controller.engines.trace_engine import ReplayRun, run_replay
from controller.services.event_writer import Tally
from controller.services.lifecycle import Health
from controller.services.stack import ServiceStack, decision_config
from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import TraceRecord
from predictor.decision.profiles import cost_profiles, drafter_profiles, pick
from predictor.drafting.token_classes import token_classes


@dataclass
class ServeResult:
    run: ReplayRun
    promotions: list[int]
    drifts: list[tuple[str, int]]
    tally: Tally
    interrupted: bool
    seconds: float
    services: list[Health] = field(default_factory=list)  # each service's state at exit
    # The allocator's plans: the tokens they expected the target to accept of what was verified, and the
    # tokens it accepted (RuntimeStats.promised, promised_accepted); (0.0, 0) when no plan promised.
    promises: tuple[float, int] = (0.0, 0)

    @property
    def events_written(self) -> int:
        return self.tally.written

    @property
    def events_dropped(self) -> int:
        return self.tally.dropped


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


def say(line: str) -> None:
    print(line, flush=True)  # a line as it happens, also into a pipe or a log file


def serve_replay(engine: Engine, records: Sequence[TraceRecord], opts: ReplayServeOptions,
                 log: Callable[[str], None] = say, on_step: Callable[[ReplayRun, Runtime], None] | None = None,
                 metrics: HvdMetrics | None = None, banner: str | None = None,
                 restore_signals: bool = True) -> ServeResult:
    """Serve `records` until done or stopped; `metrics`: the Prometheus metrics the runtime counts
    into (the CLI's --metrics-port serves them); `banner`: logged once SIGINT and SIGTERM stop the
    run cleanly (a supervisor that waits for it may signal from then on). `restore_signals=False`
    (the CLI): the handlers stay until the process exits, so a signal that comes while it prints its
    summary does not kill it before its exit status."""
    (drafter,) = pick(drafter_profiles(), [opts.drafter], "drafter")
    (cost,) = pick(cost_profiles(), [opts.cost_profile], "cost")
    tokenizer = TraceTokenizer()
    # Before the stack is built (it loads the champion, starts writers): a signal during start-up
    # stops the run as cleanly as one during serving, with its tally.
    interrupted = False
    previous: dict[int, object] = {}

    def on_signal(signum, frame) -> None:
        nonlocal interrupted
        interrupted = True
        log(f"{signal.Signals(signum).name}: stopping after the current step (again to force)")
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, on_signal)
        except ValueError:  # not the main thread: no signal handling
            previous.pop(sig, None)
    if banner is not None:
        log(banner)
    try:
        stack = ServiceStack.build(engine, decision_config(drafter, cost, rule=opts.rule), token_classes(tokenizer),
                                   replica=opts.replica, learn=opts.learn, learner_config=opts.learner,
                                   leader_lock=not opts.synchronous, stats_interval=2.0, poll_interval=1.0,
                                   metrics=metrics, shadow_drafts=opts.shadow_drafts)
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log("start-up failed: nothing was served")  # a supervisor tells a refused start from a failed run
        raise
    runtime, learner = stack.runtime, stack.learner
    if opts.synchronous:
        stack.poller.poll_once()
    else:
        stack.start()

    start = last = time.monotonic()
    steps = 0

    def step_hook(run: ReplayRun) -> None:
        nonlocal last, steps
        steps += 1
        if opts.synchronous and steps % opts.sync_every == 0:
            stack.sync_round()
        if on_step is not None:
            on_step(run, runtime)
        now = time.monotonic()
        if now - last >= opts.progress_seconds:
            last = now
            t = run.total()
            log(f"  {t.tokens} tokens, {t.cycles_per_1k:.1f} cycles/1k, cache {t.cache_cycles / max(t.cycles, 1):.0%} "
                f"of cycles, predictor v{runtime.version_id}, events {runtime.events.queued} "
                f"(dropped {runtime.events.dropped}), learner {learner.stats.events if learner else 0} events / "
                f"{len(learner.stats.promotions) if learner else 0} promotions")

    try:
        run = run_replay(runtime, records, tokenizer, drafter, batch_size=opts.batch_size, seed=opts.seed,
                         tenant_of=tenant_of(opts.tenants), on_step=step_hook, stop=lambda: interrupted,
                         oracle=opts.oracle)
    finally:
        if opts.synchronous:
            stack.sync_round()
        tally = stack.shutdown(opts.drain_seconds, log=None)
        if restore_signals:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return ServeResult(run, learner.stats.promotions if learner else [], learner.stats.drifts if learner else [],
                       tally, interrupted, time.monotonic() - start, stack.health(),
                       (runtime.stats.promised, runtime.stats.promised_accepted))
