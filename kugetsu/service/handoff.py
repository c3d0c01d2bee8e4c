"""The service's delegate socket: a Unix stream socket in KUGETSU_HOME (`Home.handoff`, beside
the wake-up socket) through which `kugetsu delegate` hands its command line to the service,
which admits it in its own warm transaction instead of the CLI decoding and writing the whole
index (issue 31). What a request says and how its answer is made is the CLI's
(frontends/cli/thin.py); this module carries bytes, and guards the loop:

- only this uid (SO_PEERCRED; the socket is 0600 in a 0700 home besides);
- a request is read without blocking, at most REQUEST_MAX bytes, complete (the client's
  end of writing) within REQUEST_DEADLINE, else the connection is dropped;
- at most MAX_CLIENTS at once: a further one is closed at once (its CLI runs in-process);
- a request is run only once it is whole, and only after one byte, ACCEPTED, went out: a
  connection that ends before it tells the client that nothing was run (it may run the
  command itself); after it, the client knows the service may have committed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable

from kugetsu.paths import Home

log = logging.getLogger("kugetsu.service")

REQUEST_MAX = 4 << 20  # bytes: a command line and its environment (ARG_MAX is 2 MB) with room
REQUEST_DEADLINE = 5.0  # seconds from the connection to the request's end
REPLY_DEADLINE = 10.0  # seconds for the client to take its answer
MAX_CLIENTS = 64
ACCEPTED = b"A"  # the request will be run now: what follows is its answer
DECLINED = b"F"  # the service does not run this one: the CLI runs it itself, nothing was done

# handle(request) -> None (declined), or what runs it and returns the answer's bytes, and the
# command's name (a `delegate` is said in the log; a `capacity`, which a PM agent polls, only
# at debug level).
Handler = Callable[[bytes], tuple[Callable[[], bytes], str] | None]


class HandoffSocket:
    def __init__(self, home: Home, loop: asyncio.AbstractEventLoop, handle: Handler):
        self.home, self.loop, self.handle = home, loop, handle
        self.sock: socket.socket | None = None
        self.clients: dict[int, _Client] = {}
        self.handled = 0  # requests run (the tests' and the log's count)

    def open(self) -> bool:
        path = self.home.handoff
        if path is None:  # a deep home: its delegates run in the CLI
            return False
        path.unlink(missing_ok=True)  # a stale one: the caller holds the service lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Made 0600 after the bind, as the wake-up socket is. Not by a umask around it: that is
        # the whole process's, and a thread creating a file or a directory meanwhile (a worktree,
        # a cgroup) would get its mode cut too (0700 -> 0600: a directory no one can enter). The
        # moment between is no opening: the home is 0700, and each client's uid is checked
        # (SO_PEERCRED) before a byte of its request is read.
        sock.bind(str(path))
        path.chmod(0o600)
        sock.listen(MAX_CLIENTS)
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._accept)
        self.sock = sock
        return True

    def close(self) -> None:
        """The service stops: a request not run yet is declined (its CLI runs it itself)."""
        for client in list(self.clients.values()):
            if not client.accepted:
                client.say(DECLINED)
            self._drop(client)
        if self.sock is None:
            return
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.sock = None
        if self.home.handoff is not None:
            self.home.handoff.unlink(missing_ok=True)

    def _accept(self) -> None:
        assert self.sock is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors: the next readiness tries again
                log.warning("delegate socket: accept failed: %s", err)
                return
            conn.setblocking(False)
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                log.warning("delegate socket: refused a connection from uid %d (pid %d): not this service's user",
                            uid, pid)
                conn.close()
                continue
            if len(self.clients) >= MAX_CLIENTS:
                conn.close()  # nothing read, nothing run: that CLI delegates in-process
                continue
            client = _Client(conn, pid)
            self.clients[conn.fileno()] = client
            client.timer = self.loop.call_later(REQUEST_DEADLINE, self._late, client)
            self.loop.add_reader(conn.fileno(), self._read, client)

    def _late(self, client: _Client) -> None:
        log.warning("delegate socket: dropped a client (pid %d) whose request did not end within %.0f s",
                    client.pid, REQUEST_DEADLINE)
        self._drop(client)

    def _read(self, client: _Client) -> None:
        while True:
            try:
                data = client.conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(client)
                return
            if not data:
                break
            client.size += len(data)
            if client.size > REQUEST_MAX:
                log.warning("delegate socket: dropped a client (pid %d) whose request passed %d bytes", client.pid,
                            REQUEST_MAX)
                self._drop(client)
                return
            client.parts.append(data)
        # The whole request: run it now, in the loop, as one transaction like any other.
        self.loop.remove_reader(client.conn.fileno())
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None
        request = b"".join(client.parts)
        client.parts = []
        try:
            handled = self.handle(request)
        except Exception:
            log.exception("delegate socket: a request could not be read")
            run = None
        if handled is None:
            client.say(DECLINED)
            self._drop(client)
            return
        if not client.say(ACCEPTED):  # gone already: run nothing
            self._drop(client)
            return
        client.accepted = True
        self.handled += 1
        run, command = handled
        try:
            answer = run()
        except Exception:  # a bug: said in the log; the client tells its user to look at the queue
            log.exception("delegate socket: a handed-over %s failed", command)
            self._drop(client)
            return
        log.log(logging.INFO if command == "delegate" else logging.DEBUG,
                "delegate socket: ran the %s of a CLI (pid %d) here", command, client.pid)
        self._reply(client, answer)

    def _reply(self, client: _Client, answer: bytes) -> None:
        client.out = memoryview(answer)
        client.timer = self.loop.call_later(REPLY_DEADLINE, self._drop, client)
        self._write(client)

    def _write(self, client: _Client) -> None:
        try:
            while client.out:
                sent = client.conn.send(client.out[:65536])
                client.out = client.out[sent:]
        except (BlockingIOError, InterruptedError):
            if not client.writing:
                client.writing = True
                self.loop.add_writer(client.conn.fileno(), self._write, client)
            return
        except OSError:
            pass  # it went away: its answer is lost, the commit stands
        self._drop(client)

    def _drop(self, client: _Client) -> None:
        fd = client.conn.fileno()
        if fd < 0 or self.clients.get(fd) is not client:
            return
        del self.clients[fd]
        if client.timer is not None:
            client.timer.cancel()
        self.loop.remove_reader(fd)
        if client.writing:
            self.loop.remove_writer(fd)
        client.conn.close()


class _Client:
    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid
        self.parts: list[bytes] = []
        self.size = 0
        self.timer: asyncio.TimerHandle | None = None
        self.accepted = False
        self.writing = False
        self.out = memoryview(b"")

    def say(self, data: bytes) -> bool:
        """A byte or two on a socket whose buffer is empty: never blocks."""
        try:
            return self.conn.send(data) == len(data)
        except OSError:
            return False
