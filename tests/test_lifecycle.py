"""The lifecycle every background service shares: one backoff, failures counted and retried, stop
then flush, and each service stopping only itself."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from controller.core.events import EventQueue
from controller.services.event_writer import EventWriter
from controller.services.lifecycle import Backoff, BackgroundService
from controller.services.stats_writer import StatsWriter


def test_backoff_doubles_up_to_the_maximum_and_resets():
    b = Backoff(0.5, 3.0)
    assert [b.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.succeeded()
    assert b.failed() == 0.5


class Flaky(BackgroundService):
    """Fails its first two rounds, then stops the test's clock."""

    name = "flaky"
    run_at_start = True

    def __init__(self) -> None:
        super().__init__(interval=0.001, max_backoff=0.004)
        self.rounds = 0
        self.delays: list[float] = []
        self.flushed = 0
        self.done = threading.Event()

    def round(self) -> float:
        self.rounds += 1
        if self.rounds <= 2:
            self.delays.append(self.retry.current)
            raise OSError(f"down ({self.rounds})\nsecond line")
        self.done.set()
        return 60.0  # sleep until stopped

    def flush(self) -> bool:
        self.flushed += 1
        return True


def test_a_failing_round_is_counted_and_retried_with_backoff():
    service = Flaky().start()
    assert service.done.wait(10)
    health = service.health()
    assert (health.name, health.running, health.failures, health.last_error) == ("flaky", True, 2, "down (2)")
    assert service.delays == [0.001, 0.002]  # the second round came after the first backoff
    assert service.stop(5) and service.flushed == 1 and not service.health().running


class Named(BackgroundService):
    """Records the kernel's name of its own thread, read from /proc, in its first round."""

    name = "hvd-event-writer"  # 16 bytes: one more than the kernel keeps
    run_at_start = True

    def __init__(self) -> None:
        super().__init__(interval=60.0, max_backoff=60.0)
        self.seen = ""
        self.done = threading.Event()

    def round(self) -> float:
        self.seen = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        self.done.set()
        return 60.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names are read from Linux's /proc")
def test_a_service_thread_carries_its_name_in_the_kernel_too():
    before = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    service = Named().start()
    assert service.done.wait(10)
    service.stop(5)
    assert service.seen == "hvd-event-write"  # what `top -H` shows beside the engine's threads
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() == before  # only its own


def test_the_event_writer_stops_only_itself(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")  # never reached: nothing queued
    stats = StatsWriter(engine, flush_interval=60.0).start()
    writer = EventWriter(engine, EventQueue(4), stats=stats, flush_interval=60.0).start()
    assert writer.stop(5) and not writer.health().running
    assert stats.health().running
    assert stats.stop(5) and not stats.health().running
