"""A real `hvd serve --engine vllm` for the tests: started on a free port and waited for, stopped
as Ctrl-C would stop it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HVD = Path(sys.executable).with_name("hvd")
STARTUP_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def start(folder: Path, db: str, extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`hvd serve --engine vllm` on a free port, up and answering /health (no HVD_* variable of this
    process reaches it)."""
    port = free_port()
    log = (folder / "server.log").open("w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_")} | (extra_env or {})
    proc = subprocess.Popen([str(HVD), "--db", db, "serve", "--engine", "vllm", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + STARTUP_SECONDS
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{(folder / 'server.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(1)
    else:
        stop(proc)
        pytest.fail("server did not come up in time:\n" + (folder / "server.log").read_text()[-3000:])
    return proc, base


def stop(proc: subprocess.Popen, seconds: float = 60.0, group: bool = True) -> int:
    """SIGINT to the server's process group, as Ctrl-C would (`group`), or SIGTERM to the server
    alone, as a service manager stopping its main process would; then wait until every process of the
    group has ended (the process where HVD drains may outlive the API server); SIGKILL after `seconds`."""
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    deadline = time.time() + seconds
    try:
        code = proc.wait(seconds)
        while time.time() < deadline:
            os.killpg(proc.pid, 0)  # ProcessLookupError once the group is empty
            time.sleep(0.2)
    except ProcessLookupError:
        return code
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group ended meanwhile
        pass
    return proc.wait()
