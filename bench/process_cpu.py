"""Where a served run's CPU went: each thread's user + system time from /proc, summed by role over
the process group a server was started in (the API server, vLLM's engine core and its worker, and
HVD's own background threads inside the worker, which name themselves `hvd-*` in the kernel:
controller.services.lifecycle.name_native_thread).

On a 2-core host a server's processes share the cores with one another, so a method's CPU seconds
per 1000 tokens say what it costs more steadily than its wall-clock rate, which moves with whatever
else is scheduled; and HVD's threads' share says whether its storage, statistics and control
services take CPU from the model.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
ROLES = ("api server", "engine core", "worker", "hvd threads")
SERVICE_THREAD_PREFIX = "hvd-"


@dataclass(frozen=True)
class TaskStat:
    """One thread's line of /proc/<pid>/task/<tid>/stat, the fields read here."""

    comm: str
    pgid: int
    cpu_ticks: int  # utime + stime, in clock ticks


def parse_stat(text: str) -> TaskStat:
    """A stat line's name, process group and CPU ticks. The name sits in parentheses and may itself
    hold spaces and parentheses, so the fields are counted from the last ')'."""
    head, close, tail = text.rpartition(")")
    if not close or "(" not in head:
        raise ValueError(f"not a /proc stat line (no '(comm)'): {text[:80]!r}")
    fields = tail.split()
    if len(fields) < 13:
        raise ValueError(f"/proc stat line has {len(fields)} fields after the name, expected at least 13: {text[:80]!r}")
    # After the name: state(0) ppid(1) pgrp(2) session tty tpgid flags minflt cminflt majflt cmajflt utime(11) stime(12)
    return TaskStat(comm=head.split("(", 1)[1], pgid=int(fields[2]), cpu_ticks=int(fields[11]) + int(fields[12]))


def role(process_comm: str, thread_comm: str) -> str:
    """Which of ROLES a thread works for: HVD's named threads apart, then by vLLM's process titles
    (the kernel keeps 15 bytes of them: `VLLM::EngineCor`, `VLLM::Worker`)."""
    if thread_comm.startswith(SERVICE_THREAD_PREFIX):
        return "hvd threads"
    if process_comm.startswith("VLLM::EngineCor"):
        return "engine core"
    if process_comm.startswith("VLLM::Worker"):
        return "worker"
    return "api server"


def group_cpu(pgid: int, proc: Path = PROC) -> dict[str, float]:
    """CPU seconds so far of every thread in process group ``pgid``, by role. Processes and threads
    that end while they are read are skipped: what they used is lost, as it is from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(ROLES, 0.0)
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            process = parse_stat((pid / "stat").read_text())
            if process.pgid != pgid:
                continue
            for task in (pid / "task").iterdir():
                thread = parse_stat((task / "stat").read_text())
                out[role(process.comm, thread.comm)] += thread.cpu_ticks / tick
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Seconds by role between two readings of group_cpu."""
    return {r: after.get(r, 0.0) - before.get(r, 0.0) for r in ROLES}
