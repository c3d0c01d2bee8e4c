"""The service's wake-up socket: a Unix datagram socket in KUGETSU_HOME (or the runtime dir for
a deep home). After each transaction a front end sends one short datagram (control.wake);
the service reads them all at once and runs one tick for the lot. `shutdown` asks it to stop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from kugetsu.paths import Home


class WakeSocket:
    def __init__(self, home: Home, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], None],
                 on_shutdown: Callable[[], None]):
        self.home, self.loop = home, loop
        self.on_wake, self.on_shutdown = on_wake, on_shutdown
        self.sock: socket.socket | None = None

    def open(self) -> None:
        path = self.home.socket
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a stale one: the caller holds the service lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        path.chmod(0o600)
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._on_message)
        self.sock = sock

    def close(self) -> None:
        if self.sock is None:
            return
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.sock = None
        self.home.socket.unlink(missing_ok=True)

    def _on_message(self) -> None:
        assert self.sock is not None
        while True:
            try:
                message = self.sock.recv(64)
            except BlockingIOError:
                break
            if message == b"shutdown":
                self.on_shutdown()
        self.on_wake()  # wake-ups that arrive together: one tick
