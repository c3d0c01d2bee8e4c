"""A TCP proxy on 127.0.0.1 that a test can cut: the database going away (connections reset,
new ones refused) or the network going silent (packets held), without touching the real
database that other tests use."""

from __future__ import annotations

import socket
import threading


class Proxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.mode = "open"  # open | refuse (the database is down) | silent (the network is)
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str) -> str:
        return f"postgresql://127.0.0.1:{self.port}/{database}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            if self.mode == "silent":
                with self.lock:
                    self.conns.append(client)  # never answered
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.mode == "silent" and not self.closed:
                    threading.Event().wait(0.05)  # held, as by a network that went quiet
                if self.mode != "open":
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self, mode: str = "refuse") -> None:
        """Every connection through the proxy ends now (refuse) or goes silent."""
        self.mode = mode
        if mode == "refuse":
            with self.lock:
                conns, self.conns = self.conns, []
            for c in conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                except OSError:
                    pass

    def restore(self) -> None:
        if self.mode == "silent":
            self.cut("refuse")  # held connections are dead by now: the peers reconnect
        self.mode = "open"

    def close(self) -> None:
        self.closed = True
        self.cut("refuse")
        self.listener.close()
