"""Clients by hand for the listeners' tests: a websocket upgrade, a page fetch, whether the
server closed a connection. Stdlib only, so that the very same file runs
as another user of the machine (tests/test_dashboard_web.py copies it where that user can
read it): `python -I rawclient.py PORT` prints what the dashboard answered, as JSON."""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request


def upgrade(port: int, target: str = "/ws", headers: dict[str, str] | None = None) -> int:
    """The status the server answered a websocket upgrade with (101: the socket opened)."""
    fields = {"Host": f"127.0.0.1:{port}", "Upgrade": "websocket", "Connection": "Upgrade",
              "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13", **(headers or {})}
    request = f"GET {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request.encode())
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                return 0
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def closed_by_server(sock: socket.socket) -> bool:
    """Has the other end closed the connection (or reset it)? Never blocks: the socket is
    made one without a timeout, which Python would otherwise wait out before the read."""
    sock.settimeout(None)
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def page(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


if __name__ == "__main__":
    port = int(sys.argv[1])
    print(json.dumps({"ws": upgrade(port), "page": page(port)}))
