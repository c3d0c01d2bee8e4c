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
        self.upstreams: list[socket.socket] = []  # the proxy's own connections to the target
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
            with self.lock:  # a cut cannot slip in between the look at the mode and the record
                if self.mode == "refuse":
                    client.close()
                    continue
                if self.mode == "silent":
                    self.conns.append(client)  # never answered
                    continue
                try:
                    upstream = socket.create_connection(self.target)
                except OSError:
                    client.close()
                    continue
                self.conns += [client, upstream]
                self.upstreams.append(upstream)
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
            for s in (src, dst):  # shutdown first: a close alone does not wake the other pipe's recv
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def upstream_ports(self) -> set[int]:
        """The local ports of the open connections to the target: pg_stat_activity's
        client_port of the backends that serve the proxy's clients."""
        with self.lock:
            self.upstreams = [s for s in self.upstreams if s.fileno() != -1]
            ports = set()
            for s in self.upstreams:
                try:
                    ports.add(s.getsockname()[1])
                except OSError:  # closed meanwhile
                    pass
            return ports

    def cut(self, mode: str = "refuse") -> None:
        """Every connection through the proxy ends now (refuse) or goes silent."""
        with self.lock:
            self.mode = mode
            conns, self.conns = (self.conns, []) if mode == "refuse" else ([], self.conns)
        if mode == "refuse":
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
