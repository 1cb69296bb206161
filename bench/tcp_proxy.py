"""A TCP proxy in front of the PostgreSQL server that can cut the database off and bring it back,
so tests and the outage bench simulate an outage without stopping the shared server.

`cut()` resets every open connection and refuses new ones (as a server that went away); `restore()`
forwards again. `partition()` drops the traffic silently instead (as a network that went away):
nothing is reset, bytes already sent stay unread in the kernel's buffers and new connections hang
unanswered; `heal()` delivers them and forwards again, as TCP does once its retransmissions get
through. The URL to give the code under test is `proxy.url(real_url)`.

Its one home: bench/outage.py imports it as its sibling, the tests (tests/test_faults.py,
tests/test_soak.py) through pytest's `pythonpath = ["bench"]` (pyproject.toml).
"""
from __future__ import annotations

import socket
import struct
import threading

from sqlalchemy import make_url


def _reset(sock: socket.socket) -> None:
    try:  # linger 0: close with RST, as a vanished server does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:  # wakes a thread blocked in recv on it (close alone would not, and the peer would never know)
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.up = True
        self._flowing = threading.Event()  # cleared while partitioned
        self._flowing.set()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    @classmethod
    def for_url(cls, url: str) -> "TcpProxy":
        u = make_url(url)
        return cls(u.host or "127.0.0.1", u.port or 5432)

    def url(self, url: str) -> str:
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def cut(self) -> None:
        with self._lock:
            self.up = False
            socks, self._open = self._open, set()
        for s in socks:
            _reset(s)

    def restore(self) -> None:
        with self._lock:
            self.up = True

    def partition(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self.up:
                _reset(client)
                continue
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._flowing.wait()  # partitioned: the connection hangs, unanswered
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            if not self.up:
                _reset(client)
                _reset(upstream)
                return
            self._open |= {client, upstream}
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while self._flowing.wait() and (data := src.recv(65536)):
                self._flowing.wait()  # what was read as the partition began is held until it heals
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    s.close()
                except OSError:
                    pass


def main() -> None:
    """`python tcp_proxy.py HOST PORT`: serve in this process (off the caller's GIL), print the
    listening port, then obey `cut` / `restore` lines on stdin until it closes."""
    import sys

    proxy = TcpProxy(sys.argv[1], int(sys.argv[2]))
    print(proxy.port, flush=True)
    for line in sys.stdin:
        {"cut": proxy.cut, "restore": proxy.restore, "partition": proxy.partition,
         "heal": proxy.heal}.get(line.strip(), lambda: None)()
        print("ok", flush=True)
    proxy.close()


class ProxyProcess:
    """The proxy in a child process, with the same `cut`/`restore`/`url`/`close` as TcpProxy."""

    def __init__(self, url: str) -> None:
        import subprocess
        import sys

        u = make_url(url)
        self._proc = subprocess.Popen([sys.executable, __file__, u.host or "127.0.0.1", str(u.port or 5432)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self._proc.stdout.readline())

    def url(self, url: str) -> str:
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def _say(self, word: str) -> None:
        self._proc.stdin.write(word + "\n")
        self._proc.stdin.flush()
        self._proc.stdout.readline()

    def cut(self) -> None:
        self._say("cut")

    def restore(self) -> None:
        self._say("restore")

    def partition(self) -> None:
        self._say("partition")

    def heal(self) -> None:
        self._say("heal")

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(10)


if __name__ == "__main__":
    main()
