"""A TCP proxy on 127.0.0.1 that makes a link slow or flaky, for the tests and benchmarks of object
storage (in front of moto's S3 server)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class LinkProxy:
    """Forward connections on ``127.0.0.1:port`` to ``target``, optionally throttled or reset.

    Args:
        target: ``(host, port)`` to forward to.
        rate: bytes per second shared by every connection's server-to-client bytes (one link); None: no limit.
        reset_every: reset the 1st, (n+1)-th, (2n+1)-th... connection as it arrives (an RST: "connection
            reset by peer").
    """

    def __init__(
        self, target: tuple[str, int], *, rate: float | None = None, reset_every: int | None = None
    ) -> None:
        self.target, self.rate, self.reset_every = target, rate, reset_every
        self.connections = 0
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the endpoint to give a client instead of the target's."""
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop accepting connections (those open finish on their own)."""
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            if self.reset_every and (self.connections - 1) % self.reset_every == 0:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()  # the target is down: so is the link
                continue
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, downstream: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if downstream and self.rate:
                    time.sleep(self._delay(len(data)))
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        source.close()  # each socket is the source of one pipe: closed once, by it

    def _delay(self, size: int) -> float:
        """Seconds to hold ``size`` bytes so that every connection together keeps to ``rate``."""
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + size / self.rate  # type: ignore[operator]
            return max(0.0, self._next - now)
